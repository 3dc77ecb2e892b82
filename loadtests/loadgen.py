"""asyncio + httpx load generation: closed loop (N clients, each sends its next request when the
previous one returns) and open loop (Poisson arrivals, latency counted from the scheduled time).

A run has three phases on one clock: warm-up (requests sent, not measured), the measurement
window, and a drain after it (no new requests; in-flight ones may finish, up to drain_s, then are
cancelled and counted as unfinished). Every request becomes a `Sample`; summary.py decides which
samples each statistic uses.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from .protocol import DONE, RequestSpec, completion_text, completion_tokens, parse_stream_line

log = logging.getLogger(__name__)


@dataclass
class Sample:
    """One request. Times are seconds on the run's clock (0 = the run's start)."""

    start: float  # sent (open loop: scheduled)
    end: float
    ok: bool
    status: int | None = None
    error: str | None = None
    ttft: float | None = None  # streamed generation: seconds from start to the first text
    tokens: int | None = None  # generation: output tokens
    piece_times: tuple[float, ...] = ()  # streamed generation: when each piece of text arrived


@dataclass(frozen=True)
class Timing:
    warmup_s: float
    duration_s: float
    drain_s: float

    @property
    def window(self) -> tuple[float, float]:
        return self.warmup_s, self.warmup_s + self.duration_s


@dataclass
class RunOutcome:
    samples: list[Sample]
    window: tuple[float, float]
    unfinished: int  # in flight when the drain ended (cancelled)
    wall_s: float


async def send(
    client: httpx.AsyncClient, spec: RequestSpec, t0: float, scheduled: float | None = None,
    pieces: list[float] | None = None,
) -> Sample:
    """Send one request; never raises for HTTP or connection errors (they become a failed Sample).
    `pieces`: a streamed answer's piece arrival times are appended there as they come (a caller that
    cancels the request keeps what arrived)."""
    start = time.perf_counter() - t0 if scheduled is None else scheduled
    try:
        if spec.stream:
            return await _streamed(client, spec, t0, start, [] if pieces is None else pieces)
        r = await client.post(spec.path, json=spec.body)
        end = time.perf_counter() - t0
        if r.status_code != 200:
            return Sample(start, end, False, r.status_code, r.text[:300])
        tokens = None
        if spec.asked_tokens is not None:
            tokens = completion_tokens(r.json()) or (spec.asked_tokens if spec.exact_length else None)
        return Sample(start, end, True, 200, tokens=tokens)
    except (httpx.HTTPError, ValueError) as e:  # ValueError: a 200 whose body is not JSON
        return Sample(start, time.perf_counter() - t0, False, None, f"{type(e).__name__}: {e}"[:300])


async def _streamed(client: httpx.AsyncClient, spec: RequestSpec, t0: float, start: float,
                    times: list[float]) -> Sample:
    ttft, usage = None, None
    async with client.stream("POST", spec.path, json=spec.body) as r:
        if r.status_code != 200:
            body = (await r.aread()).decode(errors="replace")
            return Sample(start, time.perf_counter() - t0, False, r.status_code, body[:300])
        async for line in r.aiter_lines():
            event = parse_stream_line(line)
            if event is DONE:
                break
            if not isinstance(event, dict):
                continue
            if "error" in event:
                return Sample(
                    start, time.perf_counter() - t0, False, 200, f"stream error: {event['error']}"[:300]
                )
            usage = completion_tokens(event) or usage
            if completion_text(event):
                times.append(time.perf_counter() - t0)
                if ttft is None:
                    ttft = times[0] - start
    end = time.perf_counter() - t0
    tokens = usage or (spec.asked_tokens if spec.exact_length else len(times))
    return Sample(start, end, True, 200, ttft=ttft, tokens=tokens, piece_times=tuple(times))


class _Progress:
    """Logs a line every `every_s` while a run goes on."""

    def __init__(self, label: str, timing: Timing, samples: list[Sample], every_s: float) -> None:
        self.label, self.timing, self.samples, self.every_s = label, timing, samples, every_s
        self.in_flight = 0

    async def run(self, t0: float) -> None:
        total = self.timing.warmup_s + self.timing.duration_s
        while True:
            await asyncio.sleep(self.every_s)
            now = time.perf_counter() - t0
            failed = sum(1 for s in self.samples if not s.ok)
            phase = (
                f"{min(now, total):.0f}/{total:.0f} s" if now <= total else f"draining {now - total:.0f} s"
            )
            log.info(
                "  %s: %s, %d done (%d failed), %d in flight",
                self.label,
                phase,
                len(self.samples),
                failed,
                self.in_flight,
            )


async def _finish(tasks: Sequence[asyncio.Task[None]], deadline: float, progress: asyncio.Task[None]) -> int:
    pending: set[asyncio.Task[None]] = set(tasks)
    timeout = max(0.0, deadline - time.perf_counter())
    if pending:
        _, pending = await asyncio.wait(pending, timeout=timeout)
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    progress.cancel()
    await asyncio.gather(progress, return_exceptions=True)
    return len(pending)


async def closed_loop(
    client: httpx.AsyncClient,
    specs: Sequence[RequestSpec],
    concurrency: int,
    timing: Timing,
    label: str,
    progress_s: float = 5.0,
) -> RunOutcome:
    """`concurrency` clients cycling through `specs` (client k starts at spec k) until the window ends."""
    samples: list[Sample] = []
    progress = _Progress(label, timing, samples, progress_s)
    t0 = time.perf_counter()
    stop_at = timing.window[1]
    counter = itertools.count()

    async def client_loop() -> None:
        while time.perf_counter() - t0 < stop_at:
            spec = specs[next(counter) % len(specs)]
            progress.in_flight += 1
            try:
                samples.append(await send(client, spec, t0))
            finally:
                progress.in_flight -= 1

    reporter = asyncio.create_task(progress.run(t0))
    tasks = [asyncio.create_task(client_loop()) for _ in range(concurrency)]
    unfinished = await _finish(tasks, t0 + stop_at + timing.drain_s, reporter)
    return RunOutcome(samples, timing.window, unfinished, time.perf_counter() - t0)


async def open_loop(
    client: httpx.AsyncClient,
    specs: Sequence[RequestSpec],
    arrivals: Sequence[float],
    timing: Timing,
    label: str,
    progress_s: float = 5.0,
) -> RunOutcome:
    """Request i is sent at arrivals[i] (seconds from the start; they should end before the window
    does), whatever is still in flight; its latency counts from that scheduled time."""
    samples: list[Sample] = []
    progress = _Progress(label, timing, samples, progress_s)
    t0 = time.perf_counter()

    async def one(i: int, at: float) -> None:
        await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
        progress.in_flight += 1
        try:
            samples.append(await send(client, specs[i % len(specs)], t0, scheduled=at))
        finally:
            progress.in_flight -= 1

    reporter = asyncio.create_task(progress.run(t0))
    tasks = [asyncio.create_task(one(i, at)) for i, at in enumerate(arrivals)]
    unfinished = await _finish(tasks, t0 + timing.window[1] + timing.drain_s, reporter)
    return RunOutcome(samples, timing.window, unfinished, time.perf_counter() - t0)


def http_client(base_url: str, connections: int, timeout_s: float) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=base_url,
        timeout=httpx.Timeout(timeout_s, connect=10.0),
        limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections),
    )
