"""Transformer stacks in native code, one call per step: a causal stack's decode steps (with the token
embedding and the final norm), and an encoder stack's forward pass.

At one new token per row the work of a block is a few projections and attention over each row's
cached keys (and, in an encoder-decoder, over its source's encoder keys); everything between them
(norms, rotary positions, the cache write, the residuals, the activation) is a few thousand floats
per row. Run as a compiled graph per block, entering the graph (its guards, its Python wrapper) cost
SmolLM2 more per step than the 4-bit products themselves; run eagerly, the small translator's block
is a few dozen dispatches of microseconds each (docs/benchmarks.md, "One op per layer").
models/kernels/block_step.cpp runs the whole block on the same projection and attention kernels,
block after block, so a step is one call: for a decode step also each row's token embedding (the
token's row times the model's scale, plus its position's row), the stack's final norm and, where the
model passes it (Seq2Seq.decode: CausalStack.decode_step with a `Head`), its output projection with
Marian's bias after it, so a translator's step returns its logits from one call. The call is a
plain function of the kernels' Python module (module.cpp) holding the stack's parameters in one
object (`Stack.native`), not a torch op: an op's call checked and converted every layer's tensors each
step, and with the embedding and norm as torch ops around one op per block that cost the small
translator ~45 us of a ~330 us step at one row. For the same reason what a step passes besides its
tokens and cache lengths (the stack, head, embedding, final norm, cross keys/values, each row's source)
is resolved once per row layout (StepPlan: a search keeps it while its rows stay as they are).

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
before (an embedding or final norm the op does not compute runs as torch ops around it). Results are the same arithmetic as the blocks' path with the float operations of the glue in
another order (within ~1e-5; tests/models/test_native_blocks.py), and a row's result does not depend
on its batch (bitwise), as for the kernels.
"""

from __future__ import annotations

import functools
import weakref
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .kernels import native
from .kv_cache import CrossCache
from .layers import Block, Embeddings, gelu_tanh
from .norms import RMSNorm
from .panels import BlockLinear, PanelLinear
from .positions import LearnedPositions, SinusoidalPositions

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


def _projection(m: nn.Module | None, copies: bool = False) -> tuple | None:
    """(weights, bias, kind, outputs, activation parts) of a projection block_step runs, else None (a
    tied head's packed copy of the embedding matrix only with `copies`)."""
    if isinstance(m, BlockLinear):
        return m.records, m.bias, KINDS[m.fmt], m.out_features, m.activation_bits // 8
    if isinstance(m, PanelLinear) and (copies or not m.copy):
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


class Stack(NamedTuple):
    """A stack's blocks as stack_step runs them: their LayerArgs, and all of it held once by the
    kernels' module (Blocks: every layer's lists end to end and what the layers share; None where the
    kernels are not loaded)."""

    layers: list[LayerArgs]
    native: object | None

    @property
    def cross(self) -> bool:
        return self.layers[0].cross

    @property
    def head_dim(self) -> int:
        return self.layers[0].head_dim

    @property
    def kv_heads(self) -> int:
        return self.layers[0].kv_heads


_SHARED = ("eps", "rms", "prenorm", "act", "gated", "heads", "kv_heads", "scale", "cross")
_LISTS = ("norms", "norm_biases", "weights", "biases", "kinds", "outs", "parts")


def _stack(layers: list[LayerArgs]) -> Stack | None:
    """The layers as one stack_step's arguments, or None unless they share _SHARED."""
    shared = [tuple(getattr(a, f) for f in _SHARED) for a in layers]
    if any(s != shared[0] for s in shared):
        return None
    held = None
    if native.available():  # held once: a step passes one object, not every layer's tensors
        n, nb, w, b, k, o, p = ([item for a in layers for item in getattr(a, f)] for f in _LISTS)
        eps, rms, prenorm, act, gated, heads, kv_heads, scale, cross = shared[0]
        held = native.module().Blocks(n, nb, eps, rms, prenorm, w, b, k, o, p, act, gated, heads, kv_heads, scale,
                                      len(layers), cross)
    return Stack(layers, held)


class Embedding(NamedTuple):
    """What stack_step needs to embed a row's token itself (Embeddings.forward's arithmetic)."""

    table: Tensor  # (V, C) float32
    scale: float
    positions: Tensor | None  # (P, C) float32: the absolute position rows, None without (rotary)


def embedding_args(embed: Embeddings) -> Embedding | None:
    """The token table, scale and position table of `embed` when stack_step computes it as
    Embeddings.forward does (no token types, no embedding norm, eval mode, float32 tables), else None
    (built once, again after an assignment anywhere or a change of train mode)."""
    return _per_module(embed, _embedding_args)


def final_norm_args(norm: nn.Module | None) -> tuple[Tensor, Tensor | None, float, bool] | None:
    """(weight, bias, eps, is RMSNorm) of a stack's final norm when stack_step computes it, else None
    (built once, as embedding_args)."""
    return _per_module(norm, _final_norm) if norm is not None else None


# module -> ((assignment count, train mode), what was built from it)
_MODULES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _per_module(module: nn.Module, build):  # noqa: ANN001, ANN202
    _watch()
    quick = (_assigned[0], module.training)
    cached = _MODULES.get(module)
    if cached is None or cached[0] != quick:
        cached = _MODULES[module] = (quick, build(module))
    return cached[1]


def _embedding_args(embed: Embeddings) -> Embedding | None:
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


def _final_norm(norm: nn.Module) -> tuple[Tensor, Tensor | None, float, bool] | None:
    found = _norms([norm])
    if found is None:
        return None
    (weight,), (bias,), eps, rms = found
    return weight, bias, eps, rms


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
    args: Stack | None
    bits: list[nn.Module]  # the modules whose activation_bits layer_args read


# stack's blocks -> what was built for them: kept outside the modules, so that nothing a compiled block
# could guard on changes
_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def stack_args(blocks: nn.ModuleList) -> Stack | None:
    """The stack_step arguments of the blocks (layer_args of every block), or None unless the op
    computes all of them (rebuilt when a block's signature changes; the signatures are read again only
    after a module, parameter or buffer was assigned somewhere, or a block's train mode or activation
    bits changed)."""
    _watch()
    cached = _CACHE.get(blocks)
    if cached is not None and cached.quick == _quick(blocks, cached.bits):
        return cached.args
    signatures = [_signature(b) for b in blocks]
    if cached is not None and cached.signatures == signatures:  # modules compare by identity
        built = cached.args
    else:
        args = [layer_args(b) for b in blocks]
        built = None if not args or any(a is None for a in args) else _stack(args)
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


@functools.lru_cache(maxsize=64)
def _unpadded_rows(b: int, t: int, kv_heads: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """encode_layers' slots, tables and key counts for B rows of T real tokens each (no padding): what
    its general path derives from `keep`, without its dozen small ops per call (a tenth of a
    one-sentence call on a 2-core VM). Read-only: the op never writes them."""
    seq = torch.arange(b, device=device).repeat_interleave(t)  # (B * T,) each token's sequence
    rank = torch.arange(t, device=device).repeat(b)  # (B * T,) its place in it
    heads_k = torch.arange(kv_heads, device=device)  # (K,)
    slots = ((seq[:, None] * kv_heads + heads_k[None, :]) * t + rank[:, None]).reshape(-1)  # (B * T * K,)
    return slots, seq[:, None].contiguous(), torch.full((b * t,), t, device=device)  # (M * K,), (M, 1), (M,)


def encode_layers(stack: Stack, x: Tensor, keep: Tensor | None) -> Tensor | None:
    """An encoder stack's blocks over x (B, T, C) float32, keep (B, T) True = real token (left or right
    padding; None: every token is real): one stack_step over the real tokens. Returns (B, T, C) with
    zeros at padding (what the blocks' path leaves there is never read: pooling and cross-attention
    mask it), or None when the op does not run here or the blocks attend across sequences
    (cross-attention)."""
    if not _native_here(x) or stack.cross:
        return None
    b, t, c = x.shape
    n = len(stack.layers)
    if keep is None:  # the same slots and keys as below, from a cache
        if t == 0:
            return None
        pool = x.new_empty(b * stack.kv_heads * t + 1, stack.head_dim)  # (B * K * T + 1, D)
        slots, tables, keys = _unpadded_rows(b, t, stack.kv_heads, x.device)
        h = _run(stack, x.reshape(b * t, c), None, None, [pool] * n, [torch.empty_like(pool)] * n, slots, tables,
                 keys, [], t)  # (B * T, C)
        return h.view(b, t, c)  # (B, T, C)
    real = keep.reshape(-1).nonzero().squeeze(1)  # (M,) flat index of each real token
    lengths = keep.sum(-1)  # (B,)
    longest = int(lengths.max())
    if longest == 0:
        return None
    seq = real // t  # (M,) each token's sequence
    rank = keep.cumsum(-1).reshape(-1).index_select(0, real) - 1  # (M,) its place among the real tokens
    # sequence s's keys: block s of the pool (slot j = its j-th real token), plus the trash row last; every
    # layer writes its keys there before any token attends them, so the layers share one pool
    k_pool = x.new_empty(b * stack.kv_heads * longest + 1, stack.head_dim)  # (B * K * S + 1, D)
    v_pool = torch.empty_like(k_pool)
    heads_k = torch.arange(stack.kv_heads, device=x.device)  # (K,)
    slots = ((seq[:, None] * stack.kv_heads + heads_k[None, :]) * longest + rank[:, None]).reshape(-1)  # (M * K,)
    tables, keys = seq[:, None].contiguous(), lengths.index_select(0, seq)  # (M, 1), (M,)
    h = x.reshape(b * t, c).index_select(0, real)  # (M, C)
    h = _run(stack, h, None, None, [k_pool] * n, [v_pool] * n, slots, tables, keys, [], longest)  # (M, C)
    return x.new_zeros(b * t, c).index_copy_(0, real, h).view(b, t, c)  # (B, T, C)


class TokenRows(NamedTuple):
    """A decode step's rows as stack_step embeds them: each row's token and position."""

    ids: Tensor  # (B, 1) int64
    positions: Tensor | None  # (B, 1) int64; None: the op takes each row's past length
    embedding: Embedding


class Head(NamedTuple):
    """A model's output projection as stack_step applies it after the final norm (head_args)."""

    weight: Tensor  # panels or blocks (models/panels.py)
    bias: Tensor | None  # (V,) float32: its own, or the model's bias added after it (Marian's final_logits_bias)
    kind: int  # KINDS
    n: int  # V
    parts: int


def head_args(projection: nn.Module | None, bias_after: Tensor | None = None) -> Head | None:
    """The Head of `projection` (with `bias_after`, a (V,) float32 bias the model adds after it, if any)
    when stack_step computes it as the model does: a projection block_step runs, at most one bias
    (built once, as embedding_args)."""
    if projection is None:
        return None
    head = _per_module(projection, lambda m: _head(m, bias_after))
    if head is not None and bias_after is not None and head.bias is not bias_after:  # built for another bias
        return _head(projection, bias_after)
    return head


def _head(projection: nn.Module, bias_after: Tensor | None) -> Head | None:
    found = _projection(projection, copies=True)
    if found is None:
        return None
    weight, bias, kind, n, parts = found
    if bias_after is not None:  # the float32 panels add a bias as each output is stored: the same addition
        if kind != KINDS["f32"] or bias is not None or bias_after.dtype != torch.float32 or bias_after.shape != (n,):
            return None  # two additions, or one the kernel does not make as the model does
        bias = bias_after
    return Head(weight, bias, kind, n, parts)


def step_sources(stack: Stack, cross: CrossCache | None, rows: int) -> tuple[bool, tuple[Tensor, Tensor] | None]:
    """Whether stack_step runs this step's cross-attention (none where the blocks have none; right-padded
    sources, one per row, as CrossCache.row_sources reads them), and each row's source with its key count."""
    if (cross is not None) != stack.cross:  # the blocks' cross-attention and this step's
        return False, None
    if cross is None:
        return True, None
    sources = cross.row_sources()  # (B, 1), (B,)
    return sources is not None and sources[0].size(0) == rows, sources


class StepPlan(NamedTuple):
    """What every decode step of a causal stack over one row layout passes stack_step besides the step's
    own tokens, positions and cache lengths, resolved once (step_plan; CausalStack.decode_plan): each
    step asked the modules, the sources and the head again before (~10 us of the small translator's
    ~230 us step at one row). Current (`current`) for the same CrossCache object and row count while
    nothing was assigned to any module (the count stack_args watches); a plan takes the model's train
    mode, activation bits and cache kind to stay as they were when it was built, as a search's steps do."""

    stack: Stack
    embedding: Embedding | None  # None: the stack embeds the tokens itself (embedding_args)
    final: tuple[Tensor, Tensor | None, float, bool] | None  # final_norm_args
    head: Head | None
    cross: CrossCache | None  # the sources it was built for (compared by identity)
    cross_k: list[Tensor]  # each layer's cross-attention keys (N, K, S, D), contiguous; [] without
    cross_v: list[Tensor]
    sources: tuple[Tensor, Tensor] | None  # step_sources: each row's source (B, 1) and key count (B,)
    rows: int
    assigned: int

    def current(self, cross: CrossCache | None, rows: int) -> bool:
        return cross is self.cross and rows == self.rows and self.assigned == _assigned[0]


def step_plan(stack: Stack, cross: CrossCache | None, rows: int, embedding: Embedding | None,
              final: tuple[Tensor, Tensor | None, float, bool] | None, head: Head | None) -> StepPlan | None:
    """The StepPlan of `rows` rows over the sources `cross`, or None when this cross-attention is not one
    the op runs (step_sources)."""
    takes, sources = step_sources(stack, cross, rows)
    if not takes:
        return None
    kv = [tuple(t.contiguous() for t in pair) for pair in cross.kv] if cross is not None else []  # (N, K, S, D) each
    return StepPlan(stack, embedding, final, head, cross, [k for k, _ in kv], [v for _, v in kv], sources, rows,
                    _assigned[0])


def decode_layers(plan: StepPlan, rows: Tensor | TokenRows, rope: tuple[Tensor, Tensor] | None, cache) -> Tensor:
    """One decode step of a causal stack in one stack_step: rows, the step's input (B, 1, C) float32 or
    each row's token to embed (TokenRows), through every block, then the plan's final norm, then its
    output projection when it has one. rope: cos, sin (B, 1, 1, D) or None; cache: a PagedCacheView
    after begin_decode() whose layers attend through the decode kernel. Returns (B, 1, C), or the
    logits (B, 1, V) with a head."""
    b = rows.ids.size(0) if isinstance(rows, TokenRows) else rows.size(0)
    rope = tuple(r.reshape(b, -1).contiguous() for r in rope) if rope is not None else None  # (B, D) each
    k_pools, v_pools, past, tables, block = cache.decode_args(len(plan.stack.layers))
    h = _run(plan.stack, rows, rope, plan.final, k_pools, v_pools, None, tables, None, past, block, plan.cross_k,
             plan.cross_v, plan.sources, plan.head)  # (B, C|V)
    return h.view(b, 1, -1)  # (B, 1, C) or (B, 1, V)


def _run(stack: Stack, rows: Tensor | TokenRows, rope: tuple[Tensor, Tensor] | None,
         final: tuple[Tensor, Tensor | None, float, bool] | None, k_pools: list[Tensor], v_pools: list[Tensor],
         slots: Tensor | None, tables: Tensor, keys: Tensor | None, past: list[int], block: int,
         cross_k: list[Tensor] = (), cross_v: list[Tensor] = (), sources: tuple[Tensor, Tensor] | None = None,
         head: Head | None = None) -> Tensor:
    """One stack_step: rows (B, C) or tokens -> (B, C), or the logits (B, V) of `head`; rope (B, D) each;
    final: the final norm's final_norm_args; slots and keys, or each row's past length (a decode step:
    the op derives them, and the rows' positions, through the tables); cross_k, cross_v, sources: each
    layer's cross-attention keys and values (N, K, S, D) and each row's source with its key count
    (CrossCache.row_sources)."""
    cos, sin = rope if rope is not None else (None, None)
    src, src_keys = sources if sources is not None else (None, None)
    x = ids = table = pos_table = positions = None
    scale = 1.0
    if isinstance(rows, TokenRows):
        ids = rows.ids.reshape(-1).contiguous()  # (B,)
        table, scale, pos_table = rows.embedding
        if pos_table is not None and rows.positions is not None:
            positions = rows.positions.reshape(-1).contiguous()  # (B,)
    else:
        x = rows.reshape(rows.size(0), -1).contiguous()  # (B, C)
    fw, fb, feps, frms = final if final is not None else (None, None, 0.0, True)
    hw, hb, hkind, hn, hparts = head if head is not None else (None, None, 0, 0, 1)
    return native.module().stack_step(
        stack.native, x, ids, table, scale, pos_table, positions, cos, sin, k_pools, v_pools, slots, tables, keys, past,
        cross_k, cross_v, src, src_keys, block, fw, fb, feps, frms, hw, hb, hkind, hn, hparts)  # (B, C) or (B, V)
