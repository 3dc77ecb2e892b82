"""What a long prompt costs the streams already decoding, with and without chunked prefill.

    python -m loadtests.experiments.prefill_stall                          # shipped generator, chunks off / 256 / 128
    python -m loadtests.experiments.prefill_stall --chunks none,512 --streams 8 --prompt-tokens 1000 --seconds 10

In one process, for each `--chunks` value (EngineConfig.prefill_chunk; `none` = a prompt is prefilled
whole), a fresh engine on the shipped generator (its deploy/serve_config.yaml settings: q4_1, compiled,
float32) runs `--streams` greedy streams; for `--seconds` they decode alone (baseline), then for as
long again a prompt of `--prompt-tokens` tokens arrives every `--every` seconds (one new token each).
Prints the streams' inter-token latency p50 / p95 / max in both phases, the rise of p95, and the long
prompts' time to first token. Every engine runs the same requests; the settings run one after another.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

from .engine_models import add_model_args, load_generator, percentile

LONG_MAX_NEW = 1  # a long prompt asks for one token: its prefill is what it costs the others


def inter_token(times: tuple[float, ...], start: float, stop: float) -> list[float]:
    """Gaps between consecutive tokens whose later token fell in [start, stop) (seconds since submit)."""
    return [b - a for a, b in zip(times, times[1:], strict=False) if start <= b < stop]


def measure(model, tok, chunk: int | None, args: argparse.Namespace,  # noqa: ANN001
            prompt_model=None) -> dict[str, float]:  # noqa: ANN001
    from models.decoding import SamplingParams
    from service.engine.config import EngineConfig
    from service.engine.core import GenerationEngine

    rng = random.Random(args.seed)
    vocab = model.cfg.vocab_size
    total = min(args.prompt_tokens + 64 + int(args.seconds * 2 * 100), model.cfg.max_positions)
    config = EngineConfig(max_running=args.streams + 1, max_total_tokens=total, max_new_tokens=None,
                          kv_cache_mib=4096, max_queued=256, prefill_tokens=2048, prefill_chunk=chunk)
    engine = GenerationEngine(model, tok, config, prompt_model=prompt_model).start()
    try:
        stream = SamplingParams(max_new_tokens=total - 64, ignore_eos=True)
        streams = []
        for _ in range(args.streams):
            prompt = [rng.randrange(100, vocab) for _ in range(32)]
            streams.append((time.perf_counter(), engine.submit(prompt, stream)))
        while engine.stats().running < args.streams:
            time.sleep(0.01)
        time.sleep(1.0)  # past the streams' own prefills
        base_start = time.perf_counter()
        time.sleep(args.seconds)
        load_start = time.perf_counter()
        longs = []
        while time.perf_counter() < load_start + args.seconds:
            prompt = [rng.randrange(100, vocab) for _ in range(args.prompt_tokens)]
            longs.append(engine.submit(prompt, SamplingParams(max_new_tokens=LONG_MAX_NEW, ignore_eos=True)))
            time.sleep(args.every)
        load_stop = time.perf_counter()
        ttft = [h.result_sync(timeout=600).timing.first_token_s for h in longs]
        base, load = [], []
        for submitted, handle in streams:
            engine.cancel(handle.request_id)
            times = handle.result_sync(timeout=60).timing.token_times_s  # seconds since its submit
            base += inter_token(times, base_start - submitted, load_start - submitted)
            load += inter_token(times, load_start - submitted, load_stop - submitted)
    finally:
        engine.shutdown()
    return {"base_p50": percentile(base, 0.5), "base_p95": percentile(base, 0.95),
            "load_p50": percentile(load, 0.5), "load_p95": percentile(load, 0.95), "load_max": max(load or [0]),
            "ttft_p50": statistics.median([t for t in ttft if t is not None] or [float("nan")]), "longs": len(longs)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", default="none,256,128", help="prefill_chunk values; none = whole prompts")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--every", type=float, default=3.0, help="seconds between long prompts")
    parser.add_argument("--seconds", type=float, default=15.0, help="length of each phase")
    add_model_args(parser)
    args = parser.parse_args(argv)
    model, tok, label, prompt_model = load_generator(args)
    rows = []
    for raw in args.chunks.split(","):
        chunk = None if raw.strip() == "none" else int(raw)
        print(f"prefill_chunk={raw.strip()} ...", file=sys.stderr, flush=True)
        rows.append((raw.strip(), measure(model, tok, chunk, args, prompt_model)))
    print(f"\n{label}: {args.streams} streams; a {args.prompt_tokens}-token prompt every {args.every:g} s "
          f"for {args.seconds:g} s (threads {args.threads})\n")
    print("| prefill_chunk | ITL p50 / p95 alone (ms) | ITL p50 / p95 / max with long prompts (ms) | p95 rise | "
          "long prompt TTFT p50 (s) |")
    print("|---|---:|---:|---:|---:|")
    for name, r in rows:
        rise = r["load_p95"] / r["base_p95"] - 1
        print(f"| {name} | {r['base_p50'] * 1e3:.0f} / {r['base_p95'] * 1e3:.0f} | {r['load_p50'] * 1e3:.0f} / "
              f"{r['load_p95'] * 1e3:.0f} / {r['load_max'] * 1e3:.0f} | {rise:+.0%} | {r['ttft_p50']:.2f} |")


if __name__ == "__main__":
    main()
