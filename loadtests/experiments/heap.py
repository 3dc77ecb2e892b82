"""Resident memory of a model replica's inference work with and without heap trimming, side by side.

    python -m loadtests.experiments.heap                                  # default encoder and generator, 1,500 batches
    python -m loadtests.experiments.heap --models encoder --batches 500 --intervals 0,1,5

For each model and each `--intervals` value (service/heap.py's `heap_trim_interval_s`; 0 = never
trim) a fresh Python process loads the deployment's default model (the generator in
`--generator-dtype`, auto-bf16 as in deploy/serve_config.yaml) and runs it the way a replica does, on one inference thread:
- encoder: `--batches` batches of 1-24 texts of 4-120 random tokens (EncoderRunner.run_batch),
  half classified, half embedded;
- generator: `--batches` requests (prompts of 10-200 tokens, 16-64 new tokens), 8 at a time through
  the continuous-batching engine.
The same seed draws the same work for every interval. Prints RSS after loading, at every quarter
and at the end, the seconds per batch (or per request), and the trims made with their mean cost.
Lower RSS at the same speed is the point; the processes run one after another.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DTYPE_ENV = "HEAP_BENCH_GENERATOR_DTYPE"  # --generator-dtype, for the child process


def rss_mib() -> float:
    from service.telemetry.memory import resident_bytes

    return resident_bytes() / 2**20


def _encoder(batches: int, interval: float, seed: int, marks: list[int]) -> dict[str, Any]:
    from models.catalog import DEFAULT_SPECS, load_model
    from models.zoo import default_cache_dir
    from service.replica.config import BatchLimits
    from service.replica.encoder import EncodeItem, EncoderRunner
    from service.replica.heap import HeapTrimmer

    runner = EncoderRunner(load_model(DEFAULT_SPECS["encoder"], default_cache_dir()), "encoder", BatchLimits(),
                           heap=HeapTrimmer(interval))
    runner.warm_up()
    rng, samples = random.Random(seed), {"loaded": rss_mib()}
    inference = ThreadPoolExecutor(1)  # the replica's inference thread
    started = time.perf_counter()
    for i in range(1, batches + 1):
        items = [EncodeItem([rng.randint(1000, 20000) for _ in range(rng.randint(4, 120))],
                            "classify" if rng.random() < 0.5 else "embed")
                 for _ in range(rng.randint(1, 24))]
        inference.submit(runner._compute, items).result()
        if i in marks:
            samples[str(i)] = rss_mib()
    return {"samples": samples, "seconds_per": (time.perf_counter() - started) / batches,
            "trims": runner.heap.calls, "trim_s": runner.heap.seconds}


def _generator(requests: int, interval: float, seed: int, marks: list[int]) -> dict[str, Any]:
    from models.catalog import DEFAULT_SPECS, load_model
    from models.decoding import SamplingParams
    from models.zoo import default_cache_dir
    from service.engine.config import EngineConfig
    from service.replica.device import resolve_device
    from service.replica.generator import GeneratorRunner
    from service.replica.heap import HeapTrimmer

    device, dtype = resolve_device("auto", os.environ.get(DTYPE_ENV, "auto-bf16"))
    loaded = load_model(DEFAULT_SPECS["generator"], default_cache_dir(), device=device, dtype=dtype)
    runner = GeneratorRunner(loaded, "generator", EngineConfig(), heap=HeapTrimmer(interval))
    runner.warm_up()
    runner.start()
    rng, samples = random.Random(seed), {"loaded": rss_mib()}
    vocab = loaded.model.cfg.vocab_size
    started, done, pending = time.perf_counter(), 0, []
    for i in range(1, requests + 1):
        prompt = [rng.randrange(100, vocab) for _ in range(rng.randint(10, 200))]
        params = SamplingParams(max_new_tokens=rng.randint(16, 64), ignore_eos=True, temperature=0.0)
        pending.append(runner.engine.submit(prompt, params))
        if len(pending) == 8 or i == requests:
            for handle in pending:
                handle.result_sync(timeout=600)
                done += 1
                if done in marks:
                    samples[str(done)] = rss_mib()
            pending = []
    runner.engine.shutdown()
    return {"samples": samples, "seconds_per": (time.perf_counter() - started) / requests,
            "trims": runner.heap.calls, "trim_s": runner.heap.seconds}


WORK = {"encoder": _encoder, "generator": _generator}


def measure(model: str, count: int, interval: float, seed: int, threads: int, dtype: str) -> dict[str, Any]:
    """One model and interval in a fresh interpreter (its own heap); its samples and timings."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(threads), DTYPE_ENV: dtype}
    args = [sys.executable, "-m", "loadtests.experiments.heap", "--child", model, "--batches", str(count),
            "--intervals", str(interval), "--seed", str(seed), "--threads", str(threads)]
    out = subprocess.run(args, env=env, cwd=ROOT, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{model} at interval {interval} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def quarter_marks(count: int) -> list[int]:
    return sorted({max(1, count * q // 4) for q in (1, 2, 3, 4)})


def table(results: list[tuple[str, float, dict[str, Any]]], count: int) -> str:
    marks = [str(m) for m in quarter_marks(count)]
    head = ["model", "trim interval", "RSS loaded", *[f"after {m}" for m in marks], "growth", "s per batch/request",
            "trims", "mean trim"]
    rows = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for model, interval, r in results:
        s = r["samples"]
        growth = (s[marks[-1]] - s["loaded"]) / s["loaded"]
        mean_trim = f"{1000 * r['trim_s'] / r['trims']:.1f} ms" if r["trims"] else "-"
        rows.append("| " + " | ".join([model, f"{interval:g} s" if interval else "never", f"{s['loaded']:.0f} MiB",
                                       *[f"{s[m]:.0f}" for m in marks], f"{growth:+.0%}", f"{r['seconds_per']:.3f}",
                                       str(r["trims"]), mean_trim]) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="encoder,generator", help="comma-separated: encoder, generator")
    parser.add_argument("--batches", type=int, default=1500, help="encoder batches / generator requests")
    parser.add_argument("--intervals", default="0,1", help="heap_trim_interval_s values (0 = never)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a replica's num_cpus)")
    parser.add_argument("--generator-dtype", default="auto-bf16", help="as the shipped config (auto-bf16)")
    parser.add_argument("--child", choices=sorted(WORK), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    intervals = [float(x) for x in args.intervals.split(",")]
    if args.child:
        import torch

        torch.set_num_threads(args.threads)
        print(json.dumps(WORK[args.child](args.batches, intervals[0], args.seed, quarter_marks(args.batches))))
        return
    results = []
    for model in [m.strip() for m in args.models.split(",") if m.strip()]:
        if model not in WORK:
            parser.error(f"unknown model {model!r}; choose from {sorted(WORK)}")
        for interval in intervals:
            print(f"{model}, trim interval {interval:g} s ...", file=sys.stderr, flush=True)
            results.append((model, interval, measure(model, args.batches, interval, args.seed, args.threads,
                                                         args.generator_dtype)))
    print(table(results, args.batches))


if __name__ == "__main__":
    main()
