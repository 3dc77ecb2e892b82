"""Decode attention, the paged kernel against the dense cache: `python -m loadtests.models.attention`.

One layer of SmolLM2-135M's attention shape (9 query heads on 3 key/value heads, head dim 64), one new
token per row, rows of random lengths up to a maximum: the dense cache's path (models.cache.dense: the
rows' keys as (B, K, S, D) views padded to the longest, a boolean causal mask, torch's SDPA) against
the paged cache's decode kernel (models/kernels/attention.cpp: each row's own keys, in place through
its block table, no mask) on a float32 pool and on a bfloat16 one (`kv_cache_dtype: bfloat16`). All
through the caches' own `attend`, after the same writes. Medians of `--repeats` calls; "GB/s" is the
keys and values the rows really hold over the time. Prints a table.
"""

from __future__ import annotations

import argparse

import torch

from models.attention import causal_mask
from models.cache.dense import KVCache
from models.cache.paged import PagedKVCache, blocks_for
from models.kernels import native
from models.machine import machine_info

from .bench import timed

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def one(rows: int, longest: int, repeats: int) -> dict[str, float]:
    lengths = torch.randint(max(1, longest // 4), longest, (rows,)).tolist()
    dense = KVCache(1, rows, KV_HEADS, longest + 1, HEAD_DIM)
    paged, paged_bf16 = (PagedKVCache(1, rows, KV_HEADS, longest + 1, HEAD_DIM, dtype=dtype, decode_kernel=True,
                                      blocks=rows * blocks_for(longest + 1) + 1)
                         for dtype in (torch.float32, torch.bfloat16))
    for cache in (dense, paged, paged_bf16):
        cache.set_lengths(lengths)
    for row, n in enumerate(lengths):
        paged.ensure(row, n)
        paged_bf16.ensure(row, n)
    q = torch.randn(rows, HEADS, 1, HEAD_DIM)  # (B, H, 1, D)
    k, v = torch.randn(rows, KV_HEADS, 1, HEAD_DIM), torch.randn(rows, KV_HEADS, 1, HEAD_DIM)  # (B, K, 1, D)
    out = {}
    for name, cache in (("dense", dense), ("paged", paged), ("paged_bf16", paged_bf16)):
        view = cache.view()
        positions, _ = view.begin(1)
        mask = causal_mask(positions, view.key_positions())  # (B, 1, 1, S): what the stack builds
        layer = view.layer(0)
        out[name] = timed(lambda layer=layer, mask=mask: layer.attend(q, k, v, mask, None, True), repeats)
    held = 2 * (sum(lengths) + rows) * KV_HEADS * HEAD_DIM * 4  # float32 bytes; bfloat16 holds half
    return {**out, "gbs_dense": held / out["dense"] / 1e9, "gbs_paged": held / out["paged"] / 1e9,
            "gbs_bf16": held / 2 / out["paged_bf16"] / 1e9}


def start(threads: int, kernel: str, shape_note: str = "") -> None:
    """What both attention benchmarks do first: refuse without the native kernels (naming `kernel`), set
    torch's threads and seed, print the CPU and the layer's shape."""
    if not native.available():
        raise SystemExit(f"the {kernel} needs the native kernels (AVX2 or AVX-512, g++): see models/kernels/native.py")
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    m = machine_info()
    print(f"CPU: {m.get('cpu_model')} ({', '.join(m.get('cpu_flags', []))}); torch {torch.__version__}, "
          f"{threads} threads; one layer, {HEADS} query / {KV_HEADS} KV heads, head dim {HEAD_DIM}{shape_note}\n")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", default="1,32,64,128")
    p.add_argument("--longest", default="128,512,1024")
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args(argv)
    start(args.threads, "paged decode kernel")
    print("| rows | longest | dense SDPA (ms) | paged kernel (ms) | paged, bf16 pool (ms) | dense ÷ paged | "
          "paged ÷ bf16 pool | GB/s dense / paged / bf16 pool |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    with torch.inference_mode():
        for rows in [int(r) for r in args.rows.split(",")]:
            for longest in [int(n) for n in args.longest.split(",")]:
                r = one(rows, longest, args.repeats)
                print(f"| {rows} | {longest} | {r['dense'] * 1e3:.3f} | {r['paged'] * 1e3:.3f} | "
                      f"{r['paged_bf16'] * 1e3:.3f} | {r['dense'] / r['paged']:.2f}x | "
                      f"{r['paged'] / r['paged_bf16']:.2f}x | {r['gbs_dense']:.1f} / {r['gbs_paged']:.1f} / "
                      f"{r['gbs_bf16']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
