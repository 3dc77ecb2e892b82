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
(service/http/deadline.py), which can only lower the configured one.

It also gives the errors Serve's proxy answers by itself our JSON error shape (service/errors.py):
those never passed through our app, and are plain text. When the ingress replica died while
answering (or its node was lost) Serve's proxy answers nothing and the HTTP server sends a bare
`500 Internal Server Error`: that becomes `503 model_not_ready` with Retry-After (so does a plain-text
500 with Ray's exception text); Serve's 503s become `overloaded_error` (with its Retry-After) or
`model_not_ready`, its 408 timeout a `504 timeout_error`. No torch, no FastAPI here: this module runs in
Serve's proxy process.
"""

from __future__ import annotations

import json
import logging

from starlette.middleware import Middleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..errors import RETRY_LATER, DeadlineExceeded, NotReady, Overloaded, ServiceError
from ..telemetry.logs import new_request_id, valid_request_id

log = logging.getLogger(__name__)
REQUEST_ID = b"x-request-id"
LOST = "the service's ingress stopped while answering (a replica or a node was lost); retry later"
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


def serve_error(status: int, retry_after: bool) -> ServiceError | None:
    """Our error for a plain-text error Serve's proxy answered itself; None: pass it through."""
    if status == 408:
        return DeadlineExceeded("the request did not finish within the service's timeout")
    if status == 503 and retry_after:
        return Overloaded("the service is overloaded; retry later")
    if status in (500, 502, 503):
        return NotReady(LOST)
    return None


class ProxyHeaders:
    """ASGI middleware: every HTTP request's headers through safe_headers, and Serve's own plain-text
    errors as our JSON ones (module docstring)."""

    def __init__(self, app: ASGIApp, retry_after_s: int = 1) -> None:
        self.app, self.retry_after_s = app, retry_after_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope = {**scope, "headers": safe_headers(list(scope["headers"]))}
        rid = dict(scope["headers"])[REQUEST_ID]
        replaced: ServiceError | None = None
        started = False

        async def answer(error: ServiceError) -> None:
            body = json.dumps(error.body()).encode()
            out = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"x-request-id", rid)]
            if error.type in RETRY_LATER:
                out.append((b"retry-after", str(self.retry_after_s).encode()))
            await send({"type": "http.response.start", "status": error.status, "headers": out})
            await send({"type": "http.response.body", "body": body, "more_body": False})

        async def send_ours(message: Message) -> None:
            nonlocal replaced, started
            if message["type"] == "http.response.start":
                started = True
                headers = {k.lower(): v for k, v in message.get("headers", [])}
                if message["status"] >= 400 and headers.get(b"content-type", b"").startswith(b"text/plain"):
                    replaced = serve_error(message["status"], b"retry-after" in headers)
                    if replaced is not None:
                        await answer(replaced)
                        return
            if replaced is None:
                await send(message)
            # else: the rest of Serve's own body is dropped

        try:
            await self.app(scope, receive, send_ours)
        except Exception:  # Serve's proxy itself failed: the HTTP server would answer a bare 500
            if started:
                raise
            log.warning("Serve's proxy failed before answering %s", rid.decode("latin-1"), exc_info=True)
            await answer(NotReady(LOST))
            return
        if not started:  # Serve's proxy answers nothing for a replica that died (its 500 is the server's)
            await answer(NotReady(LOST))


def proxy_middlewares() -> list[Middleware]:
    """What RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH names: Serve calls it in each HTTP server."""
    return [Middleware(ProxyHeaders)]
