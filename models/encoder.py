"""Encoder family: a BERT-style stack with mean/CLS pooling and an optional classification head.

    B batch, T padded length, C model width, L labels
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import EncoderConfig
from .layers import Embeddings
from .stacks import EncoderStack

# EncoderConfig.head_dense -> the activation after the head's dense layer
HEAD_ACTIVATIONS = {"tanh": torch.tanh, "relu": F.relu}
# EncoderConfig.head_scores -> logits (B, L) to scores (B, L)
HEAD_SCORES = {"softmax": lambda x: x.softmax(-1), "sigmoid": torch.sigmoid}


def mean_pool(hidden: Tensor, keep: Tensor) -> Tensor:
    """Average of real-token states: hidden (B, T, C), keep (B, T) -> (B, C)."""
    if bool(keep.all()):  # no padding: the same sums and division, without the weights' four ops
        return hidden.sum(1) / max(hidden.size(1), 1)  # (B, C)
    w = keep.to(hidden.dtype)[..., None]  # (B, T, 1)
    return (hidden * w).sum(1) / w.sum(1).clamp(min=1e-9)  # (B, C)


def first_token(hidden: Tensor, keep: Tensor) -> Tensor:
    """Each row's first real token (CLS): hidden (B, T, C), keep (B, T) -> (B, C). Slot 0 for the
    right-padded rows Hugging Face's heads read; the same token for left-padded rows."""
    if bool(keep.all()):
        return hidden[:, 0]  # (B, C)
    first = keep.long().argmax(-1)  # (B,): the first True
    return hidden[torch.arange(hidden.size(0), device=hidden.device), first]  # (B, C)


class HeadWeights(NamedTuple):
    """A classification head's weights used in place of a model's own (a classification adapter's:
    models/adapters/heads.py), in the model's dtype and device."""

    dense_w: Tensor | None  # (C, C): the dense layer before the classifier, where the model's head has one
    dense_b: Tensor | None  # (C,)
    out_w: Tensor  # (L, C)
    out_b: Tensor | None  # (L,)
    scores: str  # HEAD_SCORES key


class OffsetEmbeddings(Embeddings):
    """Embeddings whose positions count from `offset` (RoBERTa's tables start at padding_idx + 1)."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__(cfg, cfg.type_vocab_size)
        self.offset = cfg.position_offset

    def forward(self, ids: Tensor, positions: Tensor, token_types: Tensor | None = None) -> Tensor:
        return super().forward(ids, positions + self.offset, token_types)  # (B, T, C)


class EncoderModel(nn.Module):
    """Encoder + pooling (+ head). `forward` returns token states; `pool`/`logits` read them, and
    `embed`/`classify` do both in one call."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        embed = OffsetEmbeddings(cfg) if cfg.position_offset else None
        self.stack = EncoderStack(cfg, embed, type_vocab_size=cfg.type_vocab_size)
        has_dense = bool(cfg.labels) and cfg.head_dense is not None
        self.head_dense = nn.Linear(cfg.d_model, cfg.d_model) if has_dense else None
        self.head = nn.Linear(cfg.d_model, len(cfg.labels)) if cfg.labels else None

    def forward(self, ids: Tensor, keep: Tensor | None = None, token_types: Tensor | None = None,
                adapters: Tensor | None = None) -> Tensor:
        """ids (B, T) -> hidden states (B, T, C); adapters (B,) int64 each row's adapter slot (-1: none)."""
        return self.stack(ids, keep, token_types, adapters=adapters)

    def pool(self, hidden: Tensor, keep: Tensor) -> Tensor:
        """Sentence embeddings (B, C) from hidden (B, T, C), L2-normalised when the config says so."""
        pooled = mean_pool(hidden, keep) if self.cfg.pooling == "mean" else first_token(hidden, keep)  # (B, C)
        return F.normalize(pooled, dim=-1) if self.cfg.normalize_embeddings else pooled

    def logits(self, hidden: Tensor, keep: Tensor, head: HeadWeights | None = None) -> Tensor:
        """Label logits (B, L) from hidden (B, T, C): the head on the embedding or on the first token;
        `head`: other weights in its place (same pooling and activation)."""
        if self.head is None:
            raise ValueError("this encoder has no classification head (its config lists no labels)")
        x = self.pool(hidden, keep) if self.cfg.head_pooling == "embedding" else first_token(hidden, keep)  # (B, C)
        if head is not None:
            if head.dense_w is not None:
                x = HEAD_ACTIVATIONS[self.cfg.head_dense](F.linear(x, head.dense_w, head.dense_b))  # (B, C)
            return F.linear(x, head.out_w, head.out_b)  # (B, L)
        if self.head_dense is not None:
            x = HEAD_ACTIVATIONS[self.cfg.head_dense](self.head_dense(x))  # (B, C)
        return self.head(x)  # (B, L)

    def scores(self, logits: Tensor, head: HeadWeights | None = None) -> Tensor:
        """Logits (B, L) -> label scores (B, L): softmax, or sigmoid per label (multi-label, one label),
        as the model's head (or `head`) scores."""
        return HEAD_SCORES[self.cfg.head_scores if head is None else head.scores](logits)

    def embed(self, ids: Tensor, keep: Tensor | None = None, token_types: Tensor | None = None) -> Tensor:
        """Pooled sentence embeddings (B, C)."""
        keep = keep if keep is not None else torch.ones_like(ids, dtype=torch.bool)  # (B, T)
        return self.pool(self.forward(ids, keep, token_types), keep)

    def classify(self, ids: Tensor, keep: Tensor | None = None, token_types: Tensor | None = None) -> Tensor:
        """Label logits (B, L)."""
        keep = keep if keep is not None else torch.ones_like(ids, dtype=torch.bool)  # (B, T)
        return self.logits(self.forward(ids, keep, token_types), keep)
