"""Continuous batching for a decoder-only LM: `GenerationEngine` owns the model's KV cache and schedules
requests per decode step. No Ray, no FastAPI: a generator replica owns one (service/replica/generator.py).

Each step, on the engine's one thread: free finished and cancelled rows (live rows stay packed at the
front); admit waiting requests FIFO within the prefill budget (engine/prefill.py: groups of similar
length, or a long prompt a `prefill_chunk` per step); one decode step over every live row. On a paged
cache, short of blocks, the newest admitted request is preempted back to the head of the queue and
later recomputed to where it stopped. A request's tokens depend only on its rows and its own seeded
generator: alone, batched or preempted it decodes what models.generate.generate gives. A failing step
is retried row by row and fails only the rows that fail again; anything else fails what it held.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from models.adapters import Held, ResidentAdapters
from models.cache.base import KeyValueCache, kv_dtype
from models.cache.dense import KVCache
from models.cache.paged import PagedKVCache
from models.decoder import DecoderLM
from models.decoding import SamplingParams
from models.execution.executors import DecoderExecutor
from models.execution.graphs import GraphCaptureError
from models.execution.plan import ExecutionPlan, PlanError
from models.execution.planner import Runtime, plan_model
from models.inputs import select_batch
from models.text import TextTokenizer

from ..errors import InvalidRequest
from ..telemetry.hooks import EngineObserver
from .admission import Ask, ewma
from .batch import RunningBatch
from .config import EngineConfig
from .events import RequestHandle
from .grammar import Grammars
from .limits import EngineLimits
from .loop import StepLoop
from .prefix_cache import PagedPrefixCache, Pin, PrefixCache
from .sequence import Picked, SeqState
from .speculation.draft_model import DraftModel
from .speculation.speculator import Speculator

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Submission:
    """One request for submit_many: as submit()'s arguments."""

    prompt_ids: Sequence[int]
    params: SamplingParams | None = None
    request_id: str | None = None
    grammar: Any = None
    # time.perf_counter() seconds: refused at once if it cannot start by then or, `whole` (its caller
    # waits for the whole answer), be answered by then
    deadline: float | None = None
    whole: bool = False
    # its adapter's slot, held by the caller (models/adapters/ResidentAdapters.acquire): the engine releases
    # it when the request finishes once submit_many returned; if submit_many raises, the caller still holds it
    adapter: Held | None = None
    # its cached prefixes are reused only by requests of the same salt (and adapter): a tenant's, a request's
    cache_salt: str = ""
    priority: int = 0  # lower is sooner (vLLM's): admitted first, preempted last
    tenant: str | None = None  # its tenant: no tenant's waiting requests exceed max_queued_share of the queue


def salt(held: Held | None, cache_salt: str) -> str:
    """What a request's prefix-cache blocks are keyed under besides their tokens: its adapter's load
    and its cache salt ("": the base model, no salt)."""
    parts = ([f"adapter:{held.key}"] if held is not None else []) + ([f"salt:{cache_salt}"] if cache_salt else [])
    return "\x1f".join(parts)


def _siblings(a: SeqState, b: SeqState) -> bool:
    """Whether `a` may join on a copy of `b`'s row once b's prompt is computed (the same prompt and salt)."""
    return a.prompt == b.prompt and a.salt == b.salt


def engine_runtime(config: EngineConfig) -> Runtime:
    """What an engine with this config gives its model's decode steps (the plan depends on it):
    speculative decoding's verify steps do not run on captured graphs; the KV cache's dtype."""
    return Runtime(paged=config.paged, graphs=False if config.speculative is not None else config.decode_graphs,
                   kv_dtype=kv_dtype(config.kv_cache_dtype, None))  # "auto": None, the model's dtype


# select_batch's fixed cost of one prefill forward pass, in padded prompt tokens: prompts of very
# different lengths are prefilled in separate passes when the padding would cost more than this.
PREFILL_OVERHEAD_TOKENS = 64


class GenerationEngine(StepLoop):
    """Owns the model's KV cache and schedules every request on it. Thread-safe front: submit(),
    cancel(), stats(), shutdown(); start() runs the scheduler loop in a dedicated thread."""

    def __init__(self, model: DecoderLM | DecoderExecutor, tokenizer: TextTokenizer, config: EngineConfig | None = None,
                 observer: EngineObserver | None = None, name: str = "generation-engine",
                 after_step: Callable[[], object] | None = None, max_input_tokens: int | None = None,
                 prompt_model: DecoderLM | None = None, draft: DecoderExecutor | None = None,
                 adapters: ResidentAdapters | None = None) -> None:
        """`model`: its executor (models.catalog.LoadedModel.executor), planned for this engine's
        config (engine_runtime); a bare model is planned here with execution "auto", with
        `prompt_model` (the same model on other weights) for prompts. `max_input_tokens`: the model's
        input limit (the prompt limit when the config sets none). `draft`: the draft model's executor
        (config.speculative.method "draft" only). `adapters`: the model's adapter slots, when it serves
        adapters (a Submission's `adapter` is one of them)."""
        self.config = config or EngineConfig()
        if isinstance(model, DecoderExecutor):
            steps = model
        else:
            steps = plan_model(model, "auto", engine_runtime(self.config), prompt_model)
        model = steps.model
        weight = next(model.parameters())
        self.model, self.tokenizer, self.adapters = model, tokenizer, adapters
        self.device = weight.device
        self.kv_dtype = kv_dtype(self.config.kv_cache_dtype, weight.dtype)
        self.limits = EngineLimits.resolve(self.config, model.cfg, self.kv_dtype, max_input_tokens)
        self.cache: KeyValueCache
        if self.limits.blocks:
            self.cache = PagedKVCache.for_model(model.cfg, self.limits.rows, self.limits.blocks,
                                                self.limits.max_total_tokens, self.kv_dtype, self.device)
        else:
            self.cache = KVCache.for_model(model.cfg, self.limits.rows, self.limits.max_total_tokens, self.kv_dtype,
                                           self.device)
        super().__init__(name, self.limits.rows, self.limits.max_queued, self.cache.nbytes(), observer, after_step)
        self.max_queued_share = config.max_queued_share
        self._eos = frozenset(model.cfg.eos_token_ids)
        self.grammars = Grammars(tokenizer, model.cfg.vocab_size, self._eos)  # structured outputs
        # engine thread only: the live rows, and a group taken from the queue while it is prefilled
        # prefix caching needs rows that keep every prompt token: not a sliding window's ring
        prefix: PrefixCache | None = None
        if self.limits.prefix_cache_bytes and not self.cache.ring:
            kind = PagedPrefixCache if self.cache.paged else PrefixCache
            prefix = kind(self.cache, self.limits.prefix_cache_bytes)
        if steps.plan.backend("decode") == "native" and not self.cache.paged:
            raise PlanError(f"{name}: decode on native needs a paged KV cache; this engine keeps rows "
                            "(plan the model with engine_runtime(config))")
        self._batch = RunningBatch(steps, self.cache, model.cfg.vocab_size, prefix, steps.graphs(self.cache))
        self.speculator = self._speculator(draft)
        if self.speculator is not None:
            self._batch.on_leave = self.speculator.release
        self._admitting: list[SeqState] = []
        self._prefill_token_s: float | None = None  # measured seconds per padded prefill token (a moving average)

    def _speculator(self, draft: DecoderExecutor | None) -> Speculator | None:
        """Speculative decoding as the config asks (None: off); ValueError where it cannot run."""
        spec = self.config.speculative
        if spec is None:
            if draft is not None:
                raise ValueError(f"{self.name}: a draft model was given, and the engine config does not speculate")
            return None
        if not self.cache.paged:
            raise ValueError(f"{self.name}: speculative decoding needs the paged cache (a sliding-window model "
                             "keeps rows)")
        if self._batch.graphs is not None:
            raise ValueError(f"{self.name}: speculative decoding does not run on captured decode graphs")
        if spec.method != "draft":
            if draft is not None:
                raise ValueError(f"{self.name}: a draft model was given for method {spec.method!r}")
            return Speculator(spec)
        if draft is None:
            raise ValueError(f"{self.name}: speculative method 'draft' needs the draft model")
        if draft.model.cfg.vocab_size != self.model.cfg.vocab_size:
            raise ValueError(f"{self.name}: the draft model's vocabulary ({draft.model.cfg.vocab_size}) is not the "
                             f"model's ({self.model.cfg.vocab_size}): a draft needs the same tokenizer")
        lookup = (spec.ngram_min, spec.ngram_max) if spec.draft_lookup else None
        weight = next(draft.model.parameters())
        draft_kv = kv_dtype(self.config.kv_cache_dtype, weight.dtype)
        if draft.model.cfg == self.model.cfg and draft_kv == self.kv_dtype and weight.device == self.device:
            return Speculator(spec, DraftModel(draft, self.cache, True, lookup))  # its keys are the model's
        cache = PagedKVCache.for_model(draft.model.cfg, self.limits.rows, self.limits.blocks,
                                       self.limits.max_total_tokens, draft_kv, self.device)
        return Speculator(spec, DraftModel(draft, cache, False, lookup))

    @property
    def plan(self) -> ExecutionPlan:
        """What computes this engine's prefills and decode steps (models/execution/)."""
        return self._batch.steps.plan

    def capture_graphs(self, chosen: bool = True) -> int:
        """Capture every decode-step graph now (a replica's warm-up, before start()), so no request
        pays for one; 0 when the plan decodes otherwise. A capture that fails raises
        GraphCaptureError where graphs were asked for by name (`chosen` False); where the plan chose
        them itself, the plan's decode phase becomes the model's own forward, with the reason, before
        any request is served."""
        graphs = self._batch.graphs
        if graphs is None:
            return 0
        try:
            return graphs.capture_all()
        except GraphCaptureError as e:
            if not chosen:
                raise
            log.exception("%s: capturing the decode-step graphs failed", self.name)
            self._batch.steps.without_graphs(f"capture failed: {str(e)[:200]}")
            self._batch.graphs = None
            return 0

    # -- front (any thread) --------------------------------------------------------------------

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams | None = None,
               request_id: str | None = None, grammar: Any = None, deadline: float | None = None,
               whole: bool = False) -> RequestHandle:
        """Queue a request and return at once (it runs once start() was called, or on step()).
        Called on an event loop, the handle is an async iterator on that loop; otherwise read it
        with handle.events() / result_sync().

        `grammar`: a grammar compiled by self.grammars: the output must match it. `deadline`
        (time.perf_counter() seconds): refused at once when the wait for a row would outlast it, or,
        `whole` (its caller waits for the whole answer), the wait and its own decoding.

        Raises InvalidRequest / RequestTooLarge (naming the limit) for a request over the limits,
        EngineOverloaded when max_queued requests wait, EngineClosed after shutdown().
        """
        return self.submit_many([Submission(prompt_ids, params, request_id, grammar, deadline, whole)])[0]

    def submit_many(self, submissions: Sequence[Submission]) -> list[RequestHandle]:
        """Queue several requests at once, all or none (n > 1 siblings, a list of prompts): they stand
        together in the queue, so they are admitted in one step whenever rows and the prefill budget
        allow, and siblings with one prompt share its prefill (RunningBatch.prefill). Raises as
        submit() does; EngineOverloaded when the queue has no room for all of them, or when the wait for
        a row (engine/admission.py), with their own decoding for `whole` ones, would outlast a deadline."""
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        seqs, handles = [], []
        for sub in submissions:
            params = sub.params or SamplingParams()
            prompt = [int(t) for t in sub.prompt_ids]
            self.limits.check(prompt, params)
            request_id = sub.request_id or uuid.uuid4().hex
            handle = RequestHandle(request_id, self.cancel, loop)
            matcher = self.grammars.matcher(sub.grammar) if sub.grammar is not None else None
            held = sub.adapter
            if held is not None and self.adapters is None:
                raise InvalidRequest("this model serves no adapters", "model")
            seqs.append(SeqState(request_id, prompt, params, handle, self.tokenizer, self._eos, time.perf_counter(),
                                 matcher, -1 if held is None else held.slot, salt(held, sub.cache_salt),
                                 None if held is None else functools.partial(self.adapters.release, held.slot),
                                 None if held is None else held.name, sub.priority, sub.tenant))
            handles.append(handle)
        self._enqueue(seqs, [Ask(seq.params.max_new_tokens, bool(seq.params.ignore_eos), sub.deadline, sub.whole)
                             for seq, sub in zip(seqs, submissions, strict=True)])
        return handles

    # -- the loop (engine thread) ---------------------------------------------------------------

    def _work(self) -> bool:
        self._evict()
        prefilled = self._admit()
        self._evict()
        if self._batch:
            self._make_room()
            self._decode()
        self._evict()
        return prefilled

    def _busy(self) -> bool:
        return self._batch.busy

    def _drain(self) -> list[SeqState]:
        held, self._admitting = self._admitting + self._batch.clear(), []
        return held

    def _held(self) -> int:
        return self._batch.held

    def _usage(self) -> float:
        return self._batch.usage()

    def _extra_stats(self) -> dict[str, int]:
        stats = {"prefix_cache_bytes": self._batch.prefix.nbytes if self._batch.prefix is not None else 0,
                 "preempted": self._counts["preempted"], "first_tokens": self._counts["first_tokens"],
                 "ttft_ms": self._counts["ttft_ms"], "inter_tokens": self._counts["inter_tokens"],
                 "itl_ms": self._counts["itl_ms"]}
        if self.cache.paged:
            stats |= {"kv_blocks": self.cache.blocks_total, "kv_blocks_free": self.cache.blocks_free}
        if self.speculator is not None:
            c = self.speculator.counts
            stats |= {"spec_drafted": c.drafted, "spec_accepted": c.accepted, "spec_steps": c.steps,
                      "spec_draft_steps": self.speculator.draft.step_count if self.speculator.draft is not None else 0,
                      "spec_step_ms": round(c.step_s * 1000), "spec_plain_ms": round(c.plain_s * 1000)}
        return stats

    def _make_room(self) -> None:
        """Paged: blocks for every running row's next token. Short of them, the prefix cache gives
        back blocks nobody uses, then running requests (a prompt prefilled in chunks counts as running)
        are preempted, the least urgent priority first and the most recently admitted among equals,
        back to the head of their priority in the queue; one always stays."""
        batch = self._batch
        if not batch.paged:
            return
        while not batch.make_room(batch.decode_blocks()):
            # the least urgent first (the largest priority value), the newest among equals
            candidates = [(seq.priority, seq.admitted or 0.0, row) for row, seq in enumerate(batch.rows)]
            if batch.partial is not None:
                candidates.append((batch.partial.priority, batch.partial.admitted or 0.0, -1))
            if len(candidates) <= 1:
                return  # one request cannot outgrow the pool (EngineLimits): its step fails if it does
            *_, row = max(candidates)
            seq = batch.drop_partial() if row < 0 else batch.preempt(row)
            if seq is None:
                return
            self._preempted(seq, "KV blocks ran out")

    def _yield_to_priority(self) -> None:
        """Paged: a waiting request more urgent than running ones takes a place from them: while the head
        of the queue has no row (or too few blocks for its context) and a running request has a
        larger priority value, the least urgent of those (the newest among equals) is preempted back
        to the queue, behind the head. Requests of equal priority never preempt each other."""
        batch = self._batch
        if not batch.paged:  # rows of a dense cache are not preempted (recomputed) at all
            return
        for _ in range(len(batch.rows)):
            with self._cond:
                head = self._waiting[0] if self._waiting else None
            if head is None:
                return
            if batch.free >= 1 and batch.blocks_for(head) <= batch.blocks_available():
                return
            candidates = [(seq.priority, seq.admitted or 0.0, row) for row, seq in enumerate(batch.rows)
                          if seq.priority > head.priority]
            if not candidates:
                return
            *_, row = max(candidates)
            self._preempted(batch.preempt(row), f"request {head.request_id} of priority {head.priority} waits")

    def _preempted(self, seq: SeqState, why: str) -> None:
        """A request taken off its row back to the head of its priority in the queue (recomputed later)."""
        self._counts["preempted"] += 1
        with self._cond:
            self._requeue(seq)
        log.info("preempted request %s (priority %d, %d tokens so far): %s", seq.request_id, seq.priority,
                 len(seq.tokens), why)

    def _admit(self) -> bool:
        """One chunk of the long prompt being prefilled in chunks (if any), then prefill the waiting
        requests that fit on fresh rows and in the rest of the step's budget, in groups of similar
        prompt lengths (select_batch's cost model: padding against the fixed cost of a forward pass).
        True when it computed prompt tokens."""
        self._yield_to_priority()
        chunked = self._chunk()
        budget = self.prefill_budget()
        pins: list[Pin] = []
        try:
            group = taken = self._take_waiting(budget - chunked, pins, first_fits=not chunked)
            resumed = [seq for seq in group if seq.resume]
            if resumed:
                group = [seq for seq in group if not seq.resume]
                self._restore(resumed)
            while group:
                lengths = [self._rest(seq) for seq in group]
                picked = set(select_batch(lengths, len(group), budget, PREFILL_OVERHEAD_TOKENS))
                started = time.perf_counter()
                self._prefill([seq for i, seq in enumerate(group) if i in picked],
                              rest=[seq for i, seq in enumerate(group) if i not in picked])
                padded = len(picked) * max(lengths[i] for i in picked)
                self._prefill_token_s = ewma(self._prefill_token_s, (time.perf_counter() - started) / max(padded, 1))
                group = [seq for i, seq in enumerate(group) if i not in picked]
        finally:
            for pin in pins:  # the hits are in the rows now (or their requests failed)
                self._batch.unpin_prefix(pin)
        return bool(chunked or taken)

    def forget_timings(self) -> None:
        super().forget_timings()
        self._prefill_token_s = None

    def prefill_budget(self) -> int:
        """Padded prompt tokens for this admission step: prefill_tokens, cut to what the measured rate
        computes in prefill_step_ms (not before a prefill was measured; the first request of a step
        is always admitted whatever its length)."""
        target_ms, per_token = self.config.prefill_step_ms, self._prefill_token_s
        if target_ms is None or per_token is None:
            return self.limits.prefill_tokens
        return max(1, min(self.limits.prefill_tokens, int(target_ms / 1000 / per_token)))

    def _prefill(self, group: list[SeqState], rest: list[SeqState]) -> None:
        """Prefill `group` on fresh rows; if that fails, retry request by request and fail only those
        that fail again. `rest` (taken, not yet prefilled) is failed too if anything escapes."""
        self._admitting, start = group + rest, len(self._batch)
        tokens: list[Picked] = []
        try:
            tokens = self._batch.prefill(group)
        except Exception as exc:
            if len(group) == 1:
                self._fail(group[0], exc)
            for seq in group if len(group) > 1 else []:
                try:
                    tokens += self._batch.prefill([seq])
                except Exception as row_exc:
                    self._fail(seq, row_exc)
        self._admitting = []
        self._joined(start, tokens)

    def _restore(self, group: list[SeqState]) -> None:
        """Preempted requests back on rows (their context recomputed); those that fail, fail alone."""
        self._admitting = group
        try:
            self._batch.restore(group)
        except Exception as exc:
            for seq in group if len(group) > 1 else []:
                try:
                    self._batch.restore([seq])
                except Exception as row_exc:
                    self._fail(seq, row_exc)
            if len(group) == 1:
                self._fail(group[0], exc)
        self._admitting = []

    def _joined(self, start: int, tokens: list[Picked]) -> None:
        """Rows [start, ...) were just prefilled: count and report their prompts, then take their
        first tokens."""
        now = time.perf_counter()
        for seq in self._batch.rows[start:]:
            self._counts["prompt_tokens"] += len(seq.prompt)
            self._counts["cached_tokens"] += seq.cached_tokens
            self._observe("on_admitted", (seq.admitted or now) - seq.submitted, len(seq.prompt), seq.cached_tokens)
        self._accept(list(enumerate(tokens, start)), now)

    def _chunk(self) -> int:
        """Chunked prefill: the next chunk of the long prompt in progress, or of the waiting head when
        it is longer than a chunk and a row is free. A chunk waits a step while a more urgent prompt
        that is not chunked can be admitted (a row and, paged, its blocks free): it is prefilled
        first. Returns the prompt tokens it computed."""
        chunk, batch = self.limits.prefill_chunk, self._batch
        if chunk is None:
            return 0
        if batch.partial is not None and batch.free >= 1:
            with self._cond:
                head = self._waiting[0] if self._waiting else None
            if (head is not None and head.priority < batch.partial.priority
                    and (head.resume or not self._long(self._rest(head)))
                    and (not batch.paged or batch.blocks_for(head) <= batch.blocks_available())):
                return 0
        if batch.partial is None:
            with self._cond:
                if (not self._waiting or batch.free < 1 or self._waiting[0].resume
                        or not self._long(self._rest(self._waiting[0]))):
                    return 0
                seq = self._pop_waiting()
                seq.admitted = time.perf_counter()
            batch.start_partial(seq)
        seq, start = batch.partial, len(batch.rows)
        n = min(chunk, len(seq.prompt) - batch.partial_done)
        last = batch.partial_done + n == len(seq.prompt)
        if batch.paged and not batch.make_room(self._chunk_blocks(batch.partial_done + n, last)):
            return 0  # the running requests free blocks as they finish (or the partial is preempted)
        siblings = self._take_siblings(seq) if last else []
        self._admitting = siblings
        try:
            tokens = batch.prefill_chunk(chunk, siblings)
        except Exception as exc:  # its siblings share its prompt and its fate
            batch.drop_partial()
            for failed in [seq, *siblings]:
                self._fail(failed, exc)
            self._admitting = []
            return n
        self._admitting = []
        if tokens:
            self._joined(start, tokens)
        return n

    def _rest(self, seq: SeqState) -> int:
        """Context tokens of seq to compute (its prompt; a preempted one's output too): less what the
        prefix cache holds."""
        return len(seq.context) - self._batch.cached(seq)

    def _chunk_blocks(self, tokens: int, last: bool) -> int:
        """Paged: blocks the chunked prompt needs to hold `tokens` (with its first new token after its
        last chunk, and a block for each sibling that may join on a copy of its row: the waiting
        requests right behind it with its prompt, as _take_siblings takes them)."""
        batch = self._batch
        need = batch.cache.blocks_needed(batch.partial_row, tokens + last)
        if not last:
            return need
        with self._cond:
            siblings = next((i for i, seq in enumerate(self._waiting) if not _siblings(seq, batch.partial)),
                            len(self._waiting))
        return need + max(0, min(siblings, batch.free - 1))

    def _long(self, rest: int) -> bool:
        """Whether a prompt with `rest` tokens to compute is prefilled in chunks."""
        return self.limits.prefill_chunk is not None and rest > self.limits.prefill_chunk

    def _take_siblings(self, seq: SeqState) -> list[SeqState]:
        """Waiting requests right behind `seq` with its prompt (n > 1 siblings), as many as free rows
        take: they join on copies of its row when its chunked prefill ends."""
        siblings: list[SeqState] = []
        with self._cond:
            now = time.perf_counter()
            while self._waiting and len(siblings) < self._batch.free and _siblings(self._waiting[0], seq):
                sibling = self._pop_waiting()
                sibling.admitted = now
                siblings.append(sibling)
        return siblings

    def _take_waiting(self, budget: int, pins: list[Pin], first_fits: bool = True) -> list[SeqState]:
        """FIFO while rows are free, (longest prompt) x (requests) fits the prefill budget (the first
        one always, unless `first_fits` is False) and, paged, blocks for each context are available
        (made free before returning); stops at a prompt to prefill in chunks (a preempted request's
        context is recomputed whole) and at a less urgent priority than the first's (an urgent prompt
        is computed in a forward of its own, never padded out by the queue behind it). Paged, a
        request's prefix hit is counted as blocks it shares, not new ones, and pinned (appended to
        `pins`; the caller unpins after the prefill) so that nothing evicts it first."""
        batch = self._batch
        free, group, longest, taken = batch.free, [], 0, 0
        if not free or not self._waiting:  # nothing to admit (the loop below checks again under the lock):
            return group  # no count of the pool's blocks, which walks the prefix cache's entries
        blocks = batch.blocks_available() if batch.paged else 0
        with self._cond:
            now = time.perf_counter()
            while self._waiting and len(group) < free:
                head = self._waiting[0]
                rest = self._rest(head)
                if self._long(rest) and not head.resume:
                    break  # _chunk takes it when the chunked prefill in progress is done
                if group and head.priority > group[0].priority:
                    break  # the next step takes it
                longest_next = max(longest, rest)
                if (group or not first_fits) and longest_next * (len(group) + 1) > budget:
                    break
                if batch.paged:
                    hit = len(head.context) - rest
                    need = batch.blocks_for(head, hit)
                    pin = batch.pin_prefix(head, hit)
                    lost = pin.taken if pin is not None else 0  # pinned blocks the pool can no longer reclaim
                    if taken + need > blocks - lost:
                        if pin is not None:
                            batch.unpin_prefix(pin)
                        break  # running requests free blocks as they finish
                    taken, blocks = taken + need, blocks - lost
                    if pin is not None:
                        pins.append(pin)
                seq = self._pop_waiting()
                seq.admitted, longest = now, longest_next
                group.append(seq)
        if taken:
            batch.make_room(taken)
        return group

    def _decode(self) -> None:
        """One token for every live row (with speculation, one or more: the drafts it keeps and one);
        if the step fails, each row is retried alone and only the rows that fail again are failed."""
        n = len(self._batch)
        if self.speculator is not None and self._speculate():
            return
        results: list[tuple[int, Picked]] = []
        started = time.perf_counter()
        try:
            # no request waits for a row: launch the next step before this one's tokens are handed out
            results = list(enumerate(self._batch.decode(ahead=self.config.decode_ahead and not self._waiting)))
            if self.speculator is not None:
                self.speculator.timed(n, time.perf_counter() - started)
        except Exception as exc:
            if n == 1:
                self._fail(self._batch.rows[0], exc)
            for row in range(n if n > 1 else 0):
                try:
                    results.append((row, self._batch.decode(row, row + 1)[0]))
                except Exception as row_exc:
                    self._fail(self._batch.rows[row], row_exc)
        self._accept(results, time.perf_counter())

    def _speculate(self) -> bool:
        """A verify step of every row with the drafts the speculator proposes; False when it proposes
        none (or drafting failed: logged), and the plain step runs instead. A verify step that fails
        leaves the rows as they were, and the plain step (with its row-by-row retry) runs."""
        batch, spec = self._batch, self.speculator
        started = time.perf_counter()
        try:
            drafts = spec.propose(batch)
        except Exception:
            log.exception("%s: drafting failed; this step decodes without drafts", self.name)
            return False
        if not drafts:
            return False
        entries = len(batch) + sum(len(d) for d in drafts.values())
        verifying = time.perf_counter()
        try:
            results, kept = batch.verify(drafts)
        except Exception:
            log.exception("%s: a verify step failed; this step decodes without drafts", self.name)
            return False
        done = time.perf_counter()
        spec.timed(entries, done - verifying)
        spec.verified(batch, drafts, kept, len(results), done - started)
        self._accept(results, done)
        return True

    def _accept(self, results: list[tuple[int, Picked]], now: float) -> None:
        """Hand each row its new tokens, in order (a row's tokens after it finished are dropped); a
        request whose text handling fails is failed alone."""
        taken = 0
        for row, (token, logprobs) in results:
            seq = self._batch.rows[row]
            if seq.reason is not None or seq.closed:
                continue
            taken += 1
            try:
                seq.accept(token, now, logprobs)
            except Exception as exc:
                self._fail(seq, exc)
                continue
            times = seq.token_times
            if len(times) == 1:
                self._counts["first_tokens"] += 1
                self._counts["ttft_ms"] += round(times[0] * 1000)
                self._observe("on_first_token", times[0])
            else:
                self._counts["inter_tokens"] += 1
                self._counts["itl_ms"] += round((times[-1] - times[-2]) * 1000)
                self._observe("on_inter_token", times[-1] - times[-2])
        self._counts["generated_tokens"] += taken

    def _evict(self) -> None:
        """Free the rows of finished, cancelled and failed requests, then send their Finished events."""
        dead = [i for i, s in enumerate(self._batch.rows) if s.done]
        partial = self._batch.partial
        if partial is not None and partial.done:
            self._batch.drop_partial()
        elif not dead:
            return
        removed = self._batch.remove(dead) + ([partial] if partial is not None and partial.done else [])
        with self._cond:  # running drops before the Finished events go out (usage follows at step end)
            self._snapshot = (self._batch.held, self._snapshot[1])
        now = time.perf_counter()
        for seq in removed:
            if seq.closed:
                continue
            try:
                self._record(seq.finish("cancelled" if seq.cancelled else "stop", now))
            except Exception as exc:
                self._fail(seq, exc)
