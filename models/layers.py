"""Norms, feed-forward variants, embeddings and the transformer block shared by all families."""

from __future__ import annotations

import math

import torch.nn.functional as F
from torch import Tensor, nn

from .adapters.lora import project
from .attention import AttentionMask, MultiHeadAttention
from .config import BlockConfig
from .norms import make_norm
from .positions import LearnedPositions, SinusoidalPositions
from .projections.base import stack_linears


def gelu_tanh(x: Tensor) -> Tensor:
    """GELU's tanh approximation (GPT-2, T5 v1.1's gated variant)."""
    return F.gelu(x, approximate="tanh")


_ACT = {"relu": F.relu, "gelu": F.gelu, "gelu_tanh": gelu_tanh, "silu": F.silu}
# gated feed-forwards: the activation applied to the gate
_GATED = {"swiglu": F.silu, "geglu": F.gelu, "geglu_tanh": gelu_tanh}


class FeedForward(nn.Module):
    """Two-layer MLP, or a gated one (SwiGLU / GeGLU / T5 v1.1's tanh GeGLU: down(act(gate(x)) * up(x)))."""

    def __init__(self, cfg: BlockConfig) -> None:
        super().__init__()
        self.gated = cfg.activation in _GATED
        self.act = _GATED.get(cfg.activation) or _ACT[cfg.activation]
        self.up = nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.mlp_bias)
        self.gate = nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.mlp_bias) if self.gated else None
        self.down = nn.Linear(cfg.d_ff, cfg.d_model, bias=cfg.mlp_bias)
        self.gate_up: nn.Module | None = None  # fuse_gate_up(): one projection for gate and up
        self.dropout = nn.Dropout(cfg.dropout)

    def fuse_gate_up(self) -> None:
        """A gated MLP's gate and up projections as one Linear (C -> 2F): one matrix product instead
        of two; the separate projections are dropped. No-op for a plain MLP."""
        if self.gate is None:
            return
        fused = stack_linears(self.gate, self.up)  # C -> 2F
        del self.gate, self.up
        self.gate, self.gate_up = None, fused

    def forward(self, x: Tensor, adapters: Tensor | None = None) -> Tensor:
        """x (B, T, C) -> (B, T, C); adapters (B,) int64: each row's adapter slot (-1: none)."""
        if self.gate_up is not None:
            gate, up = project(self.gate_up, x, adapters).chunk(2, dim=-1)  # (B, T, F) each
            h = self.act(gate) * up  # (B, T, F)
        elif self.gate is not None:
            # in place: one buffer less
            h = self.act(project(self.gate, x, adapters)).mul_(project(self.up, x, adapters))  # (B, T, F)
        else:
            h = self.act(project(self.up, x, adapters))  # (B, T, F)
        return project(self.down, self.dropout(h), adapters)  # (B, T, C)


class Embeddings(nn.Module):
    """Token (+ token type) (+ absolute position) embeddings, optional scaling and norm."""

    def __init__(self, cfg: BlockConfig, type_vocab_size: int = 0) -> None:
        super().__init__()
        self.tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        nn.init.normal_(self.tokens.weight, std=0.02)
        self.scale = math.sqrt(cfg.d_model) if cfg.scale_embeddings else 1.0
        self.types = nn.Embedding(type_vocab_size, cfg.d_model) if type_vocab_size else None
        self.positions: nn.Module | None = None
        if cfg.position == "learned":
            self.positions = LearnedPositions(cfg.max_positions, cfg.d_model)
        elif cfg.position == "sinusoidal":
            self.positions = SinusoidalPositions(cfg.max_positions, cfg.d_model)
        self.norm = make_norm(cfg) if cfg.embed_norm else None
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, ids: Tensor, positions: Tensor, token_types: Tensor | None = None) -> Tensor:
        """ids, positions, token_types: (B, T) long -> (B, T, C)."""
        x = self.tokens(ids)  # (B, T, C), a new tensor: scaled and summed in place (a decode step's
        # few rows spent more time allocating than adding)
        if self.scale != 1.0:
            x.mul_(self.scale)
        if self.positions is not None:
            x.add_(self.positions(positions).to(x.dtype))  # (B, T, C)
        if self.types is not None:  # without token types every token is type 0: its row, broadcast
            x.add_(self.types(token_types) if token_types is not None else self.types.weight[0])  # (B, T, C)
        if self.norm is not None:
            x = self.norm(x)
        return self.dropout(x) if self.training else x


class Block(nn.Module):
    """Self-attention (+ cross-attention) + feed-forward, pre- or post-norm."""

    def __init__(self, cfg: BlockConfig, cross: bool = False) -> None:
        super().__init__()
        self.prenorm = cfg.prenorm
        self.self_attn = MultiHeadAttention(cfg)
        self.self_norm = make_norm(cfg)
        self.cross_attn = MultiHeadAttention(cfg) if cross else None
        self.cross_norm = make_norm(cfg) if cross else None
        self.ff = FeedForward(cfg)
        self.ff_norm = make_norm(cfg)
        self.dropout = nn.Dropout(cfg.dropout)

    def _residual(self, x: Tensor, norm: nn.Module, fn) -> Tensor:
        if self.prenorm:
            return x + self.dropout(fn(norm(x)))
        return norm(x + self.dropout(fn(x)))

    def forward(
        self,
        x: Tensor,
        mask: Tensor | AttentionMask | None,
        rope: tuple[Tensor, Tensor] | None = None,
        cache=None,
        cross_kv: tuple | None = None,
        cross_mask: Tensor | AttentionMask | None = None,
        bias: Tensor | None = None,
        adapters: Tensor | None = None,
    ) -> Tensor:
        """x: (B, T, C) -> (B, T, C). cross_kv: (B, K, S_src, D) keys/values of the encoder output (or
        grouped, CrossCache.layer_kv);
        bias: (B|1, H, T, S) added to the self-attention scores (T5's relative positions); adapters: (B,)
        int64 each row's adapter slot (-1: none; models/adapters/), None: no row has one."""
        x = self._residual(x, self.self_norm,
                           lambda h: self.self_attn(h, mask, rope, cache, bias=bias, adapters=adapters))
        if self.cross_attn is not None:
            if cross_kv is None:
                raise ValueError("a cross-attention block needs the encoder's keys/values")
            x = self._residual(x, self.cross_norm, lambda h: self.cross_attn(h, cross_mask, kv=cross_kv))
        return self._residual(x, self.ff_norm, lambda h: self.ff(h, adapters))
