"""The generation routes: /v1/generate and OpenAI's /v1/completions and /v1/chat/completions.

The ingress validates, converts the body to a GenerationRequest and calls the generator
deployment: `generate` for a whole answer (under the request's deadline, else 504) or
`generate_stream` for server-sent events. A stream is opened before the response starts: the
replica first answers GenerationStarted, once the engine accepted the request, so a refusal (422
over a limit, 503 overloaded) is still a JSON error with its status. After that each TextDelta
becomes one event. A client that disconnects cancels the handle call, and the replica cancels the
request in its engine. No Ray and no model code here.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from .errors import DeadlineExceeded, InternalError, InvalidRequest, ServiceError
from .generation_schemas import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessageOut,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    CompletionUsage,
    GenerateRequest,
    GenerateResponse,
    GenerateUsage,
    Sampling,
    check_supported,
)
from .messages import (
    ChatMessage,
    GenerationDone,
    GenerationEvent,
    GenerationRequest,
    GenerationStarted,
    TextDelta,
)
from .routing import Backend, ModelRoutes, Route

log = logging.getLogger(__name__)
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE = b"data: [DONE]\n\n"  # OpenAI's end of stream


def sse(payload: dict[str, Any]) -> bytes:
    """One server-sent event: `data: <json>` and a blank line."""
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def usage(done: GenerationDone) -> dict[str, int]:
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
            "total_tokens": done.total_tokens}


# -- stream formats: events -> SSE payloads -------------------------------------------------------

class StreamFormat(Protocol):
    end: bytes  # written after the last event (b"" for none)

    def render(self, event: GenerationEvent) -> list[dict[str, Any]]:
        ...


@dataclass
class GenerateFormat:
    """/v1/generate: `{"text"}` per piece, then `{"model", "text": "", "finish_reason", "usage"}`."""

    model: str
    end: bytes = b""

    def render(self, event: GenerationEvent) -> list[dict[str, Any]]:
        if isinstance(event, TextDelta):
            return [{"text": event.text}]
        if isinstance(event, GenerationDone):
            return [{"model": self.model, "text": "", "finish_reason": event.finish_reason, "usage": usage(event)}]
        return []


@dataclass
class _OpenAIFormat:
    """OpenAI's streamed chunk envelope: id, object, created, model, choices (+ usage when asked)."""

    id: str
    created: int
    model: str
    include_usage: bool
    end: bytes = DONE
    object_name: ClassVar[str] = ""

    def chunk(self, choices: list[dict[str, Any]], used: dict[str, int] | None = None) -> dict[str, Any]:
        out = {"id": self.id, "object": self.object_name, "created": self.created, "model": self.model,
               "choices": choices}
        return out | {"usage": used} if self.include_usage else out


@dataclass
class CompletionFormat(_OpenAIFormat):
    """OpenAI's text_completion chunks; a usage chunk (no choices) last when include_usage."""

    object_name: ClassVar[str] = "text_completion"

    def render(self, event: GenerationEvent) -> list[dict[str, Any]]:
        if isinstance(event, TextDelta):
            return [self.chunk([{"index": 0, "text": event.text, "logprobs": None, "finish_reason": None}])]
        if isinstance(event, GenerationDone):
            last = [self.chunk([{"index": 0, "text": "", "logprobs": None, "finish_reason": event.finish_reason}])]
            return last + ([self.chunk([], usage(event))] if self.include_usage else [])
        return []


@dataclass
class ChatFormat(_OpenAIFormat):
    """OpenAI's chat.completion.chunk: the role first, then content deltas, then finish_reason."""

    object_name: ClassVar[str] = "chat.completion.chunk"

    def render(self, event: GenerationEvent) -> list[dict[str, Any]]:
        def choice(delta: dict[str, str], finish: str | None = None) -> dict[str, Any]:
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}

        if isinstance(event, GenerationStarted):
            return [self.chunk([choice({"role": "assistant", "content": ""})])]
        if isinstance(event, TextDelta):
            return [self.chunk([choice({"content": event.text})])]
        last = [self.chunk([choice({}, event.finish_reason)])]
        return last + ([self.chunk([], usage(event))] if self.include_usage else [])


async def sse_body(first: GenerationEvent, events: AsyncIterator[GenerationEvent],
                   fmt: StreamFormat) -> AsyncIterator[bytes]:
    """The event stream of a response. An error after the stream started (the replica died, the
    engine failed the request) is a last `{"error": {...}}` event: the status is already sent."""
    try:
        event: GenerationEvent | None = first
        while event is not None:
            if isinstance(event, GenerationDone) and event.error is not None:
                yield sse(InternalError("the generation failed; see the server log").body())
                return
            for payload in fmt.render(event):
                yield sse(payload)
            event = await anext(events, None)
        if fmt.end:
            yield fmt.end
    except ServiceError as e:
        yield sse(e.body())
    except Exception:
        log.exception("generation stream failed")
        yield sse(InternalError("internal error; see the server log").body())
    finally:  # also when the client went away: closing the stream cancels the model call
        await events.aclose()


# -- calls ----------------------------------------------------------------------------------------

def renamed(err: InvalidRequest, names: dict[str, str]) -> InvalidRequest:
    """The same error naming the request's own field (the replica says max_new_tokens, OpenAI max_tokens)."""
    if err.param not in names:
        return err
    message, _, *rest = err.args  # (message, param, ...) for InvalidRequest and its subclasses
    return type(err)(message, names[err.param], *rest)


class GenerationCalls:
    """The two ways to call a generator deployment: a whole answer, or a stream opened at once.
    `names` maps the replica's field names to the route's, for the errors' `param`."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    async def complete(self, route: Route, request: GenerationRequest, timeout: float,
                       names: dict[str, str] | None = None) -> GenerationDone:
        try:
            return await asyncio.wait_for(self.backend.call(route.deployment, "generate", request), timeout)
        except asyncio.TimeoutError:  # wait_for cancelled the call: the replica cancels it in the engine
            raise DeadlineExceeded(f"the request did not finish within {timeout:g} s") from None
        except InvalidRequest as e:
            raise renamed(e, names or {}) from None

    async def stream(self, route: Route, request: GenerationRequest, timeout: float,
                     fmt: StreamFormat, names: dict[str, str] | None = None) -> StreamingResponse:
        """Wait (under the deadline) until the engine accepted the request, then stream. The deadline
        does not limit the stream itself: the client reads as long as it wants, and may hang up."""
        events = self.backend.stream(route.deployment, "generate_stream", request)
        try:
            first = await asyncio.wait_for(anext(events), timeout)
        except asyncio.TimeoutError:
            await events.aclose()
            raise DeadlineExceeded(f"the generation did not start within {timeout:g} s") from None
        except InvalidRequest as e:
            await events.aclose()
            raise renamed(e, names or {}) from None
        except BaseException:
            await events.aclose()
            raise
        return StreamingResponse(sse_body(first, events, fmt), media_type="text/event-stream",
                                 headers=SSE_HEADERS)


def to_request(body: Sampling, max_new_tokens: int | None, prompt: str | None = None,
               messages: tuple[ChatMessage, ...] | None = None) -> GenerationRequest:
    return GenerationRequest(
        request_id=uuid.uuid4().hex, prompt=prompt, messages=messages, max_new_tokens=max_new_tokens,
        temperature=body.temperature, top_k=body.top_k, top_p=body.top_p,
        repetition_penalty=body.repetition_penalty, seed=body.seed, stop=tuple(body.stop or ()),
        ignore_eos=body.ignore_eos)


def generation_router(routes: ModelRoutes, backend: Backend, deadline: Callable[[Request], float],
                      errors: dict[int | str, dict[str, Any]]) -> APIRouter:
    """The generation routes; `deadline(request)` is the request's timeout in seconds."""
    router = APIRouter(tags=["generation"])
    calls = GenerationCalls(backend)
    responses = {**errors, 200: {"description": "JSON, or server-sent events with `\"stream\": true`",
                                 "content": {"text/event-stream": {}}}}

    @router.post("/v1/generate", response_model=GenerateResponse, responses=responses)
    async def generate(body: GenerateRequest, request: Request) -> Any:
        """Continue a prompt. With `"stream": true`: events `{"text"}` per piece of text, then
        `{"model", "text": "", "finish_reason", "usage"}`."""
        route = routes.resolve("generate", body.model)
        req = to_request(body, body.max_new_tokens, prompt=body.prompt)
        if body.stream:
            return await calls.stream(route, req, deadline(request), GenerateFormat(route.model))
        done = await calls.complete(route, req, deadline(request))
        return GenerateResponse(model=route.model, text=done.text, finish_reason=done.finish_reason,  # type: ignore[arg-type]
                                usage=GenerateUsage(**usage(done)))

    @router.post("/v1/completions", response_model=CompletionResponse, responses=responses)
    async def completions(body: CompletionRequest, request: Request) -> Any:
        """OpenAI-compatible text completion (one prompt, n=1)."""
        check_supported(body)
        route = routes.resolve("generate", body.model)
        req = to_request(body, body.max_tokens, prompt=body.prompt_text())
        cid, created = f"cmpl-{req.request_id}", int(time.time())
        names = {"max_new_tokens": "max_tokens"}
        if body.stream:
            include = bool(body.stream_options and body.stream_options.include_usage)
            return await calls.stream(route, req, deadline(request),
                                      CompletionFormat(cid, created, route.model, include), names)
        done = await calls.complete(route, req, deadline(request), names)
        return CompletionResponse(
            id=cid, created=created, model=route.model, usage=CompletionUsage(**usage(done)),
            choices=[CompletionChoice(text=done.text, finish_reason=done.finish_reason)])  # type: ignore[arg-type]

    @router.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=responses)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        """OpenAI-compatible chat completion; the messages are rendered with the model's chat template."""
        check_supported(body)
        route = routes.resolve("generate", body.model)
        messages = tuple(ChatMessage(m.role, m.text()) for m in body.messages)
        req = to_request(body, body.max_completion_tokens or body.max_tokens, messages=messages)
        cid, created = f"chatcmpl-{req.request_id}", int(time.time())
        names = {"max_new_tokens": "max_completion_tokens" if body.max_completion_tokens else "max_tokens"}
        if body.stream:
            include = bool(body.stream_options and body.stream_options.include_usage)
            return await calls.stream(route, req, deadline(request), ChatFormat(cid, created, route.model, include),
                                      names)
        done = await calls.complete(route, req, deadline(request), names)
        return ChatCompletionResponse(
            id=cid, created=created, model=route.model, usage=CompletionUsage(**usage(done)),
            choices=[ChatChoice(message=ChatMessageOut(content=done.text),
                                finish_reason=done.finish_reason)])  # type: ignore[arg-type]

    return router
