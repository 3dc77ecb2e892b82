"""Soak: steady mixed load for minutes; errors and the resident memory of every replica process.

    python -m loadtests.soak --minutes 10                   # starts the service: deploy/serve_config.yaml
    python -m loadtests.soak --minutes 10 --tiny            # the same shape with tiny models
    python -m loadtests.soak --minutes 10 --url http://127.0.0.1:8000 --root-pid <pid of python -m service>

Started here, the service runs on a local Ray in this process with one replica per deployment
(autoscaling off, so the processes measured stay the same). `--clients` closed-loop clients each
send the next request when the previous one ends, after `--think-s` seconds: classify (1-4 texts),
embeddings (1-8), translate (one sentence), generate (16-32 tokens), chat streamed, completions,
by turns of a seeded draw. Any answer but a 200 (or a stream that does not end in [DONE] / its
finish event) is an error. Every `--sample-s` seconds the RSS of each replica process (descendants
of this process, or of --root-pid) is sampled; growth is reported from the first sample after
`--warmup-s` to the last one, and from the very first sample. Writes a JSON summary to --out.
Exit status 1 on any error or growth >= --max-growth (10 %).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import httpx

from loadtests.workload import load_sentences
from service.testing.cluster import deploy, local_cluster, wait_for
from service.testing.replicas import replica_rss_mib

log = logging.getLogger("loadtests.soak")
ROOT = Path(__file__).resolve().parent.parent
TINY_ARGS: dict[str, Any] = {
    "device": "cpu",
    "deployments": {
        "encoder": {"model": {"name": "tiny-encoder", "tasks": ["classify", "embed"], "source": "tiny:encoder"},
                    "num_cpus": 0},
        "translator": {"model": {"name": "tiny-en-es", "tasks": ["translate"], "source": "tiny:seq2seq",
                                 "languages": ["en", "es"], "defaults": {"beam_size": 2, "max_new_tokens": 16}},
                       "num_cpus": 0},
        "generator": {"model": {"name": "tiny-decoder", "tasks": ["generate"], "source": "tiny:decoder"},
                      "num_cpus": 0},
    },
}


# -- the requests ------------------------------------------------------------------------------------

class Mix:
    """Seeded draws of request bodies from held-out sentences."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.sentences = load_sentences()

    def texts(self, lo: int, hi: int) -> list[str]:
        return self.rng.sample(self.sentences, self.rng.randint(lo, hi))

    def tokens(self) -> int:
        return self.rng.randint(16, 32)


async def _json(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> bool:
    r = await client.post(path, json=body)
    return r.status_code == 200


async def _stream(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> bool:
    async with client.stream("POST", path, json={**body, "stream": True}) as r:
        if r.status_code != 200:
            return False
        last = ""
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                last = line[6:]
        return last == "[DONE]" or '"finish_reason"' in last and '"error"' not in last


def requests(mix: Mix) -> dict[str, Callable[[httpx.AsyncClient], Awaitable[bool]]]:
    """task -> a function sending one request of it; True when it was answered in full."""
    return {
        "classify": lambda c: _json(c, "/v1/classify", {"inputs": mix.texts(1, 4)}),
        "embed": lambda c: _json(c, "/v1/embeddings", {"input": mix.texts(1, 8)}),
        "translate": lambda c: _json(c, "/v1/translate", {"inputs": mix.texts(1, 1), "source_lang": "en",
                                                          "target_lang": "es"}),
        "generate": lambda c: _json(c, "/v1/generate", {"prompt": " ".join(mix.texts(1, 3)),
                                                        "max_new_tokens": mix.tokens()}),
        "chat_stream": lambda c: _stream(c, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": " ".join(mix.texts(1, 2))}], "max_tokens": mix.tokens()}),
        "completions": lambda c: _json(c, "/v1/completions", {"prompt": mix.texts(1, 1)[0],
                                                              "max_tokens": mix.tokens()}),
    }


# -- the run -----------------------------------------------------------------------------------------

class Tally:
    def __init__(self) -> None:
        self.latency: dict[str, list[float]] = {}
        self.errors: dict[str, int] = {}

    def add(self, task: str, ok: bool, seconds: float) -> None:
        self.latency.setdefault(task, []).append(seconds)
        if not ok:
            self.errors[task] = self.errors.get(task, 0) + 1

    def summary(self) -> dict[str, Any]:
        out = {}
        for task, values in sorted(self.latency.items()):
            ordered = sorted(values)
            out[task] = {"requests": len(values), "errors": self.errors.get(task, 0),
                         "p50_s": round(statistics.median(ordered), 3),
                         "p99_s": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 3)}
        return out


async def client_loop(client: httpx.AsyncClient, tasks: dict[str, Callable[[httpx.AsyncClient], Awaitable[bool]]],
                      rng: random.Random, until: float, think_s: float, tally: Tally) -> None:
    names = list(tasks)
    while time.monotonic() < until:
        task = rng.choice(names)
        started = time.monotonic()
        try:
            ok = await tasks[task](client)
        except httpx.HTTPError as e:
            log.warning("%s: %r", task, e)
            ok = False
        tally.add(task, ok, time.monotonic() - started)
        await asyncio.sleep(think_s * rng.random() * 2)


async def sample_memory(root_pid: int | None, every_s: float, until: float,
                        samples: list[tuple[float, dict[str, float]]]) -> None:
    start = time.monotonic()
    while True:
        samples.append((time.monotonic() - start, await asyncio.to_thread(replica_rss_mib, root_pid)))
        if time.monotonic() + every_s > until:
            return
        await asyncio.sleep(every_s)


def growth(samples: list[tuple[float, dict[str, float]]], warmup_s: float) -> dict[str, Any]:
    """Per process group: RSS first, after warm-up, last, max (MiB) and growth (%) from both."""
    baseline = next((s for t, s in samples if t >= warmup_s), samples[0][1])
    first, last = samples[0][1], samples[-1][1]
    out = {}
    for name in sorted(last):
        values = [s[name] for _, s in samples if name in s]
        out[name] = {"first_mib": round(first.get(name, 0), 1), "after_warmup_mib": round(baseline.get(name, 0), 1),
                     "last_mib": round(last[name], 1), "max_mib": round(max(values), 1),
                     "growth_pct": round(100 * (last[name] / baseline[name] - 1), 2) if baseline.get(name) else None,
                     "growth_from_first_pct": round(100 * (last[name] / first[name] - 1), 2) if first.get(name) else None}
    return out


async def soak(url: str, minutes: float, clients: int, think_s: float, seed: int, root_pid: int | None,
               sample_s: float, warmup_s: float) -> dict[str, Any]:
    mix, tally = Mix(seed), Tally()
    tasks = requests(mix)
    until = time.monotonic() + minutes * 60
    samples: list[tuple[float, dict[str, float]]] = []
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
        await asyncio.gather(sample_memory(root_pid, sample_s, until, samples),
                             *(client_loop(client, tasks, random.Random(seed + i), until, think_s, tally)
                               for i in range(clients)))
    summary = tally.summary()
    return {"minutes": minutes, "clients": clients, "think_s": think_s,
            "requests": sum(t["requests"] for t in summary.values()),
            "errors": sum(t["errors"] for t in summary.values()), "tasks": summary,
            "memory": growth(samples, warmup_s), "samples": [(round(t, 1), s) for t, s in samples]}


# -- the service -------------------------------------------------------------------------------------

def local_service(args: dict[str, Any], num_cpus: float) -> AbstractContextManager[str]:
    """A local Ray + Serve in this process running the app from `args` (TS_* variables apply), one
    replica per deployment; yields its URL once /readyz answers 200."""
    from contextlib import contextmanager

    @contextmanager
    def run() -> Any:
        data = json.loads(json.dumps(args))
        for dep in data.get("deployments", {}).values():
            dep.pop("autoscaling_config", None)
            dep["num_replicas"] = 1
        with local_cluster(math.ceil(num_cpus), env={}) as url:
            deploy(data, name="soak", env=os.environ)  # TS_* variables apply
            wait_for(url, "/readyz", 200, timeout_s=600)
            yield url

    return run()


def config_args(path: Path) -> dict[str, Any]:
    import yaml

    return dict(yaml.safe_load(path.read_text())["applications"][0]["args"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--url", help="a running service (memory: pass --root-pid)")
    parser.add_argument("--root-pid", type=int, default=None, help="measure the replicas under this process")
    parser.add_argument("--config", type=Path, default=ROOT / "deploy" / "serve_config.yaml")
    parser.add_argument("--tiny", action="store_true", help="tiny models instead of the config's")
    parser.add_argument("--num-cpus", type=float, default=4.0, help="the local Ray's CPUs (scheduling only)")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--think-s", type=float, default=0.25, help="mean pause between a client's requests")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sample-s", type=float, default=10.0)
    parser.add_argument("--warmup-s", type=float, default=60.0)
    parser.add_argument("--max-growth", type=float, default=10.0, help="percent")
    parser.add_argument("--out", type=Path, default=Path(".bench") / "soak.json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)

    service: AbstractContextManager[str]
    if args.url is not None:
        service = nullcontext(args.url)
    else:
        service = local_service(TINY_ARGS if args.tiny else config_args(args.config), args.num_cpus)
    with service as url:
        log.info("soaking %s for %g min with %d clients", url, args.minutes, args.clients)
        result = asyncio.run(soak(url, args.minutes, args.clients, args.think_s, args.seed,
                                  args.root_pid if args.url else None, args.sample_s, args.warmup_s))
    result["service"] = args.url or ("tiny models" if args.tiny else str(args.config))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    for task, t in result["tasks"].items():
        log.info("%-12s %6d requests %4d errors  p50 %.3f s  p99 %.3f s", task, t["requests"], t["errors"],
                 t["p50_s"], t["p99_s"])
    worst = 0.0
    for name, m in result["memory"].items():
        log.info("%-28s RSS %7.1f MiB first, %7.1f after warm-up, %7.1f last, %7.1f max: %+.2f %% (%+.2f %% from first)",
                 name, m["first_mib"], m["after_warmup_mib"], m["last_mib"], m["max_mib"], m["growth_pct"] or 0,
                 m["growth_from_first_pct"] or 0)
        worst = max(worst, m["growth_pct"] or 0)
    log.info("%d requests, %d errors; largest RSS growth after warm-up %.2f %%; summary in %s",
             result["requests"], result["errors"], worst, args.out)
    return 1 if result["errors"] or worst >= args.max_growth else 0


if __name__ == "__main__":
    sys.exit(main())
