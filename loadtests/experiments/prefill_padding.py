"""What a prefill's padding multiple costs: the same burst of prompts prefilled with each multiple.

    python -m loadtests.experiments.prefill_padding                       # shipped generator, multiples 32 and 2
    python -m loadtests.experiments.prefill_padding --tiny --rounds 1 --requests 8    # a smoke run

A prefill pads its prompts so that requests x length is a multiple of a number (service/engine/batch.py,
prefill_multiple: 32 where the projections keep a oneDNN kernel per shape, else 2). In one process,
for each round and each `--multiples` value in turn, a fresh engine on the shipped generator (its
deploy/serve_config.yaml settings; prefix cache off) is handed `--requests` prompts at once (10-200
tokens, skewed short, as the concurrency benchmark's), one new token each, and the time until all have
their token is taken. Prints, per multiple, the median prompt tokens/s over the rounds and the share
of computed prompt tokens that were real (not padding). Rounds alternate the multiples, so a machine
that slows down mid-run slows all of them.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

from .concurrency import requests
from .engine_models import add_model_args, load_generator, shipped_generator_engine


def measure(model, tok, multiple: int, prompts: list[list[int]], prompt_model=None) -> tuple[float, float]:  # noqa: ANN001
    """(prompt tokens/s, real / computed prompt tokens) of one burst on a fresh engine."""
    from models.decoding import SamplingParams
    from service.engine.config import EngineConfig
    from service.engine.core import GenerationEngine

    config = shipped_generator_engine(max_running=len(prompts), paged=True, max_queued=len(prompts),
                                      max_new_tokens=None, prefix_cache_mib=0)
    engine = GenerationEngine(model, tok, EngineConfig(**config), prompt_model=prompt_model)
    engine._batch.multiple = multiple  # what prefill_multiple() chose, replaced for the comparison
    widths: list[int] = []
    forward = engine._batch.steps.prompt_model.forward

    def counted(ids, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        widths.append(ids.numel())
        return forward(ids, *args, **kwargs)

    engine._batch.steps.prompt_model.forward = counted
    try:
        engine.start()
        started = time.perf_counter()
        handles = [engine.submit(p, SamplingParams(max_new_tokens=1, ignore_eos=True)) for p in prompts]
        for h in handles:
            h.result_sync(timeout=600)
        seconds = time.perf_counter() - started
    finally:
        engine.shutdown()
        del engine._batch.steps.prompt_model.forward
    real = sum(map(len, prompts))
    return real / seconds, real / max(1, sum(widths))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--multiples", default="32,2")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=48)
    add_model_args(parser)
    args = parser.parse_args(argv)
    multiples = [int(m) for m in args.multiples.split(",")]
    model, tok, label, twin = load_generator(args)
    rates: dict[int, list[float]] = {m: [] for m in multiples}
    real: dict[int, float] = {}
    for rnd in range(args.rounds):
        prompts = [p for p, _ in requests(random.Random(args.seed + rnd), model.cfg.vocab_size, args.requests)]
        for m in multiples:
            rate, real[m] = measure(model, tok, m, prompts, twin)
            rates[m].append(rate)
            print(f"round {rnd + 1}/{args.rounds}, multiple {m}: {rate:.0f} prompt tok/s", file=sys.stderr, flush=True)
    print(f"\n{label}, {args.threads} threads, {args.requests} prompts at once, one new token each, "
          f"median of {args.rounds} rounds\n")
    print("| padding multiple | prompt tok/s | real / computed tokens | vs first |")
    print("|---:|---:|---:|---:|")
    first = statistics.median(rates[multiples[0]])
    for m in multiples:
        rate = statistics.median(rates[m])
        print(f"| {m} | {rate:.0f} | {real[m]:.2f} | {rate / first:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
