"""A burst at once against a running service: `python -m loadtests.burst --url http://127.0.0.1:8000`.

Sends `--n` requests to one route at the same moment (each on its own connection), or one after
another with `--sequential`, waits for every answer, and prints one row per status: how many, and their
latency p50 / p95 / max; then whether /readyz answers 200 right after. `--key` sends an API key (a
tenant's: its 429s over quota are timed as any other answer). What docs/reliability.md's overload figures on the shipped models
come from (e.g. 300 x generate, 48 new tokens, sampled; 10x capacity for classify and translate).
Only for a service on this machine (127.0.0.1): the loop is bounded by `--n` and the deadline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

BODIES: dict[str, tuple[str, dict[str, Any]]] = {
    "generate": ("/v1/generate", {"prompt": "Write a short story about a robot.", "max_new_tokens": 48,
                                  "temperature": 0.8, "seed": 1, "ignore_eos": True}),
    "classify": ("/v1/classify", {"inputs": "I absolutely loved this film, the actors were wonderful."}),
    "translate": ("/v1/translate", {"inputs": "Where is the train station, please?", "source_lang": "en",
                                    "target_lang": "es"}),
    "embed": ("/v1/embeddings", {"input": "A sentence to embed."}),
}


@dataclass(frozen=True)
class Answer:
    status: int  # 0: no answer (client timeout or connection error)
    seconds: float
    error: str | None = None
    retry_after: str | None = None


def raw_request(host: str, path: str, body: dict[str, Any], key: str | None = None) -> bytes:
    data = json.dumps(body).encode()
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    return (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n{auth}"
            f"Content-Length: {len(data)}\r\n\r\n").encode() + data


async def one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes,
              start: asyncio.Event, timeout_s: float) -> Answer:
    """One request on an open connection, timed from its first byte sent to its last byte read. A
    bare HTTP/1.1 client: with 300 at once on 2 cores, httpx's own CPU per request was most of
    what it measured (a plain uvicorn answered /healthz to it in p50 0.95 s)."""
    await start.wait()
    began = time.monotonic()
    try:
        writer.write(request)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout_s)
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:] if ":" in ln)}
        payload = await reader.readexactly(int(headers.get("content-length", "0")))
    except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError, ValueError) as e:
        return Answer(0, time.monotonic() - began, type(e).__name__)
    finally:
        writer.close()
    seconds = time.monotonic() - began
    error = None
    if status != 200:
        try:
            error = json.loads(payload)["error"]["type"]
        except (ValueError, KeyError, TypeError):
            error = "not json"
    return Answer(status, seconds, error, headers.get("retry-after"))


async def burst(url: str, task: str, n: int, timeout_s: float, key: str | None = None,
                sequential: bool = False) -> tuple[list[Answer], int, float]:
    """n requests at once (or one after another), each on a connection opened beforehand; their
    answers, /readyz's status right after, and the whole burst's seconds."""
    path, body = BODIES[task]
    host, port = url.removeprefix("http://").rstrip("/").rsplit(":", 1)
    request = raw_request(host, path, body, key)
    conns = [await asyncio.open_connection(host, int(port)) for _ in range(n)]
    start = asyncio.Event()
    began = time.monotonic()
    if sequential:
        start.set()
        answers = [await one(r, w, request, start, timeout_s) for r, w in conns]
    else:
        tasks = [asyncio.create_task(one(r, w, request, start, timeout_s)) for r, w in conns]
        await asyncio.sleep(0.1)
        began = time.monotonic()
        start.set()
        answers = await asyncio.gather(*tasks)
    took = time.monotonic() - began
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s) as client:
        ready = (await client.get("/readyz")).status_code
    return list(answers), ready, took


def summary(answers: Sequence[Answer]) -> list[dict[str, Any]]:
    rows = []
    for status in sorted({a.status for a in answers}):
        secs = sorted(a.seconds for a in answers if a.status == status)
        errors = sorted({a.error for a in answers if a.status == status and a.error})
        rows.append({"status": status, "n": len(secs), "p50_s": round(statistics.median(secs), 3),
                     "p95_s": round(secs[min(len(secs) - 1, int(0.95 * len(secs)))], 3),
                     "max_s": round(secs[-1], 3), "errors": errors,
                     "retry_after": sorted({a.retry_after for a in answers if a.status == status and a.retry_after})})
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.burst", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--task", choices=sorted(BODIES), default="generate")
    p.add_argument("--n", type=int, default=300)
    p.add_argument("--timeout", type=float, default=60.0, help="client timeout per request (s)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--key", help="an API key to send (a tenant's)")
    p.add_argument("--sequential", action="store_true", help="one request after another instead of at once")
    args = p.parse_args(argv)
    if not args.url.startswith(("http://127.", "http://localhost")):
        p.error("bursts go to a service on this machine only (127.0.0.1 / localhost)")
    answers, ready, took = asyncio.run(burst(args.url, args.task, args.n, args.timeout, args.key, args.sequential))
    rows = summary(answers)
    if args.json:
        print(json.dumps({"task": args.task, "n": args.n, "seconds": round(took, 2), "readyz_after": ready,
                          "statuses": rows}))
        return 0
    how = "one after another" if args.sequential else "at once"
    print(f"{args.n} x {args.task} {how}: done in {took:.1f} s; /readyz right after: {ready}")
    print(f"{'status':>6} {'n':>5} {'p50 s':>7} {'p95 s':>7} {'max s':>7}  errors / Retry-After")
    for r in rows:
        print(f"{r['status']:>6} {r['n']:>5} {r['p50_s']:>7} {r['p95_s']:>7} {r['max_s']:>7}  "
              f"{','.join(r['errors'])} {','.join(r['retry_after'])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
