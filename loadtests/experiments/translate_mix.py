"""Request-level batches against the translation engine, in one process, on the shipped translator.

    python -m loadtests.experiments.translate_mix                       # 32 clients, beams 4, then 1/4/8 mixed
    python -m loadtests.experiments.translate_mix --clients 64 --beams 1,4,8 --seconds 20

For each scheduler (`translation.scheduler`: "batches" = TranslatorRunner, a dynamic batcher whose
beam search runs each batch to its end; "steps" = TranslatorEngineRunner, the translation engine), a
runner is built from deploy/serve_config.yaml's translator settings and warmed up; then `--clients`
closed-loop clients each translate one test-set sentence per request for `--seconds`, the beam size
of each request taken in turn from `--beams`. Before the load, every sentence's latency alone is
measured on the same runner (one client). Schedulers alternate for `--rounds` rounds. Prints sentences/s
and latency p50 / p95 per beam size under load, next to p50 alone, for both schedulers and their ratio.
No Ray, no HTTP: the scheduling alone (bench-serve measures the service).

    python -m loadtests.experiments.translate_mix --apart 256 --threads 1   # the schedulers apart, one thread

`--apart N`: no clients and no event loop either: the first N test sentences (beam `--beams`' first)
go through each scheduler's own code on one thread, in turn for `--rounds` rounds: the translation
engine with all N queued (TranslationEngine.step until it is empty, its admission as configured) and
request-level batches of `--batch` sentences in order (TranslatorRunner.run_batch). For each: sentences/s,
encoder passes (sources per pass, ms per pass), decoder steps (rows per step, us per row-step) and the
time outside both, so where one scheduler loses to the other shows.
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


def build_runner(scheduler: str, args: argparse.Namespace, start: bool = True):  # noqa: ANN201
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
    if start:
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


class SearchClock:
    """Times models.beam_search.BeamSearch's encoder passes (`add`) and decoder steps while installed."""

    def __init__(self) -> None:
        self.add_s = self.step_s = 0.0
        self.passes = self.sources = self.steps = self.rows = 0

    def __enter__(self) -> SearchClock:
        from models.beam_search import BeamSearch

        self._add, self._step = BeamSearch.add, BeamSearch.step
        clock, add, step = self, BeamSearch.add, BeamSearch.step

        def timed_add(search, sources, params, keys) -> None:  # noqa: ANN001
            started = time.perf_counter()
            add(search, sources, params, keys)
            clock.add_s += time.perf_counter() - started
            clock.passes += 1
            clock.sources += len(sources)

        def timed_step(search, cancelled=None):  # noqa: ANN001, ANN202
            rows, started = search.busy_rows, time.perf_counter()
            out = step(search, cancelled)
            clock.step_s += time.perf_counter() - started
            clock.steps += 1
            clock.rows += rows
            return out

        BeamSearch.add, BeamSearch.step = timed_add, timed_step
        return self

    def __exit__(self, *exc: object) -> None:
        from models.beam_search import BeamSearch

        BeamSearch.add, BeamSearch.step = self._add, self._step


def apart(args: argparse.Namespace, texts: list[str], beam: int) -> list[dict[str, Any]]:
    """Each scheduler's own code on this thread over the same sentences (see --apart): one row per
    scheduler and round."""
    import torch

    from service.engine.translation import TranslationSubmission
    from service.messages import TranslateOptions
    from service.replica.tokenize import tokenize
    from service.replica.translator import TranslateItem

    runners = {s: build_runner(s, args, start=False) for s in SCHEDULERS}
    loaded = runners["steps"].loaded
    params = runners["steps"].params(TranslateOptions(beam_size=beam))
    ids = tokenize(loaded.tokenizer, [runners["steps"].prefix + t for t in texts[:args.apart]],
                   loaded.max_input_tokens, truncate=True)

    def steps() -> None:
        engine = runners["steps"].engine
        handles = engine.submit_many([TranslationSubmission(x, params) for x in ids])
        while engine.stats().waiting or engine.stats().running:
            engine.step()
        assert all(h.result_sync(timeout=1).error is None for h in handles)

    def batches() -> None:
        runner = runners["batches"]
        for i in range(0, len(ids), args.batch):
            runner.run_batch([TranslateItem(x, params) for x in ids[i: i + args.batch]])

    rows = []
    with torch.inference_mode():
        for r in range(args.rounds):
            for name, run in (("batches", batches), ("steps", steps)):
                with SearchClock() as clock:
                    started = time.perf_counter()
                    run()
                    total = time.perf_counter() - started
                rows.append({"scheduler": name, "round": r + 1, "total_s": total, "sentences": len(ids),
                             "clock": clock})
                print(f"round {r + 1} {name}: {len(ids) / total:.1f} sentences/s", file=sys.stderr, flush=True)
    for runner in runners.values():
        runner.close()
    return rows


def print_apart(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print("| scheduler | round | sentences/s | encoder passes | sources / pass | ms / pass | decoder steps | "
          "rows / step | us / row-step | encoder / steps / rest (s) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for row in rows:
        c: SearchClock = row["clock"]
        rest = row["total_s"] - c.add_s - c.step_s
        label = row["scheduler"] if row["scheduler"] == "steps" else f"batches of {args.batch}"
        print(f"| {label} | {row['round']} | {row['sentences'] / row['total_s']:.1f} | {c.passes} | "
              f"{c.sources / max(c.passes, 1):.1f} | {1e3 * c.add_s / max(c.passes, 1):.2f} | {c.steps} | "
              f"{c.rows / max(c.steps, 1):.1f} | {1e6 * c.step_s / max(c.rows, 1):.1f} | "
              f"{c.add_s:.2f} / {c.step_s:.2f} / {rest:.2f} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--beams", default="4", help="beam sizes taken in turn, e.g. 1,4,8")
    p.add_argument("--seconds", type=float, default=15.0)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--alone", type=int, default=8, help="sentences timed alone per beam size")
    p.add_argument("--max-rows", type=int, default=None, help="the engine's rows (default: the shipped config's)")
    p.add_argument("--apart", type=int, default=0, metavar="N",
                   help="time the schedulers apart on N sentences, one thread, no clients (see above)")
    p.add_argument("--batch", type=int, default=8, help="--apart: sentences per request-level batch")
    args = p.parse_args(argv)
    from models.machine import machine_info

    beams = [int(b) for b in args.beams.split(",")]
    rng = random.Random(args.seed)
    texts = [line.split("\t")[0] for line in TEST_SET.read_text().splitlines() if line.strip()]
    rng.shuffle(texts)
    if args.apart:
        rows = apart(args, texts, beams[0])
        info = machine_info()
        print(f"\n{args.apart} sentences, beam {beams[0]}, {args.rounds} rounds; {info.get('cpu_model', '?')}, "
              f"{args.threads} threads\n")
        print_apart(rows, args)
        return 0
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
