"""service/http/observability.py's handling of a client that leaves mid-stream: behind Ray Serve the
replica's pending `receive` raises (TaskCancelledError) when the proxy sees the client go, and a
streaming response awaits `receive` the whole time."""

from __future__ import annotations

import asyncio
import logging

import pytest
from starlette.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from service.http.observability import Observability
from service.telemetry.metrics import ServiceMetrics


class Gone(Exception):
    """What Ray raises from a cancelled `receive` (ray.exceptions.TaskCancelledError), without Ray."""


def test_a_receive_that_fails_mid_stream_is_a_disconnect_not_an_error(caplog: pytest.LogCaptureFixture) -> None:
    produced: list[int] = []

    async def tokens():  # noqa: ANN202 - an endless stream: only the disconnect can end it
        n = 0
        while True:
            produced.append(n)
            yield f"data: {n}\n\n"
            n += 1
            await asyncio.sleep(0.01)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await StreamingResponse(tokens(), media_type="text/event-stream")(scope, receive, send)

    metrics = ServiceMetrics()
    middleware = Observability(app, metrics, lambda: ["/v1/generate"], retry_after_s=1.0)
    sent: list[Message] = []
    calls = 0

    async def receive() -> Message:
        nonlocal calls
        calls += 1
        if calls == 1:
            return {"type": "http.request", "body": b"{}", "more_body": False}
        await asyncio.sleep(0.1)  # the client stays a while, then the proxy cancels the pending receive
        raise Gone("task was cancelled")

    async def send(message: Message) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/generate", "headers": [], "query_string": b""}
    with caplog.at_level(logging.DEBUG):
        asyncio.run(asyncio.wait_for(middleware(scope, receive, send), timeout=5))
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    assert 3 < len(produced) < 100  # it streamed, then stopped when the client left
    assert metrics["requests_total"].labels("/v1/generate", "200")._value.get() == 1
    assert metrics["requests_in_progress"].labels("/v1/generate")._value.get() == 0
