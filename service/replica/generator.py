"""What a generator replica does, without Ray: prompts to token ids, requests to the engine
(service/engine/), engine events to the messages the ingress converts (service/messages.py).

A GeneratorRunner owns one GenerationEngine (one KV cache, one scheduler thread) for its model.
`generate` and `stream` run on the replica's event loop. When the task reading a request is
cancelled (the client went away, the deadline passed) or a stream is closed early, the request is
cancelled in the engine, which frees its row at the start of its next step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

from models.catalog import LoadedModel
from models.decoding import SamplingParams

from ..common.streams import interleaved
from ..common.text_limits import check_prompt_chars
from ..common.tool_calls import hf_messages, render_in_prompt, template_knows_tools
from ..engine.config import EngineConfig
from ..engine.core import GenerationEngine, Submission
from ..engine.events import Delta, Finished, RequestHandle
from ..errors import InternalError, InvalidRequest, RequestTooLarge
from ..messages import (
    GenerationDone,
    GenerationEvent,
    GenerationRequest,
    GenerationStarted,
    GrammarSpec,
    TextDelta,
    Tokenized,
)
from ..telemetry.hooks import EngineObserver
from ..telemetry.metrics import ServiceMetrics
from ..telemetry.observers import PrometheusEngineObserver
from .heap import HeapTrimmer
from .runner import EngineRunner, off_loop, on_text_thread

if TYPE_CHECKING:
    from ..settings import DeploymentSettings

log = logging.getLogger(__name__)
# request fields that fall back to the model's defaults (ModelSpec.defaults), then SamplingParams'
SAMPLING_FIELDS = ("max_new_tokens", "temperature", "top_k", "top_p", "repetition_penalty", "presence_penalty",
                   "frequency_penalty", "logprobs", "seed", "ignore_eos", "speculative")
CHAT_ROLES = {"developer": "system"}  # roles the templates know under another name
WARM_UP_STEPS = 8
DEFAULT_MAX_NEW = SamplingParams().max_new_tokens  # when neither the request nor the model sets one


class GeneratorRunner(EngineRunner):
    """One decoder-only model and its engine. Build, `warm_up()`, then `start()`."""

    loop_name = "generation engine"

    def __init__(self, loaded: LoadedModel, deployment: str, config: EngineConfig,
                 observer: EngineObserver | None = None, heap: HeapTrimmer | None = None) -> None:
        super().__init__(loaded, deployment, heap)
        draft = loaded.draft.executor if loaded.draft is not None else None
        self.engine = GenerationEngine(loaded.executor, loaded.tokenizer, config, observer, name=f"{deployment}-engine",
                                       after_step=self.heap.maybe_trim, max_input_tokens=loaded.max_input_tokens,
                                       draft=draft, adapters=loaded.adapters)
        self.defaults = {k: v for k, v in loaded.spec.defaults.items() if k in SAMPLING_FIELDS}
        SamplingParams(**self.defaults)  # bad model defaults fail the replica at start, not each request

    @classmethod
    def for_deployment(cls, loaded: LoadedModel, deployment: str, settings: DeploymentSettings,
                       metrics: ServiceMetrics) -> GeneratorRunner:
        speculative = settings.engine.speculative.method if settings.engine.speculative is not None else None
        observer = PrometheusEngineObserver(metrics, loaded.spec.name, speculative, tuple(loaded.spec.adapters))
        return cls(loaded, deployment, settings.engine, observer,
                   HeapTrimmer(settings.heap_trim_interval_s))

    # -- requests --------------------------------------------------------------------------------

    def prompt_ids(self, request: GenerationRequest) -> list[int]:
        """Token ids of the prompt or of the chat rendered with the model's template; a 422 naming
        the field when the template or the tokenizer refuses it."""
        tok, field = self.loaded.tokenizer, request.prompt_field
        # refused for the cost of len(), never rendered or tokenized
        check_prompt_chars(request.prompt_chars, self.engine.limits.max_prompt_tokens, request.param(field))
        if request.messages is None:
            assert request.prompt is not None, "a GenerationRequest has a prompt or messages"
            text, special = request.prompt, True
        else:
            if not tok.chat_template:
                raise InvalidRequest(f"model {self.loaded.spec.name!r} has no chat template; send a prompt to "
                                     "/v1/completions or /v1/generate instead", request.param("messages"))
            messages = [{"role": CHAT_ROLES.get(m.role, m.role), "content": m.content, "tool_calls": m.tool_calls,
                         "tool_call_id": m.tool_call_id} for m in request.messages]
            tools_used = bool(request.tools) or any(m["tool_calls"] or m["role"] == "tool" for m in messages)
            try:
                if tools_used and template_knows_tools(tok.chat_template):
                    tools = [{"type": "function", "function": t.as_dict()} for t in request.tools] or None
                    text = tok.apply_chat_template(hf_messages(messages), tools=tools)
                elif tools_used:  # the documented system-prompt format (service/common/tool_calls.py)
                    text = tok.apply_chat_template(render_in_prompt(messages, request.tools))
                else:
                    text = tok.apply_chat_template([{"role": m["role"], "content": m["content"]} for m in messages])
            except Exception as e:  # the template's own checks (raise_exception) or a Jinja error
                raise InvalidRequest(f"the chat template refused these messages: {e}",
                                     request.param("messages")) from None
            special = False  # the template writes the special tokens itself
        try:
            return tok.encode(text, add_special_tokens=special)
        except Exception as e:  # e.g. lone surrogates that are not UTF-8
            raise InvalidRequest(f"the {field} could not be tokenized ({type(e).__name__}: {e})",
                                 request.param(field)) from None

    def tokenize(self, request: GenerationRequest, add_special_tokens: bool = True) -> Tokenized:
        """The prompt's (or the rendered chat's) token ids, as a generation would see them; with
        add_special_tokens False a prompt is tokenized without the model's special tokens."""
        if request.messages is None and not add_special_tokens:
            check_prompt_chars(request.prompt_chars, self.engine.limits.max_prompt_tokens, "prompt")
            ids = self.loaded.tokenizer.encode(request.prompt or "", add_special_tokens=False)
        else:
            ids = self.prompt_ids(request)
        tok = self.loaded.tokenizer
        return Tokenized(tuple(ids), tuple(tok.decode([t], skip_special_tokens=False) for t in ids),
                         self.engine.limits.max_total_tokens)

    def detokenize(self, tokens: list[int]) -> str:
        """Text of token ids (special tokens shown); ids outside the vocabulary are a 422 naming one."""
        vocab = self.loaded.model.cfg.vocab_size
        for i, t in enumerate(tokens):
            if not 0 <= t < vocab:
                raise InvalidRequest(f"token id {t} is outside the vocabulary (size {vocab})", f"tokens[{i}]")
        return self.loaded.tokenizer.decode(tokens, skip_special_tokens=False)

    def params(self, request: GenerationRequest, prompt_tokens: int) -> SamplingParams:
        """The request's fields over the model's defaults. A default max_new_tokens (the request sent
        none) shrinks to what the engine's limits leave after this prompt; one the request sent does
        not (over a limit, it is a 422 naming the limit)."""
        given = {k: v for k in SAMPLING_FIELDS if (v := getattr(request, k)) is not None}
        values = {**self.defaults, **given}
        if request.max_new_tokens is None:
            limits = self.engine.limits
            room = min(limits.max_new_tokens, limits.max_total_tokens - prompt_tokens)
            values["max_new_tokens"] = max(1, min(values.get("max_new_tokens", DEFAULT_MAX_NEW), room))
        vocab = self.loaded.model.cfg.vocab_size
        outside = [token for token, _ in request.logit_bias if token >= vocab]
        if outside:
            raise InvalidRequest(f"logit_bias names token ids {outside[:5]} outside the vocabulary "
                                 f"(size {vocab})", request.param("logit_bias"))
        try:
            return SamplingParams(**values, stop=request.stop, logit_bias=request.logit_bias)
        except ValueError as e:  # the edge checks each field; this is a safety net
            raise InvalidRequest(str(e)) from None

    async def submit(self, request: GenerationRequest) -> tuple[RequestHandle, int]:
        """Queue one request in the engine: its handle and its prompt length (submit_group of one)."""
        (handle, prompt_tokens), = await self.submit_group([request])
        return handle, prompt_tokens

    async def submit_group(self, requests: Sequence[GenerationRequest], whole: bool = False
                           ) -> list[tuple[RequestHandle, int]]:
        """Queue requests in the engine together, all or none (n > 1 siblings, a list of prompts: they
        are admitted in one step and siblings share their prompt's prefill); each one's handle and
        prompt length. Their deadline (`timeout_s`) covers their start, or, `whole`, their whole answer
        (the engine refuses at once what could not make it). A prompt is tokenized once for the
        siblings that share it (a long one off the event loop, runner.off_loop).
        The cheap checks come first (prompt, parameters, limits), then a structured output's grammar
        is compiled off the event loop (tens of ms; cached by source), then the requests are queued.
        Raises InvalidRequest / RequestTooLarge naming the field (as the client called it) and the
        limit, EngineOverloaded when the queue has no room for all of them."""
        request, arrived = requests[0], time.perf_counter()
        submissions: list[Submission] = []
        held = []  # adapter slots taken for these requests: the engine releases them once it has them
        try:
            prompts: dict[tuple[int, int, int], list[int]] = {}  # siblings share their prompt's objects
            for request in requests:
                key = (id(request.prompt), id(request.messages), id(request.tools))
                first = key not in prompts
                if first:
                    prompts[key] = await off_loop(request.render_chars, self.prompt_ids, request)
                ids = prompts[key]
                params = self.params(request, len(ids))
                if first and request.tools and request.grammar is None:  # an unforced call: its schemas are
                    # checked as a forced one's would be, once for the siblings that share them
                    await on_text_thread(self.engine.grammars.compile, GrammarSpec.tool_call(request.tools))
                grammar = None
                if request.grammar is not None:
                    self.engine.limits.check(ids, params)  # before the compile; engine.submit checks the rest
                    if params.ignore_eos:
                        raise InvalidRequest("ignore_eos cannot be combined with a structured output (it ends "
                                             "the text)", "ignore_eos")
                    if params.stop:
                        raise InvalidRequest("stop strings cannot be combined with a structured output (a cut "
                                             "text would not match it)", "stop")
                    grammar = await on_text_thread(self.engine.grammars.compile, request.grammar)
                deadline = None if request.timeout_s is None else arrived + request.timeout_s
                submissions.append(Submission(ids, params, request.request_id, grammar, deadline, whole,
                                              cache_salt=request.cache_salt or "", priority=request.priority or 0,
                                              tenant=request.tenant))
            for i, sub in enumerate(submissions):  # last: a hold is released if anything above refused
                if requests[i].adapter is not None:
                    held.append(await self.adapters.hold(requests[i].adapter))
                    submissions[i] = dataclasses.replace(sub, adapter=held[-1])
            handles = self.engine.submit_many(submissions)
            held = []
        except RequestTooLarge as e:
            raise RequestTooLarge(e.message, request.param(e.param), e.limit) from None
        except InvalidRequest as e:
            raise InvalidRequest(e.message, request.param(e.param)) from None
        finally:
            for h in held:
                self.adapters.release(h)
        return [(handle, len(sub.prompt_ids)) for handle, sub in zip(handles, submissions, strict=True)]

    async def generate(self, request: GenerationRequest) -> GenerationDone:
        """The whole answer. Cancelling the awaiting task cancels the request in the engine."""
        done, = await self.generate_group([request])
        return done

    async def generate_group(self, requests: Sequence[GenerationRequest]) -> list[GenerationDone]:
        """Every request's whole answer, submitted together (submit_group). Cancelling the awaiting task
        cancels them all in the engine; if the engine failed any of them, InternalError once all ended."""
        handles = [handle for handle, _ in await self.submit_group(requests, whole=True)]
        try:
            finished = await asyncio.gather(*(handle.result() for handle in handles))
        except asyncio.CancelledError:
            for handle in handles:
                handle.cancel()
            raise
        dones = [_done(event) for event in finished]
        for done in dones:
            if done.error is not None and done.error_type == InvalidRequest.type:  # the request's own fault
                raise InvalidRequest(done.error, requests[0].param(done.error_param) if done.error_param else None)
        if any(done.error is not None for done in dones):
            raise InternalError(f"{self.deployment}: the generation failed; see the server log")
        return dones

    async def stream(self, request: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        """GenerationStarted once the engine sampled the request's first token, a TextDelta per piece
        of text, then GenerationDone (finish_reason "error" if the engine failed it). Closing the
        generator early, or cancelling the task reading it, cancels the request in the engine."""
        events = self.stream_group([request])
        try:
            async for _, event in events:
                yield event
        finally:
            await events.aclose()

    async def stream_group(self, requests: Sequence[GenerationRequest]
                           ) -> AsyncIterator[tuple[int, GenerationEvent]]:
        """(index of the request, event) for requests submitted together (submit_group), interleaved as
        their events come; each request's events as stream() gives them. Closing the generator early,
        or cancelling the task reading it, cancels every unfinished request in the engine."""
        submitted = await self.submit_group(requests)
        handles = [handle for handle, _ in submitted]
        started, finished = [False] * len(handles), [False] * len(handles)
        try:
            async for i, event in interleaved(handles):
                if not started[i]:  # the first event comes with the first token (engine/events.py)
                    started[i] = True
                    yield i, GenerationStarted(handles[i].request_id, submitted[i][1])
                if isinstance(event, Delta):
                    if event.text or event.logprobs:
                        yield i, TextDelta(event.text, event.logprobs)
                else:
                    finished[i] = True
                    yield i, _done(event)
        finally:
            for handle, done in zip(handles, finished, strict=True):
                if not done:
                    handle.cancel()

    # -- life cycle ------------------------------------------------------------------------------

    def warm_up(self) -> None:
        """Prefill and decode once on the engine (before start(); the engine thread is not running)
        and render the chat template, so the first request pays for neither."""
        if self.loaded.tokenizer.chat_template:
            try:
                self.loaded.tokenizer.apply_chat_template([{"role": "user", "content": "warm up"}])
            except Exception:
                log.warning("%s: the chat template fails on a plain user message", self.deployment, exc_info=True)
        started = time.perf_counter()
        # CUDA: every decode-step graph before the first step, so the plan is settled before serving
        if graphs := self.engine.capture_graphs(chosen=self.loaded.spec.requested_backends()["decode"] == "auto"):
            log.info("%s: captured %d decode-step graphs in %.1f s", self.deployment, graphs,
                     time.perf_counter() - started)
        ids = self.prompt_ids(GenerationRequest("warm-up", prompt="warm up"))
        # a plain request, then a structured one: the grammar library's first use (its tokenizer, its
        # mask code) is paid here, not by the first constrained request and the batch it would stall;
        # one at a time, as an engine may queue only one
        grammar = self.engine.grammars.compile(GrammarSpec("json_object"))
        for constraint in (None, grammar):
            self.engine.submit(ids, SamplingParams(max_new_tokens=2), f"warm-up-{uuid.uuid4().hex}", constraint)
            self.warm_up_steps(WARM_UP_STEPS, "the warm-up request")

    @property
    def queue_capacity(self) -> int:
        return self.engine.limits.max_queued

    @property
    def max_input_tokens(self) -> int:
        return self.engine.limits.max_prompt_tokens

    def limits(self) -> dict[str, Any]:
        return dataclasses.asdict(self.engine.limits)


    def speculative(self) -> dict[str, Any] | None:
        spec = self.engine.speculator
        if spec is None:
            return None
        out = spec.describe()
        if self.loaded.draft is not None:
            out["draft_plan"] = self.loaded.draft.plan.to_dict()
            out["draft_quantize"] = self.loaded.draft.quantize
        return out


def _done(event: Finished) -> GenerationDone:
    error = event.error
    if error is None and event.finish_reason not in ("stop", "length"):
        error = f"the request ended with finish_reason {event.finish_reason!r}"
    if error is not None:
        log.warning("generation %s ended with an error: %s", event.request_id, error)
    return GenerationDone(event.request_id, event.text, "error" if error else event.finish_reason,  # type: ignore[arg-type]
                          event.usage, error, event.logprobs, event.error_type, event.error_param)
