"""Continuous batching for a decoder-only LM: scheduling at the level of decode steps (as vLLM and
TGI do), on our own model and KV cache. No Ray and no FastAPI here: a generator replica owns one engine
(service/replica/generator.py).

Every step, on the engine's one thread:
1. free the rows of cancelled requests;
2. admit waiting requests (FIFO, while rows are free and their padded prompts fit the prefill
   budget), prefilled on fresh rows at the end of the live block in groups of similar prompt
   length (one right-padded forward per group, so little compute goes to padding), sampling each
   request's first token at its last prompt index;
   a prompt longer than `prefill_chunk` is prefilled instead a chunk per step on the cache's last
   row (one such prompt at a time), and joins the live rows after its last chunk;
3. one decode step over all live rows [0, n) (each at its own cache position), one token per row;
4. free the rows of requests that finished; the last live rows move into the holes, so the live
   rows stay packed at the front of the cache.
Each request's tokens depend only on its own rows and its own seeded generator, so a request
decodes the same tokens alone or among others, and as models.generate.generate does.

A failing forward or sampling step is retried row by row (a step writes each row's next cache
slots before its length advances, so a retry is harmless): only the requests that fail again get
an error event. Anything else that escapes a step fails the running requests; the engine goes on.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from models.decoder import DecoderLM
from models.decoding import SamplingParams
from models.inputs import select_batch
from models.kv_cache import KVCache
from models.text import TextTokenizer

from ..errors import EngineClosed, EngineOverloaded, InvalidRequest
from ..telemetry.hooks import EngineObserver, EngineStats
from .admission import WaitEstimator
from .batch import Picked, RunningBatch
from .config import EngineConfig
from .events import Finished, RequestHandle
from .grammar import Grammars
from .limits import EngineLimits
from .prefix_cache import PrefixCache
from .sequence import SeqState

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Submission:
    """One request for submit_many: as submit()'s arguments."""

    prompt_ids: Sequence[int]
    params: SamplingParams | None = None
    request_id: str | None = None
    grammar: Any = None
    deadline: float | None = None  # time.perf_counter() seconds: refused at once if it cannot start before


# select_batch's fixed cost of one prefill forward pass, in padded prompt tokens: prompts of very
# different lengths are prefilled in separate passes when the padding would cost more than this.
PREFILL_OVERHEAD_TOKENS = 64


class GenerationEngine:
    """Owns the model's KV cache and schedules every request on it. Thread-safe front: submit(),
    cancel(), stats(), shutdown(); start() runs the scheduler loop in a dedicated thread."""

    def __init__(self, model: DecoderLM, tokenizer: TextTokenizer, config: EngineConfig | None = None,
                 observer: EngineObserver | None = None, name: str = "generation-engine",
                 after_step: Callable[[], object] | None = None, max_input_tokens: int | None = None) -> None:
        """`max_input_tokens`: the model's input limit (the prompt limit when the config sets none)."""
        weight = next(model.parameters())
        self.model, self.tokenizer, self.name = model, tokenizer, name
        self.device = weight.device
        self.config = config or EngineConfig()
        self.limits = EngineLimits.resolve(self.config, model.cfg, weight.dtype, max_input_tokens)
        self.cache = KVCache.for_model(model.cfg, self.limits.rows, self.limits.max_total_tokens, weight.dtype,
                                       self.device)
        self._eos = frozenset(model.cfg.eos_token_ids)
        self.grammars = Grammars(tokenizer, model.cfg.vocab_size, self._eos)  # structured outputs
        self._observer = observer or EngineObserver()
        self._after_step = after_step  # the loop calls it after each step (the replica trims its heap there)
        # engine thread only: the live rows, and a group taken from the queue while it is prefilled
        # prefix caching needs rows that keep every prompt token: not a sliding window's ring
        prefix = (PrefixCache(self.cache, self.limits.prefix_cache_bytes)
                  if self.limits.prefix_cache_bytes and not self.cache.ring else None)
        self._batch = RunningBatch(model, self.cache, model.cfg.vocab_size, prefix)
        self._admitting: list[SeqState] = []
        # guarded by _cond
        self._cond = threading.Condition()
        self._waiting: deque[SeqState] = deque()
        self._live: dict[str, SeqState] = {}  # waiting and running, by request id
        self._closed = False
        self._thread: threading.Thread | None = None
        self._counts = Counter({"prompt_tokens": 0, "cached_tokens": 0, "generated_tokens": 0, "steps": 0})
        self._finished: Counter[str] = Counter()
        self._snapshot = (0, 0.0)  # running, cache usage after the last step
        self._prefix_bytes = 0  # the prefix cache's size after the last step
        self._wait = WaitEstimator()  # admission: how long a new request would wait for a row

    # -- front (any thread) --------------------------------------------------------------------

    def start(self) -> GenerationEngine:
        """Run the scheduler loop in its own thread (idempotent)."""
        with self._cond:
            if self._closed:
                raise EngineClosed("the generation engine is shut down")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
        return self

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams | None = None,
               request_id: str | None = None, grammar: Any = None, deadline: float | None = None) -> RequestHandle:
        """Queue a request and return at once (it runs once start() was called, or on step()).
        Called on an event loop, the handle is an async iterator on that loop; otherwise read it
        with handle.events() / result_sync().

        `grammar`: a grammar compiled by self.grammars: the output must match it. `deadline`
        (time.perf_counter() seconds): refused at once when the wait for a row would outlast it.

        Raises InvalidRequest / RequestTooLarge (naming the limit) for a request over the limits,
        EngineOverloaded when max_queued requests wait, EngineClosed after shutdown().
        """
        return self.submit_many([Submission(prompt_ids, params, request_id, grammar, deadline)])[0]

    def submit_many(self, submissions: Sequence[Submission]) -> list[RequestHandle]:
        """Queue several requests at once, all or none (n > 1 siblings, a list of prompts): they stand
        together in the queue, so they are admitted in one step whenever rows and the prefill budget
        allow, and siblings with one prompt share its prefill (RunningBatch.prefill). Raises as
        submit() does; EngineOverloaded when the queue has no room for all of them, or when the wait for
        a row (engine/admission.py) would outlast the earliest of their deadlines."""
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
            seqs.append(SeqState(request_id, prompt, params, handle, self.tokenizer, self._eos, time.perf_counter(),
                                 matcher))
            handles.append(handle)
        ids = [seq.request_id for seq in seqs]
        with self._cond:
            if self._closed:
                raise EngineClosed("the generation engine is shut down")
            taken = [i for i in ids if i in self._live] or [i for i in ids if ids.count(i) > 1]
            if taken:
                raise InvalidRequest(f"request_id {taken[0]!r} is already in use", "request_id")
            if len(self._waiting) + len(seqs) > self.limits.max_queued:
                self._observe("on_admission", None, "queue_full")
                raise EngineOverloaded(f"{len(self._waiting)} generation requests are waiting (max_queued="
                                       f"{self.limits.max_queued}); retry later")
            rows = self.limits.rows
            self._wait.on_asked([seq.params.max_new_tokens for seq in seqs])
            wait = self._wait.wait_s(len(self._waiting) + len(seqs), rows - self._snapshot[0], rows)
            deadlines = [sub.deadline for sub in submissions if sub.deadline is not None]
            if deadlines and wait > min(deadlines) - time.perf_counter():
                self._observe("on_admission", wait, "deadline")
                raise EngineOverloaded(f"{len(self._waiting)} generation requests are waiting: about {wait:.1f} s "
                                       f"before this one would start, past its deadline; retry later")
            self._observe("on_admission", wait, None)
            for seq in seqs:
                self._waiting.append(seq)
                self._live[seq.request_id] = seq
            self._cond.notify()
        return handles

    def cancel(self, request_id: str) -> bool:
        """Stop a request (its client went away). A waiting one is finished here and never
        prefilled; a running one frees its row at the start of the next step. False if unknown."""
        with self._cond:
            seq = self._live.get(request_id)
            if seq is None:
                return False
            if seq.admitted is not None:
                seq.cancelled = True
                self._cond.notify()
                return True
            self._waiting.remove(seq)
            event = seq.finish("cancelled", time.perf_counter())
        self._record(event)
        return True

    @property
    def alive(self) -> bool:
        """The scheduler thread runs: False before start(), after shutdown(), or if the loop died."""
        with self._cond:
            return self._thread is not None and self._thread.is_alive() and not self._closed

    def stats(self) -> EngineStats:
        with self._cond:
            running, usage = self._snapshot
            return EngineStats(running=running, waiting=len(self._waiting), rows=self.limits.rows,
                               cache_usage=usage, cache_bytes=self.cache.nbytes(),
                               prompt_tokens=self._counts["prompt_tokens"],
                               cached_prompt_tokens=self._counts["cached_tokens"],
                               prefix_cache_bytes=self._prefix_bytes,
                               generated_tokens=self._counts["generated_tokens"],
                               steps=self._counts["steps"], finished=dict(self._finished))

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the loop after its current step; requests still open end with an error event."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is None:
            self._abort_all("the generation engine shut down")
        elif thread is not threading.current_thread():
            thread.join(timeout_s)
            if thread.is_alive():
                log.warning("%s: the loop did not stop within %.1f s", self.name, timeout_s)

    def __enter__(self) -> GenerationEngine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- the loop (engine thread) ---------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._closed and not self._waiting and not self._batch.busy:
                        self._cond.wait()  # idle: sleep until submit(), cancel() or shutdown()
                    if self._closed:
                        return
                self.step()
                if self._after_step is not None:
                    try:
                        self._after_step()
                    except Exception:
                        log.exception("%s: after_step failed", self.name)
        finally:
            self._abort_all("the generation engine shut down")

    @torch.inference_mode()
    def step(self) -> None:
        """One scheduler step. The engine thread calls it; call it yourself only on an engine that was
        never started (tests drive the scheduler step by step this way)."""
        if self._thread is not None and self._thread is not threading.current_thread():
            raise RuntimeError("step() belongs to the engine thread once start() was called")
        started, before = time.perf_counter(), self._counts["generated_tokens"]
        try:
            self._evict()
            self._admit()
            self._evict()
            if self._batch:
                self._decode()
            self._evict()
        except Exception as exc:  # a bug outside the model calls: fail what the step held, go on
            log.exception("%s: step failed; failing its %d requests", self.name, len(self._batch))
            for seq in self._admitting + self._batch.clear():
                if not seq.closed:
                    self._fail(seq, exc, traceback=False)
            self._admitting = []
        usage = self._batch.usage()
        seconds, generated = time.perf_counter() - started, self._counts["generated_tokens"] - before
        with self._cond:
            self._counts["steps"] += 1
            self._snapshot = (self._batch.held, usage)
            self._prefix_bytes = self._batch.prefix.nbytes if self._batch.prefix is not None else 0
            if generated:
                self._wait.on_step(seconds)
        self._observe("on_step", self.stats(), generated, seconds)

    def _admit(self) -> None:
        """One chunk of the long prompt being prefilled in chunks (if any), then prefill the waiting
        requests that fit on fresh rows and in the rest of the step's budget, in groups of similar
        prompt lengths (select_batch's cost model: padding against the fixed cost of a forward pass)."""
        chunked = self._chunk()
        group = self._take_waiting(self.limits.prefill_tokens - chunked, first_fits=not chunked)
        while group:
            lengths = [self._rest(seq) for seq in group]
            picked = set(select_batch(lengths, len(group), self.limits.prefill_tokens, PREFILL_OVERHEAD_TOKENS))
            self._prefill([seq for i, seq in enumerate(group) if i in picked],
                          rest=[seq for i, seq in enumerate(group) if i not in picked])
            group = [seq for i, seq in enumerate(group) if i not in picked]

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
        it is longer than a chunk and a row is free. Returns the prompt tokens it computed."""
        chunk, batch = self.limits.prefill_chunk, self._batch
        if chunk is None:
            return 0
        if batch.partial is None:
            with self._cond:
                if not self._waiting or batch.free < 1 or not self._long(self._rest(self._waiting[0])):
                    return 0
                seq = self._waiting.popleft()
                seq.admitted = time.perf_counter()
            batch.start_partial(seq)
        seq, start = batch.partial, len(batch.rows)
        n = min(chunk, len(seq.prompt) - batch.partial_done)
        last = batch.partial_done + n == len(seq.prompt)
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
        """Prompt tokens of seq to compute: less what the prefix cache holds."""
        return len(seq.prompt) - self._batch.cached(seq)

    def _long(self, rest: int) -> bool:
        """Whether a prompt with `rest` tokens to compute is prefilled in chunks."""
        return self.limits.prefill_chunk is not None and rest > self.limits.prefill_chunk

    def _take_siblings(self, seq: SeqState) -> list[SeqState]:
        """Waiting requests right behind `seq` with its prompt (n > 1 siblings), as many as free rows
        take: they join on copies of its row when its chunked prefill ends."""
        siblings: list[SeqState] = []
        with self._cond:
            now = time.perf_counter()
            while (self._waiting and len(siblings) < self._batch.free
                   and self._waiting[0].prompt == seq.prompt):
                sibling = self._waiting.popleft()
                sibling.admitted = now
                siblings.append(sibling)
        return siblings

    def _take_waiting(self, budget: int, first_fits: bool = True) -> list[SeqState]:
        """FIFO while rows are free and (longest prompt) x (requests) fits the prefill budget (the
        first one always, unless `first_fits` is False); stops at a prompt to prefill in chunks."""
        free, group, longest = self._batch.free, [], 0
        with self._cond:
            now = time.perf_counter()
            while self._waiting and len(group) < free:
                rest = self._rest(self._waiting[0])
                if self._long(rest):
                    break  # _chunk takes it when the chunked prefill in progress is done
                longest_next = max(longest, rest)
                if (group or not first_fits) and longest_next * (len(group) + 1) > budget:
                    break
                seq = self._waiting.popleft()
                seq.admitted, longest = now, longest_next
                group.append(seq)
        return group

    def _decode(self) -> None:
        """One token for every live row; if the step fails, each row is retried alone and only the
        rows that fail again are failed."""
        n = len(self._batch)
        results: list[tuple[int, Picked]] = []
        try:
            results = list(enumerate(self._batch.decode()))
        except Exception as exc:
            if n == 1:
                self._fail(self._batch.rows[0], exc)
            for row in range(n if n > 1 else 0):
                try:
                    results.append((row, self._batch.decode(row, row + 1)[0]))
                except Exception as row_exc:
                    self._fail(self._batch.rows[row], row_exc)
        self._accept(results, time.perf_counter())

    def _accept(self, results: list[tuple[int, Picked]], now: float) -> None:
        """Hand each row its new token; a request whose text handling fails is failed alone."""
        for row, (token, logprobs) in results:
            seq = self._batch.rows[row]
            try:
                seq.accept(token, now, logprobs)
            except Exception as exc:
                self._fail(seq, exc)
                continue
            times = seq.token_times
            if len(times) == 1:
                self._observe("on_first_token", times[0])
            else:
                self._observe("on_inter_token", times[-1] - times[-2])
        self._counts["generated_tokens"] += len(results)

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

    # -- bookkeeping -----------------------------------------------------------------------------

    def _fail(self, seq: SeqState, exc: BaseException, traceback: bool = True) -> None:
        log.error("%s: request %s failed: %r", self.name, seq.request_id, exc, exc_info=exc if traceback else None)
        self._record(seq.finish("error", time.perf_counter(), error=f"{type(exc).__name__}: {exc}"))

    def _record(self, event: Finished) -> None:
        with self._cond:
            self._live.pop(event.request_id, None)
            self._finished[event.finish_reason] += 1
            if event.finish_reason in ("stop", "length"):
                self._wait.on_finished(event.usage.completion_tokens)
        self._observe("on_finished", event)

    def _abort_all(self, message: str) -> None:
        """Shutdown: end every open request with an error event."""
        with self._cond:
            waiting = list(self._waiting)
            self._waiting.clear()
        now = time.perf_counter()
        for seq in waiting + self._admitting + self._batch.clear():
            if not seq.closed:
                self._record(seq.finish("error", now, error=message))
        self._admitting = []

    def _observe(self, hook: str, *args: object) -> None:
        try:
            getattr(self._observer, hook)(*args)
        except Exception:
            log.exception("%s: observer hook %s failed", self.name, hook)
