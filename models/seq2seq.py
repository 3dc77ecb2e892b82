"""Encoder-decoder (Marian / original Transformer, T5) with separate encode() and decode()."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .cache.base import CacheStep
from .cache.cross import CrossCache
from .config import Seq2SeqConfig
from .layers import Embeddings
from .projections.panels import PanelLinear
from .stacks import CausalStack, EncoderStack, gather_rows


class Seq2Seq(nn.Module):
    """Shared token embeddings (Marian and T5 share one matrix between encoder and decoder; the output
    head is that matrix too unless the config unties it, as T5 v1.1 does)."""

    def __init__(self, cfg: Seq2SeqConfig) -> None:
        super().__init__()
        self.cfg = cfg
        shared = Embeddings(cfg)
        self.encoder = EncoderStack(cfg, embed=shared)
        self.decoder = CausalStack(cfg, cfg.n_decoder_layers, cross=True, embed=Embeddings(cfg))
        self.decoder.embed.tokens = shared.tokens  # one token matrix, two position/dropout wrappers
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.final_logits_bias = nn.Parameter(torch.zeros(cfg.vocab_size)) if cfg.final_logits_bias else None
        self.head_scale = cfg.d_model ** -0.5 if cfg.scale_head else 1.0  # T5 v1.0 rescales before its head

    def encode(self, src: Tensor, src_keep: Tensor | None = None) -> Tensor:
        """src (B, S) -> memory (B, S, C)."""
        return self.encoder(src, src_keep)

    def cross_cache(self, memory: Tensor, src_keep: Tensor) -> CrossCache:
        """Encoder keys/values for every decoder layer, computed once per request."""
        # contiguous: every decode step reads them, and the native step (models/execution/native.py) needs it
        kv = [tuple(t.contiguous() for t in block.cross_attn.project_kv(memory))
              for block in self.decoder.blocks]  # (B, K, S, D) x2
        return CrossCache.build(kv, src_keep)

    def logits(self, hidden: Tensor) -> Tensor:
        """(B, T, C) -> (B, T, V)."""
        if self.head_scale != 1.0:
            hidden = hidden * self.head_scale  # (B, T, C)
        if (isinstance(self.lm_head, PanelLinear) and self.lm_head.bias is None and self.final_logits_bias is not None
                and hidden.dtype == torch.float32):
            return self.lm_head(hidden, bias=self.final_logits_bias)  # (B, T, V): the bias added as outputs are stored
        out = F.linear(hidden, self.decoder.embed.tokens.weight) if self.lm_head is None else self.lm_head(hidden)
        return out + self.final_logits_bias if self.final_logits_bias is not None else out

    def decode(
        self,
        tgt: Tensor,
        cross: CrossCache,
        tgt_keep: Tensor | None = None,
        cache: CacheStep | None = None,
        last: Tensor | None = None,
    ) -> Tensor:
        """tgt (B, T) -> logits (B, T, V) (or (B, 1, V) at `last`)."""
        hidden = self.decoder(tgt, tgt_keep, cache, cross)  # (B, T, C)
        return self.logits(gather_rows(hidden, last))

    def forward(self, src: Tensor, src_keep: Tensor, tgt: Tensor, tgt_keep: Tensor | None = None) -> Tensor:
        """Teacher-forced logits (B, T, V), for training and parity checks."""
        memory = self.encode(src, src_keep)  # (B, S, C)
        return self.decode(tgt, self.cross_cache(memory, src_keep), tgt_keep)
