"""The two stacks every family is built from: a bidirectional encoder stack and a causal stack.

Both take a (B, T) "keep" mask (True = real token) and build their boolean attention masks
here and only here, with the helpers of attention.py. With relative positions (T5) each stack
also builds its additive position bias here, once per forward pass from the same query and key
positions as the masks, and hands it to every layer's self-attention.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from .attention import AttentionMask, causal_mask, padding_mask, positions_from_mask
from .cache.base import CacheStep
from .cache.cross import CrossCache
from .config import BlockConfig
from .layers import Block, Embeddings, make_norm
from .positions import RelativePositionBias, RotaryPositions


class EncoderStack(nn.Module):
    """Embeddings + bidirectional blocks (+ final norm). Output (B, T, C)."""

    def __init__(self, cfg: BlockConfig, embed: Embeddings | None = None, type_vocab_size: int = 0) -> None:
        super().__init__()
        self.embed = embed if embed is not None else Embeddings(cfg, type_vocab_size)
        self.relative_bias = _relative_bias(cfg, bidirectional=True)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = make_norm(cfg) if cfg.final_norm else None

    def forward(self, ids: Tensor, keep: Tensor | None = None, token_types: Tensor | None = None,
                layers: Callable[..., Tensor] | None = None, adapters: Tensor | None = None) -> Tensor:
        """ids: (B, T) long; keep: (B, T) bool, True = real token; adapters (B,) int64 each row's adapter
        slot (-1: none; models/adapters/), None: no row has one. Returns (B, T, C).

        `layers`: the blocks as an execution backend computes them (models/execution/: x (B, T, C),
        keep, None when no row is padded, and adapters -> (B, T, C)); None runs them here."""
        # no padding (always so for one text): positions without mask arithmetic
        full = keep is None or bool(keep.all())
        if keep is None:
            keep = torch.ones_like(ids, dtype=torch.bool)  # (B, T)
        # (B, T): pad-invariant for left or right padding
        positions = torch.arange(ids.size(1), device=ids.device).expand_as(ids) if full else positions_from_mask(keep)
        x = self.embed(ids, positions, token_types)  # (B, T, C)
        if layers is not None:
            x = layers(x, None if full else keep, adapters)  # (B, T, C)
        else:
            mask = AttentionMask.build(padding_mask(keep))  # (B, 1, 1, T)
            bias = self.relative_bias(positions, positions) if self.relative_bias is not None else None  # (B, H, T, T)
            for block in self.blocks:
                x = block(x, mask, bias=bias, adapters=adapters)
        return self.norm(x) if self.norm is not None else x


class CausalStack(nn.Module):
    """Embeddings + causal blocks (+ cross-attention) (+ final norm). Output (B, T, C).

    Without a cache, rows may be left- or right-padded (keep marks real tokens). With a cache,
    inputs are right-padded: row b's T new tokens sit at positions lengths[b] .. lengths[b]+T-1,
    and keep (when given) tells a windowed cache which of them to store.
    """

    def __init__(self, cfg: BlockConfig, n_layers: int, cross: bool = False,
                 embed: Embeddings | None = None) -> None:
        super().__init__()
        self.embed = embed if embed is not None else Embeddings(cfg)
        self.rotary = (RotaryPositions(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
                       if cfg.position == "rotary" else None)
        self.window = cfg.sliding_window
        self.relative_bias = _relative_bias(cfg, bidirectional=False)
        self.blocks = nn.ModuleList(Block(cfg, cross=cross) for _ in range(n_layers))
        self.norm = make_norm(cfg) if cfg.final_norm else None
        # the paged prompt kernel may round q and the softmax weights to bfloat16 for its products: set
        # on a model whose projections round their inputs to bfloat16 (a bfloat16 prompt twin)
        self.bf16_products = False

    def forward(
        self,
        ids: Tensor,
        keep: Tensor | None = None,
        cache: CacheStep | None = None,
        cross: CrossCache | None = None,
        adapters: Tensor | None = None,
    ) -> Tensor:
        """ids: (B, T) long; keep: (B, T) bool; cache: rows to read/write; cross: encoder keys/values;
        adapters: (B,) int64 each row's adapter slot (-1: none; models/adapters/), None: no row has one."""
        b, t = ids.shape
        unpadded = keep is None
        if cache is not None:
            positions, _ = cache.begin(t, keep)  # (B, T); S = longest past + T (at most the cache's L)
        else:
            if keep is None:
                keep = torch.ones_like(ids, dtype=torch.bool)  # (B, T)
            positions = positions_from_mask(keep)  # (B, T)
        x = self.embed(ids, positions)  # (B, T, C)
        rope = self.rotary(positions, x.dtype) if self.rotary is not None else None  # (B, 1, T, D) x2
        plain = self.window is None and self.relative_bias is None  # masks that only say "causal"
        if cache is not None:
            k_pos = cache.key_positions()  # (S,) or (B, S): the position each key slot holds
            if plain and t > 1 and cache.fresh():
                # empty rows, right-padded: slot j holds position j, a real query sees only real keys
                mask = AttentionMask.lower_triangle(self.bf16_products)
            elif plain:  # every query sees at least its own key: no dead rows to look for (no host sync)
                mask = AttentionMask.after(causal_mask(positions, k_pos), self.bf16_products)  # (B, 1, T, S)
            else:
                mask = AttentionMask(causal_mask(positions, k_pos, self.window), None)  # (B, 1, T, S)
        elif plain and unpadded:
            k_pos, mask = positions, AttentionMask.lower_triangle()
        else:
            k_pos = positions  # (B, T): the keys are these tokens
            slots = torch.arange(t, device=ids.device)  # (T,)
            # a row's real tokens are contiguous (left or right padding): slot distances are position distances
            mask = causal_mask(slots.expand(b, t), slots, self.window) & padding_mask(keep)  # (B, 1, T, T)
            mask = AttentionMask.build(mask)  # once for every layer
        bias = self.relative_bias(positions, k_pos) if self.relative_bias is not None else None  # (B, H, T, S)
        cross_mask = None  # (B, 1, 1, S_src): built once per request with its CrossCache
        if cross is not None:
            cross_mask = cross.mask if cross.mask is not None else AttentionMask.build(padding_mask(cross.src_keep))
        for i, block in enumerate(self.blocks):
            kv = cross.layer_kv(i) if cross is not None else None
            x = block(x, mask, rope, cache.layer(i) if cache is not None else None, kv, cross_mask, bias=bias,
                      adapters=adapters)
        return self.norm(x) if self.norm is not None else x


def _relative_bias(cfg: BlockConfig, bidirectional: bool) -> RelativePositionBias | None:
    """The stack's one relative position bias table (position "relative", T5), else None."""
    if cfg.position != "relative":
        return None
    return RelativePositionBias(cfg.n_heads, cfg.relative_buckets, cfg.relative_max_distance, bidirectional)


def gather_rows(hidden: Tensor, index: Tensor | None) -> Tensor:
    """hidden (B, T, C), index (B,) -> (B, 1, C) at each row's index; None keeps all of T."""
    if index is None:
        return hidden
    idx = index.view(-1, 1, 1).expand(-1, 1, hidden.size(-1))  # (B, 1, C)
    return hidden.gather(1, idx)  # (B, 1, C)
