"""ASGI middleware that refuses a body over the limit (413), or not whole within its deadline (408),
before anything parses it."""

from __future__ import annotations

import asyncio
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..errors import BodyTimeout, InvalidRequest, PayloadTooLarge, ServiceError
from .errors import error_response


class BodyLimit:
    """413 when Content-Length or the bytes actually sent exceed max_bytes, 408 when the body is not whole
    `timeout_s` after the request began (a client trickling bytes holds no connection and no request
    slot longer), before anything parses the body. The body is buffered (the routes parse all of it
    anyway)."""

    def __init__(self, app: ASGIApp, max_bytes: int, retry_after_s: float, timeout_s: float = 10.0) -> None:
        self.app, self.max_bytes, self.retry_after_s, self.timeout_s = app, max_bytes, retry_after_s, timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:
            if not declared.isdigit():
                await self._reject(scope, receive, send, InvalidRequest("Content-Length is not a number"))
                return
            if int(declared) > self.max_bytes:
                await self._reject(scope, receive, send, self._too_large(int(declared)))
                return
        chunks, size, deadline = [], 0, time.monotonic() + self.timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                await self._reject(scope, receive, send, BodyTimeout(
                    f"the request body was not whole within {self.timeout_s:g} s ({size} bytes came)"))
                return
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._reject(scope, receive, send, self._too_large(size, at_least=True))
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body, sent = b"".join(chunks), False

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _too_large(self, size: int, at_least: bool = False) -> PayloadTooLarge:
        return PayloadTooLarge(f"the request body has {'more than ' if at_least else ''}{size} bytes; "
                               f"the limit is {self.max_bytes}")

    async def _reject(self, scope: Scope, receive: Receive, send: Send, err: ServiceError) -> None:
        await error_response(err, self.retry_after_s)(scope, receive, send)
