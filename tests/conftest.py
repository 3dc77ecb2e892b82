"""Session-wide test settings."""

import sys
from collections.abc import Iterator

import pytest
import torch

from service.ray_env import use_fast_path

# Ray Serve's request path as `python -m service` runs it (service/ray_env.py); every Ray process a
# test starts inherits it.
use_fast_path()


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Tiny tensors: one torch thread is fastest, and the machine's cores are shared. Modules that
    want it say `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session", autouse=True)
def kept_cluster() -> Iterator[None]:
    """The service's end-to-end modules share one local Ray + Serve (service.testing.cluster.local_cluster with
    keep=True: each deletes its applications after, and starting Ray costs ~8 s a module); it ends
    with the session."""
    yield
    cluster = sys.modules.get("service.testing.cluster")  # imported by the tests that start Ray, if any ran
    if cluster is not None:
        cluster.stop_kept()
