"""A real local Ray Serve for end-to-end tests: one helper shared by every e2e module.

    with local_cluster() as url:                       # Ray + Serve's HTTP proxy on a free port
        deploy(app_args, name="e2e", prefix="/")       # build_app_from_settings(Settings.build(...))
        wait_for(url, "/readyz", 200, timeout_s=120)

Each module starts its own cluster (module-scoped fixtures) and shuts it down; `OMP_NUM_THREADS=1`
keeps the replicas from fighting over the two CI cores.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


@contextmanager
def local_cluster(num_cpus: int = 4, env: Mapping[str, str] | None = None) -> Iterator[str]:
    """A fresh local Ray with Serve's proxy on a free 127.0.0.1 port; yields the base URL."""
    import ray
    from ray import serve

    port = free_port()
    pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env_vars = {"PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1", **(env or {})}
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": env_vars})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def deploy(app_args: dict[str, Any], name: str = "e2e", prefix: str = "/") -> None:
    """Deploy the service app built from `app_args` (the Serve config's `args`, no TS_* env); returns
    when Serve reports the application running (readiness is then `wait_for(url, "/readyz", 200)`)."""
    from ray import serve

    from service.app import build_app_from_settings
    from service.settings import Settings

    serve.run(build_app_from_settings(Settings.build(app_args, env={})), name=name, route_prefix=prefix)
