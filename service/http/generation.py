"""The generation routes: /v1/generate and OpenAI's /v1/completions and /v1/chat/completions.

The ingress validates, converts the body to a GenerationRequest and calls the generator
deployment: `generate` for a whole answer (under the request's deadline, else 504) or
`generate_stream` for server-sent events (sse.py). A stream is opened before the response starts:
the replica first answers GenerationStarted, once the engine accepted the request, so a refusal
(422 over a limit, 503 overloaded) is still a JSON error with its status. After that each
TextDelta becomes one event. A client that disconnects cancels the handle call, and the replica
cancels the request in its engine. The request carries the route's field names (`names`), so the
replica's errors name the client's fields and pass through unchanged. No Ray and no model code here.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from ..messages import ChatMessage, GenerationDone, GenerationRequest
from ..settings import Settings
from .deadline import request_timeout, within
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
    Sampling,
    check_supported,
)
from .logprobs import chat_logprobs, completion_logprobs
from .routing import Backend, ModelRoutes, Route
from .sse import SSE_HEADERS, ChatFormat, CompletionFormat, GenerateFormat, StreamFormat, sse_body

# -- calls ----------------------------------------------------------------------------------------

class GenerationCalls:
    """The two ways to call a generator deployment: a whole answer, or a stream opened at once."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    async def complete(self, route: Route, request: GenerationRequest, timeout: float) -> GenerationDone:
        # on the deadline the call is cancelled: the replica cancels the request in its engine
        return await within(self.backend.call(route.deployment, "generate", request), timeout)

    async def stream(self, route: Route, request: GenerationRequest, timeout: float,
                     fmt: StreamFormat) -> StreamingResponse:
        """Wait (under the deadline) until the engine accepted the request, then stream. The deadline
        does not limit the stream itself: the client reads as long as it wants, and may hang up."""
        events = self.backend.stream(route.deployment, "generate_stream", request)
        try:
            first = await within(anext(events), timeout, "the generation did not start")
        except BaseException:
            await events.aclose()
            raise
        return StreamingResponse(sse_body(first, events, fmt), media_type="text/event-stream",
                                 headers=SSE_HEADERS)


def to_request(body: Sampling, max_new_tokens: int | None, prompt: str | None = None,
               messages: tuple[ChatMessage, ...] | None = None,
               names: Mapping[str, str] | None = None, logprobs: int | None = None) -> GenerationRequest:
    """`names`: the route's names of GenerationRequest fields, for the errors' `param`."""
    return GenerationRequest(
        request_id=uuid.uuid4().hex, prompt=prompt, messages=messages, max_new_tokens=max_new_tokens,
        temperature=body.temperature, top_k=body.top_k, top_p=body.top_p,
        repetition_penalty=body.repetition_penalty, presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty, logit_bias=body.bias(), logprobs=logprobs, seed=body.seed,
        stop=tuple(body.stop or ()), ignore_eos=body.ignore_eos, names=dict(names or {}))


def usage(done: GenerationDone) -> CompletionUsage:
    return CompletionUsage(**done.usage.as_dict())


def generation_router(settings: Settings, routes: ModelRoutes, backend: Backend,
                      errors: dict[int | str, dict[str, Any]]) -> APIRouter:
    router = APIRouter(tags=["generation"])

    def deadline(request: Request) -> float:
        return request_timeout(request, settings)

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
                                usage=usage(done))

    @router.post("/v1/completions", response_model=CompletionResponse, responses=responses)
    async def completions(body: CompletionRequest, request: Request) -> Any:
        """OpenAI-compatible text completion (one prompt, n=1)."""
        check_supported(body)
        route = routes.resolve("generate", body.model)
        req = to_request(body, body.max_tokens, prompt=body.prompt_text(), names={"max_new_tokens": "max_tokens"},
                         logprobs=body.logprobs)
        cid, created = f"cmpl-{req.request_id}", int(time.time())
        if body.stream:
            include = bool(body.stream_options and body.stream_options.include_usage)
            return await calls.stream(route, req, deadline(request),
                                      CompletionFormat(cid, created, route.model, include, logprobs=req.logprobs is not None))
        done = await calls.complete(route, req, deadline(request))
        lp = completion_logprobs(done.logprobs)[0] if done.logprobs is not None else None
        return CompletionResponse(
            id=cid, created=created, model=route.model, usage=usage(done),
            choices=[CompletionChoice(text=done.text, finish_reason=done.finish_reason, logprobs=lp)])  # type: ignore[arg-type]

    @router.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=responses)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        """OpenAI-compatible chat completion; the messages are rendered with the model's chat template."""
        check_supported(body)
        route = routes.resolve("generate", body.model)
        messages = tuple(ChatMessage(m.role, m.text()) for m in body.messages)
        names = {"max_new_tokens": "max_completion_tokens" if body.max_completion_tokens else "max_tokens"}
        req = to_request(body, body.max_completion_tokens or body.max_tokens, messages=messages, names=names,
                         logprobs=body.logprobs_k())
        cid, created = f"chatcmpl-{req.request_id}", int(time.time())
        if body.stream:
            include = bool(body.stream_options and body.stream_options.include_usage)
            return await calls.stream(route, req, deadline(request),
                                      ChatFormat(cid, created, route.model, include, logprobs=req.logprobs is not None))
        done = await calls.complete(route, req, deadline(request))
        lp = chat_logprobs(done.logprobs) if done.logprobs is not None else None
        return ChatCompletionResponse(
            id=cid, created=created, model=route.model, usage=usage(done),
            choices=[ChatChoice(message=ChatMessageOut(content=done.text), logprobs=lp,
                                finish_reason=done.finish_reason)])  # type: ignore[arg-type]

    return router
