"""Continuous batching for the encoder-decoder: `TranslationEngine` runs the shared scheduler loop
(engine/loop.py) over a models.beam_search.BeamSearch. No Ray, no FastAPI: a translator replica owns
one (service/replica/translator.py).

Each step, on the engine's one thread: admit waiting requests FIFO while the search has rows for their
whole beam and their padded sources fit the encoder budget (encoded together by length group, their
cross-attention keys/values kept once per source); one decoder step over every beam of every request,
each scored by its own beam size, length penalty and limit; a request leaves when its search ends or
the step after it is cancelled. Greedy requests stream Delta events, beam searches send their text
with Finished; each result is what models.beam_search.translate_ids gives the request alone. A failing
decoder call is retried source by source; a failure elsewhere fails the step's requests.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from models.beam_search import BeamParams, BeamSearch
from models.execution.executors import Seq2SeqExecutor
from models.inputs import select_batch
from models.seq2seq import Seq2Seq
from models.text import IncrementalDetokenizer, TextTokenizer

from ..messages import FinishReason, Usage
from ..telemetry.hooks import EngineObserver
from .admission import Ask
from .events import Delta, Event, Finished, RequestHandle, Timing
from .loop import StepLoop

log = logging.getLogger(__name__)
# select_batch's fixed cost of one encoder pass, in padded source tokens: sources of very different
# lengths are encoded in separate passes when the padding would cost more than this
ENCODE_OVERHEAD_TOKENS = 32
# Admission's guess of a translation's length before any request finished: twice its source tokens
# (+2, the end token and slack), never past its max_new_tokens. A translation runs about as long as its
# source, so this overestimates, but far less than the default max_new_tokens (128) would for a short
# sentence, with which a cold engine refused bursts it could have translated in time.
EXPECTED_PER_SOURCE_TOKEN = 2


@dataclass(frozen=True)
class TranslationSubmission:
    """One source for submit_many: its token ids (ending with eos) and its search."""

    source_ids: Sequence[int]
    params: BeamParams
    request_id: str | None = None
    deadline: float | None = None  # time.perf_counter() seconds: refused at once if it cannot be translated by then
    priority: int = 0  # lower is sooner: admitted ahead of waiting sources of a larger value


class TranslationState:
    """One source inside the engine. Mutated by the engine thread only, except `cancelled` (set by
    cancel() from any thread) and the finish of a request cancelled while waiting."""

    def __init__(self, request_id: str, source: list[int], params: BeamParams, handle: RequestHandle,
                 tokenizer: TextTokenizer, submitted: float, priority: int = 0) -> None:
        self.request_id, self.source, self.params, self.handle = request_id, source, params, handle
        self.priority = priority  # the queue's order (engine/loop.py)
        self.tokenizer = tokenizer
        self.detok = IncrementalDetokenizer(tokenizer) if params.beam_size == 1 else None  # greedy: streamed
        self.text, self.steps = "", 0
        self.submitted = submitted
        self.admitted: float | None = None
        self.token_times: list[float] = []
        self.cancelled = False
        self.closed = False

    @property
    def rows(self) -> int:
        """Cache rows it reserves."""
        return self.params.beam_size

    def token(self, token: int, now: float) -> None:
        """A greedy step's token: stream what text it completes (an empty Delta for the first token)."""
        self.steps += 1
        self.token_times.append(now - self.submitted)
        piece = self.detok.push(token) if self.detok is not None else ""
        self.text += piece
        if piece or self.steps == 1:
            self._emit(Delta(piece, self.steps))

    def finish(self, reason: FinishReason, now: float, error: str | None = None,
               ids: list[int] | None = None) -> Finished:
        """Send the rest of the text and the Finished event (call once). `ids`: the search's result."""
        if self.closed:
            raise RuntimeError(f"request {self.request_id} is already finished")
        self.closed = True
        tokens = tuple(ids or ())
        if ids is not None and error is None:
            text = self.tokenizer.decode(list(ids))
            if self.detok is not None and text.startswith(self.text):
                rest = text[len(self.text):]  # what the stream held back (an incomplete character)
            else:
                rest = text if self.detok is None else ""
            if rest:
                self._emit(Delta(rest, len(tokens)))
            self.text += rest
        times = tuple(self.token_times)
        timing = Timing(queued_s=None if self.admitted is None else self.admitted - self.submitted,
                        first_token_s=times[0] if times else None, total_s=now - self.submitted, token_times_s=times)
        event = Finished(self.request_id, self.text, tokens, reason, Usage(len(self.source), len(tokens)), timing, error)
        self._emit(event)
        return event

    def _emit(self, event: Event) -> None:
        if not self.handle.deliver(event):
            self.cancelled = True  # the caller's event loop is gone: stop searching for it


class TranslationEngine(StepLoop):
    """Owns the decoder's KV cache (`rows` beams of up to max_new_tokens + 1 tokens) and schedules every
    translation on it. Thread-safe front: submit_many(), cancel(), stats(), shutdown()."""

    kind = "translation"

    def __init__(self, model: Seq2Seq | Seq2SeqExecutor, tokenizer: TextTokenizer, rows: int, max_new_tokens: int,
                 max_queued: int = 512, encode_tokens: int = 4096, banned_ids: Sequence[int] = (),
                 observer: EngineObserver | None = None, name: str = "translation-engine",
                 after_step: Callable[[], object] | None = None) -> None:
        """`model`: its executor (a bare model is planned with execution "auto"); `encode_tokens`: padded
        source tokens per admission step (one source is always admitted)."""
        self.search = BeamSearch(model, rows, max_new_tokens, banned_ids)
        self.model, self.tokenizer, self.max_new_tokens = self.search.model, tokenizer, max_new_tokens
        self.encode_tokens = encode_tokens
        super().__init__(name, rows, max_queued, self.search.cache.nbytes(), observer, after_step)
        self._running: dict[str, TranslationState] = {}  # engine thread only
        self._admitting: list[TranslationState] = []
        self.largest_step = 0  # the most sources one decoder step advanced (engine thread writes it)

    # -- front (any thread) ----------------------------------------------------------------------

    def submit_many(self, submissions: Sequence[TranslationSubmission]) -> list[RequestHandle]:
        """Queue several sources at once, all or none (the sentences of one request). Called on an event
        loop, each handle is an async iterator on that loop. Raises ValueError for a source or a search
        the engine cannot run, EngineOverloaded when the queue has no room for all of them or when the
        wait for rows would outlast the earliest deadline, EngineClosed after shutdown()."""
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        states, handles, now = [], [], time.perf_counter()
        for sub in submissions:
            if not sub.source_ids:
                raise ValueError("a source needs at least one token")
            if sub.params.beam_size > self.rows:
                raise ValueError(f"beam_size {sub.params.beam_size} is over the engine's {self.rows} rows")
            if sub.params.max_new_tokens > self.max_new_tokens:
                raise ValueError(f"max_new_tokens {sub.params.max_new_tokens} is over the engine's "
                                 f"{self.max_new_tokens}")
            request_id = sub.request_id or uuid.uuid4().hex
            handle = RequestHandle(request_id, self.cancel, loop)
            states.append(TranslationState(request_id, [int(t) for t in sub.source_ids], sub.params, handle,
                                           self.tokenizer, now, sub.priority))
            handles.append(handle)
        self._enqueue(states, [Ask(s.params.max_new_tokens, False, sub.deadline, whole=True,
                                   expected=EXPECTED_PER_SOURCE_TOKEN * len(s.source) + 2)
                               for s, sub in zip(states, submissions, strict=True)])
        return handles

    def _rows_of(self, state: TranslationState) -> int:
        return state.rows

    # -- the loop (engine thread) ---------------------------------------------------------------

    def _work(self) -> bool:
        encoded = self._admit()
        if not self.search:
            return encoded
        self.largest_step = max(self.largest_step, len(self.search))
        rows = self.search.busy_rows
        events = self.search.step(cancelled=lambda key: self._running[key].cancelled)
        now = time.perf_counter()
        for event in events:
            state = self._running[event.key]
            if event.token is not None:
                try:
                    state.token(event.token, now)
                except Exception as exc:  # its text handling failed: it alone
                    state.cancelled = True
                    self._fail(state, exc)
            if event.done:
                del self._running[event.key]
                if state.closed:
                    continue
                if event.error is not None:  # its rows failed the step alone too; the others went on
                    self._fail(state, event.error)
                    continue
                if event.ids is None:
                    self._record(state.finish("cancelled", now))
                    continue
                reason: FinishReason = "length" if len(event.ids) >= state.params.max_new_tokens - 1 else "stop"
                try:
                    self._record(state.finish(reason, now, ids=event.ids))
                except Exception as exc:
                    self._fail(state, exc)
        self._counts["generated_tokens"] += rows  # decoder rows advanced (the step time is measured on them)
        return encoded

    def _admit(self) -> bool:
        """FIFO while the next waiting source's beams fit the free rows and the padded sources fit
        the encoder budget; encoded in groups of similar length (select_batch's cost model: padding
        against the fixed cost of an encoder pass), each group in one padded pass. True when it
        encoded any."""
        group: list[TranslationState] = []
        free, longest = self.search.free, 0
        with self._cond:
            now = time.perf_counter()
            while self._waiting and self._waiting[0].rows <= free:
                state = self._waiting[0]
                longest_next = max(longest, len(state.source))
                if group and longest_next * (len(group) + 1) > self.encode_tokens:
                    break
                self._pop_waiting()
                state.admitted, longest, free = now, longest_next, free - state.rows
                group.append(state)
        self._admitting = group
        encoded = bool(group)
        while group:
            picked = set(select_batch([len(s.source) for s in group], len(group), self.encode_tokens,
                                      ENCODE_OVERHEAD_TOKENS))
            self._add([s for i, s in enumerate(group) if i in picked], now)
            group = [s for i, s in enumerate(group) if i not in picked]
            self._admitting = group
        self._admitting = []
        return encoded

    def _add(self, group: list[TranslationState], now: float) -> None:
        """Encode `group` into the search; if that fails, its requests fail (the others go on)."""
        try:
            self.search.add([s.source for s in group], [s.params for s in group], [s.request_id for s in group])
        except Exception as exc:
            for state in group:
                self._fail(state, exc)
            return
        for state in group:
            self._running[state.request_id] = state
            self._counts["prompt_tokens"] += len(state.source)
            self._observe("on_admitted", now - state.submitted, len(state.source), 0)

    def _busy(self) -> bool:
        return bool(self.search)

    def _drain(self) -> list[TranslationState]:
        self.search.clear()
        held = self._admitting + list(self._running.values())
        self._admitting, self._running = [], {}
        return held

    def _held(self) -> int:
        return self.rows - self.search.free

    def _usage(self) -> float:
        return self.search.busy_rows / self.rows
