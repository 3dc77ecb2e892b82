"""The two stacks every family is built from: a bidirectional encoder stack and a causal stack.

Both take a (B, T) "keep" mask (True = real token) and build their boolean attention masks
here and only here, with the helpers of attention.py. With relative positions (T5) each stack
also builds its additive position bias here, once per forward pass from the same query and key
positions as the masks, and hands it to every layer's self-attention.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from . import native_blocks
from .attention import AttentionMask, causal_mask, padding_mask, positions_from_mask
from .config import BlockConfig
from .kv_cache import CacheView, CrossCache
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

    def forward(self, ids: Tensor, keep: Tensor | None = None, token_types: Tensor | None = None) -> Tensor:
        """ids: (B, T) long; keep: (B, T) bool, True = real token. Returns (B, T, C)."""
        # no padding (always so for one text): positions and the native op's indices without mask arithmetic
        full = keep is None or bool(keep.all())
        if keep is None:
            keep = torch.ones_like(ids, dtype=torch.bool)  # (B, T)
        # (B, T): pad-invariant for left or right padding
        positions = torch.arange(ids.size(1), device=ids.device).expand_as(ids) if full else positions_from_mask(keep)
        x = self.embed(ids, positions, token_types)  # (B, T, C)
        if self.relative_bias is None:
            stack = native_blocks.stack_args(self.blocks)  # None unless the native op computes every block
            # one native op over the real tokens (models/native_blocks.py): no mask to build
            out = native_blocks.encode_layers(stack, x, None if full else keep) if stack is not None else None
            if out is not None:
                return self.norm(out) if self.norm is not None else out  # (B, T, C)
        mask = AttentionMask.build(padding_mask(keep))  # (B, 1, 1, T)
        bias = self.relative_bias(positions, positions) if self.relative_bias is not None else None  # (B, H, T, T)
        for block in self.blocks:
            x = block(x, mask, bias=bias)
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

    def forward(
        self,
        ids: Tensor,
        keep: Tensor | None = None,
        cache: CacheView | None = None,
        cross: CrossCache | None = None,
    ) -> Tensor:
        """ids: (B, T) long; keep: (B, T) bool; cache: rows to read/write; cross: encoder keys/values."""
        b, t = ids.shape
        unpadded = keep is None
        if unpadded and t == 1:
            out = self.decode_step(ids, cache, cross)  # (B, 1, C), or None where the native op does not run
            if out is not None:
                return out
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
                mask = AttentionMask.lower_triangle()
            else:  # every query sees at least its own key: no dead rows to look for (no host sync)
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
            x = block(x, mask, rope, cache.layer(i) if cache is not None else None, kv, cross_mask, bias=bias)
        return self.norm(x) if self.norm is not None else x


    def decode_plan(self, cache: CacheView | None, cross: CrossCache | None, rows: int,
                    head: native_blocks.Head | None = None) -> native_blocks.StepPlan | None:
        """What the native op takes for every decode step of `rows` rows over `cache` (its kind) and the
        sources `cross`, with the output projection `head` when given (native_blocks.head_args), resolved
        once (native_blocks.StepPlan); None where the op does not compute these steps."""
        weight = self.embed.tokens.weight  # (V, C)
        if self.relative_bias is not None or self.window is not None or not native_blocks.runs(cache, 1, weight):
            return None
        stack = native_blocks.stack_args(self.blocks)  # None unless the native op computes every block
        if stack is None:
            return None
        final = native_blocks.final_norm_args(self.norm)  # None: no norm, or one the op does not compute
        if head is not None and self.norm is not None and final is None:
            return None  # a norm the op does not compute comes before the head
        return native_blocks.step_plan(stack, cross, rows, native_blocks.embedding_args(self.embed), final, head)

    def decode_step(self, ids: Tensor, cache: CacheView | None, cross: CrossCache | None = None,
                    head: native_blocks.Head | None = None, plan: native_blocks.StepPlan | None = None,
                    ) -> Tensor | None:
        """A decode step, ids (B, 1), in one native call (models/native_blocks.py), the cache's begin
        included: the embedding where the op computes it, every block, the final norm, and the model's
        output projection `head` when given (native_blocks.head_args). `plan`: decode_plan's for these
        sources, rows, cache and head, when the caller keeps one across steps (built here when it is
        None or not current). Returns (B, 1, C), or the logits (B, 1, V) with a head; None, having done
        nothing, where the op does not compute this step."""
        if plan is None or not plan.current(cross, ids.size(0)):
            plan = self.decode_plan(cache, cross, ids.size(0), head)
            if plan is None:
                return None
        past = cache.begin_decode()  # the rows' lengths: the op derives the new keys' slots and positions
        positions = None  # (B, 1), where Python needs them
        if plan.embedding is None or self.rotary is not None:
            positions = torch.tensor(past, dtype=torch.long, device=ids.device).view(-1, 1)  # (B, 1)
        if plan.embedding is not None:
            rows = native_blocks.TokenRows(ids, positions, plan.embedding)
        else:
            rows = self.embed(ids, positions)  # (B, 1, C)
        rope = self.rotary(positions, torch.float32) if self.rotary is not None else None  # (B, 1, 1, D) x2
        out = native_blocks.decode_layers(plan, rows, rope, cache)  # (B, 1, C|V)
        return self.norm(out) if plan.head is None and plan.final is None and self.norm is not None else out


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
