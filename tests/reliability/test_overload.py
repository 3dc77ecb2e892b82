"""A burst of 10x the measured capacity on a small generator (1 row, 4 queue slots): every request
is answered 200 or 503 + Retry-After (every refusal within a second), none past its deadline; afterwards the
latency is back to normal and the replicas' memory has not grown.

The model, not the HTTP stack, must be the bottleneck: on 2 cores the stack (this client, Serve's proxy, the
ingress, the replica) refuses 60-220 requests a second at most, depending on the machine, and a burst above
that measures the proxy's queue, not admission. The test measures that rate (64 clients on the saturated
model) and requires 10x capacity to stay below 80 % of it. Hence the burst deployment runs tiny:decoder-wide
(~0.7 ms a step): 500-token requests on one row give ~3 req/s, bursts of ~30/s (tiny:decoder gave 6-8 req/s,
and a CI machine whose stack refused only 58/s failed the precondition)."""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from dataclasses import dataclass

import httpx
import pytest

from service.testing.replicas import rss_mib, serve_replicas
from tests.reliability.conftest import APP, RETRY_AFTER, Live, engine_idle, run

pytestmark = pytest.mark.e2e
log = logging.getLogger(__name__)
BODY = {"prompt": "overload", "max_new_tokens": 500, "ignore_eos": True, "model": "tiny-decoder-burst"}
CLIENTS = 4  # the capacity run: enough to keep the row and the queue busy
# each request's own deadline (X-Request-Timeout). In the capacity run a request can wait for the row
# and then run its 500 steps; admission refuses what it estimates past the deadline, so the deadline
# leaves room for step-time jitter on slower CPUs.
DEADLINE_S = 8.0
BURST_S = 3.0


@dataclass
class Result:
    status: int
    seconds: float
    retry_after: str | None = None
    error: str | None = None


async def one(client: httpx.AsyncClient) -> Result:
    started = time.monotonic()
    try:
        r = await client.post("/v1/generate", json=BODY, headers={"X-Request-Timeout": str(DEADLINE_S)})
    except httpx.TimeoutException:
        return Result(0, time.monotonic() - started)
    error = None if r.status_code == 200 else r.json()["error"]["type"]
    return Result(r.status_code, time.monotonic() - started, r.headers.get("Retry-After"), error)


async def closed_loop(client: httpx.AsyncClient, seconds: float, clients: int = CLIENTS) -> list[Result]:
    results: list[Result] = []
    end = time.monotonic() + seconds

    async def user() -> None:
        while time.monotonic() < end:
            results.append(await one(client))

    await asyncio.gather(*(user() for _ in range(clients)))
    return results


async def burst(client: httpx.AsyncClient, rate: float, seconds: float) -> list[Result]:
    """Open loop: `rate` requests per second for `seconds`, each on its own, whatever the answers."""
    tasks = []
    start = time.monotonic()
    for i in range(int(rate * seconds)):
        await asyncio.sleep(max(0.0, start + i / rate - time.monotonic()))
        tasks.append(asyncio.create_task(one(client)))
    return await asyncio.gather(*tasks)


def p(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] if len(values) > 1 else values[0]


def test_a_burst_of_ten_times_capacity(live: Live) -> None:
    replicas = {key[1]: ps for key, ps in serve_replicas().items() if key[0] == APP}
    procs = [p for ps in replicas.values() for p in ps]
    rss: list[dict[str, float]] = []
    refusals: list[float] = []

    def measure() -> None:
        rss.append({k: rss_mib(v) for k, v in replicas.items()})

    async def main() -> tuple[list[Result], list[Result], list[Result], float]:
        async with live.async_client(connections=512) as client:
            await closed_loop(client, 1.0)  # warm
            before = await closed_loop(client, 3.0)
            capacity = sum(r.status == 200 for r in before) / 3.0
            for _ in range(3):  # the model saturated: how fast the stack can refuse (a busy moment of the
                # machine's can halve one window's figure: the best of up to three windows)
                stack = await closed_loop(client, 2.0, clients=64)
                await asyncio.to_thread(live.wait_stats, "burst", engine_idle)
                refusals.append(sum(r.status == 503 for r in stack) / 2.0)
                if 10 * capacity <= 0.8 * max(refusals):
                    break
            assert 10 * capacity <= 0.8 * max(refusals), (
                f"the tiny decoder serves {capacity:.1f} req/s and the stack refuses {refusals}/s: a burst "
                "of 10x would measure the HTTP stack, not admission; make the burst deployment's requests costlier")
            during: list[Result] = []
            for _ in range(2):  # the second burst shows whether memory keeps growing
                await asyncio.to_thread(measure)
                during += await burst(client, 10 * capacity, BURST_S)
                await asyncio.to_thread(live.wait_stats, "burst", engine_idle)
            await asyncio.to_thread(measure)
            after = await closed_loop(client, 3.0)
            return before, during, after, capacity

    before, during, after, capacity = run(main())
    refused = sorted(r.seconds for r in during if r.status == 503)
    served = sorted(r.seconds for r in during if r.status == 200)
    log.info("capacity %.1f req/s (p50 %.3f s), the stack refuses %.0f/s; 2 bursts of %d at %.1f/s for %g s: %d ok (p50 %.2f, max %.2f s), "
             "%d refused (p50 %.3f, p95 %.3f, max %.3f s), other %s; after: p50 %.3f s; RSS MiB per deployment "
             "before and after each burst %s", capacity, statistics.median(r.seconds for r in before), max(refusals),
             len(during) // 2, 10 * capacity, BURST_S, len(served), p(served, 50) if served else 0,
             max(served, default=0), len(refused), p(refused, 50) if refused else 0, p(refused, 95) if refused else 0,
             max(refused, default=0), sorted({r.status for r in during} - {200, 503}),
             statistics.median(r.seconds for r in after), [{k: round(v) for k, v in m.items()} for m in rss])
    assert {r.status for r in before} == {200} and capacity > 0.5
    assert {r.status for r in during} == {200, 503}  # both: it was overloaded, and it kept serving
    for r in during:
        assert r.seconds < DEADLINE_S + 1, r  # none past its deadline (0: the client gave up)
        if r.status == 503:
            assert r.error == "overloaded_error" and r.retry_after == RETRY_AFTER, r
    assert max(refused) < 1.0, f"503s p50 {p(refused, 50):.3f} s, max {max(refused):.3f} s"  # every one, at once
    assert {r.status for r in after} == {200}
    p50_before = statistics.median(r.seconds for r in before)
    p50_after = statistics.median(r.seconds for r in after)
    assert p50_after < 1.5 * p50_before + 0.05, (p50_before, p50_after)
    total = [sum(m.values()) for m in rss]
    assert total[2] < 1.05 * total[1] + 16, total  # the second burst: no further growth
    assert len(procs) == len(rss[0])
