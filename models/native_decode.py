"""Decode steps of a Llama-style causal stack in native code, one op per layer.

At one new token per row the work of a block is four projections and an attention over each row's
cached keys; everything between them (two RMSNorms, rotary positions, the cache write, the residuals,
SiLU(gate) * up) is a few thousand floats per row. Run as a compiled graph per block, entering the
graph (its guards, its Python wrapper) cost SmolLM2 more per step than the 4-bit products themselves
(docs/benchmarks.md, "One op per layer"). models/kernels/decode_layer.cpp runs the whole block on the
same projection and attention kernels, so a step is one call per layer.

It serves exactly the blocks it computes the same way as the model code, and nothing else: pre-norm,
RMSNorm, fused q/k/v and gate/up projections (models/projections.py) held as float32 panels or
GGUF-style blocks (models/panels.py), rotary positions, no q/k norm, no attention bias table, no cross
attention, SwiGLU, in eval mode, on a paged KV cache whose decode kernel runs (float32 on an AVX2 or
AVX-512 CPU). `layer_args` returns None for any other block and the stack runs its blocks as before.
Results are the same arithmetic as the blocks' path with the float operations of the glue in another
order (within ~1e-5; tests/models/test_native_decode.py), and a row's result does not depend on its
batch (bitwise), as for the kernels.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .layers import Block
from .norms import RMSNorm
from .panels import BlockLinear, PanelLinear

KINDS = {"f32": 0, "q4_1": 1, "q8_0": 2}  # ops.h's Kind


def _projection(m: nn.Module | None) -> tuple | None:
    """(weights, bias, kind, outputs, activation parts) of a projection decode_layer runs, else None."""
    if isinstance(m, BlockLinear):
        return m.records, m.bias, KINDS[m.fmt], m.out_features, m.activation_bits // 8
    if isinstance(m, PanelLinear) and not m.copy:
        return m.panels, m.bias, KINDS["f32"], m.out_features, 1
    return None


def layer_args(block: Block) -> tuple | None:
    """The decode_layer arguments that describe `block` (norms, eps, the four projections' lists,
    heads, kv heads, scale), or None when decode_layer does not compute it as the block does."""
    attn, ff = block.self_attn, block.ff
    if (block.training or not block.prenorm or block.cross_attn is not None or attn.q_norm is not None
            or ff.gate_up is None or ff.act is not F.silu):
        return None
    norms = block.self_norm, block.ff_norm
    if not all(isinstance(n, RMSNorm) for n in norms) or norms[0].eps != norms[1].eps:
        return None
    projections = [_projection(m) for m in (attn.qkv, attn.o_proj, ff.gate_up, ff.down)]
    if any(p is None for p in projections):
        return None
    weights, biases, kinds, outs, parts = (list(column) for column in zip(*projections, strict=True))
    scale = attn.head_dim ** -0.5 if attn.scale is None else attn.scale
    return (norms[0].weight, norms[1].weight, norms[0].eps, weights, biases, kinds, outs, parts,
            attn.n_heads, attn.n_kv_heads, scale)


def _signature(block: Block) -> tuple:
    """What layer_args reads that can change after load (modules swapped by quantizing or packing, the
    activation bits, train/eval), read straight from the modules' dictionaries: ~1 us a block, where
    building layer_args through nn.Module's attribute lookups took ~20."""
    attn, ff = block._modules["self_attn"], block._modules["ff"]
    mods = (attn._modules.get("qkv"), attn._modules.get("o_proj"), attn._modules.get("q_norm"),
            ff._modules.get("gate_up"), ff._modules.get("down"), block._modules.get("self_norm"),
            block._modules.get("ff_norm"), block._modules.get("cross_attn"))
    return (block.training, *mods, *(m.__dict__.get("activation_bits") for m in mods if m is not None))


# stack's blocks -> (their signatures, their layer_args or None): kept outside the modules, so that
# nothing a compiled block could guard on changes
_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def stack_args(blocks: nn.ModuleList) -> list[tuple] | None:
    """layer_args of every block, or None unless decode_layer computes all of them (rebuilt when a
    block's signature changes)."""
    signatures = [_signature(b) for b in blocks]
    cached = _CACHE.get(blocks)
    if cached is not None and cached[0] == signatures:  # modules compare by identity
        return cached[1]
    args = [layer_args(b) for b in blocks]
    built = None if any(a is None for a in args) else args
    _CACHE[blocks] = (signatures, built)
    return built


def decode_layers(layers: list[tuple], x: Tensor, rope: tuple[Tensor, Tensor], cache) -> Tensor:
    """x (B, 1, C) float32 through every layer's decode_layer; rope: cos, sin (B, 1, 1, D); cache: a
    PagedCacheView after begin(1) whose layers attend through the decode kernel. Returns (B, 1, C)."""
    b, _, c = x.shape
    cos, sin = (r.reshape(b, -1).contiguous() for r in rope)  # (B, D) each
    h = x.reshape(b, c).contiguous()  # (B, C)
    op = torch.ops.ts_panels.decode_layer
    for i, (norm1, norm2, eps, weights, biases, kinds, outs, parts, heads, kv_heads, scale) in enumerate(layers):
        lc = cache.layer(i)
        h = op(h, norm1, norm2, eps, weights, biases, kinds, outs, parts, cos, sin, lc.flat_k, lc.flat_v, lc.slots,
               lc.tables, lc.keys, heads, kv_heads, lc.block, scale)  # (B, C)
    return h.view(b, 1, c)  # (B, 1, C)


def runs(cache, t: int, x: Tensor, rope: tuple[Tensor, Tensor] | None) -> bool:
    """Whether this step can take decode_layers: one float32 token per row with rotary positions, on a
    paged cache whose decode kernel runs (float32 on the CPU)."""
    return (t == 1 and rope is not None and cache is not None and cache.cache.paged and cache.cache.decode_kernel
            and x.dtype == torch.float32)
