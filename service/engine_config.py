"""Limits of the continuous-batching engine (its request errors: service/engine_errors.py).

`EngineConfig` is what an operator sets; `EngineLimits` is the config resolved against one model
(its max_positions, the bytes of one cache row), computed once when the engine is built.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from models.config import DecoderConfig
from models.decoding import SamplingParams

from .engine_errors import RequestTooLarge
from .errors import InvalidRequest


@dataclass(frozen=True)
class EngineConfig:
    """Scheduler limits. Token limits left at None follow from the model and max_total_tokens."""

    max_running: int = 32  # sequences decoding at once (upper bound on cache rows)
    kv_cache_bytes: int = 256 * 2**20  # KV-cache budget: rows = min(max_running, bytes // bytes per row)
    max_total_tokens: int | None = None  # prompt + output per request = tokens per cache row; None = max_positions
    max_prompt_tokens: int | None = None  # None = max_total_tokens - 1
    max_new_tokens: int | None = None  # output tokens per request; None = max_total_tokens - 1
    max_queued: int = 256  # waiting requests; one more raises EngineOverloaded
    prefill_tokens: int = 4096  # padded prompt tokens per admission step (one request is always admitted)

    def __post_init__(self) -> None:
        problems = [f"{name} must be a positive integer, got {getattr(self, name)!r}"
                    for name in ("max_running", "kv_cache_bytes", "max_queued", "prefill_tokens",
                                 "max_total_tokens", "max_prompt_tokens", "max_new_tokens")
                    if getattr(self, name) is not None and getattr(self, name) < 1]
        if problems:
            raise ValueError("EngineConfig: " + "; ".join(problems))


@dataclass(frozen=True)
class EngineLimits:
    """EngineConfig resolved for one model: cache rows and the token limits as plain ints."""

    rows: int
    row_bytes: int  # bytes of keys + values of one cache row at max_total_tokens
    max_total_tokens: int
    max_prompt_tokens: int
    max_new_tokens: int
    max_queued: int
    prefill_tokens: int
    vocab_size: int

    @classmethod
    def resolve(cls, config: EngineConfig, model_cfg: DecoderConfig, dtype: torch.dtype) -> EngineLimits:
        total = config.max_total_tokens or model_cfg.max_positions
        if total > model_cfg.max_positions:
            raise ValueError(f"EngineConfig.max_total_tokens={total} exceeds the model's max_positions "
                             f"({model_cfg.max_positions})")
        if total < 2:
            raise ValueError(f"EngineConfig.max_total_tokens must leave room for a prompt and one token, got {total}")
        item = torch.empty((), dtype=dtype).element_size()
        row_bytes = 2 * model_cfg.n_layers * model_cfg.kv_heads * total * model_cfg.head_dim * item
        rows = min(config.max_running, config.kv_cache_bytes // row_bytes)
        if rows < 1:
            raise ValueError(f"EngineConfig.kv_cache_bytes={config.kv_cache_bytes} holds no cache row: one row "
                             f"of {total} tokens needs {row_bytes} bytes (lower max_total_tokens or raise the budget)")
        prompt = min(config.max_prompt_tokens or total - 1, total - 1)
        new = min(config.max_new_tokens or total - 1, total - 1)
        return cls(rows, row_bytes, total, prompt, new, config.max_queued, config.prefill_tokens,
                   model_cfg.vocab_size)

    def check(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise InvalidRequest / RequestTooLarge (naming the limit) for a request the engine cannot run."""
        n = len(prompt_ids)
        if n == 0:
            raise InvalidRequest("the prompt is empty: it needs at least one token", "prompt")
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequest(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})",
                                 "prompt")
        if n > self.max_prompt_tokens:
            raise RequestTooLarge(f"the prompt has {n} tokens; the limit max_prompt_tokens is "
                                  f"{self.max_prompt_tokens}", "prompt", "max_prompt_tokens")
        if params.max_new_tokens > self.max_new_tokens:
            raise RequestTooLarge(f"max_new_tokens={params.max_new_tokens} is over the limit max_new_tokens "
                                  f"({self.max_new_tokens})", "max_new_tokens", "max_new_tokens")
        if n + params.max_new_tokens > self.max_total_tokens:
            raise RequestTooLarge(f"prompt ({n} tokens) + max_new_tokens ({params.max_new_tokens}) = "
                                  f"{n + params.max_new_tokens} is over the limit max_total_tokens "
                                  f"({self.max_total_tokens})", "max_new_tokens", "max_total_tokens")
