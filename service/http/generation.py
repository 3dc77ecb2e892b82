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

import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from ..common.tool_calls import Tool
from ..common.tool_calls import parse as parse_tool_calls
from ..errors import InvalidRequest
from ..messages import (
    ChatMessage,
    GenerationDone,
    GenerationEvent,
    GenerationRequest,
    GenerationStarted,
    GrammarSpec,
)
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
    FunctionCallOut,
    GenerateRequest,
    GenerateResponse,
    Sampling,
    ToolCallOut,
    check_supported,
    grammar_of,
)
from .logprobs import chat_logprobs, completion_logprobs
from .quotas import allowed_priority, cache_salt, charge_tokens, current_tenant
from .routing import Backend, InputLimits, ModelRoutes, Route
from .sse import (
    DONE,
    SSE_HEADERS,
    STREAMED_200,
    ChatFormat,
    CompletionFormat,
    GenerateFormat,
    StreamFormat,
    sse,
    sse_body,
)

log = logging.getLogger(__name__)


# -- calls ----------------------------------------------------------------------------------------

class GenerationCalls:
    """The two ways to call a generator deployment, for one choice or several at once (n > 1, a list
    of prompts): whole answers, or streams opened before the response starts."""

    def __init__(self, backend: Backend, limits: InputLimits) -> None:
        self.backend, self.limits = backend, limits

    async def prepared(self, route: Route, requests: list[GenerationRequest], timeout: float
                       ) -> list[GenerationRequest]:
        """The requests as the replica gets them: prompts within the character cap (else a 422), each
        carrying the deadline's seconds for the engine's admission, the route's adapter and its prefix-cache
        salt (its tenant's and its own: quotas.cache_salt)."""
        await self.limits.check_prompts(route.deployment, requests)
        return [dataclasses.replace(r, timeout_s=timeout, adapter=route.adapter, cache_salt=cache_salt(r.cache_salt),
                                    priority=allowed_priority(r.priority), tenant=current_tenant()) for r in requests]

    async def complete(self, route: Route, requests: list[GenerationRequest], timeout: float) -> list[GenerationDone]:
        """Every request's answer, from one replica call (several are submitted to the engine together,
        so siblings share their prompt's prefill). On the deadline the call is cancelled: the replica
        cancels the requests in its engine."""
        requests = await self.prepared(route, requests, timeout)
        if len(requests) == 1:
            dones = [await within(self.backend.call(route.deployment, "generate", requests[0]), timeout)]
        else:
            dones = list(await within(self.backend.call(route.deployment, "generate_group", requests), timeout))
        charge_tokens(sum(d.usage.prompt_tokens + d.usage.completion_tokens for d in dones))
        return dones

    async def stream(self, route: Route, requests: list[GenerationRequest], timeout: float,
                     formats: Sequence[StreamFormat],
                     usage: Callable[[list[tuple[int, GenerationDone]]], dict[str, Any]] | None = None,
                     ) -> StreamingResponse:
        """Wait (under the deadline) until every request has its first token (the replica's
        GenerationStarted): a stream still queued in the engine at its deadline is a 504 like a whole
        answer, not a 200 that stays silent. Then stream; the deadline does not limit the rest: the
        client reads as long as it wants, and may hang up. One replica call, as in complete()."""
        requests = await self.prepared(route, requests, timeout)
        if len(requests) == 1:
            events = charged(indexed(self.backend.stream(route.deployment, "generate_stream", requests[0])))
        else:
            events = charged(self.backend.stream(route.deployment, "generate_group_stream", requests))

        async def started() -> list[tuple[int, GenerationEvent]]:  # what came until every first token
            read, waiting = [], set(range(len(requests)))
            while waiting:
                i, event = await anext(events)
                read.append((i, event))
                if isinstance(event, GenerationStarted):
                    waiting.discard(i)
            return read

        try:
            first = await within(started(), timeout, "the generation did not start")
        except BaseException:
            await events.aclose()
            raise
        return StreamingResponse(sse_body(first, events, formats, usage), media_type="text/event-stream",
                                 headers=SSE_HEADERS)


async def charged(events: AsyncIterator[tuple[int, GenerationEvent]]) -> AsyncIterator[tuple[int, GenerationEvent]]:
    """The events, each generation's tokens charged to the request's tenant as it ends (quotas.py).
    Closing this closes them."""
    try:
        async for i, event in events:
            if isinstance(event, GenerationDone):
                charge_tokens(event.usage.prompt_tokens + event.usage.completion_tokens)
            yield i, event
    finally:
        await events.aclose()  # type: ignore[attr-defined]


async def indexed(events: AsyncIterator[GenerationEvent]) -> AsyncIterator[tuple[int, GenerationEvent]]:
    """One request's stream in a group stream's shape: (0, event). Closing this closes it."""
    try:
        async for event in events:
            yield 0, event
    finally:
        await events.aclose()  # type: ignore[attr-defined]


def to_request(body: Sampling, max_new_tokens: int | None, prompt: str | None = None,
               messages: tuple[ChatMessage, ...] | None = None,
               names: Mapping[str, str] | None = None, logprobs: int | None = None,
               sibling: int = 0, grammar: GrammarSpec | None = None, tools: tuple[Tool, ...] = (),
               session: str | None = None, choices: int = 1) -> GenerationRequest:
    """`names`: the route's names of GenerationRequest fields, for the errors' `param`. `sibling`: the
    choice's number among a prompt's `choices` (n, best_of); a seeded request's siblings get seed +
    sibling, and several choices without a temperature sample at OpenAI's default, 1 (the model's
    default may be greedy: n identical answers). `session`: the routing session (`session_of`)."""
    seed = None if body.seed is None else (body.seed + sibling) % 2**63
    temperature = body.temperature if body.temperature is not None or choices == 1 else OPENAI_TEMPERATURE
    return GenerationRequest(
        request_id=uuid.uuid4().hex, prompt=prompt, messages=messages, max_new_tokens=max_new_tokens,
        temperature=temperature, top_k=body.top_k, top_p=body.top_p,
        repetition_penalty=body.repetition_penalty, presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty, logit_bias=body.bias(), logprobs=logprobs, seed=seed,
        grammar=grammar if grammar is not None else grammar_of(body.response_format), tools=tools,
        stop=tuple(body.stop or ()), ignore_eos=body.ignore_eos, speculative=body.speculative, names=dict(names or {}),
        session=session, cache_salt=body.cache_salt, priority=body.priority)


OPENAI_TEMPERATURE = 1.0  # OpenAI's default temperature: several choices without one sample at it
SESSION_HEADER = "x-session-id"
MAX_SESSION_CHARS = 256


def session_of(request: Request, body: Any) -> str | None:
    """The request's routing session: the `x-session-id` header, else the OpenAI `user` field; its
    requests go to one replica while load allows (service/fleet/router.py). A 422 past 256 characters."""
    session = request.headers.get(SESSION_HEADER)
    if session is None:
        return getattr(body, "user", None)
    if len(session) > MAX_SESSION_CHARS:
        raise InvalidRequest(f"{SESSION_HEADER}: at most {MAX_SESSION_CHARS} characters", SESSION_HEADER)
    return session


def usage(done: GenerationDone) -> CompletionUsage:
    return CompletionUsage(**done.usage.as_dict())


def summed_usage(dones: Sequence[GenerationDone], per_prompt: int) -> CompletionUsage:
    """OpenAI's usage of several choices: each prompt's tokens once, every choice's completion tokens
    (best_of candidates included). `dones` come in prompt order, `per_prompt` of them each."""
    prompt = sum(d.usage.prompt_tokens for d in dones[::per_prompt])
    completion = sum(d.usage.completion_tokens for d in dones)
    return CompletionUsage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def mean_logprob(done: GenerationDone) -> float:
    """best_of's ranking: mean log-probability per output token (an empty answer ranks last)."""
    entries = done.logprobs or ()
    return sum(e.logprob for e in entries) / len(entries) if entries else float("-inf")


def chat_choice(index: int, done: GenerationDone, tools: tuple[Tool, ...]) -> ChatChoice:
    """One chat choice; with tools, <tool_call> blocks of the answer become tool_calls."""
    lp = chat_logprobs(done.logprobs) if done.logprobs is not None else None
    if not tools:
        return ChatChoice(index=index, message=ChatMessageOut(content=done.text), logprobs=lp,
                          finish_reason=done.finish_reason)  # type: ignore[arg-type]
    content, found = parse_tool_calls(done.text, [t.name for t in tools])
    out = [ToolCallOut(id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments)) for c in found]
    return ChatChoice(index=index, message=ChatMessageOut(content=content, tool_calls=out or None), logprobs=lp,
                      finish_reason="tool_calls" if out else done.finish_reason)  # type: ignore[arg-type]


async def replayed_chat(response: ChatCompletionResponse, include_usage: bool) -> AsyncIterator[bytes]:
    """A whole chat answer as OpenAI's chunks: per choice the role, its content, its tool calls, its
    finish_reason; then the usage chunk when asked, then [DONE]."""
    fmt = ChatFormat(response.id, response.created, response.model, include_usage)
    for choice in response.choices:
        def chunk(delta: dict[str, Any], finish: str | None = None, index: int = choice.index) -> bytes:
            return sse(fmt.chunk([{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}]))

        yield chunk({"role": "assistant", "content": ""})
        if choice.message.content or choice.logprobs is not None:
            lp = choice.logprobs.model_dump() if choice.logprobs is not None else None
            yield sse(fmt.chunk([{"index": choice.index, "delta": {"content": choice.message.content or ""},
                                  "logprobs": lp, "finish_reason": None}]))
        if choice.message.tool_calls:
            yield chunk({"tool_calls": [{"index": j, **call.model_dump()}
                                        for j, call in enumerate(choice.message.tool_calls)]})
        yield chunk({}, choice.finish_reason)
    if include_usage:
        yield sse(fmt.chunk([], response.usage.model_dump()))
    yield DONE


def check_choices(settings: Settings, route: Route, prompts: int, per_prompt: int, field: str) -> None:
    """Prompts x choices within max_inputs and within what the generator's engine queues (a request
    it could never take whole would only ever get 503s)."""
    dep = settings.deployments.get(route.deployment)
    limit = min(settings.max_inputs, dep.engine.max_queued if dep is not None else settings.max_inputs)
    if prompts * per_prompt > limit:
        raise InvalidRequest(f"{prompts} prompt(s) x {per_prompt} choices = {prompts * per_prompt} generations; "
                             f"at most {limit} per request", field)


def generation_router(settings: Settings, routes: ModelRoutes, backend: Backend, limits: InputLimits,
                      errors: dict[int | str, dict[str, Any]]) -> APIRouter:
    router = APIRouter(tags=["generation"])

    def deadline(request: Request) -> float:
        return request_timeout(request, settings)

    calls = GenerationCalls(backend, limits)

    def log_user(body: Any, request_id: str) -> None:
        if getattr(body, "user", None) is not None:  # an opaque id, logged escaped
            log.info("generation %s for user %r", request_id, body.user)
    responses = {**errors, 200: STREAMED_200}

    @router.post("/v1/generate", response_model=GenerateResponse, responses=responses)
    async def generate(body: GenerateRequest, request: Request) -> Any:
        """Continue a prompt. With `"stream": true`: events `{"text"}` per piece of text, then
        `{"model", "text": "", "finish_reason", "usage"}`."""
        route = routes.resolve("generate", body.model)
        req = to_request(body, body.max_new_tokens, prompt=body.prompt,
                         grammar=grammar_of(body.response_format, body.regex, body.grammar),
                         session=session_of(request, body))
        if body.stream:
            return await calls.stream(route, [req], deadline(request), [GenerateFormat(route.model)])
        done, = await calls.complete(route, [req], deadline(request))
        return GenerateResponse(model=route.model, text=done.text, finish_reason=done.finish_reason,  # type: ignore[arg-type]
                                usage=usage(done))

    @router.post("/v1/completions", response_model=CompletionResponse, responses=responses)
    async def completions(body: CompletionRequest, request: Request) -> Any:
        """OpenAI-compatible text completion: one prompt or several, `n` choices each (`best_of`
        candidates, the best `n` returned)."""
        check_supported(body)
        route = routes.resolve("generate", body.model)
        prompts, (n, best_of) = body.prompt_texts(), body.choices()
        check_choices(settings, route, len(prompts), best_of, "best_of" if best_of > n else "n" if n > 1 else "prompt")
        # best_of ranks candidates by their log-probabilities: asked for even when the client did not
        wanted = body.logprobs if best_of == n else (body.logprobs or 0)
        session = session_of(request, body)
        reqs = [to_request(body, body.max_tokens, prompt=p, names={"max_new_tokens": "max_tokens"},
                           logprobs=wanted, sibling=i, session=session, choices=best_of)
                for p in prompts for i in range(best_of)]
        cid, created = f"cmpl-{reqs[0].request_id}", int(time.time())
        log_user(body, cid)
        if body.stream:
            include = bool(body.stream_options and body.stream_options.include_usage)
            formats = [CompletionFormat(cid, created, route.model, include, index=i, final_usage=False,
                                        logprobs=body.logprobs is not None) for i in range(len(reqs))]
            tail = (lambda done: formats[0].chunk([], summed_usage([d for _, d in sorted(done, key=lambda x: x[0])],
                                                                    n).model_dump())) if include else None
            return await calls.stream(route, reqs, deadline(request), formats, tail)
        dones = await calls.complete(route, reqs, deadline(request))
        choices = []
        for p in range(len(prompts)):
            candidates = dones[p * best_of:(p + 1) * best_of]
            best = sorted(candidates, key=mean_logprob, reverse=True)[:n] if best_of > n else candidates
            for j, done in enumerate(best):
                lp = completion_logprobs(done.logprobs) if body.logprobs is not None and done.logprobs is not None else None
                choices.append(CompletionChoice(index=p * n + j, text=done.text, logprobs=lp,
                                                finish_reason=done.finish_reason))  # type: ignore[arg-type]
        return CompletionResponse(id=cid, created=created, model=route.model, choices=choices,
                                  usage=summed_usage(dones, best_of))

    @router.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=responses)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        """OpenAI-compatible chat completion; the messages are rendered with the model's chat template.
        `n` choices share the prompt's prefill."""
        check_supported(body)
        route = routes.resolve("generate", body.model)
        n = body.n or 1
        check_choices(settings, route, 1, n, "n")
        tools, _, forced = body.tool_plan()
        messages = tuple(m.message() for m in body.messages)
        names = {"max_new_tokens": "max_completion_tokens" if body.max_completion_tokens else "max_tokens"}
        k = body.logprobs_k()
        session = session_of(request, body)
        reqs = [to_request(body, body.max_completion_tokens or body.max_tokens, messages=messages, names=names,
                           logprobs=k, sibling=i, grammar=forced, tools=tools, session=session, choices=n)
                for i in range(n)]
        cid, created = f"chatcmpl-{reqs[0].request_id}", int(time.time())
        log_user(body, cid)
        include = bool(body.stream and body.stream_options and body.stream_options.include_usage)
        if body.stream and not tools:
            formats = [ChatFormat(cid, created, route.model, include, index=i, final_usage=False,
                                  logprobs=k is not None) for i in range(n)]
            tail = (lambda done: formats[0].chunk([], summed_usage([d for _, d in done], n).model_dump())
                    ) if include else None
            return await calls.stream(route, reqs, deadline(request), formats, tail)
        dones = await calls.complete(route, reqs, deadline(request))
        choices = [chat_choice(i, done, tools) for i, done in enumerate(dones)]
        response = ChatCompletionResponse(id=cid, created=created, model=route.model, choices=choices,
                                          usage=summed_usage(dones, n))
        if body.stream:  # with tools: the calls are known only once the answer is whole (docs/serving.md)
            return StreamingResponse(replayed_chat(response, include), media_type="text/event-stream",
                                     headers=SSE_HEADERS)
        return response

    return router
