"""The HTTP layer in process (no Ray): routing of tasks, deadlines, error mapping, body limits.

A fake backend stands in for the Ray handles; the end-to-end tests cover the real thing.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from service.errors import Overloaded
from service.http.api import create_api
from service.http.routing import probed_readiness
from service.messages import Classification, ModelInfo
from service.settings import Settings

ENCODER = {"name": "enc", "tasks": ["classify", "embed"], "source": "tiny:encoder"}


class FakeBackend:
    """Answers classify with a fixed result after `delay_s`, or raises `error`; records cancellations."""

    def __init__(self, delay_s: float = 0.0, error: BaseException | None = None) -> None:
        self.delay_s, self.error = delay_s, error
        self.calls: list[tuple[str, str, tuple[Any, ...]]] = []
        self.cancelled = 0

    async def call(self, deployment: str, method: str, *args: Any) -> Any:
        self.calls.append((deployment, method, args))
        try:
            await asyncio.sleep(self.delay_s)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        if self.error is not None:
            raise self.error
        return [Classification("pos", 0.75, {"neg": 0.25, "pos": 0.75}) for _ in args[0]]

    async def info(self, deployment: str, timeout_s: float) -> ModelInfo:
        return ModelInfo(name="enc", deployment=deployment, tasks=("classify", "embed"), device="cpu",
                         dtype="float32", max_input_tokens=8)

    async def readiness(self, deployments: list[str], timeout_s: float) -> dict[str, str]:
        return await probed_readiness(self, deployments, timeout_s)

    async def replica_states(self) -> dict[str, dict[str, int]]:
        return {}


def request(backend: FakeBackend, method: str, path: str, settings: dict[str, Any] | None = None,
            **kwargs: Any) -> httpx.Response:
    args = {"deployments": {"encoder": {"model": ENCODER}}, "max_body_bytes": 256, **(settings or {})}
    app = create_api(Settings.build(args, env={}), backend)

    async def main() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)  # as a server: log, answer 500
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.request(method, path, **kwargs)

    return asyncio.run(main())


def test_classify_routes_to_the_deployment_and_converts() -> None:
    backend = FakeBackend()
    r = request(backend, "POST", "/v1/classify", json={"inputs": ["a", "b"], "truncate": True},
                headers={"X-Request-Timeout": "3"})
    assert r.status_code == 200
    assert r.json() == {"model": "enc", "results": [{"label": "pos", "score": 0.75,
                                                     "scores": {"neg": 0.25, "pos": 0.75}}] * 2}
    assert backend.calls == [("encoder", "classify", (["a", "b"], True, None, 3.0, 0))]  # no tenant: priority 0


def test_a_task_no_model_serves_is_a_404() -> None:
    r = request(FakeBackend(), "POST", "/v1/translate", json={"inputs": "a", "source_lang": "en", "target_lang": "es"})
    assert r.status_code == 404
    assert r.json()["error"]["type"] == "not_found_error"
    assert "no model on this server serves 'translate' (served tasks: classify, embed)" in r.json()["error"]["message"]


def test_the_deadline_answers_504_and_cancels_the_model_call() -> None:
    backend = FakeBackend(delay_s=5.0)
    r = request(backend, "POST", "/v1/classify", json={"inputs": "a"}, headers={"X-Request-Timeout": "0.05"})
    assert r.status_code == 504 and r.json()["error"]["type"] == "timeout_error"
    assert backend.cancelled == 1


def test_the_settings_deadline_caps_the_header() -> None:
    backend = FakeBackend()
    request(backend, "POST", "/v1/classify", {"request_timeout_s": 2}, json={"inputs": "a"},
            headers={"X-Request-Timeout": "60"})
    assert backend.calls[0][2][-2:] == (2.0, 0)  # (the deadline, the priority)


def test_overload_from_a_replica_is_a_503_with_retry_after() -> None:
    r = request(FakeBackend(error=Overloaded("queue full")), "POST", "/v1/classify", {"retry_after_s": 3},
                json={"inputs": "a"})
    assert r.status_code == 503 and r.headers["Retry-After"] == "3"
    assert r.json() == {"error": {"type": "overloaded_error", "message": "queue full"}}


def test_an_unexpected_error_is_a_generic_500_without_details() -> None:
    r = request(FakeBackend(error=RuntimeError("secret internals")), "POST", "/v1/classify", json={"inputs": "a"})
    assert r.status_code == 500
    assert r.json() == {"error": {"type": "internal_error", "message": "internal error; see the server log"}}


@pytest.mark.parametrize("chunked", [False, True])
def test_the_body_limit_applies_before_parsing(chunked: bool) -> None:
    body = b'{"inputs": "' + b"x" * 300 + b'"}'

    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length
        yield body[:100]
        yield body[100:]

    content: Any = chunks() if chunked else body
    backend = FakeBackend()
    r = request(backend, "POST", "/v1/classify", content=content, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
    assert backend.calls == []


def test_readyz_and_models_use_the_backend_probe() -> None:
    assert request(FakeBackend(), "GET", "/readyz").json() == {"status": "ready", "deployments": {"encoder": "ready"}}
    models = request(FakeBackend(), "GET", "/v1/models").json()
    assert models["tasks"] == {"classify": ["enc"], "embed": ["enc"]} and models["data"][0]["ready"] is True


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/classify", '{"inputs": ["fine", "a\\ud800b"]}', "inputs[1]"),
    ("/v1/embeddings", '{"input": "\\udfff"}', "input"),
    ("/v1/classify", '{"inputs": "ok", "model": "e\\ud83dx"}', "model"),
])
def test_a_string_that_is_not_unicode_text_is_a_422_naming_where(path: str, body: str, param: str) -> None:
    """JSON's escapes spell lone surrogates, which no tokenizer takes: a 422 at the edge naming the
    field, never a 500, and no model is called."""
    backend = FakeBackend()
    r = request(backend, "POST", path, content=body.encode(), headers={"content-type": "application/json"})
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"].startswith(f"{param}: not Unicode text (a lone surrogate")
    assert backend.calls == []


def test_lone_surrogates_are_found_anywhere_in_a_body_keys_included() -> None:
    from service.http.schemas import lone_surrogate

    assert lone_surrogate({"a": ["x", {"b": "é\ud800"}]}) == ("a[1].b", "U+D800")
    assert lone_surrogate({"bias": {"\udc00": 1}}) == ("bias", "U+DC00")  # a key names its object
    assert lone_surrogate("\ud800") == (None, "U+D800")
    assert lone_surrogate({"a": ["é", "😀", {"b": "ok"}], "n": 3}) is None
    deep: Any = "\ud800"
    for _ in range(5000):  # deeper than Python's recursion limit
        deep = [deep]
    assert lone_surrogate(deep)[1] == "U+D800"


def test_a_body_not_whole_within_its_deadline_is_a_408_before_any_model_call() -> None:
    """A client that sends part of its body and stalls: 408 request_timeout_error after body_timeout_s,
    naming how much came; the model is never called. The front's nginx has the same timeout."""
    import time
    from pathlib import Path

    from service.front.config import Address, FrontConfig, render_nginx
    from service.testing.fake_backend import fake_app

    app = fake_app({"body_timeout_s": 0.3})
    messages = [{"type": "http.request", "body": b'{"inputs": "ab', "more_body": True}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop(0)
        await asyncio.sleep(30)  # the client stalls
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/classify", "raw_path": b"/v1/classify", "root_path": "",
             "query_string": b"", "headers": [(b"content-type", b"application/json")], "http_version": "1.1",
             "scheme": "http", "server": ("test", 80), "client": ("127.0.0.1", 1)}
    began = time.monotonic()
    asyncio.run(app(scope, receive, send))
    took = time.monotonic() - began
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = json.loads(b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"))
    assert start["status"] == 408 and body["error"]["type"] == "request_timeout_error"
    assert "within 0.3 s (14 bytes came)" in body["error"]["message"] and took < 5
    cfg = FrontConfig(Address("127.0.0.1", 8000), Address("127.0.0.1", 8001), Path("/tmp"), 1 << 20, 1, body_timeout_s=7)
    assert "client_body_timeout 7s;" in render_nginx(cfg)
