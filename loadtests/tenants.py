"""Two tenants on one running service: what a flood by one costs the other.

    python -m loadtests.tenants --url http://127.0.0.1:8000 --calm-key K1 --flood-key K2
                                [--flood 32] [--requests 20] [--max-tokens 32]
                                [--calm-priority P --flood-priority P] [--model NAME]

The service runs with both keys as tenants (docs/reliability.md, "Tenants and quotas"), e.g. the
flooding one at a larger priority value: `TS_TENANTS='{"calm": {"keys": ["K1"]}, "flood": {"keys":
["K2"], "priority": 10}}' make serve`. First the calm tenant alone sends `--requests` streaming chat
completions one after another (its time to first token: the first content chunk); then `--flood`
clients of the other tenant stream completions in a closed loop while the calm tenant sends the same
requests again. Prints the calm tenant's TTFT p50 / p95 alone and under the flood, their ratio, and
the flood's output tok/s and statuses. Only for a service on this machine (127.0.0.1).

A server without tenants (vLLM's with `--scheduling-policy priority`) is measured the same way with
the requests' own `priority` field (`--calm-priority 0 --flood-priority 10`, no keys) and its model's
name (`--model`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

QUESTIONS = ["What is the capital of France?", "Name three primary colours.", "What is 12 times 7?",
             "Give me a synonym for happy.", "Which planet is closest to the sun?"]


@dataclass(frozen=True)
class Tenant:
    """How one tenant's requests are told apart: its API key and/or their `priority` field; the model."""

    key: str | None = None
    priority: int | None = None
    model: str | None = None

    def headers(self) -> dict[str, str]:
        return {} if self.key is None else {"Authorization": f"Bearer {self.key}"}

    def body(self, **fields: Any) -> dict[str, Any]:
        extra = {"priority": self.priority} if self.priority is not None else {}
        return fields | extra | ({"model": self.model} if self.model is not None else {})


async def ttft(client: httpx.AsyncClient, tenant: Tenant, question: str, max_tokens: int) -> float | None:
    """Seconds from sending a streaming chat completion to its first content chunk (None: refused)."""
    body = tenant.body(messages=[{"role": "user", "content": question}], max_tokens=max_tokens, stream=True,
                       temperature=0)
    began = time.perf_counter()
    async with client.stream("POST", "/v1/chat/completions", json=body, headers=tenant.headers()) as r:
        if r.status_code != 200:
            return None
        first = None
        async for line in r.aiter_lines():
            if first is None and line.startswith("data: {"):
                delta = json.loads(line[6:])["choices"][0]["delta"]
                if delta.get("content"):
                    first = time.perf_counter() - began
    return first


async def calm(url: str, tenant: Tenant, n: int, max_tokens: int) -> list[float]:
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        out = []
        for i in range(n):
            t = await ttft(client, tenant, QUESTIONS[i % len(QUESTIONS)], max_tokens)
            if t is not None:
                out.append(t)
        return out


async def flood(url: str, tenant: Tenant, clients: int, stop: asyncio.Event,
                max_tokens: int) -> tuple[int, Counter[int]]:
    """`clients` streaming completions in a closed loop until `stop`: (chunks received, statuses)."""
    chunks, statuses = [0], Counter()

    async def one(c: int) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=300) as client:
            i = c
            while not stop.is_set():
                body = tenant.body(prompt=f"Story {i}: once upon a time", max_tokens=max_tokens, stream=True,
                                   temperature=0.8, seed=i)
                async with client.stream("POST", "/v1/completions", json=body, headers=tenant.headers()) as r:
                    statuses[r.status_code] += 1
                    if r.status_code != 200:
                        await asyncio.sleep(0.5)
                        continue
                    async for line in r.aiter_lines():
                        chunks[0] += line.startswith("data: {")
                i += clients

    tasks = [asyncio.create_task(one(c)) for c in range(clients)]
    await stop.wait()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return chunks[0], statuses


def p95(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]


async def run(args: argparse.Namespace) -> dict[str, Any]:
    calm_tenant = Tenant(args.calm_key, args.calm_priority, args.model)
    flood_tenant = Tenant(args.flood_key, args.flood_priority, args.model)
    await calm(args.url, calm_tenant, 2, args.max_tokens)  # warm-up
    alone = await calm(args.url, calm_tenant, args.requests, args.max_tokens)
    stop = asyncio.Event()
    flooding = asyncio.create_task(flood(args.url, flood_tenant, args.flood, stop, args.max_tokens))
    await asyncio.sleep(args.ramp_s)
    began = time.perf_counter()
    under = await calm(args.url, calm_tenant, args.requests, args.max_tokens)
    took = time.perf_counter() - began
    stop.set()
    chunks, statuses = await flooding
    return {"alone": alone, "under": under, "flood_chunks_per_s": chunks / (took + args.ramp_s),
            "flood_statuses": dict(statuses)}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.tenants", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--calm-key", help="the calm tenant's API key")
    p.add_argument("--flood-key", help="the flooding tenant's API key")
    p.add_argument("--calm-priority", type=int, help="the calm tenant's requests' `priority` field")
    p.add_argument("--flood-priority", type=int, help="the flooding tenant's requests' `priority` field")
    p.add_argument("--model", help="the `model` field of every request (a peer server's model name)")
    p.add_argument("--flood", type=int, default=32, help="the flooding tenant's concurrent streams")
    p.add_argument("--requests", type=int, default=20, help="the calm tenant's requests in each phase")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--ramp-s", type=float, default=5.0, help="seconds of flood before the calm tenant measures")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if not args.url.startswith(("http://127.", "http://localhost")):
        p.error("the load goes to a service on this machine only (127.0.0.1 / localhost)")
    if (args.calm_key is None and args.calm_priority is None) or (args.flood_key is None and args.flood_priority is None):
        p.error("each tenant needs a key (--calm-key, --flood-key) or a priority (--calm-priority, --flood-priority)")
    out = asyncio.run(run(args))
    alone, under = out["alone"], out["under"]
    row = {"alone_p50_s": round(statistics.median(alone), 3), "alone_p95_s": round(p95(alone), 3),
           "flood_p50_s": round(statistics.median(under), 3), "flood_p95_s": round(p95(under), 3),
           "p95_ratio": round(p95(under) / p95(alone), 2), "flood_chunks_per_s": round(out["flood_chunks_per_s"], 1),
           "flood_statuses": out["flood_statuses"]}
    if args.json:
        print(json.dumps(row))
        return 0
    print(f"calm tenant's TTFT over {args.requests} requests, alone and beside {args.flood} flooding streams")
    print("| alone p50 / p95 s | under flood p50 / p95 s | p95 ratio | flood chunks/s | flood statuses |")
    print("|---:|---:|---:|---:|---|")
    print(f"| {row['alone_p50_s']} / {row['alone_p95_s']} | {row['flood_p50_s']} / {row['flood_p95_s']} | "
          f"{row['p95_ratio']}x | {row['flood_chunks_per_s']} | {row['flood_statuses']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
