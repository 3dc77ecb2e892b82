"""How output throughput grows with concurrent streams, on the paged KV cache and on preallocated rows.

    python -m loadtests.experiments.concurrency                              # shipped generator, 32 / 64 / 128 clients
    python -m loadtests.experiments.concurrency --clients 8,32 --seconds 10 --caches paged --tiny   # a smoke run

In one process, for each `--caches` kind (`paged`: EngineConfig.paged, the default; `rows`: one
preallocated row of max_total_tokens per sequence, the engine before the paged cache) and each
`--clients` count, a fresh engine on the shipped generator (its deploy/serve_config.yaml settings, with
max_running = the clients) serves a closed loop: every client sends a request as soon as its last one
ends, prompts of 10-200 tokens and outputs of 16-128 (both skewed short, as `make bench-serve`'s
generate load), greedy, ignore_eos. After `--warmup` seconds, output tokens are counted for
`--seconds`. Prints output tok/s, the most sequences running at once, requests preempted, time to
first token and inter-token latency percentiles. Every run sends the same requests in the same order.
"""

from __future__ import annotations

import argparse
import random
import sys
import threading
import time

from .engine_models import add_model_args, load_generator, percentile


def requests(rng: random.Random, vocab: int, n: int) -> list[tuple[list[int], int]]:
    """n (prompt token ids, output tokens): 10-200 prompt tokens, 16-128 new, both skewed short."""
    from ..workload import skewed_int

    return [([rng.randrange(100, vocab) for _ in range(skewed_int(rng, 10, 200, median=48))],
             skewed_int(rng, 16, 128, median=48)) for _ in range(n)]


def measure(model, tok, cache: str, clients: int, args: argparse.Namespace,  # noqa: ANN001
            prompt_model=None) -> dict[str, float]:  # noqa: ANN001
    from models.decoding import SamplingParams
    from service.engine.config import EngineConfig
    from service.engine.core import GenerationEngine

    from .engine_models import shipped_generator_engine

    # rows: no speculative decoding (it verifies drafts on the paged cache)
    config = shipped_generator_engine(max_running=clients, paged=cache == "paged", max_queued=clients,
                                      max_new_tokens=None, **({} if cache == "paged" else {"speculative": None}))
    engine = GenerationEngine(model, tok, EngineConfig(**config), prompt_model=prompt_model).start()
    work = requests(random.Random(args.seed), model.cfg.vocab_size, 100_000)
    lock, taken = threading.Lock(), [0]
    started = time.perf_counter()
    window = (started + args.warmup, started + args.warmup + args.seconds)
    stats: list[tuple[float, tuple[float, ...], int]] = []  # (submitted, token times, tokens) per request

    def client() -> None:
        while time.perf_counter() < window[1]:
            with lock:
                prompt, new = work[taken[0]]
                taken[0] += 1
            submitted = time.perf_counter()
            done = engine.submit(prompt, SamplingParams(max_new_tokens=new, ignore_eos=True)).result_sync(timeout=600)
            with lock:
                stats.append((submitted, done.timing.token_times_s, done.usage.completion_tokens))

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    peak = 0
    while time.perf_counter() < window[1]:
        time.sleep(0.05)
        peak = max(peak, engine.stats().running)
    for t in threads:
        t.join()
    preempted = engine.stats().preempted
    engine.shutdown()
    tokens = sum(1 for sub, times, _ in stats for t in times if window[0] <= sub + t < window[1])
    ttft = [times[0] for sub, times, _ in stats if times and window[0] <= sub + times[0] < window[1]]
    itl = [b - a for sub, times, _ in stats for a, b in zip(times, times[1:], strict=False)
           if window[0] <= sub + b < window[1]]
    return {"tok_s": tokens / args.seconds, "peak": peak, "preempted": preempted,
            "ttft50": percentile(ttft, 0.5), "ttft95": percentile(ttft, 0.95),
            "itl50": percentile(itl, 0.5), "itl95": percentile(itl, 0.95)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", default="32,64,128")
    parser.add_argument("--caches", default="paged,rows")
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--warmup", type=float, default=10.0)
    parser.add_argument("--prompt-weights", default=None,
                        help="ModelSpec.prompt_weights values to run side by side, e.g. same,float "
                             "(default: the shipped config's)")
    add_model_args(parser)
    args = parser.parse_args(argv)
    kinds = args.prompt_weights.split(",") if args.prompt_weights else [None]
    # one load: with "float" in the list the twin is loaded once and left out for "same"
    model, tok, label, twin = load_generator(args, "float" if "float" in kinds and not args.tiny else None)
    rows = []
    for clients in [int(c) for c in args.clients.split(",")]:
        for cache in args.caches.split(","):
            for kind in kinds:
                prompt_model = None if kind == "same" else twin
                print(f"{cache}, {clients} clients, prompts on {kind or 'shipped'} weights ...", file=sys.stderr,
                      flush=True)
                rows.append((cache, kind or "shipped", clients, measure(model, tok, cache, clients, args, prompt_model)))
    print(f"\n{label}, {args.threads} threads, closed loop, greedy, {args.seconds:.0f} s after {args.warmup:.0f} s\n")
    print("| KV cache | prompt weights | clients | output tok/s | most running | preempted | TTFT p50 / p95 (s) | "
          "inter-token p50 / p95 (ms) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for cache, kind, clients, r in rows:
        print(f"| {cache} | {kind} | {clients} | {r['tok_s']:.1f} | {r['peak']} | {r['preempted']} | "
              f"{r['ttft50']:.2f} / {r['ttft95']:.2f} | {r['itl50'] * 1e3:.0f} / {r['itl95'] * 1e3:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
