"""Offline generation for a decoder-only LM: static batch, KV cache, per-row parameters.

The reference loop for tests and benchmarks (the service's continuous-batching engine admits
and evicts rows between steps instead). Prompts are right-padded into one prefill; each row
then decodes at its own position until its stop condition.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .cache.base import KeyValueCache
from .cache.dense import KVCache
from .cache.paged import PagedKVCache, blocks_for, kernel_runs
from .decoder import DecoderLM
from .decoding import BatchParams, RowSampler, SamplingParams, find_stop, next_tokens
from .execution.executors import DecoderExecutor
from .execution.planner import executor_for
from .inputs import PaddedBatch


@dataclass
class Generated:
    tokens: list[int]  # new tokens, without the prompt (and without a final stop token)
    finish_reason: str  # "stop" (stop token or string) or "length"


def _cache(model: DecoderLM, rows: int, max_len: int, dtype: torch.dtype, device: torch.device) -> KeyValueCache:
    """The cache the engine would decode on: paged, each row's blocks reserved up front, where its decode
    kernel runs; the dense one elsewhere and for a sliding window."""
    if model.cfg.sliding_window is None and kernel_runs(dtype, device):
        return PagedKVCache.for_model(model.cfg, rows, rows * blocks_for(max_len) + 1, max_len, dtype, device)
    return KVCache.for_model(model.cfg, rows, max_len, dtype=dtype, device=device)


@torch.inference_mode()
def generate(
    model: DecoderLM | DecoderExecutor,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams],
    decode: Callable[[list[int]], str] | None = None,
) -> list[Generated]:
    """Generate for every prompt with `model`'s executor (a bare model is planned with execution
    "auto"). `decode` (token ids -> text) is needed only for stop strings."""
    steps = executor_for(model)
    model = steps.model
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    if len(params) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(params)} parameter sets")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    b = len(prompts)
    eos = set(model.cfg.eos_token_ids)
    max_len = max(len(p) for p in prompts) + max(p.max_new_tokens for p in params)
    if max_len > model.cfg.max_positions:
        raise ValueError(f"prompt + max_new_tokens = {max_len} exceeds the model's {model.cfg.max_positions}")
    cache = _cache(model, b, max_len, dtype, device)
    samplers = [RowSampler(p) for p in params]
    batch = BatchParams.build(list(params), device)
    padded = PaddedBatch.from_token_lists(prompts, device=device)  # (B, T)
    seen = None
    if batch.any_penalty:
        seen = padded.mark_seen(torch.zeros(b, model.cfg.vocab_size, dtype=torch.bool, device=device))  # (B, V)
    last = padded.last_index()  # (B,)
    logits = steps.prefill(padded.ids, cache.view(), last)[:, 0]  # (B, V)
    cache.advance(padded.lengths)  # the real tokens, known on the host
    out: list[list[int]] = [[] for _ in range(b)]
    reasons: list[str | None] = [None] * b
    while True:
        tok = next_tokens(logits.float(), batch, samplers, seen)  # (B,)
        for i, t in enumerate(tok.tolist()):
            if reasons[i] is not None:
                continue
            p = params[i]
            if not p.ignore_eos and (t in eos or t in p.stop_token_ids):
                reasons[i] = "stop"
                continue
            out[i].append(t)
            if p.stop and decode is not None:
                text = decode(out[i])
                if find_stop(text, p.stop) >= 0:
                    reasons[i] = "stop"
                    continue
            if len(out[i]) >= p.max_new_tokens:
                reasons[i] = "length"
        if all(r is not None for r in reasons):
            break
        if seen is not None:
            seen.scatter_(1, tok[:, None], True)
        logits = steps.decode(tok[:, None], cache.view())[:, 0]  # (B, V)
        cache.advance(1)
    return [Generated(toks, reason or "length") for toks, reason in zip(out, reasons, strict=True)]
