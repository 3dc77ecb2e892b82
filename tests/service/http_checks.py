"""Helpers shared by the HTTP tests: the error-shape assertion, an in-process ASGI request."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx


def assert_error(r: httpx.Response, status: int, type_: str, param: str | None = None) -> dict[str, Any]:
    """The response is our JSON error shape with this status and type (and param); returns the error."""
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and body["error"]["type"] == type_, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    assert "Traceback" not in r.text
    if param is not None:
        assert body["error"].get("param") == param, body
    return body["error"]


def send(app: Any, method: str, path: str, **kwargs: Any) -> httpx.Response:
    """One request to an ASGI app in this process (its exceptions become 500 answers, as on a server)."""
    async def main() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.request(method, path, **kwargs)

    return asyncio.run(main())
