"""Dynamic batching without Ray: padding and masks, token budget, length grouping, routing of results,
isolation of failures, cancellation, deadlines, overload, and multi-input requests."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from models.inputs import PaddedBatch, select_batch
from service.errors import DeadlineExceeded, Overloaded
from service.replica.batcher import STOPPED, DynamicBatcher
from service.replica.config import BatchLimits


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 20))


class Recorder:
    """A run_batch that records each batch (as payload lists) and maps payload -> f(payload)."""

    def __init__(self, fn: Callable[[Any], Any] = lambda p: p * 10, delay_s: float = 0.0) -> None:
        self.fn, self.delay_s = fn, delay_s
        self.batches: list[list[Any]] = []
        self.threads: set[str] = set()

    def __call__(self, payloads: list[Any]) -> list[Any]:
        self.batches.append(list(payloads))
        self.threads.add(threading.current_thread().name)
        if self.delay_s:
            time.sleep(self.delay_s)
        return [self.fn(p) for p in payloads]


def make(recorder: Callable[[list[Any]], Sequence[Any]], **limits: Any) -> DynamicBatcher:
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="test-inference")
    return DynamicBatcher(recorder, BatchLimits(**limits), executor, name="test")


# -- padded batches ------------------------------------------------------------------------------

def test_padded_batch_pads_right_and_masks_padding() -> None:
    seqs = [[5, 6, 7], [8], [9, 10]]
    batch = PaddedBatch.from_token_lists(seqs, pad_id=0)
    assert batch.ids.shape == (3, 3) and batch.ids.dtype == torch.long
    assert batch.keep.shape == (3, 3) and batch.keep.dtype == torch.bool
    assert batch.lengths == (3, 1, 2)
    assert torch.equal(batch.keep.sum(-1), torch.tensor([3, 1, 2]))
    for row, seq in enumerate(seqs):
        assert batch.ids[row, : len(seq)].tolist() == seq
        assert (batch.ids[row, len(seq):] == 0).all()
        assert not batch.keep[row, len(seq):].any()
    assert batch.real_tokens == 6 and batch.computed_tokens == 9
    assert batch.efficiency == pytest.approx(6 / 9)


def test_padded_batch_rejects_empty_rows() -> None:
    with pytest.raises(ValueError, match="at least one token"):
        PaddedBatch.from_token_lists([[1], []], pad_id=0)


# -- batch selection -----------------------------------------------------------------------------

def test_select_batch_takes_oldest_then_closest_lengths() -> None:
    lengths = [10, 50, 11, 9, 48, 30]
    assert select_batch(lengths, max_batch_size=3, max_batch_tokens=10_000) == [0, 2, 3]


def test_select_batch_respects_token_budget_but_always_takes_the_oldest() -> None:
    assert select_batch([100, 5, 5], max_batch_size=8, max_batch_tokens=50) == [0]
    chosen = select_batch([10, 10, 10, 10, 10], max_batch_size=8, max_batch_tokens=30)
    assert chosen == [0, 1, 2]


def test_select_batch_does_not_pad_short_items_to_a_long_oldest_one() -> None:
    assert select_batch([120] + [12] * 7, max_batch_size=8, max_batch_tokens=10_000) == [0]
    assert select_batch([12] * 7 + [120], max_batch_size=8, max_batch_tokens=10_000) == list(range(7))


@pytest.mark.parametrize(("overhead", "expected"), [(0, [0]), (10_000, [0, 1, 2, 3])])
def test_select_batch_overhead_trades_padding_for_fewer_batches(overhead: int, expected: list[int]) -> None:
    # no fixed cost: any padding is waste; a huge fixed cost: pad to the longest, one batch
    assert select_batch([10, 11, 30, 9], 8, 10_000, overhead_tokens=overhead) == expected


@pytest.mark.parametrize("seed", range(5))
def test_select_batch_invariants_on_random_queues(seed: int) -> None:
    rng = random.Random(seed)
    lengths = [rng.choice([rng.randint(1, 12), rng.randint(60, 128)]) for _ in range(60)]
    size, budget = 8, 512
    chosen = select_batch(lengths, size, budget)
    assert chosen[0] == 0 and chosen == sorted(set(chosen))
    assert len(chosen) <= size
    assert len(chosen) == 1 or len(chosen) * max(lengths[i] for i in chosen) <= budget


# -- the batcher ---------------------------------------------------------------------------------

def test_results_go_back_to_their_own_requests_and_batches_form() -> None:
    rec = Recorder()
    batcher = make(rec, max_batch_size=4, max_wait_ms=50)

    async def main() -> list[int]:
        return await asyncio.gather(*(batcher.submit(i, length=3) for i in range(10)))

    assert run(main()) == [i * 10 for i in range(10)]
    assert max(len(b) for b in rec.batches) == 4
    assert len(rec.batches) == 3 and sorted(p for b in rec.batches for p in b) == list(range(10))
    assert batcher.stats.items == 10 and batcher.stats.batches == 3 and batcher.stats.largest_batch == 4
    assert rec.threads == {"test-inference_0"}


def test_token_budget_limits_rows_times_longest() -> None:
    rec = Recorder(fn=lambda p: p[0])
    batcher = make(rec, max_batch_size=16, max_wait_ms=50, max_batch_tokens=40)
    lengths = [10, 10, 10, 10, 10, 20, 20, 5, 5, 5, 5, 5, 5, 5, 5]

    async def main() -> list[int]:
        return await asyncio.gather(*(batcher.submit((i, n), length=n) for i, n in enumerate(lengths)))

    assert run(main()) == list(range(len(lengths)))
    for batch in rec.batches:
        assert len(batch) * max(n for _, n in batch) <= 40


def test_length_grouping_keeps_padding_low_under_skewed_lengths() -> None:
    rng = random.Random(0)
    lengths = [rng.randint(4, 12) if rng.random() < 0.8 else rng.randint(90, 120) for _ in range(96)]
    rec = Recorder(fn=lambda p: p)
    batcher = make(rec, max_batch_size=8, max_wait_ms=200, max_batch_tokens=100_000)

    async def main() -> None:
        await asyncio.gather(*(batcher.submit(n, length=n) for n in lengths))

    run(main())
    fifo = [lengths[i: i + 8] for i in range(0, len(lengths), 8)]
    fifo_eff = sum(lengths) / sum(len(b) * max(b) for b in fifo)
    assert batcher.stats.padding_efficiency >= 0.85
    assert batcher.stats.padding_efficiency > fifo_eff + 0.2
    real = sum(sum(b) for b in rec.batches)
    computed = sum(len(b) * max(b) for b in rec.batches)
    assert batcher.stats.real_tokens == real and batcher.stats.computed_tokens == computed


def test_the_oldest_item_is_never_starved_by_closer_lengths() -> None:
    rec = Recorder(fn=lambda p: p[0], delay_s=0.01)
    batcher = make(rec, max_batch_size=2, max_wait_ms=0)

    async def main() -> None:
        first = asyncio.ensure_future(batcher.submit(("outlier", 100), length=100))
        others = [asyncio.ensure_future(batcher.submit((f"s{i}", 5), length=5)) for i in range(8)]
        await asyncio.gather(first, *others)

    run(main())
    assert ("outlier", 100) in rec.batches[0]


def test_a_more_urgent_request_is_batched_before_earlier_less_urgent_ones() -> None:
    """Priority (lower is sooner, a tenant's): while a batch computes, the queue orders what waits by
    priority, then arrival; the next batch is built around its head, and equal priorities keep
    their arrival order."""
    rec = Recorder(fn=lambda p: p, delay_s=0.05)
    batcher = make(rec, max_batch_size=2, max_wait_ms=0)

    async def main() -> None:
        busy = asyncio.ensure_future(batcher.submit("busy", length=5, priority=5))
        await asyncio.sleep(0.02)  # computing "busy": the rest queue behind it
        late = [asyncio.ensure_future(batcher.submit(f"low{i}", length=5, priority=10)) for i in range(4)]
        await asyncio.sleep(0)
        urgent = [asyncio.ensure_future(batcher.submit(f"high{i}", length=5, priority=-1)) for i in range(2)]
        mid = asyncio.ensure_future(batcher.submit("mid", length=5))
        await asyncio.gather(busy, *late, *urgent, mid)

    run(main())
    assert rec.batches == [["busy"], ["high0", "high1"], ["mid", "low0"], ["low1", "low2"], ["low3"]]


def test_the_wait_estimate_counts_only_the_inputs_a_request_would_stand_behind() -> None:
    rec = Recorder(delay_s=0.1)
    batcher = make(rec, max_batch_size=2, max_wait_ms=0)

    async def main() -> None:
        assert await batcher.submit(1, length=4) == 10  # measures seconds per padded token
        queued = [asyncio.ensure_future(batcher.submit(i, length=4, priority=10)) for i in range(8)]
        await asyncio.sleep(0.01)
        assert batcher.wait_estimate(priority=10) > 0.3
        assert batcher.wait_estimate(priority=0) < batcher.wait_estimate(priority=10) / 3  # only the running batch
        started = time.monotonic()
        assert await batcher.submit(7, length=4, deadline=time.monotonic() + 0.5) == 70  # admitted, and ahead
        assert time.monotonic() - started < 0.35
        await asyncio.gather(*queued)

    run(main())


def test_a_full_batch_does_not_wait_and_a_lone_item_waits_max_wait() -> None:
    async def timed(batcher: DynamicBatcher, n: int) -> float:
        started = time.monotonic()
        await asyncio.gather(*(batcher.submit(i, length=1) for i in range(n)))
        return time.monotonic() - started

    assert run(timed(make(Recorder(), max_batch_size=4, max_wait_ms=5000), 4)) < 1.0
    waited = run(timed(make(Recorder(), max_batch_size=4, max_wait_ms=200), 1))
    assert 0.18 <= waited < 2.0


def test_a_failing_item_fails_alone_and_its_batch_mates_succeed() -> None:
    def fn(p: int) -> int:
        if p == 3:
            raise ValueError("poisoned input")
        return p * 10

    rec = Recorder(fn=fn)
    batcher = make(rec, max_batch_size=8, max_wait_ms=50)

    async def main() -> list[Any]:
        return await asyncio.gather(*(batcher.submit(i, length=2) for i in range(8)), return_exceptions=True)

    results = run(main())
    assert isinstance(results[3], ValueError)
    assert [r for i, r in enumerate(results) if i != 3] == [i * 10 for i in range(8) if i != 3]
    assert len(rec.batches[0]) == 8  # they really shared a batch before the split
    assert batcher.stats.failed == 1


def test_an_exception_returned_as_a_result_fails_only_that_item() -> None:
    batcher = make(Recorder(fn=lambda p: KeyError(p) if p == 1 else p), max_batch_size=4, max_wait_ms=50)

    async def main() -> list[Any]:
        return await asyncio.gather(*(batcher.submit(i, length=1) for i in range(4)), return_exceptions=True)

    results = run(main())
    assert isinstance(results[1], KeyError) and [results[0], results[2], results[3]] == [0, 2, 3]


def test_run_batch_breaking_its_contract_fails_items_with_a_clear_error() -> None:
    batcher = make(lambda payloads: payloads[:-1], max_batch_size=4, max_wait_ms=10)

    async def main() -> list[Any]:
        return await asyncio.gather(*(batcher.submit(i, length=1) for i in range(3)), return_exceptions=True)

    results = run(main())
    assert all(isinstance(r, RuntimeError) and "returned 0 results for 1 inputs" in str(r) for r in results)


def test_cancelled_items_are_dropped_before_compute_and_never_wedge_the_loop() -> None:
    rec = Recorder()
    batcher = make(rec, max_batch_size=8, max_wait_ms=200)

    async def main() -> int:
        gone = asyncio.ensure_future(batcher.submit(1, length=1))
        await asyncio.sleep(0.02)
        gone.cancel()  # the client went away while its item waited
        result = await batcher.submit(2, length=1)
        assert batcher.alive
        return result

    assert run(main()) == 20
    assert [p for b in rec.batches for p in b] == [2]
    assert batcher.stats.cancelled == 1


def test_cancelling_during_compute_leaves_the_batcher_serving() -> None:
    rec = Recorder(delay_s=0.2)
    batcher = make(rec, max_batch_size=8, max_wait_ms=0)

    async def main() -> int:
        running = asyncio.ensure_future(batcher.submit(1, length=1))
        await asyncio.sleep(0.05)
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running
        result = await batcher.submit(2, length=1)
        assert batcher.alive
        return result

    assert run(main()) == 20


def test_expired_items_fail_with_deadline_exceeded_without_compute() -> None:
    rec = Recorder()
    batcher = make(rec, max_batch_size=8, max_wait_ms=100)

    async def main() -> list[Any]:
        late = batcher.submit(1, length=1, deadline=time.monotonic() + 0.01)
        fine = batcher.submit(2, length=1, deadline=time.monotonic() + 10)
        return await asyncio.gather(late, fine, return_exceptions=True)

    late, fine = run(main())
    assert isinstance(late, DeadlineExceeded) and fine == 20
    assert [p for b in rec.batches for p in b] == [2]
    assert batcher.stats.expired == 1


def test_a_full_queue_refuses_at_once_and_recovers() -> None:
    rec = Recorder(delay_s=0.05)
    batcher = make(rec, max_batch_size=2, max_wait_ms=200, max_queued=4)

    async def main() -> tuple[list[int], float, list[int]]:
        queued = asyncio.ensure_future(batcher.submit_many([1, 2, 3], [1, 1, 1]))
        await asyncio.sleep(0)
        started = time.monotonic()
        with pytest.raises(Overloaded, match="limit 4"):
            await batcher.submit_many([4, 5], [1, 1])
        refused_after = time.monotonic() - started
        first = await queued
        return first, refused_after, await batcher.submit_many([6, 7], [1, 1])

    first, refused_after, later = run(main())
    assert first == [10, 20, 30] and later == [60, 70]
    assert refused_after < 0.05
    assert batcher.stats.rejected == 2


def test_a_multi_input_request_is_split_across_batches_and_reassembled_in_order() -> None:
    rec = Recorder()
    batcher = make(rec, max_batch_size=3, max_wait_ms=50)
    lengths = [1, 9, 2, 8, 3, 7, 4, 6, 5, 5]

    async def main() -> tuple[list[int], list[int]]:
        many = batcher.submit_many(list(range(10)), lengths)
        other = batcher.submit_many([100, 101], [5, 5])
        return await asyncio.gather(many, other)

    many, other = run(main())
    assert many == [i * 10 for i in range(10)] and other == [1000, 1010]
    assert len(rec.batches) >= 4 and all(len(b) <= 3 for b in rec.batches)


def test_a_failing_item_fails_its_whole_request_with_the_first_failing_index() -> None:
    def fn(p: int) -> int:
        if p in (2, 4):
            raise ValueError(f"bad {p}")
        return p

    batcher = make(Recorder(fn=fn), max_batch_size=8, max_wait_ms=50)

    async def main() -> tuple[Any, list[int]]:
        bad = batcher.submit_many([1, 2, 3, 4], [1, 1, 1, 1])
        good = batcher.submit_many([5, 6], [1, 1])
        return await asyncio.gather(bad, good, return_exceptions=True)

    bad, good = run(main())
    assert isinstance(bad, ValueError) and str(bad) == "bad 2"
    assert good == [5, 6]


def test_limits_are_validated() -> None:
    with pytest.raises(ValueError, match="max_batch_size"):
        BatchLimits(max_batch_size=0)
    with pytest.raises(ValueError, match="max_wait_ms"):
        BatchLimits(max_wait_ms=-1)
    with pytest.raises(ValueError, match="overhead_tokens"):
        BatchLimits(overhead_tokens=-1)


# -- admission that knows the deadline --------------------------------------------------------------

class Admissions:
    """A BatchObserver recording on_admission calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[float | None, str | None]] = []

    def on_admission(self, wait_s: float | None, refused: str | None) -> None:
        self.calls.append((wait_s, refused))

    def __getattr__(self, name: str) -> Any:  # the other hooks: nothing
        return lambda *args: None


def test_a_request_that_cannot_start_before_its_deadline_is_refused_at_once() -> None:
    """Queued work x measured seconds per padded token: a request whose wait would outlast its deadline
    is a 503 at submit, not a 504 later; one with time enough (or no deadline) is queued and served."""
    admissions = Admissions()
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="test-inference")
    batcher = DynamicBatcher(Recorder(delay_s=0.1), BatchLimits(max_batch_size=2, max_wait_ms=0, max_queued=64),
                             executor, name="test", observer=admissions)  # type: ignore[arg-type]

    async def main() -> None:
        assert await batcher.submit(1, length=4) == 10  # measures ~0.1 s per batch of 4 padded tokens
        queued = [asyncio.ensure_future(batcher.submit(i, length=4)) for i in range(8)]  # ~4 batches of work
        await asyncio.sleep(0.01)
        assert batcher.wait_estimate() > 0.3
        started = time.monotonic()
        with pytest.raises(Overloaded, match="deadline"):
            await batcher.submit(99, length=4, deadline=time.monotonic() + 0.1)
        assert time.monotonic() - started < 0.05  # refused at once
        assert await batcher.submit(7, length=4, deadline=time.monotonic() + 10) == 70
        assert await asyncio.gather(*queued) == [i * 10 for i in range(8)]

    run(main())
    refused = [c for c in admissions.calls if c[1] is not None]
    assert refused == [(pytest.approx(refused[0][0]), "deadline")] and refused[0][0] > 0.1
    assert admissions.calls[0] == (0.0, None)  # nothing measured yet: never refused
    assert batcher.stats.rejected == 0 and batcher.stats.items == 10


def test_run_batch_can_stop_an_input_whose_deadline_passed_mid_computation() -> None:
    """still_wanted() during a computation: False once an input's deadline passed (or its caller went
    away); run_batch returns STOPPED for it, and its caller gets DeadlineExceeded, the others results."""
    batcher: DynamicBatcher | None = None
    seen: list[bool] = []

    def run_batch(payloads: list[Any]) -> list[Any]:
        assert batcher is not None
        time.sleep(0.2)  # one long step
        wanted = [batcher.still_wanted(p) for p in payloads]
        seen.extend(wanted)
        return [p * 10 if w else STOPPED for p, w in zip(payloads, wanted, strict=True)]

    batcher = make(run_batch, max_batch_size=4, max_wait_ms=20)

    async def main() -> list[Any]:
        return await asyncio.gather(batcher.submit(1, 1, deadline=time.monotonic() + 0.1),  # passes mid-batch
                                    batcher.submit(2, 1, deadline=time.monotonic() + 10), batcher.submit(3, 1),
                                    return_exceptions=True)

    first, second, third = run(main())
    assert isinstance(first, DeadlineExceeded) and (second, third) == (20, 30)
    assert seen == [False, True, True] and batcher.stats.expired == 1


def test_a_batch_holds_at_most_max_batch_work() -> None:
    """Translations count beam_size x max_new_tokens each: a batch takes inputs, oldest first, while
    their work fits max_batch_work (one over it runs alone), however many rows and tokens are left."""
    rec = Recorder()
    batcher = make(rec, max_batch_size=16, max_wait_ms=50, max_batch_work=1000)

    async def main() -> list[Any]:
        shares = [400, 400, 400, 2000, 100, 100]
        return await asyncio.gather(*(batcher.submit_many([i], [3], None, [w]) for i, w in enumerate(shares)))

    assert run(main()) == [[i * 10] for i in range(6)]
    assert rec.batches[0] == [0, 1, 4, 5]  # 1000: a third 400 would be 1200, the two 100s still fit
    assert [3] in rec.batches  # over the budget alone: runs alone
    assert all(sum([400, 400, 400, 2000, 100, 100][i] for i in b) <= 1000 or len(b) == 1 for b in rec.batches)
    with pytest.raises(ValueError, match="max_batch_work"):
        BatchLimits(max_batch_work=0)
