"""Transformer blocks in native code, one op per layer: a causal stack's decode steps, and an encoder
stack's forward pass.

At one new token per row the work of a block is a few projections and attention over each row's
cached keys (and, in an encoder-decoder, over its source's encoder keys); everything between them
(norms, rotary positions, the cache write, the residuals, the activation) is a few thousand floats
per row. Run as a compiled graph per block, entering the graph (its guards, its Python wrapper) cost
SmolLM2 more per step than the 4-bit products themselves; run eagerly, the small translator's block
is a few dozen dispatches of microseconds each (docs/benchmarks.md, "One op per layer").
models/kernels/block_step.cpp runs the whole block on the same projection and attention kernels,
so a step is one call per layer.

An encoder's forward pass is the same op over its real tokens only (no padding rows): each sequence's
keys and values go to one block of a pool as long as the longest sequence, and every token attends the
first n slots of its sequence's block (n its real tokens), as a decode row attends its cached keys.

It serves exactly the blocks it computes the same way as the model code, and nothing else: RMSNorm or
LayerNorm, pre- or post-norm, a fused q/k/v projection (models/projections.py) and the other
projections held as float32 panels or GGUF-style blocks (models/panels.py), rotary or absolute
positions, no q/k norm, no relative position bias or sliding window, cross-attention over right-padded
sources, a fused gated feed-forward or a plain one (ReLU, GELU, SiLU), in eval mode, on a paged KV
cache whose decode kernel runs (float32 on an AVX2 or AVX-512 CPU). Llama-style decoders and Marian
translators take it; for any other block `layer_args` returns None and the stack runs its blocks as
before. Results are the same arithmetic as the blocks' path with the float operations of the glue in
another order (within ~1e-5; tests/models/test_native_blocks.py), and a row's result does not depend
on its batch (bitwise), as for the kernels.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .kernels import native
from .kv_cache import CrossCache
from .layers import Block, gelu_tanh
from .norms import RMSNorm
from .panels import BlockLinear, PanelLinear

KINDS = {"f32": 0, "q4_1": 1, "q8_0": 2}  # ops.h's Kind
ACTS = {F.silu: 0, F.relu: 1, F.gelu: 2, gelu_tanh: 3}  # block_step.cpp's Act


class LayerArgs(NamedTuple):
    """block_step's arguments that describe one block (the rest describe the step: rows, cache, cross)."""

    norms: list[Tensor]  # the sublayers' norm weights: self[, cross], ff
    norm_biases: list[Tensor | None]
    eps: float
    rms: bool  # RMSNorm, else LayerNorm
    prenorm: bool
    weights: list[Tensor]  # projections: qkv, o[, cross q, cross o], up (gate_up), down
    biases: list[Tensor | None]
    kinds: list[int]  # KINDS
    outs: list[int]
    parts: list[int]  # the activations' 8-bit parts (block formats)
    act: int  # ACTS
    gated: bool
    heads: int
    kv_heads: int
    scale: float

    @property
    def cross(self) -> bool:
        """Whether the block has cross-attention (its two projections)."""
        return len(self.weights) == 6

    @property
    def head_dim(self) -> int:
        return self.outs[0] // (self.heads + 2 * self.kv_heads)


def _projection(m: nn.Module | None) -> tuple | None:
    """(weights, bias, kind, outputs, activation parts) of a projection block_step runs, else None."""
    if isinstance(m, BlockLinear):
        return m.records, m.bias, KINDS[m.fmt], m.out_features, m.activation_bits // 8
    if isinstance(m, PanelLinear) and not m.copy:
        return m.panels, m.bias, KINDS["f32"], m.out_features, 1
    return None


def _norms(norms: list[nn.Module]) -> tuple[list[Tensor], list[Tensor | None], float, bool] | None:
    """(weights, biases, eps, is RMSNorm) of the sublayers' norms, or None unless all are RMSNorm or
    all a LayerNorm over the last dim with weights, with one eps."""
    eps = {getattr(n, "eps", None) for n in norms}
    if len(eps) != 1:
        return None
    if all(isinstance(n, RMSNorm) for n in norms):
        return [n.weight for n in norms], [None] * len(norms), eps.pop(), True
    if all(isinstance(n, nn.LayerNorm) and n.elementwise_affine and len(n.normalized_shape) == 1 for n in norms):
        return [n.weight for n in norms], [n.bias for n in norms], eps.pop(), False
    return None


def layer_args(block: Block) -> LayerArgs | None:
    """The block_step arguments that describe `block` (norms, their biases, eps, RMSNorm or not,
    pre-norm or not, the projections' lists, activation, gated or not, heads, kv heads, scale), or None
    when block_step does not compute it as the block does."""
    attn, cross, ff = block.self_attn, block.cross_attn, block.ff
    if block.training or attn.qkv is None or attn.q_norm is not None or ff.gate is not None:
        return None
    if cross is not None and (cross.q_norm is not None or cross.scale != attn.scale):
        return None
    act = ACTS.get(ff.act)
    norms = _norms([block.self_norm, *([block.cross_norm] if cross is not None else []), block.ff_norm])
    if act is None or norms is None:
        return None
    gated = ff.gate_up is not None
    modules = [attn.qkv, attn.o_proj, *((cross.q_proj, cross.o_proj) if cross is not None else ()),
               ff.gate_up if gated else ff.up, ff.down]
    projections = [_projection(m) for m in modules]
    if any(p is None for p in projections):
        return None
    weights, biases, kinds, outs, parts = (list(column) for column in zip(*projections, strict=True))
    scale = attn.head_dim ** -0.5 if attn.scale is None else attn.scale
    return LayerArgs(*norms, block.prenorm, weights, biases, kinds, outs, parts, act, gated, attn.n_heads,
                     attn.n_kv_heads, scale)


def _signature(block: Block) -> tuple:
    """What layer_args reads that can change after load (modules swapped by quantizing or packing, the
    activation bits, train/eval), read straight from the modules' dictionaries: ~1 us a block, where
    building layer_args through nn.Module's attribute lookups took ~20."""
    subs = block._modules
    mods = [subs.get(name) for name in ("self_norm", "cross_norm", "ff_norm")]
    for name in ("self_attn", "cross_attn", "ff"):
        sub = subs.get(name)
        if sub is not None:
            mods += [sub._modules.get(p) for p in ("qkv", "q_proj", "o_proj", "q_norm", "gate_up", "gate", "up", "down")]
    return (block.training, *mods, *(m.__dict__.get("activation_bits") for m in mods if m is not None))


# Submodules, parameters and buffers assigned anywhere since the kernels were first asked for a stack
# (nn.Module's global registration hooks, installed on that first call): a count that only a swap
# moves, so a step checks its stack's cached layer_args against the modules (~1 us a block, 20 us a
# translator step in practice) only after something was assigned
_assigned = [0]
_watching: list = []


def _count(*_: object) -> None:
    _assigned[0] += 1


def _watch() -> None:
    if not _watching:
        from torch.nn.modules import module

        _watching.extend(register(_count) for register in (module.register_module_module_registration_hook,
                                                            module.register_module_parameter_registration_hook,
                                                            module.register_module_buffer_registration_hook))


class _Cached(NamedTuple):
    quick: tuple  # the assignment count, the blocks' train flags and activation bits when it was checked
    signatures: list[tuple]
    args: list[LayerArgs] | None
    bits: list[nn.Module]  # the modules whose activation_bits layer_args read


# stack's blocks -> what was built for them: kept outside the modules, so that nothing a compiled block
# could guard on changes
_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def stack_args(blocks: nn.ModuleList) -> list[LayerArgs] | None:
    """layer_args of every block, or None unless block_step computes all of them (rebuilt when a
    block's signature changes; the signatures are read again only after a module, parameter or buffer
    was assigned somewhere, or a block's train mode or activation bits changed)."""
    _watch()
    cached = _CACHE.get(blocks)
    if cached is not None and cached.quick == _quick(blocks, cached.bits):
        return cached.args
    signatures = [_signature(b) for b in blocks]
    if cached is not None and cached.signatures == signatures:  # modules compare by identity
        built = cached.args
    else:
        args = [layer_args(b) for b in blocks]
        built = None if any(a is None for a in args) else args
    bits = [m for sig in signatures for m in sig if isinstance(m, nn.Module) and "activation_bits" in m.__dict__]
    _CACHE[blocks] = _Cached(_quick(blocks, bits), signatures, built, bits)
    return built


def _quick(blocks: nn.ModuleList, bits: list[nn.Module]) -> tuple:
    return (_assigned[0], *[b.training for b in blocks], *[m.__dict__["activation_bits"] for m in bits])


def runs(cache, t: int, x: Tensor) -> bool:
    """Whether this step can take decode_layers: one float32 token per row on a paged cache whose
    decode kernel runs (float32 on the CPU)."""
    return t == 1 and cache is not None and cache.cache.paged and cache.decode_kernel and x.dtype == torch.float32


def _native_here(x: Tensor) -> bool:
    return x.dtype == torch.float32 and x.device.type == "cpu" and native.available()


def encode_layers(layers: list[LayerArgs], x: Tensor, keep: Tensor) -> Tensor | None:
    """An encoder stack's blocks over x (B, T, C) float32, keep (B, T) True = real token (left or right
    padding): one block_step per layer over the real tokens. Returns (B, T, C) with zeros at padding
    (what the blocks' path leaves there is never read: pooling and cross-attention mask it), or None
    when the op does not run here or the blocks attend across sequences (cross-attention)."""
    first = layers[0]
    if not _native_here(x) or first.cross:
        return None
    b, t, c = x.shape
    real = keep.reshape(-1).nonzero().squeeze(1)  # (M,) flat index of each real token
    lengths = keep.sum(-1)  # (B,)
    longest = int(lengths.max())
    if longest == 0:
        return None
    seq = real // t  # (M,) each token's sequence
    rank = keep.cumsum(-1).reshape(-1).index_select(0, real) - 1  # (M,) its place among the real tokens
    # sequence s's keys: block s of the pool (slot j = its j-th real token), plus the trash row last
    k_pool = x.new_empty(b * first.kv_heads * longest + 1, first.head_dim)  # (B * K * S + 1, D)
    v_pool = torch.empty_like(k_pool)
    heads_k = torch.arange(first.kv_heads, device=x.device)  # (K,)
    slots = ((seq[:, None] * first.kv_heads + heads_k[None, :]) * longest + rank[:, None]).reshape(-1)  # (M * K,)
    tables, keys = seq[:, None].contiguous(), lengths.index_select(0, seq)  # (M, 1), (M,)
    h = x.reshape(b * t, c).index_select(0, real)  # (M, C)
    for layer in layers:
        h = _step(layer, h, None, k_pool, v_pool, slots, tables, keys, longest)  # (M, C)
    return x.new_zeros(b * t, c).index_copy_(0, real, h).view(b, t, c)  # (B, T, C)


def decode_layers(layers: list[LayerArgs], x: Tensor, rope: tuple[Tensor, Tensor] | None, cache,
                  cross: CrossCache | None = None) -> Tensor | None:
    """x (B, 1, C) float32 through every layer's block_step; rope: cos, sin (B, 1, 1, D) or None;
    cache: a PagedCacheView after begin(1) whose layers attend through the decode kernel; cross: the
    encoder's keys/values (an encoder-decoder's stack). Returns (B, 1, C), or None when this step's
    cross-attention is not one block_step runs (the caller runs its blocks)."""
    b, _, c = x.shape
    if (cross is not None) != layers[0].cross:  # the blocks' cross-attention and this step's
        return None
    sources = None
    if cross is not None:
        sources = cross.row_sources()  # (B, 1), (B,)
        if sources is None or sources[0].size(0) != b:
            return None
    rope = tuple(r.reshape(b, -1).contiguous() for r in rope) if rope is not None else None  # (B, D) each
    h = x.reshape(b, c).contiguous()  # (B, C)
    for i, layer in enumerate(layers):
        lc = cache.layer(i)
        kv = cross.kv[i] if cross is not None else None  # (N, K, S, D) each
        h = _step(layer, h, rope, lc.flat_k, lc.flat_v, lc.slots, lc.tables, lc.keys, lc.block,
                  kv, sources)  # (B, C)
    return h.view(b, 1, c)  # (B, 1, C)


def _step(layer: LayerArgs, h: Tensor, rope: tuple[Tensor, Tensor] | None, k_pool: Tensor, v_pool: Tensor,
          slots: Tensor, tables: Tensor, keys: Tensor, block: int, kv: tuple[Tensor, Tensor] | None = None,
          sources: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """One block_step: h (B, C) -> (B, C); rope (B, D) each; kv, sources: cross-attention's keys/values
    (N, K, S, D) and each row's source with its key count (CrossCache.row_sources)."""
    cos, sin = rope if rope is not None else (None, None)
    ck, cv = (t.contiguous() for t in kv) if kv is not None else (None, None)
    src, src_keys = sources if sources is not None else (None, None)
    return torch.ops.ts_panels.block_step(
        h, layer.norms, layer.norm_biases, layer.eps, layer.rms, layer.prenorm, layer.weights, layer.biases,
        layer.kinds, layer.outs, layer.parts, layer.act, layer.gated, cos, sin, k_pool, v_pool, slots, tables, keys,
        ck, cv, src, src_keys, layer.heads, layer.kv_heads, block, layer.scale)  # (B, C)
