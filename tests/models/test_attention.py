"""Masks, the shared attention() function and MultiHeadAttention.

Dimension legend:
    B batch rows, T query length, S key length, H query heads, K key/value heads (H % K == 0;
    K < H is grouped-query attention), D head dim, C model dim (H * D).
Masks are bool with True = attend: padding (B, 1, 1, S), causal (B, 1, T, S).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from models.attention import MultiHeadAttention, attention, causal_mask, padding_mask, positions_from_mask
from models.cache.dense import KVCache
from models.config import DecoderConfig
from models.positions import RotaryPositions

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors: one thread is fastest


B, T, S, D = 3, 5, 7, 8


def reference_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
    """softmax(q k^T / sqrt(D)) v written out by hand; K heads repeated to H (repeat_interleave)."""
    rep = q.size(1) // k.size(1)
    k = k.repeat_interleave(rep, dim=1)  # (B, H, S, D)
    v = v.repeat_interleave(rep, dim=1)  # (B, H, S, D)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.size(-1))  # (B, H, T, S)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1) @ v  # (B, H, T, D)


def qkv(h: int, k_heads: int, t: int = T, s: int = S, seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, h, t, D, generator=g)  # (B, H, T, D)
    k = torch.randn(B, k_heads, s, D, generator=g)  # (B, K, S, D)
    v = torch.randn(B, k_heads, s, D, generator=g)  # (B, K, S, D)
    return q, k, v


# --- mask helpers -----------------------------------------------------------------------------------


def test_padding_mask_shape_and_values() -> None:
    keep = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])  # (B, S) int
    mask = padding_mask(keep)
    assert mask.shape == (2, 1, 1, 4) and mask.dtype == torch.bool
    assert torch.equal(mask[:, 0, 0], keep.bool())


@pytest.mark.parametrize("batched_keys", [False, True])
def test_causal_mask_is_right_aligned_per_row(batched_keys: bool) -> None:
    offsets = torch.tensor([0, 2, 4])  # rows sit at different steps (cached decoding)
    q_pos = offsets[:, None] + torch.arange(3)[None, :]  # (B, T=3)
    k_pos = torch.arange(S)  # (S,)
    if batched_keys:
        k_pos = k_pos.expand(B, S)  # (B, S)
    mask = causal_mask(q_pos, k_pos)
    assert mask.shape == (B, 1, 3, S) and mask.dtype == torch.bool
    want = torch.arange(S)[None, None, :] <= q_pos[:, :, None]  # (B, T, S)
    assert torch.equal(mask[:, 0], want)
    assert mask[1, 0, 0].sum() == 3  # row 1's first query sits at position 2: keys 0, 1, 2


@pytest.mark.parametrize(("keep", "want"), [
    ([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], [[0, 1, 2, 2, 2], [0, 1, 2, 3, 4]]),  # right padding
    ([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]]),  # left padding
])
def test_positions_from_mask_skip_padding(keep: list[list[int]], want: list[list[int]]) -> None:
    keep_t = torch.tensor(keep, dtype=torch.bool)  # (B, T)
    pos = positions_from_mask(keep_t)
    assert pos.shape == keep_t.shape and pos.dtype == torch.long
    assert torch.equal(pos, torch.tensor(want))
    assert torch.equal(pos[0][keep_t[0]], torch.arange(3))  # real tokens count from 0 on either side


# --- attention() ------------------------------------------------------------------------------------


def _masks() -> dict[str, Tensor | None]:
    """Masks of every kind, none with a fully masked query row."""
    keep = torch.arange(S)[None, :] < torch.tensor([S, 4, 2])[:, None]  # (B, S): rows of 7, 4, 2 keys
    q_pos = torch.tensor([S - T, 0, 0])[:, None] + torch.arange(T)[None, :]  # (B, T)
    return {
        "none": None,
        "padding": padding_mask(keep),  # (B, 1, 1, S)
        "causal": causal_mask(q_pos, torch.arange(S)),  # (B, 1, T, S)
        "causal+padding": causal_mask(q_pos, torch.arange(S)) & padding_mask(keep),  # (B, 1, T, S)
    }


@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("mask_kind", sorted(_masks()))
def test_attention_matches_reference(heads: tuple[int, int], mask_kind: str) -> None:
    q, k, v = qkv(*heads)
    mask = _masks()[mask_kind]
    out = attention(q, k, v, mask)
    assert out.shape == (B, heads[0], T, D)
    torch.testing.assert_close(out, reference_attention(q, k, v, mask), atol=1e-5, rtol=1e-5)


def test_fully_masked_query_row_gives_exact_zeros() -> None:
    q, k, v = qkv(4, 2)
    mask = torch.ones(B, 1, T, S, dtype=torch.bool)  # (B, 1, T, S)
    mask[0, 0, 1] = False  # row 0, query 1 sees nothing
    mask[2] = False  # row 2 sees nothing at all (a row that is all padding)
    q.requires_grad_(True)
    out = attention(q, k, v, mask)  # (B, H, T, D)
    assert not out.isnan().any()
    assert torch.equal(out[0, :, 1], torch.zeros_like(out[0, :, 1]))
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    live = mask[:, 0].any(-1)  # (B, T)
    ref = reference_attention(q, k, v, mask)  # NaN on dead rows
    torch.testing.assert_close(out.transpose(1, 2)[live], ref.transpose(1, 2)[live], atol=1e-5, rtol=1e-5)
    out.sum().backward()
    assert torch.isfinite(q.grad).all()


def test_attention_dropout_only_when_asked() -> None:
    q, k, v = qkv(2, 2)
    torch.manual_seed(0)
    dropped = attention(q, k, v, None, dropout_p=0.5)
    assert not torch.allclose(dropped, attention(q, k, v, None))


# --- MultiHeadAttention -----------------------------------------------------------------------------


def _cfg(**changes) -> DecoderConfig:
    return DecoderConfig(vocab_size=50, d_model=32, n_heads=4, d_ff=64, n_layers=1, max_positions=32,
                         **changes)


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_multi_head_attention_shapes(kv_heads: int) -> None:
    torch.manual_seed(0)
    cfg = _cfg(n_kv_heads=kv_heads)
    mha = MultiHeadAttention(cfg).eval()
    x = torch.randn(B, T, cfg.d_model)  # (B, T, C)
    memory = torch.randn(B, S, cfg.d_model)  # (B, S, C)

    k, v = mha.project_kv(memory)
    assert k.shape == v.shape == (B, kv_heads, S, cfg.head_dim)
    assert mha.q_proj.out_features == cfg.n_heads * cfg.head_dim
    assert mha.k_proj.out_features == mha.v_proj.out_features == kv_heads * cfg.head_dim

    slots = torch.arange(T)
    self_mask = causal_mask(slots.expand(B, T), slots)  # (B, 1, T, T)
    assert mha(x, self_mask).shape == (B, T, cfg.d_model)
    cross_mask = padding_mask(torch.ones(B, S, dtype=torch.bool))  # (B, 1, 1, S)
    assert mha(x, cross_mask, kv=(k, v)).shape == (B, T, cfg.d_model)


def test_multi_head_attention_with_rope_and_cache() -> None:
    """A cached forward returns (B, T, C), writes K/V at the rows' slots, and leaves lengths to the caller."""
    torch.manual_seed(0)
    cfg = _cfg(n_kv_heads=2, position="rotary")
    mha = MultiHeadAttention(cfg).eval()
    cache = KVCache(1, B, cfg.kv_heads, 16, cfg.head_dim)
    view = cache.view()
    positions, s = view.begin(T)  # (B, T), S
    rope = RotaryPositions(cfg.head_dim, cfg.rope_theta)(positions, torch.float32)  # (B, 1, T, D) x2
    assert rope[0].shape == (B, 1, T, cfg.head_dim)
    x = torch.randn(B, T, cfg.d_model)  # (B, T, C)
    out = mha(x, causal_mask(positions, torch.arange(s)), rope, cache=view.layer(0))
    assert out.shape == (B, T, cfg.d_model)
    assert torch.equal(cache.lengths, torch.zeros(B, dtype=torch.long))
    assert cache.k[0][:, :, :T].abs().sum() > 0 and cache.k[0][:, :, T:].abs().sum() == 0
