"""The engine's limits resolved for one model, once, when the engine is built: `EngineConfig` (what
an operator sets, service/engine/config.py) against the model's max_positions and input limit and
the bytes of one cache row; and the check of each request against them (its errors are in
service/errors.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from models.cache.dense import slots_per_row
from models.cache.paged import BLOCK_TOKENS, blocks_for
from models.config import DecoderConfig
from models.decoding import SamplingParams

from ..errors import InvalidRequest, RequestTooLarge
from .config import EngineConfig


@dataclass(frozen=True)
class EngineLimits:
    """EngineConfig resolved for one model: cache rows and the token limits as plain ints."""

    rows: int  # sequences at once (paged: max_running; rows: as many as the budget holds, at most that)
    row_bytes: int  # bytes of keys + values of one full row: max_total_tokens (or the window) slots
    max_total_tokens: int
    max_prompt_tokens: int
    max_new_tokens: int
    max_queued: int
    prefill_tokens: int
    vocab_size: int
    prefill_chunk: int | None = None  # prompts longer than this are prefilled in chunks of it
    prefix_cache_bytes: int = 0  # 0: no prefix cache
    blocks: int = 0  # paged: the pool's blocks, the null block included; 0: a row per sequence

    @classmethod
    def resolve(cls, config: EngineConfig, model_cfg: DecoderConfig, dtype: torch.dtype,
                max_input_tokens: int | None = None) -> EngineLimits:
        """Token limits cut to the model's max_positions (and the prompt to `max_input_tokens`, the
        model's input limit, when the config sets none); cache rows from the budget."""
        total = min(config.max_total_tokens or model_cfg.max_positions, model_cfg.max_positions)
        if total < 2:
            raise ValueError(f"max_total_tokens must leave room for a prompt and one token, got {total}")
        item = torch.empty((), dtype=dtype).element_size()
        slots = slots_per_row(total, model_cfg.sliding_window)  # a windowed model's row holds its window
        token_bytes = 2 * model_cfg.n_layers * model_cfg.kv_heads * model_cfg.head_dim * item
        row_bytes = slots * token_bytes
        blocks = 0
        if config.paged and model_cfg.sliding_window is None:
            rows = config.max_running
            # the budget's blocks, at most what max_running sequences of max_total_tokens can fill; + the null block
            blocks = 1 + min(config.kv_cache_bytes // (BLOCK_TOKENS * token_bytes), rows * blocks_for(total))
            if blocks - 1 < blocks_for(total):
                raise ValueError(f"EngineConfig.kv_cache_mib={config.kv_cache_mib} holds {blocks - 1} blocks of "
                                 f"{BLOCK_TOKENS} tokens; one sequence of max_total_tokens={total} needs "
                                 f"{blocks_for(total)} (lower max_total_tokens or raise the budget)")
        else:
            rows = min(config.max_running, config.kv_cache_bytes // row_bytes)
        if rows < 1:
            raise ValueError(f"EngineConfig.kv_cache_mib={config.kv_cache_mib} holds no cache row: one row "
                             f"of {slots} tokens needs {row_bytes} bytes (lower max_total_tokens or raise the budget)")
        prompt = min(config.max_prompt_tokens or max_input_tokens or total - 1, total - 1)
        new = min(config.max_new_tokens or total - 1, total - 1)
        chunk = min(config.prefill_chunk, config.prefill_tokens) if config.prefill_chunk is not None else None
        return cls(rows, row_bytes, total, prompt, new, config.max_queued, config.prefill_tokens,
                   model_cfg.vocab_size, chunk, int(config.prefix_cache_mib * 2**20), blocks)

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
