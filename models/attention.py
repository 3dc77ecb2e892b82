"""Masks, the one attention function, and multi-head self/cross attention.

    B batch rows, T query length, S key length, H query heads, K key/value heads (K divides H; K < H
    is grouped-query attention), D head dim, C model dim (H * D unless the config sets d_head)

Masks are boolean, True = attend, built only by the helpers here: a padding mask (B, 1, 1, S) from a
(B, S) "is a real token" mask, a causal mask (B, 1, T, S) from per-row query and key positions, so it
is right-aligned for cached decoding (query t of row b at position lengths[b] + t sees keys <= it). A
query with no key to attend gives zeros, never NaN. An additive float bias (T5's relative positions,
(B|1, H, T, S)) may come with the mask; the mask still decides who attends.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F
from torch import Tensor, nn

from .adapters.lora import project
from .config import BlockConfig
from .norms import RMSNorm
from .positions import apply_rotary
from .projections.base import stack_linears


def padding_mask(keep: Tensor) -> Tensor:
    """(B, S) bool/int, True/1 = real token -> (B, 1, 1, S) bool."""
    return keep.bool()[:, None, None, :]  # (B, 1, 1, S)


def causal_mask(q_pos: Tensor, k_pos: Tensor, window: int | None = None) -> Tensor:
    """Query at position p attends keys at positions <= p (and > p - window with a sliding window).

    q_pos: (B, T) absolute positions of the queries; k_pos: (S,) or (B, S) positions of the keys.
    Returns (B, 1, T, S) bool.
    """
    if k_pos.dim() == 1:
        k_pos = k_pos[None, :]  # (1, S)
    k, q = k_pos[:, None, None, :], q_pos[:, None, :, None]  # (B|1, 1, 1, S), (B, 1, T, 1)
    if window is None:
        return k <= q  # (B, 1, T, S)
    return (k <= q) & (k > q - window)  # (B, 1, T, S)


def positions_from_mask(keep: Tensor) -> Tensor:
    """Positions that skip padding, for left- or right-padded rows: (B, T) -> (B, T) long."""
    keep = keep.long()
    return (keep.cumsum(-1) - 1).clamp(min=0)  # (B, T)


@dataclass(frozen=True)
class AttentionMask:
    """A boolean mask (True = attend) made ready for scaled_dot_product_attention once per forward
    pass, so the layers do not redo it: query rows with no key to attend ("dead" rows, e.g. padding
    queries of an encoder) attend everywhere in `safe`, and their outputs are zeroed after.

    `causal` (then `safe` is None): query i attends keys 0..i and nothing else is masked, which
    SDPA's `is_causal` computes without a mask in memory, so it may pick its flash kernels (a prompt
    prefilled into empty cache rows, right-padded: a real query never reaches a padded key).
    `after_past`: the mask says no more than "query t of row b, at position past[b] + t, attends keys
    0 .. past[b] + t" (no window, no padding), so a paged cache may attend with its prompt kernel
    instead (models/cache/paged.py); `bf16_products`: that kernel may take its products in bfloat16
    (a stack whose projections round their inputs to bfloat16: CausalStack.bf16_products)."""

    safe: Tensor | None  # (B, 1, T, S) bool: the mask, with dead rows all True; None when causal
    dead: Tensor | None  # (B, 1, T, 1) bool: rows with no key; None when every row has one
    causal: bool = False
    after_past: bool = False
    bf16_products: bool = False

    @classmethod
    def build(cls, mask: Tensor) -> AttentionMask:
        live = mask.any(dim=-1, keepdim=True)  # (B, 1, T, 1): rows with at least one key
        if bool(live.all()):
            return cls(mask, None)
        return cls(mask | ~live, ~live)  # (B, 1, T, S), (B, 1, T, 1)

    @classmethod
    def lower_triangle(cls, bf16_products: bool = False) -> AttentionMask:
        """Query i attends keys 0..i (keys aligned with the queries from the first; S >= T)."""
        return cls(None, None, causal=True, after_past=True, bf16_products=bf16_products)

    @classmethod
    def after(cls, mask: Tensor, bf16_products: bool = False) -> AttentionMask:
        """causal_mask(positions, key positions) of cached rows without a window: (B, 1, T, S) bool."""
        return cls(mask, None, after_past=True, bf16_products=bf16_products)


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | AttentionMask | None,
              dropout_p: float = 0.0, bias: Tensor | None = None, scale: float | None = None,
              gqa: bool | None = None) -> Tensor:
    """Scaled dot-product attention, softmax(q k^T * scale + bias) v, scale = 1/sqrt(D) unless given.

    q: (B, H, T, D); k, v: (B, K, S, D) with H % K == 0; mask: bool, broadcastable to
    (B, 1, T, S), True = attend (or an AttentionMask built from one); bias: float, broadcastable to
    (B, H, T, S), in q's dtype. gqa: whether K < H, when the caller knows it from its config (sizes
    are symbolic under torch.compile). Returns (B, H, T, D). Fully masked query rows give zeros.
    """
    if gqa is None:
        gqa = bool(k.size(1) != q.size(1))  # a Python bool also under tracing (ONNX export)
    if mask is not None and not isinstance(mask, AttentionMask):
        mask = AttentionMask.build(mask)
    if mask is not None and mask.causal:
        if bias is not None:
            raise ValueError("a causal AttentionMask takes no bias: build the mask for a biased attention")
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, scale=scale, is_causal=True,
                                              enable_gqa=gqa)  # (B, H, T, D)
    attn_mask = mask.safe if mask is not None else None  # (B, 1, T, S) bool
    if bias is not None:
        attn_mask = bias if attn_mask is None else bias.masked_fill(~attn_mask, float("-inf"))  # (B, H, T, S)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, scale=scale,
                                         enable_gqa=gqa)  # (B, H, T, D)
    return out if mask is None or mask.dead is None else out.masked_fill(mask.dead, 0.0)  # (B, H, T, D)


def group_queries(q: Tensor, rows: Tensor, width: int, sources: int) -> Tensor:
    """Queries of decoder rows (R, H, T, D) -> (N, H, width * T, D): row r goes to slot rows[r] of an
    (N, width) grid, so each source's beams attend its keys (N, K, S, D) together. Empty slots are zeros."""
    b, h, t, d = q.shape
    grid = q.new_zeros(sources * width, h, t, d).index_copy_(0, rows, q)  # (N*width, H, T, D)
    return grid.view(sources, width, h, t, d).transpose(1, 2).reshape(sources, h, width * t, d)  # (N, H, width*T, D)


def ungroup_queries(out: Tensor, rows: Tensor, width: int, t: int) -> Tensor:
    """group_queries' inverse for the attention output: (N, H, width * T, D) -> (R, H, T, D)."""
    n, h, _, d = out.shape
    grid = out.view(n, h, width, t, d).transpose(1, 2).reshape(n * width, h, t, d)  # (N*width, H, T, D)
    return grid.index_select(0, rows)  # (R, H, T, D)


class MultiHeadAttention(nn.Module):
    """Multi-head (or grouped-query) attention; self-attention or cross-attention.

    Self-attention may write into a per-layer KV cache (see cache.dense.CacheView); cross-attention
    takes keys/values precomputed once per request by `project_kv`.
    """

    def __init__(self, cfg: BlockConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=cfg.attn_bias)
        self.k_proj = nn.Linear(cfg.d_model, cfg.kv_heads * cfg.head_dim, bias=cfg.attn_bias)
        self.v_proj = nn.Linear(cfg.d_model, cfg.kv_heads * cfg.head_dim, bias=cfg.attn_bias)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=cfg.out_bias)
        self.qkv: nn.Module | None = None  # fuse_qkv(): one projection for q, k and v (self-attention)
        # Qwen3: RMSNorm over each head's D features of q and k, before rotary
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.scale = None if cfg.scale_attention else 1.0  # None: SDPA's 1/sqrt(D)
        self.dropout = cfg.dropout

    def fuse_qkv(self) -> None:
        """Serve q, k and v from one Linear with the three weight matrices stacked (C -> (H + 2K) * D):
        one matrix product instead of three. For self-attention only (cross-attention projects q and
        k/v from different inputs); the separate projections are dropped."""
        fused = stack_linears(self.q_proj, self.k_proj, self.v_proj)  # C -> (H + 2K) * D
        del self.q_proj, self.k_proj, self.v_proj
        self.qkv = fused

    def _split(self, x: Tensor, heads: int, norm: nn.Module | None = None) -> Tensor:
        b, t, _ = x.shape
        x = x.reshape(b, t, heads, self.head_dim)  # (B, T, heads, D)
        if norm is not None:
            x = norm(x)  # (B, T, heads, D): per head
        return x.transpose(1, 2)  # (B, heads, T, D)

    def _project_qkv(self, x: Tensor, adapters: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """(B, T, C) -> q (B, H, T, D), k and v (B, K, T, D), by one fused product when fuse_qkv() ran."""
        if self.qkv is None:
            q = project(self.q_proj, x, adapters)  # (B, T, H*D)
            return (self._split(q, self.n_heads, self.q_norm), *self.project_kv(x, adapters))
        qd, kd = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        q, k, v = project(self.qkv, x, adapters).split([qd, kd, kd], dim=-1)  # (B, T, H*D), (B, T, K*D) x2
        return (self._split(q, self.n_heads, self.q_norm), self._split(k, self.n_kv_heads, self.k_norm),
                self._split(v, self.n_kv_heads))

    def _project_qkv_rotated(self, x: Tensor, rope: tuple[Tensor, Tensor],
                             adapters: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """The fused product's q and k rotated together, as one (B, H + K, T, D) tensor: the rotation's
        elementwise kernels run once a layer instead of twice (what a GPU step is made of), the same
        values as rotating each."""
        b, t, _ = x.shape
        h, kh, d = self.n_heads, self.n_kv_heads, self.head_dim
        assert self.qkv is not None
        qkv = project(self.qkv, x, adapters)  # (B, T, (H + 2K) * D)
        qk = qkv[..., :(h + kh) * d].reshape(b, t, h + kh, d).transpose(1, 2)  # (B, H + K, T, D) view
        q, k = apply_rotary(qk, *rope).split([h, kh], dim=1)  # (B, H, T, D), (B, K, T, D)
        v = qkv[..., (h + kh) * d:].reshape(b, t, kh, d).transpose(1, 2)  # (B, K, T, D)
        return q, k, v

    def project_kv(self, x: Tensor, adapters: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """(B, S, C) -> keys, values (B, K, S, D) each."""
        k = self._split(project(self.k_proj, x, adapters), self.n_kv_heads, self.k_norm)  # (B, K, S, D)
        v = self._split(project(self.v_proj, x, adapters), self.n_kv_heads)  # (B, K, S, D)
        return k, v

    def forward(
        self,
        x: Tensor,
        mask: Tensor | AttentionMask | None,
        rope: tuple[Tensor, Tensor] | None = None,
        cache=None,
        kv: tuple[Tensor, Tensor] | None = None,
        bias: Tensor | None = None,
        adapters: Tensor | None = None,
    ) -> Tensor:
        """x: (B, T, C); mask: (B|1, 1, T|1, S) bool; rope: cos, sin (B, 1, T, D).

        cache: a cache.dense.LayerCache to write this step's keys into (self-attention);
        kv: precomputed (B, K, S, D) keys/values (cross-attention), or (k, v, rows, width) with keys
        (N, K, S, D) one per source and mask (N, 1, 1, S) (cache.cross.CrossCache.grouped); bias: (B|1, H, T, S) added to the
        scores (T5's relative positions); adapters: (B,) int64 each row's adapter slot (-1: none; models/adapters/),
        None: no row has one. Returns (B, T, C).
        """
        b, t, _ = x.shape
        gqa = self.n_kv_heads != self.n_heads
        if kv is None and rope is not None and self.qkv is not None and self.q_norm is None and self.k_norm is None:
            q, k, v = self._project_qkv_rotated(x, rope, adapters)  # (B, H, T, D), (B, K, T, D) x2
        elif kv is None:
            q, k, v = self._project_qkv(x, adapters)  # (B, H, T, D), (B, K, T, D) x2
            if rope is not None:
                q = apply_rotary(q, *rope)  # (B, H, T, D)
                k = apply_rotary(k, *rope)  # (B, K, T, D)
        else:
            q = self._split(project(self.q_proj, x, adapters), self.n_heads, self.q_norm)  # (B, H, T, D)
            k, v = kv[0], kv[1]  # (B, K, S, D) each, or (N, K, S, D) grouped
            if len(kv) == 4:
                q = group_queries(q, kv[2], kv[3], k.size(0))  # (N, H, width*T, D)
        if cache is not None and bias is None and not self.training:
            # the cache stores this step's keys and attends them with the past: a dense cache through
            # attention() below, a paged one through its own decode kernel where it has one
            out = cache.attend(q, k, v, mask, self.scale, gqa)  # (B, H, T, D)
        else:
            if cache is not None:
                k, v = cache.write(k, v)  # (B, K, S, D) each: past + this step
            drop = self.dropout if self.training else 0.0
            out = attention(q, k, v, mask, drop, bias, self.scale, gqa)  # (B|N, H, T', D)
        if kv is not None and len(kv) == 4:
            out = ungroup_queries(out, kv[2], kv[3], t)  # (B, H, T, D)
        out = out.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim)  # (B, T, H*D)
        return project(self.o_proj, out, adapters)  # (B, T, C)
