"""Decoder-only causal language model (GPT-2 / Llama style)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .cache.base import CacheStep
from .config import DecoderConfig
from .stacks import CausalStack, gather_rows


class DecoderLM(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.stack = CausalStack(cfg, cfg.n_layers)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def logits(self, hidden: Tensor) -> Tensor:
        """(B, T, C) -> (B, T, V)."""
        if self.lm_head is None:
            return F.linear(hidden, self.stack.embed.tokens.weight)
        return self.lm_head(hidden)

    def forward(
        self,
        ids: Tensor,
        keep: Tensor | None = None,
        cache: CacheStep | None = None,
        last: Tensor | None = None,
        adapters: Tensor | None = None,
    ) -> Tensor:
        """ids (B, T) -> logits (B, T, V), or (B, 1, V) at index `last` (B,) of each row.

        With `cache`, the step's keys/values are written into it; the caller advances the
        cache lengths by each row's real token count afterwards. The rows are right-padded there:
        without `keep`, `last` marks each row's last real token (a windowed cache stores only those).
        adapters: (B,) int64 each row's adapter slot (-1: none; models/adapters/), None: no row has one.
        """
        if cache is not None and keep is None and last is not None:
            keep = torch.arange(ids.size(1), device=ids.device)[None, :] <= last[:, None]  # (B, T)
        hidden = self.stack(ids, keep, cache, adapters=adapters)  # (B, T, C)
        return self.logits(gather_rows(hidden, last))
