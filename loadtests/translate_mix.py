"""Request-level batches against the translation engine, in one process, on the shipped translator.

    python -m loadtests.translate_mix                       # 32 clients, beams 4, then 1/4/8 mixed
    python -m loadtests.translate_mix --clients 64 --beams 1,4,8 --seconds 20

For each scheduler (`translation.scheduler`: "batches" = TranslatorRunner, a dynamic batcher whose
beam search runs each batch to its end; "steps" = TranslatorEngineRunner, the translation engine), a
runner is built from deploy/serve_config.yaml's translator settings and warmed up; then `--clients`
closed-loop clients each translate one test-set sentence per request for `--seconds`, the beam size
of each request taken in turn from `--beams`. Before the load, every sentence's latency alone is
measured on the same runner (one client). Schedulers alternate for `--rounds` rounds. Prints sentences/s
and latency p50 / p95 per beam size under load, next to p50 alone, for both schedulers and their ratio.
No Ray, no HTTP: the scheduling alone (bench-serve measures the service).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections import defaultdict
from typing import Any

from .engine_models import ROOT, add_model_args, percentile

TEST_SET = ROOT / "models" / "weights" / "translator-en-es" / "test.tsv"
SCHEDULERS = ("batches", "steps")


def shipped_translator() -> tuple[Any, Any, str]:
    """The translator's DeploymentSettings, dtype and weights directory as deploy/serve_config.yaml has them."""
    import yaml

    from service.settings import Settings

    (app,) = yaml.safe_load((ROOT / "deploy" / "serve_config.yaml").read_text())["applications"]
    settings = Settings.build(app["args"], {})
    dep = settings.deployments["translator"]
    return dep, settings.device_for(dep)[1], settings.cache_path()


def build_runner(scheduler: str, args: argparse.Namespace):  # noqa: ANN201
    import dataclasses

    import torch

    from models.catalog import load_model
    from models.spec import ModelSpec
    from service.replica.translator import TranslatorEngineRunner, TranslatorRunner

    torch.set_num_threads(args.threads)
    dep, dtype, cache_dir = shipped_translator()
    if args.tiny:
        spec = ModelSpec(name="tiny-seq2seq", tasks=("translate",), source="tiny:seq2seq", max_input_tokens=64,
                         languages=("en", "es"))
        loaded = load_model(spec, cache_dir)
    else:
        loaded = load_model(dep.model, cache_dir, dtype=None if dtype == "auto" else getattr(torch, dtype))
    if scheduler == "batches":
        runner = TranslatorRunner(loaded, "translator", dep.batching)
    else:
        config = dataclasses.replace(dep.translation, scheduler="steps",
                                     max_rows=args.max_rows or dep.translation.max_rows)
        runner = TranslatorEngineRunner(loaded, "translator", config)
    runner.warm_up()
    runner.start()
    return runner


async def alone(runner, texts: list[str], beams: list[int]) -> dict[int, list[float]]:  # noqa: ANN001
    from service.messages import TranslateOptions

    out: dict[int, list[float]] = defaultdict(list)
    for beam in sorted(set(beams)):
        for text in texts:
            started = time.perf_counter()
            await runner.translate([text], TranslateOptions(beam_size=beam), 120.0)
            out[beam].append(time.perf_counter() - started)
    return out


async def load(runner, texts: list[str], beams: list[int], clients: int, seconds: float  # noqa: ANN001
               ) -> tuple[float, dict[int, list[float]], int]:
    """Closed loop: (sentences/s, latencies by beam size, errors)."""
    from service.messages import TranslateOptions

    latencies: dict[int, list[float]] = defaultdict(list)
    errors, done, counter = 0, 0, iter(range(10**9))
    stop = time.perf_counter() + seconds

    async def client() -> None:
        nonlocal errors, done
        while time.perf_counter() < stop:
            i = next(counter)
            beam, text = beams[i % len(beams)], texts[i % len(texts)]
            started = time.perf_counter()
            try:
                await runner.translate([text], TranslateOptions(beam_size=beam), 120.0)
            except Exception:
                errors += 1
                continue
            if time.perf_counter() <= stop:
                latencies[beam].append(time.perf_counter() - started)
                done += 1

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return done / (min(time.perf_counter(), stop) - started), latencies, errors


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--beams", default="4", help="beam sizes taken in turn, e.g. 1,4,8")
    p.add_argument("--seconds", type=float, default=15.0)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--alone", type=int, default=8, help="sentences timed alone per beam size")
    p.add_argument("--max-rows", type=int, default=None, help="the engine's rows (default: the shipped config's)")
    args = p.parse_args(argv)
    from models.machine import machine_info

    beams = [int(b) for b in args.beams.split(",")]
    rng = random.Random(args.seed)
    texts = [line.split("\t")[0] for line in TEST_SET.read_text().splitlines() if line.strip()]
    rng.shuffle(texts)
    runners = {s: build_runner(s, args) for s in SCHEDULERS}
    results: dict[str, dict[str, Any]] = {s: {"rate": [], "lat": defaultdict(list), "errors": 0} for s in SCHEDULERS}

    async def run() -> None:
        for s in SCHEDULERS:
            results[s]["alone"] = await alone(runners[s], texts[:args.alone], beams)
        for r in range(args.rounds):
            for s in SCHEDULERS:
                rate, lat, errors = await load(runners[s], texts, beams, args.clients, args.seconds)
                results[s]["rate"].append(rate)
                results[s]["errors"] += errors
                for beam, xs in lat.items():
                    results[s]["lat"][beam] += xs
                print(f"round {r + 1} {s}: {rate:.1f} sentences/s", file=sys.stderr, flush=True)

    asyncio.run(run())
    for runner in runners.values():
        runner.close()
    info = machine_info()
    print(f"\n{args.clients} clients, beams {args.beams}, {args.seconds:g} s x {args.rounds} rounds; "
          f"{info.get('cpu_model', '?')}, {args.threads} threads\n")
    print("| scheduler | sentences/s | beam | p50 / p95 under load (s) | p50 alone (s) | errors |")
    print("|---|---:|---:|---:|---:|---:|")
    for s in SCHEDULERS:
        rate = sum(results[s]["rate"]) / len(results[s]["rate"])
        for beam in sorted(set(beams)):
            xs, solo = results[s]["lat"][beam], results[s]["alone"][beam]
            print(f"| {s} | {rate:.1f} | {beam} | {percentile(xs, 0.5):.2f} / {percentile(xs, 0.95):.2f} | "
                  f"{percentile(solo, 0.5):.3f} | {results[s]['errors']} |")
    ratio = (sum(results["steps"]["rate"]) / sum(results["batches"]["rate"]))
    print(f"\nsteps / batches, sentences/s: {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
