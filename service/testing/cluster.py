"""A local Ray with Serve's HTTP entry on a free 127.0.0.1 port, for the end-to-end tests and the
load-test commands that start the service themselves (autoscale, soak, hops).

    with local_cluster() as url:        # Ray Serve's request path as `python -m service` runs it
        deploy(app_args)                 # the Serve config's `args`, no TS_* environment
        wait_for(url, "/readyz", 200, timeout_s=120)

    with local_cluster() as url, fronted(url, nginx) as front:   # and the nginx front before it
        ...                              # clients go to front.url
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import ray
from ray import serve

from ..app import build_app_from_settings
from ..front.config import Address
from ..front.launch import serve_front
from ..front.ports import free_port
from ..front.supervisor import Front
from ..ray_env import DRAIN, use_fast_path
from ..settings import Settings

ROOT = Path(__file__).resolve().parents[2]
# A local cluster has no load balancer to wait for (the ingress drain, service/ray_env.py): the
# default 30 s made every test module's shutdown take 30 s.
LOCAL_DRAIN_S = "1"


def local_ray_env() -> None:
    """The process environment a local Ray inherits: throughput mode (service/ray_env.py), and the
    short ingress drain of a cluster no load balancer fronts (unless set)."""
    use_fast_path(os.environ)
    os.environ.setdefault(DRAIN, LOCAL_DRAIN_S)


def wait_for(url: str, path: str, status: int, timeout_s: float) -> httpx.Response:
    """Poll GET url+path until it answers `status`; TimeoutError naming the path otherwise."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(base_url=url, timeout=5) as client:
        while True:
            try:
                r = client.get(path)
                if r.status_code == status:
                    return r
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"GET {path} did not answer {status} within {timeout_s} s")
            time.sleep(0.2)


# A local Ray + Serve that local_cluster(keep=True) left running for the next one with the same
# settings: [((num_cpus, env), base URL)] while it runs (a test session's end-to-end modules share it).
_KEPT: list[tuple[tuple[int, tuple[tuple[str, str], ...]], str]] = []


@contextmanager
def local_cluster(num_cpus: int = 4, env: Mapping[str, str] | None = None, keep: bool = False) -> Iterator[str]:
    """A local Ray (workers get `env`, one OpenMP thread unless `env` says otherwise) with Serve on a
    free 127.0.0.1 port; yields the base URL. Fresh, and shut down after, unless `keep`: then one kept
    by an earlier local_cluster(keep=True) with the same num_cpus and env is reused, and after the
    block its Serve applications are deleted and Ray and Serve left running (stop_kept() ends them;
    a local_cluster with other settings, or without keep, ends them first)."""
    key = (num_cpus, tuple(sorted((env or {}).items())))
    if not (keep and _KEPT and _KEPT[0][0] == key and ray.is_initialized()):
        stop_kept()
        url = _start(num_cpus, env)
        if keep:
            _KEPT.append((key, url))
    else:
        url = _KEPT[0][1]
    try:
        yield url
    finally:
        if keep and _KEPT:
            for name in list(serve.status().applications):
                serve.delete(name)
        else:
            serve.shutdown()
            ray.shutdown()


def stop_kept() -> None:
    """Shut down the Ray and Serve a local_cluster(keep=True) left running, if any."""
    if _KEPT:
        _KEPT.clear()
        serve.shutdown()
        ray.shutdown()


def _start(num_cpus: int, env: Mapping[str, str] | None) -> str:
    local_ray_env()
    port = free_port()
    pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env_vars = {"PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1", **(env or {})}
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": env_vars})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
    except BaseException:
        ray.shutdown()
        raise
    return f"http://127.0.0.1:{port}"


def deploy(app_args: dict[str, Any], name: str = "e2e", prefix: str = "/",
           env: Mapping[str, str] | None = None) -> None:
    """Deploy the service app built from `app_args` (and `env`'s TS_* variables, none by default);
    returns when Serve reports it running (readiness is `wait_for(url, "/readyz", 200)`)."""
    serve.run(build_app_from_settings(Settings.build(app_args, env=env or {})), name=name, route_prefix=prefix)


@contextmanager
def fronted(serve_url: str, binary: str, max_body_bytes: int = 1 << 20, retry_after_s: int = 1,
            poll_s: float = 0.5, metrics_dir: str | None = None) -> Iterator[Front]:
    """The nginx front of `python -m service` (service/front/) on a free 127.0.0.1 port, in front of
    this process's Serve (its proxy at `serve_url` as the backup); `.url` is where clients go. With the
    app's `metrics_dir`, its own answers are counted into /metrics."""
    backup = Address("127.0.0.1", int(serve_url.rsplit(":", 1)[1]))
    with serve_front(binary, Address("127.0.0.1", free_port()), backup, max_body_bytes, retry_after_s,
                     poll_s=poll_s, metrics_dir=metrics_dir) as front:
        yield front
