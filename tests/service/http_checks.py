"""Assertions shared by the HTTP end-to-end tests."""

from __future__ import annotations

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
