"""Prompt attention, the paged cache's prompt kernel against SDPA: `python -m loadtests.models.prompt_attention`.

One layer of SmolLM2-135M's attention shape (9 query heads on 3 key/value heads, head dim 64) on a
paged bfloat16 pool (the shipped `kv_cache_dtype`), T new tokens a row after `past` cached ones: the
gathered path (the rows' keys gathered to (B, K, S, D) float32, torch's SDPA, causal without a mask
for fresh rows, a boolean mask after cached keys) against the prompt kernel
(models/kernels/prompt_attention.cpp: each row's keys in place through its block table), with float32
products and, where the AVX512-BF16 build runs, bfloat16 products (as a bfloat16 prompt twin's
prompts attend). All through the cache's own `attend`, after the same writes, called in turn; medians
of `--repeats` calls each.
"GFLOP/s" counts the causal products (4 B H D per query-key pair). Prints a table.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from models.attention import AttentionMask, causal_mask
from models.cache.paged import PagedKVCache, blocks_for
from models.kernels import native

from .attention import HEAD_DIM, HEADS, KV_HEADS, start


def one(rows: int, tokens: int, past: int, repeats: int) -> dict[str, float]:
    """Seconds per call of each path for `rows` rows of `tokens` new tokens after `past` cached ones."""
    longest = past + tokens
    caches = {name: PagedKVCache(1, rows, KV_HEADS, longest, HEAD_DIM, dtype=torch.bfloat16, prompt_kernel=on,
                                 blocks=rows * blocks_for(longest) + 1)
              for name, on in (("sdpa", False), ("kernel", True))}
    q = torch.randn(rows, HEADS + KV_HEADS, tokens, HEAD_DIM)[:, :HEADS]  # (B, H, T, D): as the fused projection leaves it
    k, v = torch.randn(rows, KV_HEADS, tokens, HEAD_DIM), torch.randn(rows, KV_HEADS, tokens, HEAD_DIM)  # (B, K, T, D)
    calls = {}
    bf16 = native.has_bf16()
    if bf16:
        caches["kernel_bf16"] = PagedKVCache(1, rows, KV_HEADS, longest, HEAD_DIM, dtype=torch.bfloat16,
                                             prompt_kernel=True, blocks=rows * blocks_for(longest) + 1)
    for name, cache in caches.items():
        for row in range(rows):
            cache.ensure(row, past)
        cache.set_lengths([past] * rows)
        view = cache.view()
        positions, _ = view.begin(tokens)  # (B, T)
        products = name == "kernel_bf16"
        mask = (AttentionMask.lower_triangle(products) if past == 0
                else AttentionMask.after(causal_mask(positions, view.key_positions()), products))  # (B, 1, T, S)
        layer = view.layer(0)
        calls[name] = lambda layer=layer, mask=mask: layer.attend(q, k, v, mask, None, True)
    times: dict[str, list[float]] = {name: [] for name in calls}
    for call in calls.values():
        call()  # warm-up
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    flops = 4 * rows * HEADS * HEAD_DIM * sum(past + t + 1 for t in range(tokens))
    out = {name: statistics.median(t) for name, t in times.items()}
    return {**out, **{f"gflops_{name}": flops / t / 1e9 for name, t in out.items()}}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cases", default="1x128,1x512,1x1000,4x256,8x64,1x256+768,1x16+1000",
                   help="rows x new tokens [+ cached tokens], comma-separated")
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args(argv)
    start(args.threads, "prompt kernel", ", bfloat16 pool")
    bf16 = native.has_bf16()
    extra = (" kernel, bf16 products (ms) | SDPA ÷ bf16 products |", "---:|---:|") if bf16 else ("", "")
    print(f"| rows | new tokens | cached | SDPA (ms) | prompt kernel (ms) | SDPA ÷ kernel |{extra[0]} GFLOP/s "
          f"SDPA / kernel{' / bf16 products' if bf16 else ''} |")
    print(f"|---:|---:|---:|---:|---:|---:|{extra[1]}---:|")
    with torch.inference_mode():
        for case in args.cases.split(","):
            size, _, cached = case.partition("+")
            rows, tokens = (int(x) for x in size.split("x"))
            past = int(cached or 0)
            r = one(rows, tokens, past, args.repeats)
            products = (f" {r['kernel_bf16'] * 1e3:.3f} | {r['sdpa'] / r['kernel_bf16']:.2f}x |" if bf16 else "")
            rates = " / ".join(f"{r[f'gflops_{n}']:.0f}" for n in ("sdpa", "kernel", "kernel_bf16") if f"gflops_{n}" in r)
            print(f"| {rows} | {tokens} | {past} | {r['sdpa'] * 1e3:.3f} | {r['kernel'] * 1e3:.3f} | "
                  f"{r['sdpa'] / r['kernel']:.2f}x |{products} {rates} |", flush=True)


if __name__ == "__main__":
    main()
