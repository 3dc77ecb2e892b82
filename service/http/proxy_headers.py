"""`ProxyHeaders`: the ASGI middleware that Ray Serve's own HTTP servers (its proxy, or in throughput
mode the ingress replica's) run before our app, via `proxy_middlewares` (set by service/ray_env.py).

Serve acts on three request headers itself (Ray 2.60): `x-request-timeout-seconds` (<= 0 turns the
timeout off) and `x-request-disconnect-disabled` (work runs on after a hang-up) are dropped; exactly
one valid `x-request-id` is kept (the client's when valid, else a fresh one). Our own deadline is
`X-Request-Timeout` (service/http/deadline.py), which can only lower the configured one. Errors Serve
answers by itself get our JSON shape (service/errors.py): a bare or Ray-text 500 (the ingress died
while answering) becomes `503 model_not_ready` with Retry-After, Serve's 503s `overloaded_error` or
`model_not_ready`, its 408 a `504 timeout_error`. Runs in Serve's proxy process: no torch, no FastAPI.
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
