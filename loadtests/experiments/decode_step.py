"""A decode step on the model's own blocks (compiled where they are) against the native backend
(models/execution/native.py): the two execution plans of one model side by side.

    python -m loadtests.experiments.decode_step                         # shipped generator, 1 and 32 rows
    python -m loadtests.experiments.decode_step --tiny --rounds 1 --steps 4    # a smoke run
    python -m loadtests.experiments.decode_step --kv float32,bfloat16 --prompt 450   # each KV cache dtype

In one process, on the shipped generator (as deploy/serve_config.yaml deploys it) or the tiny decoder
(its projections fused and in 4-bit blocks, so the native step applies): for each `--rows` count, a
prompt of `--prompt` tokens per row is prefilled on a paged cache, then `--steps` greedy decode steps are
timed on each plan (and each `--kv` cache dtype) in turn, round after round (a machine that slows down
mid-run slows all). Prints the median milliseconds per step of each, each one's ratio to the first, how
many steps the native step computed, and whether the plans gave the same tokens on each cache dtype.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from .engine_models import add_model_args, load_generator


def decode(executor, rows: int, prompt: int, steps: int, kv=None) -> tuple[float, list[list[int]], int]:  # noqa: ANN001
    """(ms per decode step, the tokens, steps the native step computed) of one run on a fresh paged cache
    of `kv` (a torch dtype; None: float32)."""
    import torch

    from models.cache.paged import PagedKVCache, blocks_for

    model, total = executor.model, prompt + steps
    cache = PagedKVCache.for_model(model.cfg, rows, rows * blocks_for(total) + 1, total, kv)
    real, taken = executor.step, [0]
    if real is not None:
        executor.step = lambda *args: taken.__setitem__(0, taken[0] + 1) or real(*args)
    try:
        with torch.inference_mode():
            ids = torch.arange(rows * prompt).remainder(model.cfg.vocab_size - 10).add(5).view(rows, prompt)  # (B, T)
            logits = executor.prefill(ids, cache.view(), torch.full((rows,), prompt - 1))[:, -1]  # (B, V)
            cache.advance(prompt)
            tokens = []
            started = time.perf_counter()
            for _ in range(steps):
                nxt = logits.argmax(-1, keepdim=True)  # (B, 1)
                tokens.append(nxt)
                logits = executor.decode(nxt, cache.view())[:, -1]  # (B, V)
                cache.advance(1)
            seconds = time.perf_counter() - started
    finally:
        executor.step = real
    return seconds / steps * 1e3, torch.cat(tokens, 1).tolist(), taken[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,32")
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--kv", default="float32", help="KV cache dtypes, each plan runs on each: float32,bfloat16")
    add_model_args(parser)
    args = parser.parse_args(argv)
    model, _, label, _ = load_generator(args)
    if args.tiny:  # as the shipped generator holds its projections, so that the op applies
        from models.projections.fuse import fuse_projections
        from models.projections.quant import quantize

        model, label = quantize(fuse_projections(model), "q4_1"), "tiny decoder (q4_1, fused)"
    from models.cache.base import KV_DTYPES
    from models.execution.compiled import is_compiled, thread_settings
    from models.execution.planner import Runtime, plan_model

    thread_settings()
    blocks = "compiled" if is_compiled(model) else "torch"
    variants = {}  # name -> (executor, KV dtype)
    for kv in args.kv.split(","):
        dtype = KV_DTYPES[kv]
        for backend in (blocks, "native"):
            variants[f"{backend}, {kv} KV"] = plan_model(model, {"decode": backend}, Runtime(kv_dtype=dtype)), dtype
    names = list(variants)
    print(f"\n{label}, {args.threads} threads, {args.prompt}-token prompts, {args.steps} greedy steps, "
          f"median of {args.rounds} rounds\n")
    print("| rows | " + " | ".join(f"{n} (ms/step)" for n in names) + " | " +
          " | ".join(f"{n} gain" for n in names[1:]) + " | steps on the native step | same tokens |")
    print("|---:|" + "---:|" * (2 * len(names) - 1) + "---:|---|")
    for rows in (int(r) for r in args.rows.split(",")):
        times: dict[str, list[float]] = {n: [] for n in names}
        tokens, taken = {}, {}
        for rnd in range(args.rounds + 1):  # round 0 warms up (first shapes, allocations)
            for name, (executor, dtype) in variants.items():
                ms, tokens[name], taken[name] = decode(executor, rows, args.prompt, args.steps, dtype)
                if rnd:
                    times[name].append(ms)
            print(f"rows {rows}, round {rnd}/{args.rounds} done", file=sys.stderr, flush=True)
        ms = {n: statistics.median(times[n]) for n in names}
        # the plans on one cache dtype give the same tokens (a narrower cache may change close calls)
        same = "yes" if all(tokens[n] == tokens[f"{blocks}, {n.split(', ')[1]}"] for n in names) else "no"
        native = max(taken.values())
        print(f"| {rows} | " + " | ".join(f"{ms[n]:.2f}" for n in names) + " | " +
              " | ".join(f"{ms[names[0]] / ms[n]:.2f}x" for n in names[1:]) + f" | {native} / {args.steps} | {same} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
