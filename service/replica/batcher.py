"""Dynamic batching inside a model replica: `DynamicBatcher` queues a request's items (one per input text)
and runs batches one at a time on the replica's single inference thread. No Ray here.

The queue is ordered by priority (lower is sooner, a tenant's: service/http/quotas.py), first come
first served within one. A batch goes when the queue could fill one or its head waited max_wait; it
takes the head (the most urgent, oldest item) and the run next to it in length order that wastes
least on padding, within `n_rows * longest <= max_batch_tokens` (models.inputs.select_batch). Past
`max_queued` items, or when the estimated wait would outlast its deadline, a request is refused at
once with `Overloaded`.
Cancelled and expired items are dropped before compute; a failing batch is split and re-run in
halves, so an item fails alone. `run_batch(payloads)` returns one result per payload, in order: a
value, an Exception (fails that item), or STOPPED where `still_wanted(payload)` said to stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import asdict, dataclass, field
from typing import Any, Generic, TypeVar

from models.inputs import select_batch

from ..engine.admission import ewma
from ..errors import DeadlineExceeded, Overloaded
from ..telemetry.hooks import CANCELLED, DEADLINE, EXPIRED, QUEUE_FULL, REJECTED, BatchObserver
from .config import BatchLimits

log = logging.getLogger(__name__)
STOPPED = object()  # a run_batch result: the input's work was stopped because still_wanted() was False

P = TypeVar("P")
R = TypeVar("R")


@dataclass
class BatchStats:
    """Counters since start-up (for metrics). Efficiency = real tokens / computed (padded) tokens."""

    batches: int = 0
    items: int = 0
    largest_batch: int = 0
    real_tokens: int = 0
    computed_tokens: int = 0
    failed: int = 0  # items whose computation raised
    cancelled: int = 0  # dropped before compute: the caller went away
    expired: int = 0  # dropped before compute: past their deadline
    rejected: int = 0  # refused at submit: queue full

    @property
    def padding_efficiency(self) -> float:
        return self.real_tokens / self.computed_tokens if self.computed_tokens else 1.0

    def record(self, items: int, real_tokens: int, computed_tokens: int) -> None:
        """Count one computed batch of `items` rows."""
        self.batches += 1
        self.items += items
        self.largest_batch = max(self.largest_batch, items)
        self.real_tokens += real_tokens
        self.computed_tokens += computed_tokens

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "padding_efficiency": self.padding_efficiency}


@dataclass(eq=False)
class _Item(Generic[P]):
    payload: P
    length: int
    future: asyncio.Future
    deadline: float | None  # time.monotonic() seconds
    enqueued: float = field(default_factory=time.monotonic)
    work: int = 0  # its share of BatchLimits.max_batch_work (a translation: beam_size x max_new_tokens)
    priority: int = 0  # lower is sooner


def within_work(chosen: Sequence[int], work: Sequence[int], budget: int | None) -> list[int]:
    """The chosen items (indices, oldest first) whose work adds up to at most `budget`: always the
    first one (an input over the budget runs alone), then each later one that still fits."""
    if budget is None:
        return list(chosen)
    kept, total = [], 0
    for i in sorted(chosen):
        if not kept or total + work[i] <= budget:
            kept.append(i)
            total += work[i]
    return kept


class DynamicBatcher(Generic[P, R]):
    """Gathers items from concurrent requests into batches for `run_batch` (see the module docstring).

    Owned by one model replica; all methods must be called from that replica's event loop.
    `run_batch` runs in `executor` (one worker thread: one inference at a time per replica).
    """

    def __init__(self, run_batch: Callable[[list[P]], Sequence[R | BaseException]], limits: BatchLimits,
                 executor: Executor | None = None, name: str = "batcher",
                 observer: BatchObserver | None = None) -> None:
        self.run_batch = run_batch
        self.limits = limits
        self.executor = executor
        self.name = name
        self.stats = BatchStats()
        self.observer = observer or BatchObserver()
        self._queue: list[_Item[P]] = []
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._running: list[_Item[P]] = []  # the batch being computed
        self._running_since = 0.0
        self._running_by_payload: dict[int, _Item[P]] = {}
        self._seconds_per_token: float | None = None  # moving average over batches, per padded token
        self._padding = 1.0  # moving average of padded / real tokens per batch

    # -- submitting ----------------------------------------------------------------------------
    async def submit(self, payload: P, length: int, deadline: float | None = None, priority: int = 0) -> R:
        return (await self.submit_many([payload], [length], deadline, priority=priority))[0]

    async def submit_many(self, payloads: Sequence[P], lengths: Sequence[int],
                          deadline: float | None = None, work: Sequence[int] | None = None,
                          priority: int = 0) -> list[R]:
        """Queue one item per payload, behind the queued items of `priority` or sooner and ahead of
        later ones; return their results in order, or raise the first failure (by input index). On
        failure or cancellation the request's other items are cancelled. `work`: each item's share of
        `max_batch_work` (none: 0)."""
        if len(payloads) != len(lengths):
            raise ValueError(f"{len(payloads)} payloads but {len(lengths)} lengths")
        if not payloads:
            return []
        self._ensure_started()
        self._make_room(len(payloads))
        self._admit(deadline, priority)
        loop = asyncio.get_running_loop()
        shares = work if work is not None else [0] * len(payloads)
        items = [_Item(p, n, loop.create_future(), deadline, work=w, priority=priority)
                 for p, n, w in zip(payloads, lengths, shares, strict=True)]
        at = len(self._queue)  # behind every item of this priority or a sooner one
        while at > 0 and self._queue[at - 1].priority > priority:
            at -= 1
        self._queue[at:at] = items
        self._observe("on_queue", len(self._queue))
        assert self._wakeup is not None
        self._wakeup.set()
        futures = [it.future for it in items]
        try:
            await asyncio.wait(futures, return_when=asyncio.FIRST_EXCEPTION)
            failures = [f.exception() for f in futures if f.done() and not f.cancelled() and f.exception()]
            if failures:
                raise failures[0]
            return [f.result() for f in futures]
        finally:
            for f in futures:
                if not f.done():
                    f.cancel()  # dropped by the loop before compute

    def _make_room(self, n: int) -> None:
        if len(self._queue) + n > self.limits.max_queued:
            self._drop_finished()
        if len(self._queue) + n > self.limits.max_queued:
            self.stats.rejected += n
            self._observe("on_dropped", REJECTED, n)
            self._observe("on_admission", None, QUEUE_FULL)
            raise Overloaded(f"{self.name}: {len(self._queue)} inputs are queued (limit "
                             f"{self.limits.max_queued}); retry later")

    def wait_estimate(self, priority: int = 0) -> float:
        """Seconds before a request of `priority` queued now would start computing: the batch running
        now, then the padded tokens of the queued inputs it would stand behind (those of its priority or
        a sooner one) at the measured seconds per padded token (0 until measured)."""
        per_token = self._seconds_per_token
        if per_token is None:
            return 0.0
        queued = sum(it.length for it in self._queue if not it.future.done() and it.priority <= priority)
        running = 0.0
        if self._running:
            work = len(self._running) * max(it.length for it in self._running) * per_token
            running = max(0.0, work - (time.monotonic() - self._running_since))
        return running + queued * self._padding * per_token

    def _admit(self, deadline: float | None, priority: int = 0) -> None:
        """Refuse (Overloaded) a request whose estimated wait outlasts its deadline."""
        wait = self.wait_estimate(priority)
        if deadline is not None and wait > 0 and wait > deadline - time.monotonic():
            self._observe("on_admission", wait, DEADLINE)
            raise Overloaded(f"{self.name}: about {wait:.1f} s of queued work before this request would start, "
                             "past its deadline; retry later")
        self._observe("on_admission", wait, None)

    def still_wanted(self, payload: P) -> bool:
        """Whether an input of the batch being computed is still wanted: its caller has not gone away
        and its deadline has not passed. For run_batch (in the inference thread) to stop the work of
        an input between steps of a long computation (beam search)."""
        item = self._running_by_payload.get(id(payload))
        if item is None:
            return True
        return not item.future.done() and (item.deadline is None or time.monotonic() < item.deadline)

    @property
    def queued(self) -> int:
        return sum(1 for it in self._queue if not it.future.done())

    @property
    def alive(self) -> bool:
        """False once the loop has died (it should never; a health check reports it)."""
        return self._task is None or not self._task.done()

    # -- the loop --------------------------------------------------------------------------------
    def _ensure_started(self) -> None:
        if self._task is None:
            self._wakeup = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._loop(), name=f"{self.name}-loop")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        for it in [*self._queue, *self._running]:
            if not it.future.done():
                it.future.cancel()
        self._queue.clear()

    async def _loop(self) -> None:
        while True:
            try:
                batch = await self._next_batch()
                await self._run(batch)
            except asyncio.CancelledError:
                raise
            except Exception:  # never let one bad batch stop the loop
                log.exception("%s: batch loop error", self.name)

    def _drop_finished(self) -> None:
        """Remove cancelled items and fail expired ones (both before compute)."""
        now = time.monotonic()
        kept: list[_Item[P]] = []
        dropped = {CANCELLED: 0, EXPIRED: 0}
        for it in self._queue:
            if it.future.done():
                dropped[CANCELLED] += 1
            elif it.deadline is not None and now >= it.deadline:
                it.future.set_exception(DeadlineExceeded(f"{self.name}: deadline passed while queued"))
                dropped[EXPIRED] += 1
            else:
                kept.append(it)
        self._queue = kept
        self.stats.cancelled += dropped[CANCELLED]
        self.stats.expired += dropped[EXPIRED]
        for reason, n in dropped.items():
            if n:
                self._observe("on_dropped", reason, n)
        if any(dropped.values()):
            self._observe("on_queue", len(kept))

    async def _next_batch(self) -> list[_Item[P]]:
        assert self._wakeup is not None
        lim = self.limits
        while True:
            self._drop_finished()
            if not self._queue:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            queued = len(self._queue)
            full = (queued >= lim.max_batch_size or queued * max(it.length for it in self._queue) > lim.max_batch_tokens
                    or (lim.max_batch_work is not None and sum(it.work for it in self._queue) >= lim.max_batch_work))
            wait = self._queue[0].enqueued + lim.max_wait_s - time.monotonic()
            if full or wait <= 0:
                chosen = within_work(select_batch([it.length for it in self._queue], lim.max_batch_size,
                                                  lim.max_batch_tokens, lim.overhead_tokens),
                                     [it.work for it in self._queue], lim.max_batch_work)
                picked = set(chosen)
                batch = [self._queue[i] for i in chosen]
                self._queue = [it for i, it in enumerate(self._queue) if i not in picked]
                self._observe("on_queue", len(self._queue))
                return batch
            self._wakeup.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wakeup.wait(), wait)

    async def _run(self, batch: list[_Item[P]]) -> None:
        self._running = batch
        self._running_by_payload = {id(it.payload): it for it in batch}
        started = self._running_since = time.monotonic()
        waits = [started - it.enqueued for it in batch]
        try:
            results: list[R | BaseException] = await asyncio.get_running_loop().run_in_executor(
                self.executor, self._run_isolated, [it.payload for it in batch])
        except Exception as e:  # the executor itself failed (e.g. shut down): fail the batch, keep going
            results = [e] * len(batch)
        finally:
            self._running, self._running_by_payload = [], {}
        s = self.stats
        real, computed = sum(it.length for it in batch), len(batch) * max(it.length for it in batch)
        s.record(len(batch), real, computed)
        seconds = time.monotonic() - started
        self._seconds_per_token = ewma(self._seconds_per_token, seconds / max(computed, 1))
        self._padding = ewma(self._padding, computed / max(real, 1))
        self._observe("on_batch", len(batch), real, computed, seconds, waits)
        for it, result in zip(batch, results, strict=True):
            if isinstance(result, BaseException):
                s.failed += 1
            if it.future.done():  # cancelled while computing
                continue
            if result is STOPPED:  # run_batch stopped it (still_wanted): its deadline passed
                s.expired += 1
                it.future.set_exception(DeadlineExceeded(f"{self.name}: deadline passed while computing"))
                continue
            if isinstance(result, BaseException):
                it.future.set_exception(result)
            else:
                it.future.set_result(result)

    def _observe(self, hook: str, *args: Any) -> None:
        try:
            getattr(self.observer, hook)(*args)
        except Exception:
            log.exception("%s: batch observer hook %s failed", self.name, hook)

    def _run_isolated(self, payloads: list[P]) -> list[R | BaseException]:
        """run_batch, checked against its contract; a raising batch is split in halves and re-run,
        so only the items that fail on their own get an exception. Runs in the inference thread."""
        try:
            results = list(self.run_batch(payloads))
            if len(results) != len(payloads):
                raise RuntimeError(f"{self.name}: run_batch returned {len(results)} results "
                                   f"for {len(payloads)} inputs")
            return results
        except Exception as e:
            if len(payloads) == 1:
                log.warning("%s: an item failed: %r", self.name, e)
                return [e]
            half = len(payloads) // 2
            return self._run_isolated(payloads[:half]) + self._run_isolated(payloads[half:])
