"""Chat traffic that shares a system prompt, with the engine's prefix cache on and off.

    python -m loadtests.experiments.prefix_reuse                       # shipped generator, 500-token system prompt
    python -m loadtests.experiments.prefix_reuse --system-tokens 200 --requests 24 --clients 2

In one process, for each `--cache-mib` value (EngineConfig.prefix_cache_mib; 0 = off), a fresh
engine on the shipped generator (deploy/serve_config.yaml's settings) serves `--requests` requests
from `--clients` closed-loop clients: each prompt is the same `--system-tokens`-token system
prompt followed by its own `--user-tokens` tokens, asking for `--new-tokens` greedy tokens. Prints
time to first token p50 / p95, requests/s and the prefix hit rate (cached prompt tokens / prompt
tokens, as the metrics report it) and the most requests running at once. With a small
`--kv-cache-mib` the pool's blocks bound admission, where a prefix hit counts as blocks shared, not
new ones. The same seed draws the same prompts for every setting.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from .engine_models import add_model_args, load_generator, percentile


def measure(model, tok, cache_mib: float, args: argparse.Namespace,  # noqa: ANN001
            prompt_model=None) -> dict[str, float]:  # noqa: ANN001
    from models.decoding import SamplingParams
    from service.engine.config import EngineConfig
    from service.engine.core import GenerationEngine

    rng = random.Random(args.seed)
    vocab = model.cfg.vocab_size
    system = [rng.randrange(100, vocab) for _ in range(args.system_tokens)]
    prompts = [system + [rng.randrange(100, vocab) for _ in range(args.user_tokens)] for _ in range(args.requests)]
    config = EngineConfig(max_running=max(8, args.clients), max_total_tokens=len(prompts[0]) + args.new_tokens + 1,
                          max_new_tokens=None, kv_cache_mib=args.kv_cache_mib, prefix_cache_mib=cache_mib)
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    with GenerationEngine(model, tok, config, prompt_model=prompt_model) as engine:
        engine.submit(prompts[0][:8], SamplingParams(max_new_tokens=2)).result_sync(timeout=120)  # warm
        before = engine.stats()
        started = time.perf_counter()
        peak = 0
        with ThreadPoolExecutor(args.clients) as pool:
            futures = [pool.submit(lambda p: engine.submit(p, params).result_sync(timeout=600), p) for p in prompts]
            while not all(f.done() for f in futures):
                peak = max(peak, engine.stats().running)
                time.sleep(0.02)
            finished = [f.result() for f in futures]
        seconds = time.perf_counter() - started
        after = engine.stats()
    ttft = [f.timing.first_token_s for f in finished]
    prompt = after.prompt_tokens - before.prompt_tokens
    cached = after.cached_prompt_tokens - before.cached_prompt_tokens
    return {"ttft_p50": percentile(ttft, 0.5), "ttft_p95": percentile(ttft, 0.95), "rps": len(prompts) / seconds,
            "hit_rate": cached / prompt if prompt else 0.0, "peak": peak}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache-mib", default="0,256", help="prefix_cache_mib values; 0 = off")
    parser.add_argument("--system-tokens", type=int, default=500)
    parser.add_argument("--user-tokens", type=int, default=30)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--kv-cache-mib", type=float, default=2048,
                        help="the engine's KV pool; small, admission is bound by its blocks (a hit counts as shared)")
    parser.add_argument("--prompt-weights", default=None, help="ModelSpec.prompt_weights (default: the shipped config's)")
    add_model_args(parser)
    args = parser.parse_args(argv)
    model, tok, label, prompt_model = load_generator(args, args.prompt_weights)
    rows = []
    for raw in args.cache_mib.split(","):
        print(f"prefix_cache_mib={raw.strip()} ...", file=sys.stderr, flush=True)
        rows.append((raw.strip(), measure(model, tok, float(raw), args, prompt_model)))
    print(f"\n{label}: {args.requests} requests from {args.clients} clients, each a shared {args.system_tokens}-token "
          f"system prompt + {args.user_tokens} own tokens, {args.new_tokens} new tokens (threads {args.threads})\n")
    print(f"KV pool {args.kv_cache_mib:g} MiB\n")
    print("| prefix_cache_mib | TTFT p50 (s) | TTFT p95 (s) | requests/s | hit rate | most running |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in rows:
        print(f"| {name} | {r['ttft_p50']:.3f} | {r['ttft_p95']:.3f} | {r['rps']:.2f} | {r['hit_rate']:.2f} | {r['peak']} |")
    if len(rows) > 1 and rows[-1][1]["ttft_p50"] > 0:
        print(f"\nTTFT p50 off / on: {rows[0][1]['ttft_p50'] / rows[-1][1]['ttft_p50']:.1f}x")


if __name__ == "__main__":
    main()
