"""Which weights a quantized generator computes its prompts with (ModelSpec.prompt_weights).

A prefill multiplies many rows (a prompt's tokens) by each weight, where the block formats' integer
kernels are compute-bound: on a CPU without 8-bit dot products (AVX2, no VNNI) they run 16-bit
activations as two multiply-add passes and lose to float32 products of the same weight values, while
a one-row decode step streams weights from memory, where the 4-bit blocks read a fifth of the bytes.
So a generator may compute its prompts on a twin: the same model on the float32 weights (our float32
panels) or on those weights rounded to bfloat16 (our bfloat16 panels, where the CPU has AVX512-BF16:
half the bytes and twice the products per instruction of float32, and faster than the
16-bit-activation blocks at a prompt's many rows; docs/benchmarks.md, "Matrix units"). The kernels' rows do not
depend on each other, so a prompt's keys are the same in any batch. "auto" measures one prompt through
the blocks and through each twin this CPU runs, at load, and keeps the fastest.
"""

from __future__ import annotations

import time

import torch
from torch import nn

PROBE_TOKENS = 128  # one prompt of this many tokens: a prefill's many-row products
PROBE_ROUNDS = 3  # timed passes through each model, alternating, after one untimed each


def prompt_speedup(blocks: nn.Module, floats: nn.Module, tokens: int = PROBE_TOKENS,
                   rounds: int = PROBE_ROUNDS) -> float:
    """How many times faster one `tokens`-token prompt runs through `floats` than through `blocks`
    (best pass of each; > 1: the float twin is faster)."""
    gen = torch.Generator().manual_seed(0)
    device = next(blocks.parameters()).device
    ids = torch.randint(0, blocks.cfg.vocab_size, (1, tokens), generator=gen).to(device)  # (1, T)
    last = torch.full((1,), tokens - 1, device=device)  # (1,): only the last position's logits
    best = {"blocks": float("inf"), "floats": float("inf")}
    with torch.inference_mode():
        for timed in [False] + [True] * rounds:
            for name, model in (("blocks", blocks), ("floats", floats)):
                start = time.perf_counter()
                model(ids, last=last)
                if device.type == "cuda":  # the kernels have run, not just been queued
                    torch.cuda.synchronize(device)
                if timed:
                    best[name] = min(best[name], time.perf_counter() - start)
    return best["blocks"] / best["floats"]


TWINS = {"float": "float32", "bfloat16": "bfloat16"}  # prompt_weights -> the twin it asks for
KERNELS = {"float32": "panels", "bfloat16": "bf16"}  # a twin's dense kernel (models/projections/dense.py)


def twins_for(prompt_weights: str, bf16_here: bool) -> tuple[str, ...]:
    """The twins a spec's prompt_weights asks to build: one it names, or for "auto" every one this
    CPU runs (`bf16_here`: our bfloat16 panels load); () for "same"."""
    if prompt_weights == "auto":
        return ("float32",) + (("bfloat16",) if bf16_here else ())
    return (TWINS[prompt_weights],) if prompt_weights in TWINS else ()


def fastest(speedups: dict[str, float]) -> str | None:
    """The twin "auto" keeps: the fastest where it beats the blocks (speedup > 1), else None."""
    best = max(speedups, key=speedups.__getitem__, default=None)
    return best if best is not None and speedups[best] > 1.0 else None
