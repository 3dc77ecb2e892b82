"""Which weights a quantized generator computes its prompts with (ModelSpec.prompt_weights).

A prefill multiplies many rows (a prompt's tokens) by each weight, where the block formats' integer
kernels are compute-bound: on a CPU without 8-bit dot products (AVX2, no VNNI) they run 16-bit
activations as two multiply-add passes and lose to float32 products of the same weight values, while
a one-row decode step streams weights from memory, where the 4-bit blocks read a fifth of the bytes.
So "auto" loads a float32 twin of the model (on our panel kernels, whose rows do not depend on each
other) and keeps it for prompts only where one prompt through it measures faster than through the
blocks here, at load.
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
