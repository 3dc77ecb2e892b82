"""The native backend: a whole stack of blocks in one call of our C++ kernels (kernels/block_step.cpp).

    B rows, T tokens a row, M real tokens, C model dim, K kv heads, D head dim, S keys, V vocabulary

Turns a loaded stack into the kernels' arguments once: `NativeEncoder` (an encoder's pass over the
real tokens of a padded batch), `NativeDecoder` (a causal stack's decode step, one token a row on a
paged cache, with embedding, final norm and, where the model allows, its head in the same call).
Built by the planner (planner.py) from the model as it serves (quantized, fused, packed, eval);
`Unsupported` says why not, for the plan. A built backend never falls back: a call it cannot compute
raises, and a swapped module needs a new plan. float32 on the CPU; results are the torch blocks' to
float32 rounding (block formats: to their activation codes); a row's bits do not depend on the others.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..adapters.lora import LoraLinear
from ..cache.cross import CrossCache
from ..kernels import native
from ..layers import Block, Embeddings, gelu_tanh
from ..norms import RMSNorm
from ..positions import LearnedPositions, RotaryPositions, SinusoidalPositions
from ..projections.panels import Bf16PanelLinear, BlockLinear, PanelLinear

KINDS = {"f32": 0, "q4_1": 1, "q8_0": 2, "bf16": 3}  # ops.h's Kind
ACTS = {F.silu: 0, F.relu: 1, F.gelu: 2, gelu_tanh: 3}  # block_step.cpp's Act


class Unsupported(Exception):
    """What the native step does not compute as the model does; str(e) is the plan's reason."""


def here(dtype: torch.dtype, device: torch.device) -> None:
    """Raise Unsupported unless the kernels run for this dtype and device in this process."""
    if device.type != "cpu":
        raise Unsupported(f"our CPU kernels; this model is on {device.type}")
    if dtype != torch.float32:
        raise Unsupported(f"float32 weights; this model is {str(dtype).removeprefix('torch.')}")
    if not native.available():
        raise Unsupported(f"our CPU kernels, which are off here ({native.unavailable_reason()})")


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
    adapters: list[LoraLinear | None]  # each projection's adapter slots (models/adapters/), None: none

    @property
    def cross(self) -> bool:
        """Whether the block has cross-attention (its two projections)."""
        return len(self.weights) == 6

    @property
    def head_dim(self) -> int:
        return self.outs[0] // (self.heads + 2 * self.kv_heads)


def _projection(m: nn.Module | None, name: str, copies: bool = False) -> tuple:
    """(weights, bias, kind, outputs, activation parts) of a projection block_step runs (a tied head's
    packed copy of the embedding matrix only with `copies`); of its base when it carries adapters."""
    if isinstance(m, LoraLinear):
        m = m.base
    if isinstance(m, BlockLinear):
        return m.records, m.bias, KINDS[m.fmt], m.out_features, m.activation_bits // 8
    if isinstance(m, PanelLinear) and (copies or not m.copy):
        return m.panels, m.bias, KINDS["f32"], m.out_features, 1
    if isinstance(m, Bf16PanelLinear) and (copies or not m.copy):
        return m.panels, m.bias, KINDS["bf16"], m.out_features, 1
    raise Unsupported(f"float32 or bfloat16 panels or q4_1/q8_0 blocks; its {name} projection is {type(m).__name__}")


def _norms(norms: list[nn.Module]) -> tuple[list[Tensor], list[Tensor | None], float, bool]:
    """(weights, biases, eps, is RMSNorm) of the sublayers' norms: all RMSNorm, or all LayerNorm over
    the last dim with weights, with one eps."""
    eps = {getattr(n, "eps", None) for n in norms}
    if len(eps) == 1:
        if all(isinstance(n, RMSNorm) for n in norms):
            return [n.weight for n in norms], [None] * len(norms), eps.pop(), True
        if all(isinstance(n, nn.LayerNorm) and n.elementwise_affine and len(n.normalized_shape) == 1 for n in norms):
            return [n.weight for n in norms], [n.bias for n in norms], eps.pop(), False
    raise Unsupported(f"RMSNorm or affine LayerNorm with one eps; its norms are {sorted({type(n).__name__ for n in norms})}")


def layer_args(block: Block) -> LayerArgs:
    """The block_step arguments that describe `block`; Unsupported when block_step does not compute it
    as the block does."""
    attn, cross, ff = block.self_attn, block.cross_attn, block.ff
    if block.training:
        raise Unsupported("eval mode; the block is training")
    if attn.qkv is None or ff.gate is not None:
        raise Unsupported("fused q/k/v and gate/up projections (fuse: true)")
    if attn.q_norm is not None:
        raise Unsupported("q/k norms")
    if cross is not None and (cross.q_norm is not None or cross.scale != attn.scale):
        raise Unsupported("cross-attention scaled as self-attention, without q/k norms")
    act = ACTS.get(ff.act)
    if act is None:
        raise Unsupported(f"SiLU, ReLU or GELU; the activation is {getattr(ff.act, '__name__', ff.act)}")
    norms = _norms([block.self_norm, *([block.cross_norm] if cross is not None else []), block.ff_norm])
    gated = ff.gate_up is not None
    names = ["qkv", "o_proj", *(("cross q_proj", "cross o_proj") if cross is not None else ()), "up", "down"]
    modules = [attn.qkv, attn.o_proj, *((cross.q_proj, cross.o_proj) if cross is not None else ()),
               ff.gate_up if gated else ff.up, ff.down]
    projections = [_projection(m, name) for m, name in zip(modules, names, strict=True)]
    weights, biases, kinds, outs, parts = (list(column) for column in zip(*projections, strict=True))
    scale = attn.head_dim ** -0.5 if attn.scale is None else attn.scale
    adapters = [m if isinstance(m, LoraLinear) else None for m in modules]
    return LayerArgs(*norms, block.prenorm, weights, biases, kinds, outs, parts, act, gated, attn.n_heads,
                     attn.n_kv_heads, scale, adapters)


_SHARED = ("eps", "rms", "prenorm", "act", "gated", "heads", "kv_heads", "scale", "cross")
_LISTS = ("norms", "norm_biases", "weights", "biases", "kinds", "outs", "parts")


class Stack(NamedTuple):
    """A stack's blocks as stack_step runs them: their LayerArgs, and all of it held once by the
    kernels' module (every layer's lists end to end and what the layers share)."""

    layers: list[LayerArgs]
    native: object

    @property
    def cross(self) -> bool:
        return self.layers[0].cross

    @property
    def head_dim(self) -> int:
        return self.layers[0].head_dim

    @property
    def kv_heads(self) -> int:
        return self.layers[0].kv_heads


def stack_args(blocks: nn.ModuleList) -> Stack:
    """The stack_step arguments of every block; Unsupported (naming the block) unless the op computes
    all of them and they share _SHARED."""
    layers = []
    for i, block in enumerate(blocks):
        try:
            layers.append(layer_args(block))
        except Unsupported as e:
            raise Unsupported(f"{e} (block {i})") from None
    if not layers:
        raise Unsupported("at least one block")
    shared = [tuple(getattr(a, f) for f in _SHARED) for a in layers]
    differ = [f for j, f in enumerate(_SHARED) if len({s[j] for s in shared}) > 1]
    if differ:
        raise Unsupported(f"blocks alike in {', '.join(differ)}")
    n, nb, w, b, k, o, p = ([item for a in layers for item in getattr(a, f)] for f in _LISTS)
    eps, rms, prenorm, act, gated, heads, kv_heads, scale, cross = shared[0]
    held = native.module().Blocks(n, nb, eps, rms, prenorm, w, b, k, o, p, act, gated, heads, kv_heads, scale,
                                  len(layers), cross)
    for index, lin in enumerate(m for a in layers for m in a.adapters):
        if lin is not None:  # the same tensors the torch forward reads: a loaded adapter is seen by both
            held.set_lora(index, lin.a, lin.bt, lin.ranks, list(lin.bounds), lin.rank, lin.scales)
    return Stack(layers, held)


class Embedding(NamedTuple):
    """What stack_step needs to embed a row's token itself (Embeddings.forward's arithmetic)."""

    table: Tensor  # (V, C) float32
    scale: float
    positions: Tensor | None  # (P, C) float32: the absolute position rows, None without (rotary)


def embedding_args(embed: Embeddings) -> Embedding | None:
    """The token table, scale and position table of `embed` when stack_step computes it as
    Embeddings.forward does (no token types, no embedding norm, eval mode, float32 tables), else None."""
    table = embed.tokens.weight
    if embed.training or embed.types is not None or embed.norm is not None or embed.tokens.max_norm is not None:
        return None
    positions = embed.positions
    rows = None
    if isinstance(positions, SinusoidalPositions):
        rows = positions.table
    elif isinstance(positions, LearnedPositions):
        rows = positions.weight
    elif positions is not None:
        return None
    tables = [table] if rows is None else [table, rows]
    if any(t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous() for t in tables):
        return None
    return Embedding(table, float(embed.scale), rows)


class FinalNorm(NamedTuple):
    weight: Tensor  # (C,)
    bias: Tensor | None
    eps: float
    rms: bool


def final_norm_args(norm: nn.Module) -> FinalNorm:
    """A stack's final norm as stack_step applies it; Unsupported for another kind of norm."""
    (weight,), (bias,), eps, rms = _norms([norm])
    return FinalNorm(weight, bias, eps, rms)


class Head(NamedTuple):
    """A model's output projection as stack_step applies it after the final norm (head_args)."""

    weight: Tensor  # panels or blocks (models/projections/panels.py)
    bias: Tensor | None  # (V,) float32: its own, or the model's bias added after it (Marian's final_logits_bias)
    kind: int  # KINDS
    n: int  # V
    parts: int


def head_args(projection: nn.Module | None, bias_after: Tensor | None = None) -> Head:
    """The Head of `projection` (with `bias_after`, a (V,) float32 bias the model adds after it, if any)
    when stack_step computes it as the model does: a projection block_step runs, at most one bias."""
    if projection is None:
        raise Unsupported("an output projection of its own or a packed copy of the tied embedding")
    weight, bias, kind, n, parts = _projection(projection, "output", copies=True)
    if bias_after is not None:  # the float32 panels add a bias as each output is stored: the same addition
        if kind not in (KINDS["f32"], KINDS["bf16"]) or bias is not None or bias_after.dtype != torch.float32 \
                or bias_after.shape != (n,):
            raise Unsupported("float32 or bfloat16 panels for a head with a bias after it (Marian's final_logits_bias)")
        bias = bias_after
    return Head(weight, bias, kind, n, parts)


@functools.lru_cache(maxsize=64)
def _unpadded_rows(b: int, t: int, kv_heads: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """The encoder pass's slots, tables and key counts for B rows of T real tokens each (no padding):
    what the general path derives from `keep`, without its dozen small ops per call. Read-only."""
    seq = torch.arange(b, device=device).repeat_interleave(t)  # (B * T,) each token's sequence
    rank = torch.arange(t, device=device).repeat(b)  # (B * T,) its place in it
    heads_k = torch.arange(kv_heads, device=device)  # (K,)
    slots = ((seq[:, None] * kv_heads + heads_k[None, :]) * t + rank[:, None]).reshape(-1)  # (B * T * K,)
    return slots, seq[:, None].contiguous(), torch.full((b * t,), t, device=device)  # (M * K,), (M, 1), (M,)


@dataclass(frozen=True)
class NativeEncoder:
    """An encoder stack's blocks as one stack_step over the real tokens: each sequence's keys and values
    go to one block of a pool as long as its longest sequence, and every token attends the first n
    slots of its sequence's block (n its real tokens), as a decode row attends its cached keys."""

    stack: Stack

    @classmethod
    def build(cls, stack: nn.Module) -> NativeEncoder:
        """From an EncoderStack (or a translator's source encoder); Unsupported with the reason."""
        if stack.relative_bias is not None:
            raise Unsupported("absolute or rotary positions; this stack has T5's relative position bias")
        weight = stack.embed.tokens.weight
        here(weight.dtype, weight.device)
        return cls(stack_args(stack.blocks))

    def __call__(self, x: Tensor, keep: Tensor | None, adapters: Tensor | None = None) -> Tensor:
        """x (B, T, C) float32, keep (B, T) True = real token (left or right padding; None: all real),
        adapters (B,) int64 each row's adapter slot (-1: none) -> (B, T, C), zeros at padding (pooling and
        cross-attention never read them)."""
        stack = self.stack
        b, t, c = x.shape
        n = len(stack.layers)
        if keep is None:
            pool = x.new_empty(b * stack.kv_heads * t + 1, stack.head_dim)  # (B * K * T + 1, D)
            slots, tables, keys = _unpadded_rows(b, t, stack.kv_heads, x.device)
            a = _args([pool] * n, [torch.empty_like(pool)] * n, t)
            if adapters is not None:
                a.adapters = adapters.repeat_interleave(t)  # (B * T,) each token's row's slot
            h = _run(stack, a, x.reshape(b * t, c), tables, slots=slots, keys=keys)  # (B * T, C)
            return h.view(b, t, c)  # (B, T, C)
        real = keep.reshape(-1).nonzero().squeeze(1)  # (M,) flat index of each real token
        lengths = keep.sum(-1)  # (B,)
        longest = int(lengths.max())
        seq = real // t  # (M,) each token's sequence
        rank = keep.cumsum(-1).reshape(-1).index_select(0, real) - 1  # (M,) its place among the real tokens
        # sequence s's keys: block s of the pool (slot j = its j-th real token), plus the trash row last; every
        # layer writes its keys there before any token attends them, so the layers share one pool
        k_pool = x.new_empty(b * stack.kv_heads * max(longest, 1) + 1, stack.head_dim)  # (B * K * S + 1, D)
        v_pool = torch.empty_like(k_pool)
        heads_k = torch.arange(stack.kv_heads, device=x.device)  # (K,)
        slots = ((seq[:, None] * stack.kv_heads + heads_k[None, :]) * longest + rank[:, None]).reshape(-1)  # (M * K,)
        tables, keys = seq[:, None].contiguous(), lengths.index_select(0, seq)  # (M, 1), (M,)
        h = x.reshape(b * t, c).index_select(0, real)  # (M, C)
        if h.size(0):
            a = _args([k_pool] * n, [v_pool] * n, longest)
            if adapters is not None:
                a.adapters = adapters.index_select(0, seq)  # (M,) each token's row's slot
            h = _run(stack, a, h, tables, slots=slots, keys=keys)  # (M, C)
        return x.new_zeros(b * t, c).index_copy_(0, real, h).view(b, t, c)  # (B, T, C)


class CrossRows(NamedTuple):
    """A decode step's cross-attention inputs for one row layout (CrossCache.row_sources): each layer's
    encoder keys and values, contiguous, and each row's source with its real key count."""

    cross: CrossCache
    k: list[Tensor]  # (N, K, S_src, D) each
    v: list[Tensor]
    sources: Tensor  # (B, 1) int64
    counts: Tensor  # (B,) int64


@dataclass(frozen=True)
class NativeDecoder:
    """A causal stack's decode step in one stack_step: every block, and where the model allows the
    token embedding, the final norm and the output head (then the step returns logits)."""

    stack: Stack
    embed: Embeddings  # the stack's, run in torch when `embedding` is None
    embedding: Embedding | None
    rotary: RotaryPositions | None
    final: FinalNorm | None
    norm: nn.Module | None  # the stack's final norm, run in torch after the step when `final` is None
    head: Head | None
    # the StepArgs of the last cache and cross rows stepped on (what stays the same from step to step),
    # with that cache and those rows: [cache, cross, args]
    _held: list = field(default_factory=list, init=False, compare=False, repr=False)

    @classmethod
    def build(cls, stack: nn.Module, head: Callable[[], Head] | None = None) -> NativeDecoder:
        """From a CausalStack on a paged cache, with the model's output projection (`head` builds its
        head_args) when the step should return logits; Unsupported with the reason."""
        if stack.relative_bias is not None:
            raise Unsupported("absolute or rotary positions; this stack has T5's relative position bias")
        if stack.window is not None:
            raise Unsupported("a paged KV cache; a sliding window keeps the dense ring")
        weight = stack.embed.tokens.weight
        here(weight.dtype, weight.device)
        blocks = stack_args(stack.blocks)
        projection = head() if head is not None else None
        final = None
        if stack.norm is not None:
            try:
                final = final_norm_args(stack.norm)
            except Unsupported:
                if projection is not None:  # a norm the op does not compute comes before the head
                    raise
                # otherwise the stack's norm runs as a torch op after the step
        return cls(blocks, stack.embed, embedding_args(stack.embed), stack.rotary, final, stack.norm, projection)

    def detail(self) -> str:
        inside = ["blocks"] + (["embedding"] if self.embedding is not None else []) + (
            ["final norm"] if self.final is not None else []) + (["head"] if self.head is not None else [])
        return " + ".join(inside) + " in one call"

    def cross_rows(self, cross: CrossCache | None) -> CrossRows | None:
        """The step's cross-attention inputs for this row layout (a search keeps them while its rows stay
        as they are); ValueError where the blocks and the sources disagree."""
        if (cross is not None) != self.stack.cross:
            raise ValueError("these blocks have cross-attention and no sources were given, or the reverse")
        if cross is None:
            return None
        sources = cross.row_sources()  # (B, 1), (B,)
        if sources is None:
            raise ValueError("the native step attends right-padded sources with at least one token each")
        kv = [tuple(t.contiguous() for t in pair) for pair in cross.kv]  # (N, K, S, D) each
        return CrossRows(cross, [k for k, _ in kv], [v for _, v in kv], *sources)

    def __call__(self, ids: Tensor, cache, cross: CrossRows | None = None, adapters: Tensor | None = None) -> Tensor:
        """ids (B, 1) over `cache`, a PagedCacheView whose decode kernel runs (the step begins it), adapters
        (B,) int64 each row's adapter slot (-1: none; None: no row has one) -> (B, 1, C), or the logits
        (B, 1, V) with a head."""
        b = ids.size(0)
        if cross is not None and cross.sources.size(0) != b:
            raise ValueError(f"cross rows for {cross.sources.size(0)} rows; this step has {b}")
        past = cache.begin_decode()  # the rows' lengths: the op derives the new keys' slots and positions
        positions = None  # (B, 1), where Python needs them
        if self.embedding is None or self.rotary is not None:
            positions = torch.tensor(past, dtype=torch.long, device=ids.device).view(-1, 1)  # (B, 1)
        rows = TokenRows(ids, positions, self.embedding) if self.embedding is not None else self.embed(ids, positions)
        rope = None
        if self.rotary is not None:
            cos, sin = self.rotary(positions, torch.float32)  # (B, 1, 1, D) each
            rope = (cos.reshape(b, -1).contiguous(), sin.reshape(b, -1).contiguous())  # (B, D) each
        k_pools, v_pools, past, tables, block = cache.decode_args(len(self.stack.layers))
        held = self._held
        if not held or held[0] is not cache.cache or held[1] is not cross:  # another cache, or another layout
            held[:] = [cache.cache, cross, _args(k_pools, v_pools, block, self.final, self.head, self.embedding, cross)]
        held[2].adapters = None if adapters is None else adapters.reshape(-1).contiguous()  # (B,)
        out = _run(self.stack, held[2], rows, tables, past, rope=rope).view(b, 1, -1)  # (B, 1, C|V)
        if self.head is None and self.final is None and self.norm is not None:
            return self.norm(out)
        return out


class TokenRows(NamedTuple):
    """A decode step's rows as stack_step embeds them: each row's token and position."""

    ids: Tensor  # (B, 1) int64
    positions: Tensor | None  # (B, 1) int64; None: the op takes each row's past length
    embedding: Embedding


def _args(k_pools: list[Tensor], v_pools: list[Tensor], block: int, final: FinalNorm | None = None,
          head: Head | None = None, embedding: Embedding | None = None, cross: CrossRows | None = None):  # noqa: ANN202
    """A StepArgs (ops.h) with what stays the same from one step to the next over these pools: each
    layer's pool, the block size, the final norm, the head, the embedding tables, the cross-attention."""
    a = native.module().StepArgs()
    a.k_pools, a.v_pools, a.block = k_pools, v_pools, block
    if final is not None:
        a.final_norm, a.final_norm_bias, a.final_eps, a.final_rms = final
    if head is not None:
        a.head, a.head_bias, a.head_kind, a.head_n, a.head_parts = head
    if embedding is not None:
        a.embed, a.embed_scale, a.pos_table = embedding
    if cross is not None:
        a.cross_k, a.cross_v, a.sources, a.source_keys = cross.k, cross.v, cross.sources, cross.counts
    return a


def _run(stack: Stack, a, rows: Tensor | TokenRows, tables: Tensor, past: list[int] | None = None,  # noqa: ANN001
         slots: Tensor | None = None, keys: Tensor | None = None, rope: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """One stack_step with StepArgs `a` (_args) and this step's rows (B, C) or tokens, its tables, and
    each row's past length (a decode step: the op derives the new keys' slots, the key counts and the
    positions) or the slots and key counts; rope (B, D) each. -> (B, C), or the logits (B, V) of a head."""
    if isinstance(rows, TokenRows):
        a.ids = rows.ids.reshape(-1).contiguous()  # (B,)
        if rows.embedding.positions is not None and rows.positions is not None:
            a.positions = rows.positions.reshape(-1).contiguous()  # (B,)
    else:
        a.x = rows.reshape(rows.size(0), -1).contiguous()  # (B, C)
    if rope is not None:
        a.cos, a.sin = rope
    a.tables = tables
    if past is not None:
        a.past = past
    else:
        a.slots, a.keys = slots, keys
    return native.module().stack_step(stack.native, a)  # (B, C) or (B, V)
