"""The generation routes in process (no Ray, no model): request conversion, the three SSE formats,
errors before and after a stream starts, OpenAI's field names in errors."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest

from service.errors import NotReady, Overloaded, RequestTooLarge, ServiceError
from service.http.api import create_api
from service.messages import (
    ChatMessage,
    GenerationDone,
    GenerationEvent,
    GenerationRequest,
    GenerationStarted,
    ModelInfo,
    TextDelta,
    Usage,
)
from service.settings import Settings

GEN = {"name": "gen", "tasks": ["generate"], "source": "tiny:decoder"}


class FakeBackend:
    """Streams `events` (then raises `fail`, if set); a whole answer is the last event. Records requests.
    `refuse`: an error, or a function of the request giving one (as a replica names the request's fields)."""

    def __init__(self, events: list[GenerationEvent], fail: ServiceError | None = None,
                 refuse: ServiceError | Callable[[GenerationRequest], ServiceError] | None = None) -> None:
        self.events, self.fail, self.refuse = events, fail, refuse
        self.requests: list[GenerationRequest] = []
        self.closed = 0

    async def call(self, deployment: str, method: str, request: GenerationRequest) -> Any:
        assert (deployment, method) == ("generator", "generate")
        self.requests.append(request)
        if self.refuse is not None:
            raise self.refuse if isinstance(self.refuse, ServiceError) else self.refuse(request)
        return self.events[-1]

    async def stream(self, deployment: str, method: str, request: GenerationRequest) -> AsyncIterator[Any]:
        assert (deployment, method) == ("generator", "generate_stream")
        self.requests.append(request)
        if self.refuse is not None:
            raise self.refuse if isinstance(self.refuse, ServiceError) else self.refuse(request)
        try:
            for event in self.events:
                yield event
            if self.fail is not None:
                raise self.fail
        finally:
            self.closed += 1

    async def info(self, deployment: str, timeout_s: float) -> ModelInfo:
        return ModelInfo(name="gen", deployment=deployment, tasks=("generate",), device="cpu", dtype="float32",
                         max_input_tokens=8)

    async def replica_states(self) -> dict[str, dict[str, int]]:
        return {}


def post(backend: FakeBackend, path: str, body: dict[str, Any], headers: dict[str, str] | None = None
         ) -> httpx.Response:
    app = create_api(Settings.build({"deployments": {"generator": {"model": GEN}}, "retry_after_s": 3}, env={}),
                     backend)

    async def main() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post(path, json=body, headers=headers)

    return asyncio.run(main())


def payloads(r: httpx.Response) -> list[Any]:
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert r.text.endswith("\n\n") and all(block.startswith("data: ") for block in r.text[:-2].split("\n\n"))
    return [b[6:] if b[6:] == "[DONE]" else json.loads(b[6:]) for b in r.text[:-2].split("\n\n")]


EVENTS: list[GenerationEvent] = [GenerationStarted("r1", 5), TextDelta("Hé"), TextDelta("llo"),
                                 GenerationDone("r1", "Héllo", "length", Usage(5, 3))]
USAGE = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}


def test_generate_answers_whole_or_as_events() -> None:
    backend = FakeBackend(EVENTS)
    body = {"prompt": "hi", "max_new_tokens": 3, "temperature": 0.5, "top_k": 4, "top_p": 0.9,
            "repetition_penalty": 1.1, "seed": 7, "stop": "x"}
    whole = post(backend, "/v1/generate", body)
    assert whole.json() == {"model": "gen", "text": "Héllo", "finish_reason": "length", "usage": USAGE}
    streamed = payloads(post(backend, "/v1/generate", {**body, "stream": True}))
    assert streamed == [{"text": "Hé"}, {"text": "llo"},
                        {"model": "gen", "text": "", "finish_reason": "length", "usage": USAGE}]
    first, second = backend.requests
    assert first == GenerationRequest(first.request_id, prompt="hi", max_new_tokens=3, temperature=0.5, top_k=4,
                                      top_p=0.9, repetition_penalty=1.1, seed=7, stop=("x",), timeout_s=30.0)
    assert second.request_id != first.request_id and backend.closed == 1


def test_completions_chunks_in_openai_format() -> None:
    backend = FakeBackend(EVENTS)
    whole = post(backend, "/v1/completions", {"prompt": ["hi"], "max_tokens": 3}).json()
    assert whole["object"] == "text_completion" and whole["id"].startswith("cmpl-") and whole["usage"] == USAGE
    assert whole["choices"] == [{"index": 0, "text": "Héllo", "logprobs": None, "finish_reason": "length"}]
    chunks = payloads(post(backend, "/v1/completions", {"prompt": "hi", "stream": True}))
    assert chunks[-1] == "[DONE]" and all(c["object"] == "text_completion" and "usage" not in c for c in chunks[:-1])
    assert [c["choices"][0]["text"] for c in chunks[:-1]] == ["Hé", "llo", ""]
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None, None, "length"]
    with_usage = payloads(post(backend, "/v1/completions", {"prompt": "hi", "stream": True,
                                                             "stream_options": {"include_usage": True}}))
    assert with_usage[-2]["choices"] == [] and with_usage[-2]["usage"] == USAGE
    assert all(c["usage"] is None for c in with_usage[:-2])


def test_chat_chunks_in_openai_format() -> None:
    backend = FakeBackend(EVENTS)
    messages = [{"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}]
    whole = post(backend, "/v1/chat/completions", {"messages": messages, "max_tokens": 9,
                                                   "max_completion_tokens": 3, "n": 1, "stop": ["a", "b"]}).json()
    assert whole["object"] == "chat.completion" and whole["id"].startswith("chatcmpl-")
    assert whole["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "Héllo", "tool_calls": None},
                                 "logprobs": None, "finish_reason": "length"}]
    request = backend.requests[0]
    assert request.messages == (ChatMessage("developer", "be brief"), ChatMessage("user", "hi"))
    assert request.prompt is None and request.max_new_tokens == 3 and request.stop == ("a", "b")
    chunks = payloads(post(backend, "/v1/chat/completions", {"messages": messages, "stream": True}))
    assert chunks[-1] == "[DONE]" and {c["object"] for c in chunks[:-1]} == {"chat.completion.chunk"}
    assert [c["choices"][0]["delta"] for c in chunks[:-1]] == [
        {"role": "assistant", "content": ""}, {"content": "Hé"}, {"content": "llo"}, {}]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("path", ["/v1/generate", "/v1/completions", "/v1/chat/completions"])
def test_a_failure_after_the_stream_started_is_a_last_error_event(path: str) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"}
    died = FakeBackend(EVENTS[:2], fail=NotReady("generator: the model replica died; retry later"))
    *_, last = payloads(post(died, path, {**body, "stream": True}))
    assert last == {"error": {"type": "model_not_ready", "message": "generator: the model replica died; retry later"}}
    failed = FakeBackend([*EVENTS[:2], GenerationDone("r1", "Hé", "error", Usage(5, 1), error="RuntimeError: boom")])
    *_, last = payloads(post(failed, path, {**body, "stream": True}))
    assert last["error"]["type"] == "internal_error" and "boom" not in json.dumps(last)
    grammar = FakeBackend([*EVENTS[:2], GenerationDone("r1", "Hé", "error", Usage(5, 1), error="the grammar failed",
                                                       error_type="invalid_request_error", error_param="response_format")])
    *_, last = payloads(post(grammar, path, {**body, "stream": True}))  # the request's own fault: said as it is
    assert last == {"error": {"type": "invalid_request_error", "message": "the grammar failed",
                              "param": "response_format"}}


@pytest.mark.parametrize("stream", [False, True])
def test_refusals_are_json_errors_with_the_route_field_names(stream: bool) -> None:
    def too_long(request: GenerationRequest) -> RequestTooLarge:
        return RequestTooLarge("max_new_tokens=900 is over the limit max_new_tokens (512)",
                               request.param("max_new_tokens"), "max_new_tokens")

    r = post(FakeBackend([], refuse=too_long), "/v1/completions", {"prompt": "hi", "max_tokens": 900, "stream": stream})
    assert r.status_code == 422 and r.json()["error"]["param"] == "max_tokens"
    assert "limit max_new_tokens" in r.json()["error"]["message"]
    r = post(FakeBackend([], refuse=too_long), "/v1/chat/completions",
             {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 900, "stream": stream})
    assert r.json()["error"]["param"] == "max_completion_tokens"
    r = post(FakeBackend([], refuse=Overloaded("full")), "/v1/generate", {"prompt": "hi", "stream": stream})
    assert r.status_code == 503 and r.headers["Retry-After"] == "3" and r.json()["error"]["type"] == "overloaded_error"


class QueuedBackend(FakeBackend):
    """The request waits `wait_s` in the engine's queue before its first token (GenerationStarted)."""

    def __init__(self, wait_s: float) -> None:
        super().__init__(EVENTS)
        self.wait_s = wait_s

    async def stream(self, deployment: str, method: str, request: GenerationRequest) -> AsyncIterator[Any]:
        try:
            await asyncio.sleep(self.wait_s)
            for event in self.events:
                yield event
        finally:
            self.closed += 1


def test_a_stream_keeps_its_deadline_until_its_first_token() -> None:
    app = create_api(Settings.build({"deployments": {"generator": {"model": GEN}}}, env={}), QueuedBackend(5.0))

    async def main() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post("/v1/generate", json={"prompt": "hi", "stream": True},
                                     headers={"X-Request-Timeout": "0.2"})

    started = time.monotonic()
    r = asyncio.run(main())
    assert r.status_code == 504 and r.json()["error"]["type"] == "timeout_error", r.text
    assert time.monotonic() - started < 2
    slow_but_in_time = QueuedBackend(0.05)
    assert payloads(post(slow_but_in_time, "/v1/generate", {"prompt": "hi", "stream": True}))[0] == {"text": "Hé"}
    assert slow_but_in_time.closed == 1


def test_the_routing_session_comes_from_the_header_else_the_openai_user() -> None:
    backend = FakeBackend(EVENTS)
    chat = {"messages": [{"role": "user", "content": "hi"}], "user": "alice"}
    assert post(backend, "/v1/chat/completions", chat).status_code == 200
    assert post(backend, "/v1/chat/completions", chat, {"x-session-id": "s-1"}).status_code == 200
    assert post(backend, "/v1/completions", {"prompt": "hi", "user": "bob"}).status_code == 200
    assert post(backend, "/v1/generate", {"prompt": "hi"}, {"x-session-id": "s-2"}).status_code == 200
    assert post(backend, "/v1/generate", {"prompt": "hi"}).status_code == 200
    assert [r.session for r in backend.requests] == ["alice", "s-1", "bob", "s-2", None]
    too_long = post(backend, "/v1/generate", {"prompt": "hi"}, {"x-session-id": "x" * 257})
    assert too_long.status_code == 422 and too_long.json()["error"]["param"] == "x-session-id"
    assert len(backend.requests) == 5


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/tokenize", '{"prompt": "a\\ud800b", "add_special_tokens": false}', "prompt"),
    ("/v1/completions", '{"prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": "\\udc00"}]}',
     "messages[1].content"),
])
def test_a_prompt_that_is_not_unicode_text_is_a_422_not_a_500(path: str, body: str, param: str) -> None:
    """The tenants issue's probe: /tokenize with a lone surrogate answered 500; every generation route
    refuses it at the edge with the OpenAI error shape, and no replica is asked."""
    backend = FakeBackend([])
    app = create_api(Settings.build({"deployments": {"generator": {"model": GEN}}}, env={}), backend)

    async def main() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post(path, content=body.encode(), headers={"content-type": "application/json"})

    r = asyncio.run(main())
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and "lone surrogate" in error["message"]
    assert error["param"] == param and backend.requests == []


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
def test_more_chat_messages_than_any_context_holds_is_a_422_before_any_replica(path: str) -> None:
    """The tenants issue's probe: 35,000 empty messages (1 MB) were rendered and tokenized on the
    replica's loop; past MAX_MESSAGES the edge refuses them, naming the field."""
    from service.http.generation_schemas import MAX_MESSAGES

    backend = FakeBackend([])
    messages = [{"role": "user", "content": ""}] * (MAX_MESSAGES + 1)
    r = post(backend, path, {"messages": messages})
    assert r.status_code == 422, r.text
    assert r.json()["error"]["param"] == "messages" and backend.requests == []
    if path == "/v1/chat/completions":  # the bound itself passes the edge and reaches the replica
        post(backend, path, {"messages": messages[:MAX_MESSAGES]})
        assert len(backend.requests) == 1 and len(backend.requests[0].messages) == MAX_MESSAGES


def test_several_choices_without_a_temperature_sample_at_openais_default() -> None:
    """n > 1 (or best_of) and no temperature: OpenAI's default temperature 1, not the model's default
    (greedy for the shipped generator: n identical answers); a temperature given, or one choice, as asked."""
    from prometheus_client import CollectorRegistry

    from service.http.api import create_api
    from service.telemetry.metrics import ServiceMetrics
    from service.testing.fake_backend import fake_settings
    from tests.service.http.test_quotas import KEY_C, Recording, calls

    backend = Recording()
    app = create_api(fake_settings({"api_keys": [KEY_C]}), backend, ServiceMetrics(CollectorRegistry()))
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    got = calls(app, [(KEY_C, "/v1/chat/completions", {**chat, "n": 2}),
                      (KEY_C, "/v1/chat/completions", {**chat, "n": 2, "temperature": 0}),
                      (KEY_C, "/v1/completions", {"prompt": "a", "max_tokens": 4, "best_of": 2}),
                      (KEY_C, "/v1/chat/completions", chat)])
    assert [r.status_code for r in got] == [200] * 4
    assert [r.temperature for r in backend.requests] == [1.0, 1.0, 0, 0, 1.0, 1.0, None]
