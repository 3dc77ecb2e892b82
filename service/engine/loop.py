"""The scheduler loop every engine shares: one thread that runs `step()` while requests wait or rows
are busy, a bounded FIFO queue with admission that knows the deadline (engine/admission.py),
cancellation, counters and the observer's hooks, and shutdown. What a step does is the engine's
(`_work`): the generation engine (engine/core.py) prefills prompts and samples one token per row;
the translation engine (engine/translation.py) encodes sources and advances every beam by one token.

A request's state (SeqState, engine/sequence.py; TranslationState, engine/translation.py) has
`request_id`, `admitted`, `cancelled`, `closed` and `finish(reason, now, error=)`, which sends its
Finished event; the loop needs nothing else of it.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from typing import Any

import torch

from models.execution.compiled import thread_settings

from ..errors import EngineClosed, EngineOverloaded, InvalidRequest, ServiceError
from ..telemetry.hooks import DEADLINE, QUEUE_FULL, EngineObserver, EngineStats
from .admission import Ask, WaitEstimator
from .events import Finished

log = logging.getLogger(__name__)


class StepLoop:
    """Thread-safe front: cancel(), stats(), shutdown(); start() runs the loop in its own thread.
    Subclasses queue requests with `_enqueue` and implement `_work`, `_busy`, `_drain`, `_held`,
    `_usage` (see each)."""

    kind = "generation"  # what its requests are, in messages

    def __init__(self, name: str, rows: int, max_queued: int, cache_bytes: int,
                 observer: EngineObserver | None = None, after_step: Callable[[], object] | None = None) -> None:
        self.name, self.rows, self.max_queued, self.cache_bytes = name, rows, max_queued, cache_bytes
        self.max_queued_share = 1.0  # of max_queued, for one tenant's waiting requests (EngineConfig)
        self._observer = observer or EngineObserver()
        self._after_step = after_step  # the loop calls it after each step (the replica trims its heap there)
        # guarded by _cond
        self._cond = threading.Condition()
        self._waiting: deque[Any] = deque()
        self._live: dict[str, Any] = {}  # waiting and running, by request id
        self._closed = False
        self._thread: threading.Thread | None = None
        self._counts = Counter({"prompt_tokens": 0, "cached_tokens": 0, "generated_tokens": 0, "steps": 0})
        self._finished: Counter[str] = Counter()
        self._snapshot = (0, 0.0)  # rows held (after the last step, plus those admitted since), cache usage
        self._extra: dict[str, int] = {}  # the engine's own EngineStats fields after the last step (_extra_stats)
        self._wait = WaitEstimator()  # admission: how long a new request would wait for a row

    # -- what an engine implements (engine thread) -------------------------------------------------

    def _work(self) -> bool:
        """One step's work: free what ended, admit what fits, advance every row. True when it computed
        prompt (or source) tokens: admission times decoding on the steps that did not."""
        raise NotImplementedError

    def _busy(self) -> bool:
        """Rows are in use (the loop keeps stepping)."""
        raise NotImplementedError

    def _drain(self) -> list[Any]:
        """Drop every row (a step failed, or shutdown): the requests they held, still open or not."""
        raise NotImplementedError

    def _held(self) -> int:
        """Rows in use now (generation: one per request)."""
        raise NotImplementedError

    def _usage(self) -> float:
        """Cache usage after a step, 0..1."""
        raise NotImplementedError

    def _rows_of(self, state: Any) -> int:
        """Cache rows a request takes (a beam search: its beam size)."""
        return 1

    # -- front (any thread) ----------------------------------------------------------------------

    def start(self) -> StepLoop:
        """Run the scheduler loop in its own thread (idempotent)."""
        with self._cond:
            if self._closed:
                raise EngineClosed(f"the {self.kind} engine is shut down")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
        return self

    def _enqueue(self, states: Sequence[Any], asks: Sequence[Ask]) -> None:
        """Queue `states` together, all or none. Raises InvalidRequest for a request id in use,
        EngineOverloaded when the queue has no room for all of them or when one of them could not make
        its deadline (engine/admission.py; `asks`: what admission knows of each), EngineClosed after
        shutdown()."""
        ids = [state.request_id for state in states]
        with self._cond:
            if self._closed:
                raise EngineClosed(f"the {self.kind} engine is shut down")
            taken = [i for i in ids if i in self._live] or [i for i in ids if ids.count(i) > 1]
            if taken:
                raise InvalidRequest(f"request_id {taken[0]!r} is already in use", "request_id")
            if self._beyond_free_rows(states) > self.max_queued:
                self._observe("on_admission", None, QUEUE_FULL)
                raise EngineOverloaded(f"{len(self._waiting)} {self.kind} requests are waiting, more than the free "
                                       f"rows take at the next step and max_queued={self.max_queued}; retry later")
            tenant = getattr(states[0], "tenant", None) if states else None
            if tenant is not None:
                mine = sum(getattr(w, "tenant", None) == tenant for w in self._waiting) + len(states)
                share = max(1, int(self.max_queued_share * self.max_queued))
                if mine > share:
                    self._observe("on_admission", None, QUEUE_FULL)
                    raise EngineOverloaded(f"tenant {tenant!r} has {mine - len(states)} {self.kind} requests waiting; "
                                           f"its share of this replica's queue is {share}; retry later")
            self._wait.on_asked([ask.prior for ask in asks])
            ahead = sum(map(self._rows_of, self._waiting)) + sum(map(self._rows_of, states))
            wait = self._wait.wait_s(ahead, self.rows - self._snapshot[0], self.rows)
            need = self._wait.late_s(asks, wait, time.perf_counter())
            if need is not None:
                self._observe("on_admission", wait, DEADLINE)
                raise EngineOverloaded(f"{len(self._waiting)} {self.kind} requests are waiting: this one would "
                                       f"start in about {wait:.1f} s and need about {need:.1f} s in all, past its "
                                       f"deadline; retry later")
            self._observe("on_admission", wait, None)
            for state in states:
                self._insert(state, behind=True)
                self._live[state.request_id] = state
            self._cond.notify()

    def _insert(self, state: Any, behind: bool) -> None:
        """Queue `state` by its priority (lower is sooner): behind every waiting request of its priority
        (a new one), or ahead of them (a preempted one, back to the head of its class)."""
        for i, other in enumerate(self._waiting):
            if other.priority > state.priority or (not behind and other.priority == state.priority):
                self._waiting.insert(i, state)
                return
        self._waiting.append(state)

    def _requeue(self, state: Any) -> None:
        """A preempted request back at the head of its priority (under _cond)."""
        self._insert(state, behind=False)

    def _pop_waiting(self) -> Any:
        """The head of the queue, taken for admission (engine thread, under _cond). Its rows count as
        held from now on, so that admission on the other threads does not see them free while a long
        prefill step admits them (the step's end counts the rows again)."""
        state = self._waiting.popleft()
        held, usage = self._snapshot
        self._snapshot = (held + self._rows_of(state), usage)
        return state

    def _beyond_free_rows(self, states: Sequence[Any]) -> int:
        """How many of the waiting requests, then `states`, the rows free after the last step will not
        take: what max_queued bounds (under _cond). A request that a free row takes at the next step
        does not wait for a row, so a burst that arrives between two steps fills the free rows first
        (before, the queue filled first and requests an idle engine could take were refused)."""
        free = self.rows - self._snapshot[0]
        beyond = 0
        for state in itertools.chain(self._waiting, states):
            free -= self._rows_of(state)
            beyond += free < 0
        return beyond

    def cancel(self, request_id: str) -> bool:
        """Stop a request (its client went away). A waiting one is finished here and never
        admitted; a running one frees its rows at the start of the next step. False if unknown."""
        with self._cond:
            state = self._live.get(request_id)
            if state is None:
                return False
            if state.admitted is not None:
                state.cancelled = True
                self._cond.notify()
                return True
            self._waiting.remove(state)
            event = state.finish("cancelled", time.perf_counter())
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
            return EngineStats(running=running, waiting=len(self._waiting), rows=self.rows,
                               cache_usage=usage, cache_bytes=self.cache_bytes,
                               prompt_tokens=self._counts["prompt_tokens"],
                               cached_prompt_tokens=self._counts["cached_tokens"],
                               generated_tokens=self._counts["generated_tokens"],
                               steps=self._counts["steps"], finished=dict(self._finished), **self._extra)

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the loop after its current step; requests still open end with an error event."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is None:
            self._abort_all(f"the {self.kind} engine shut down")
        elif thread is not threading.current_thread():
            thread.join(timeout_s)
            if thread.is_alive():
                log.warning("%s: the loop did not stop within %.1f s", self.name, timeout_s)

    def __enter__(self) -> StepLoop:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- the loop (engine thread) ---------------------------------------------------------------

    def _run(self) -> None:
        thread_settings()  # compiled blocks run on this thread: torch's compiler settings are per thread
        try:
            while True:
                with self._cond:
                    while not self._closed and not self._waiting and not self._busy():
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
            self._abort_all(f"the {self.kind} engine shut down")

    @torch.inference_mode()
    def step(self) -> None:
        """One scheduler step. The engine thread calls it; call it yourself only on an engine that was
        never started (tests drive the scheduler step by step this way)."""
        if self._thread is not None and self._thread is not threading.current_thread():
            raise RuntimeError("step() belongs to the engine thread once start() was called")
        started, before = time.perf_counter(), self._counts["generated_tokens"]
        prefilled = True  # a failed step's time is no decoding time
        try:
            prefilled = self._work()
        except Exception as exc:  # a bug outside the model calls: fail what the step held, go on
            held = self._drain()
            log.exception("%s: step failed; failing its %d requests", self.name, len(held))
            for state in held:
                if not state.closed:
                    self._fail(state, exc, traceback=False)
        usage = self._usage()
        seconds, generated = time.perf_counter() - started, self._counts["generated_tokens"] - before
        with self._cond:
            self._counts["steps"] += 1
            self._snapshot = (self._held(), usage)
            self._extra = self._extra_stats()
            if generated:
                self._wait.on_step(seconds, prefilled)
        self._observe("on_step", self.stats(), generated, seconds)

    def _extra_stats(self) -> dict[str, int]:
        """EngineStats fields only this engine has, as they stand after a step (on the engine thread)."""
        return {}

    def forget_timings(self) -> None:
        """Drop what the steps so far measured (a replica's warm-up: its first calls allocate and compile,
        and would make admission refuse the first requests); call it before start()."""
        with self._cond:
            self._wait = WaitEstimator()

    # -- bookkeeping -----------------------------------------------------------------------------

    def _fail(self, state: Any, exc: BaseException, traceback: bool = True) -> None:
        """End `state` with finish_reason "error": the request's own fault (a ServiceError: a grammar
        that failed) with its message and type, anything else as an internal error (logged with its
        traceback)."""
        if isinstance(exc, ServiceError):
            log.warning("%s: request %s failed: %s", self.name, state.request_id, exc)
            state.fault = exc  # its Finished event says so (a 4xx)
            self._record(state.finish("error", time.perf_counter(), error=exc.message))
            return
        log.error("%s: request %s failed: %r", self.name, state.request_id, exc, exc_info=exc if traceback else None)
        self._record(state.finish("error", time.perf_counter(), error=f"{type(exc).__name__}: {exc}"))

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
        for state in waiting + self._drain():
            if not state.closed:
                self._record(state.finish("error", now, error=message))

    def _observe(self, hook: str, *args: object) -> None:
        try:
            getattr(self._observer, hook)(*args)
        except Exception:
            log.exception("%s: observer hook %s failed", self.name, hook)
