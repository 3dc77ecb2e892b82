"""The headers Ray Serve's own HTTP servers act on before our app sees a request, made safe.

Serve's proxy (and, in throughput mode, the ingress replica's own HTTP server) reads three request
headers itself (ray/serve/_private/proxy.py, replica.py, http_util.py in Ray 2.60):
- `x-request-timeout-seconds`: replaces the deployment's request timeout, and a value <= 0 turns it
  off, so a client could hold a replica slot for ever;
- `x-request-disconnect-disabled: ?1`: stops Serve cancelling the request when the client hangs up,
  so a client could leave work running that nobody reads;
- `x-request-id`: taken as it is for Serve's logs and echoed on the response; an id that our
  app then rejected (service/telemetry/logs.py) reached Ray's logs and came back twice.

`ProxyHeaders` is a pure ASGI middleware that Serve puts outside its own (Serve applies the
middlewares of `RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`, which service/ray_env.py sets to
`proxy_middlewares` before Ray starts): it drops the first two and keeps exactly one valid request
id (the client's when valid, else a fresh one). Our own per-request deadline is `X-Request-Timeout`
(service/http/deadline.py), which can only lower the configured one. No torch, no FastAPI here: this
module runs in Serve's proxy process.
"""

from __future__ import annotations

from starlette.middleware import Middleware
from starlette.types import ASGIApp, Receive, Scope, Send

from ..telemetry.logs import new_request_id, valid_request_id

REQUEST_ID = b"x-request-id"
DROPPED = frozenset({b"x-request-timeout-seconds", b"x-request-disconnect-disabled"})


def safe_headers(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The request's headers without DROPPED, with exactly one valid x-request-id, last."""
    rid = None
    kept = []
    for name, value in headers:
        lower = name.lower()
        if lower == REQUEST_ID:
            rid = rid or valid_request_id(value.decode("latin-1"))
        elif lower not in DROPPED:
            kept.append((name, value))
    kept.append((REQUEST_ID, (rid or new_request_id()).encode("latin-1")))
    return kept


class ProxyHeaders:
    """ASGI middleware: every HTTP request's headers through safe_headers (module docstring)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope = {**scope, "headers": safe_headers(list(scope["headers"]))}
        await self.app(scope, receive, send)


def proxy_middlewares() -> list[Middleware]:
    """What RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH names: Serve calls it in each HTTP server."""
    return [Middleware(ProxyHeaders)]
