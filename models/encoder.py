"""Encoder family: a BERT-style stack with mean/CLS pooling and an optional classification head."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import EncoderConfig
from .stacks import EncoderStack


def mean_pool(hidden: Tensor, keep: Tensor) -> Tensor:
    """Average of real-token states: hidden (B, T, C), keep (B, T) -> (B, C)."""
    w = keep.to(hidden.dtype)[..., None]  # (B, T, 1)
    return (hidden * w).sum(1) / w.sum(1).clamp(min=1e-9)  # (B, C)


class EncoderModel(nn.Module):
    """Encoder + pooling (+ head). `forward` returns token states; `embed`/`classify` build on it."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.stack = EncoderStack(cfg, type_vocab_size=cfg.type_vocab_size)
        self.head = nn.Linear(cfg.d_model, len(cfg.labels)) if cfg.labels else None

    def forward(self, ids: Tensor, keep: Tensor | None = None, token_types: Tensor | None = None) -> Tensor:
        """ids (B, T) -> hidden states (B, T, C)."""
        return self.stack(ids, keep, token_types)

    def embed(self, ids: Tensor, keep: Tensor | None = None) -> Tensor:
        """Pooled sentence embeddings (B, C), L2-normalised when the config says so."""
        if keep is None:
            keep = torch.ones_like(ids, dtype=torch.bool)
        hidden = self.forward(ids, keep)  # (B, T, C)
        pooled = mean_pool(hidden, keep) if self.cfg.pooling == "mean" else hidden[:, 0]  # (B, C)
        return F.normalize(pooled, dim=-1) if self.cfg.normalize_embeddings else pooled

    def classify(self, ids: Tensor, keep: Tensor | None = None) -> Tensor:
        """Label logits (B, n_labels) from the pooled embedding."""
        if self.head is None:
            raise ValueError("this encoder has no classification head (its config lists no labels)")
        return self.head(self.embed(ids, keep))  # (B, n_labels)
