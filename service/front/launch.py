"""Which front serves a `python -m service` (or a test's local cluster), and starting it.

`auto` (the default) is nginx when its binary is found, else Serve's own proxy with a warning;
`nginx` fails without the binary; `serve` is Serve's proxy on the service's port, as before the front.
With nginx, Serve's servers (its proxy and the ingress replicas' own ports) bind 127.0.0.1 only and
nginx alone faces the network.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from ..ray_env import HA_PROXY, THROUGHPUT
from ..telemetry.front_answers import answers_file
from ..telemetry.metrics import node_dir
from .answers import Answers
from .config import ANSWERED, Address, FrontConfig
from .supervisor import Front, nginx_binary
from .targets import is_loopback, serve_controller, serve_targets

log = logging.getLogger(__name__)
CHOICES = ("auto", "nginx", "serve")
INTERNAL_HOST = "127.0.0.1"


def choose_front(requested: str, env: Mapping[str, str]) -> str | None:
    """The nginx binary to run, or None for Serve's own proxy. ValueError when `requested` cannot be had."""
    if requested not in CHOICES:
        raise ValueError(f"front must be one of {', '.join(CHOICES)}, not {requested!r}")
    if requested == "serve":
        return None
    if env.get(HA_PROXY) == "1":  # Ray's HAProxy already replaces Serve's proxy on the service's port
        if requested == "nginx":
            raise ValueError(f"front nginx and {HA_PROXY}=1 exclude each other")
        return None
    if env.get(THROUGHPUT) == "0":  # no direct ingress: nginx could only add a hop before Serve's proxy
        if requested == "nginx":
            raise ValueError(f"front nginx needs Serve's direct ingress, which {THROUGHPUT}=0 turns off")
        return None
    binary = nginx_binary()
    if binary is None:
        if requested == "nginx":
            raise ValueError("front nginx: no nginx binary (Debian/Ubuntu: apt-get install nginx)")
        log.warning("no nginx binary: Serve's own proxy is the service's front, slower under load "
                    "(docs/reliability.md); apt-get install nginx, or --front serve to silence this")
    return binary


@contextmanager
def serve_front(binary: str, listen: Address, backup: Address, max_body_bytes: int, retry_after_s: int,
                poll_s: float = 0.5, route_prefix: str = "/", metrics_dir: str | None = None,
                grace_s: float = 5.0, body_timeout_s: int = 10) -> Iterator[Front]:
    """nginx on `listen`, following this process's Serve (already started, its proxy at `backup`) for
    the application at `route_prefix`; the counts of its own answers (each status it can answer at 0
    from its start) go to this node's directory of `metrics_dir` (the app's,
    service/telemetry/metrics.py), where the ingress's /metrics reads them. On exit nginx stops
    listening and gives the requests it holds (streams) `grace_s` to finish."""
    import ray

    run_dir = Path(tempfile.mkdtemp(prefix="ts-front-"))
    host = backup.host if is_loopback(backup.host) else None  # one node, bound to loopback: connect there
    cfg = FrontConfig(listen, backup, run_dir, max_body_bytes, retry_after_s, body_timeout_s=body_timeout_s)
    counts = None if metrics_dir is None else answers_file(
        node_dir(Path(metrics_dir), ray.get_runtime_context().get_node_id()), os.getpid())
    front = Front(cfg, serve_targets(serve_controller(), route_prefix, host=host), binary, poll_s=poll_s,
                  answers=Answers(counts, ANSWERED))
    try:
        yield front.start()
    finally:
        front.stop(grace_s)
        shutil.rmtree(run_dir, ignore_errors=True)
