"""A paged key/value cache: a pool of fixed-size blocks shared by all rows (as vLLM's PagedAttention).

    R rows, N blocks, BS token slots a block, K kv heads, D head dim, M table entries a row

A layer's keys (and values) are one flat (N * K * BS + 1, D) pool: block n, head k, slot t at row
(n * K + k) * BS + t; the last row is a trash slot. Row r's table (R, M) lists its blocks in position
order, so a row costs the blocks its tokens fill. Blocks are reference counted: a full block may be
shared by rows and the prefix cache, since a row writes only at positions >= its length. Block 0, the
null block, is never handed out and fills tables past a row's blocks. `ensure` allocates (CacheFull
when the pool is out); the rest is base.KeyValueCache's surface. A step attends through the native
decode kernel (one token a row, a float32 or bfloat16 pool on the CPU: `pool_kernel_runs`), the native
prompt kernel (several tokens a row under a plain causal mask: `prompt_kernel_runs`), or gathers rows
to (B, K, S, D). The pool's dtype may be narrower than the model's: keys and values are rounded to it
as they are stored, and every step, prompt or decode, attends the stored (rounded) values widened to
the queries' dtype, so a prompt computed in chunks or found in the prefix cache sees what one computed
whole sees.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..attention import AttentionMask, attention
from ..kernels import native
from .base import RowLengths

BLOCK_TOKENS = 16  # token slots per block (the prefix cache's block too)


class CacheFull(RuntimeError):
    """The pool has no free block for a row's next tokens (the engine preempts before this)."""


def blocks_for(tokens: int, block: int = BLOCK_TOKENS) -> int:
    """Blocks that hold `tokens` tokens."""
    return -(-tokens // block)


class PagedKVCache(RowLengths):
    """R rows of up to max_len tokens over a pool of `blocks` blocks (block 0 the null block)."""

    paged = True
    ring = False
    window = None

    def __init__(self, n_layers: int, rows: int, kv_heads: int, max_len: int, head_dim: int, blocks: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 block: int = BLOCK_TOKENS, decode_kernel: bool | None = None, zeroed: bool = True,
                 prompt_kernel: bool | None = None) -> None:
        """decode_kernel / prompt_kernel: whether steps of one token a row / of several attend through
        models/kernels/ (None: where they run, `pool_kernel_runs` / `prompt_kernel_runs`). zeroed
        False: the pool starts uninitialised and each block is zeroed when `ensure` hands it out, so
        only the pages of blocks in use are ever touched (a beam search: its pool is sized for every
        beam's longest output, most of which it never uses)."""
        if blocks < 2:
            raise ValueError(f"a paged cache needs at least 2 blocks (one is the null block), got {blocks}")
        self.block, self.kv_heads, self.max_len, self.n_blocks = block, kv_heads, max_len, blocks
        self.slots = max_len  # a row's most tokens (usage, limits)
        self.width = blocks_for(max_len, block)  # M: table entries per row
        self.trash = blocks * kv_heads * block  # flat index of the trash slot
        with torch.inference_mode(False):  # ordinary tensors even when built under inference_mode
            # keys then values of every layer in one buffer: a block is copied in one op for all of them
            self._pool = (torch.zeros if zeroed else torch.empty)(2, n_layers, self.trash + 1, head_dim,
                                                                  dtype=dtype, device=device)
            if not zeroed:
                self._pool[:, :, :kv_heads * block].zero_()  # the null block
                self._pool[:, :, self.trash].zero_()
            self._flat_k = list(self._pool[0])  # (N * K * BS + 1, D) each, contiguous views
            self._flat_v = list(self._pool[1])
            self.tables = torch.zeros(rows, self.width, dtype=torch.long, device=device)  # (R, M): 0 = null block
            RowLengths.__init__(self, rows, device)
        # on the CPU the tables' memory as a numpy array: a step's few small writes without a torch op each
        self._tab = self.tables.numpy() if self.tables.device.type == "cpu" else None
        self.zeroed = zeroed
        self.host_tables: list[list[int]] = [[] for _ in range(rows)]
        self._refs = [0] * blocks
        self._free = list(range(blocks - 1, 0, -1))  # a stack: the lowest ids first
        if decode_kernel is None:
            decode_kernel = pool_kernel_runs(dtype, torch.device(device))
        self.decode_kernel = decode_kernel
        if prompt_kernel is None:
            prompt_kernel = prompt_kernel_runs(dtype, torch.device(device), head_dim)
        self.prompt_kernel = prompt_kernel
        self.block_bytes = 2 * n_layers * kv_heads * block * head_dim * self._flat_k[0].element_size()

    @classmethod
    def for_model(cls, cfg, rows: int, blocks: int, max_len: int | None = None, dtype=None, device=None,
                  decode_kernel: bool | None = None, zeroed: bool = True,
                  prompt_kernel: bool | None = None) -> PagedKVCache:
        """A pool shaped for a decoder config (no sliding window: windowed models keep the dense ring)."""
        if getattr(cfg, "sliding_window", None) is not None:
            raise ValueError("a sliding-window model keeps the dense cache's ring (models.cache.dense.KVCache)")
        n_layers = getattr(cfg, "n_decoder_layers", cfg.n_layers)
        return cls(n_layers, rows, cfg.kv_heads, max_len or cfg.max_positions, cfg.head_dim, blocks,
                   dtype or torch.float32, device or "cpu", decode_kernel=decode_kernel, zeroed=zeroed,
                   prompt_kernel=prompt_kernel)

    # -- blocks --------------------------------------------------------------------------------

    @property
    def blocks_total(self) -> int:
        """Blocks rows can hold (the null block excluded)."""
        return self.n_blocks - 1

    @property
    def blocks_free(self) -> int:
        return len(self._free)

    def refs(self, block: int) -> int:
        return self._refs[block]

    def ref(self, block: int) -> None:
        self._refs[block] += 1

    def unref(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] == 0:
            self._free.append(block)

    def blocks_needed(self, row: int, tokens: int) -> int:
        """New blocks row needs to hold `tokens` tokens."""
        return max(0, blocks_for(tokens, self.block) - len(self.host_tables[row]))

    def key_slots(self, row: int, position: int) -> list[int]:
        """The flat slots of each key/value head for row's key at `position`, from the host's table
        (the row must hold a block for it: `ensure`)."""
        bs, heads = self.block, self.kv_heads
        first = self.host_tables[row][position // bs] * heads * bs + position % bs  # head 0's slot
        return [first + k * bs for k in range(heads)]

    def ensure(self, row: int, tokens: int) -> None:
        """Give row blocks for `tokens` tokens (at most max_len); CacheFull when the pool is out."""
        need = self.blocks_needed(row, min(tokens, self.max_len))
        if need == 0:
            return
        if need > len(self._free):
            raise CacheFull(f"row {row} needs {need} more KV blocks; {len(self._free)} are free")
        table = self.host_tables[row]
        new = [self._free.pop() for _ in range(need)]
        for b in new:
            self._refs[b] = 1
            if not self.zeroed:  # the gathered path reads a row's whole blocks (masked past its length)
                self._pool[:, :, self._block_rows(b)].zero_()
        self._put((row, slice(len(table), len(table) + need)), new)
        table.extend(new)

    def share(self, row: int, blocks: Sequence[int]) -> None:
        """Row (empty) takes `blocks` (full ones, shared: each gains a reference) as its first blocks;
        the caller sets its length."""
        if self.host_tables[row]:
            raise ValueError(f"row {row} is not empty")
        for b in blocks:
            self.ref(b)
        self.host_tables[row] = list(blocks)
        if blocks:
            self._put((row, slice(0, len(blocks))), list(blocks))

    def _release(self, row: int) -> None:
        self._release_host(row)
        self._put(row, 0)

    def _release_host(self, row: int) -> None:
        """_release without touching `tables` (the caller writes the rows' tables at once)."""
        for b in self.host_tables[row]:
            self.unref(b)
        self.host_tables[row] = []

    def _put(self, index, values: int | list) -> None:  # noqa: ANN001 - an index as numpy and torch take it
        """tables[index] = values (an int, or nested lists of block ids) from the host."""
        if self._tab is not None:
            self._tab[index] = values
        else:
            self.tables[index] = values if isinstance(values, int) else torch.tensor(values, dtype=torch.long)

    def _write_tables(self, start: int, tables: Sequence[Sequence[int]]) -> None:
        """Rows [start, start + len(tables)) of `tables` from the host's, in one write (zeros past each)."""
        if not tables:
            return
        width = self.tables.size(1)
        self._put(slice(start, start + len(tables)), [list(t) + [0] * (width - len(t)) for t in tables])

    # -- the engine's surface (as models.cache.dense.KVCache) -------------------------------------

    def nbytes(self) -> int:
        return self._pool.numel() * self._pool.element_size()

    def held(self) -> list[int]:
        return list(self.host_lengths)

    def usage(self) -> float:
        """Blocks the rows hold / blocks rows can hold: a block shared by rows counts once, and one
        only another holder keeps (a prefix cache, which gives it up on demand) counts as free."""
        return len({b for table in self.host_tables for b in table}) / self.blocks_total

    def view(self, start: int = 0, stop: int | None = None) -> PagedCacheView:
        return PagedCacheView(self, start, self.rows if stop is None else stop)

    def view_tokens(self, rows: Sequence[int], past: Sequence[int]) -> PagedTokensView:
        """A one-token step over entries that need not be rows [start, stop): entry i is row rows[i]'s
        token at position past[i]. A row may have several entries (speculative decoding verifies a
        row's drafted tokens as entries at consecutive positions); every entry's key is written before
        any entry attends, so an entry sees the keys of the same row's earlier entries of the step.
        The rows' lengths do not change (the caller advances them by the tokens it keeps)."""
        return PagedTokensView(self, 0, len(rows), rows=list(rows), past=list(past))

    def reset(self, start: int = 0, stop: int | None = None) -> None:
        """Empty rows [start, stop): their blocks go back to the pool (unless shared)."""
        stop = self.rows if stop is None else stop
        for row in range(start, stop):
            self._release_host(row)
        self._put(slice(start, stop), 0)
        self.set_lengths(0, start, stop)

    def move_row(self, src: int, dst: int) -> None:
        """Row dst becomes a copy of row src (a sibling sharing a prompt): the full blocks shared, a
        partly filled last block copied (dst writes its own tokens there)."""
        if src == dst:
            return
        self._release(dst)
        n = self.host_lengths[src]
        full = n // self.block
        self.share(dst, self.host_tables[src][:full])
        if n % self.block:
            self.ensure(dst, n)
            self._copy_blocks([(self.host_tables[src][full], self.host_tables[dst][full])])
        self.set_lengths(n, dst, dst + 1)

    def relocate(self, src: int, dst: int) -> None:
        """Row dst takes over row src's blocks and length (no copy); src is left empty."""
        if src == dst:
            return
        self._release(dst)
        self.host_tables[dst], self.host_tables[src] = self.host_tables[src], []
        self.tables[dst] = self.tables[src]
        self._put(src, 0)
        self.set_lengths(self.host_lengths[src], dst, dst + 1)
        self.set_lengths(0, src, src + 1)

    def reorder(self, index: Tensor | Sequence[int], start: int = 0) -> None:
        """Rows [start, start+len(index)) become rows start+index (beam search): tables copied, blocks
        shared (no keys move); a row whose last block is partly filled and now shared gets its own
        copy of it (its next token is written there)."""
        rows = [start + int(i) for i in (index.tolist() if isinstance(index, Tensor) else index)]
        tables = [list(self.host_tables[r]) for r in rows]
        lengths = [self.host_lengths[r] for r in rows]
        for table in tables:
            for b in table:
                self.ref(b)
        for i, table in enumerate(tables):
            self._release_host(start + i)
            self.host_tables[start + i] = table
        copies: list[tuple[int, int]] = []  # (shared block, its copy)
        try:
            for table, n in zip(tables, lengths, strict=True):
                if n % self.block and self._refs[table[-1]] > 1:  # copy on write
                    if not self._free:
                        raise CacheFull("no free KV block to copy a shared partial block into")
                    own = self._free.pop()
                    self._refs[own] = 1
                    copies.append((table[-1], own))
                    self.unref(table[-1])
                    table[-1] = own
        finally:  # the device tables follow the host's, also when a copy found no block
            self._copy_blocks(copies)
            self._write_tables(start, tables)
        self.set_lengths(lengths, start, start + len(rows))

    def _copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Block b becomes a copy of block a for every (a, b) in pairs, in every layer's keys and values
        (no b is any pair's a): one native call on the CPU, else one gather and one scatter in all."""
        if not pairs:
            return
        size = self.kv_heads * self.block  # a block's rows in a flat pool
        if self._pool.device.type == "cpu" and native.available():
            native.module().copy_blocks(self._pool, [a for a, _ in pairs], [b for _, b in pairs], size)
            return
        within = torch.arange(size, device=self.tables.device)  # (K * BS,)
        src = (torch.tensor([a for a, _ in pairs], device=within.device)[:, None] * size + within).view(-1)  # (P * K * BS,)
        dst = (torch.tensor([b for _, b in pairs], device=within.device)[:, None] * size + within).view(-1)  # (P * K * BS,)
        two, layers, rows, d = self._pool.shape
        flat = self._pool.view(two * layers, rows, d)  # (2L, N * K * BS + 1, D), contiguous
        flat.index_copy_(1, dst, flat.index_select(1, src))  # (2L, P * K * BS, D)

    def _block_rows(self, block: int) -> slice:
        """A block's K * BS rows in a flat pool."""
        first = block * self.kv_heads * self.block
        return slice(first, first + self.kv_heads * self.block)

    def block_kv(self, block: int) -> list[Tensor]:
        """A block's keys then values of every layer, (K * BS, D) views (tests, debugging)."""
        return [buf[self._block_rows(block)] for buf in self._flat_k + self._flat_v]


KERNEL_POOL_DTYPES = (torch.float32, torch.bfloat16)  # the pools models/kernels/attention.cpp reads


def kernel_runs(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether decode steps attend through models/kernels/attention.cpp: float32 on an AVX2 or AVX-512 CPU
    where the native kernels build."""
    return dtype == torch.float32 and device.type == "cpu" and native.available()


def pool_kernel_runs(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a pool of `dtype` on `device` is read by the decode kernel (kernel_runs; a bfloat16 pool
    too, its values widened exactly)."""
    return dtype in KERNEL_POOL_DTYPES and kernel_runs(torch.float32, torch.device(device))


PROMPT_HEAD_DIMS = (32, 64, 128)  # the head dims models/kernels/prompt_attention.cpp takes at either width


def prompt_kernel_runs(dtype: torch.dtype, device: torch.device, head_dim: int) -> bool:
    """Whether steps of several tokens a row (prompts, chunks) attend through
    models/kernels/prompt_attention.cpp: a pool the decode kernel reads, float32 queries, a head dim it
    takes (the stack's mask must say no more than causal after each row's past: AttentionMask.after_past)."""
    return pool_kernel_runs(dtype, device) and head_dim in PROMPT_HEAD_DIMS


@dataclass
class PagedCacheView:
    """Rows [start, stop) of a PagedKVCache, as one forward pass sees them."""

    cache: PagedKVCache
    start: int
    stop: int
    step_len: int | None = None  # S: the keys the gathered path attends (whole blocks)
    _slots: Tensor | None = None  # (B * K * T,) flat slot of each new key, set by begin()
    _tables: Tensor | None = None  # (B, nb) the rows' first nb blocks, contiguous
    _past: list[int] | None = None  # a decode step's rows' lengths before it (begin_decode)
    _keys: Tensor | None = None  # (B,) keys per row after the step
    native: bool = True  # whether this step may attend through the decode kernel (a captured step may not)

    @property
    def decode_kernel(self) -> bool:
        """Whether this step's one-token rows attend through models/kernels/attention.cpp."""
        return self.native and self.cache.decode_kernel

    @property
    def prompt_kernel(self) -> bool:
        """Whether this step's rows of several tokens attend through models/kernels/prompt_attention.cpp."""
        return self.native and self.cache.prompt_kernel

    def fresh(self) -> bool:
        """Whether every row starts this step empty (a prefill from the first token; host lengths)."""
        return not any(self.cache.host_lengths[self.start:self.stop])

    @property
    def lengths(self) -> Tensor:
        return self.cache.lengths[self.start:self.stop]  # (B,)

    def begin(self, t: int, keep: Tensor | None = None) -> tuple[Tensor, int]:
        """Start a step of T new tokens per row (keep (B, T): its real ones; right padding is not
        given blocks): blocks for every row's real tokens, their positions (B, T) and S."""
        c = self.cache
        if t == 1 and keep is None and c.tables.device.type == "cpu":
            return self._begin_decode(), self.step_len
        lengths = c.host_lengths[self.start:self.stop]
        longest = max(lengths, default=0) + t
        real = [t] * (self.stop - self.start) if keep is None else keep.sum(-1).tolist()
        if max((n + r for n, r in zip(lengths, real, strict=True)), default=0) > c.max_len:
            raise ValueError(f"KV cache holds {c.max_len} tokens per row; this step needs {longest}")
        for row, (n, r) in enumerate(zip(lengths, real, strict=True), self.start):
            c.ensure(row, n + r)
        nb = min(blocks_for(longest, c.block), c.width)
        self.step_len = nb * c.block
        base = self.lengths  # (B,)
        positions = base[:, None] + torch.arange(t, device=base.device)[None, :]  # (B, T)
        tables = c.tables[self.start:self.stop]  # (B, M)
        ids = tables.gather(1, (positions // c.block).clamp(max=c.width - 1))  # (B, T): past the table -> null
        heads = torch.arange(c.kv_heads, device=base.device)  # (K,)
        flat = (ids[:, None, :] * c.kv_heads + heads[None, :, None]) * c.block + (positions % c.block)[:, None, :]  # (B, K, T)
        self._slots = flat.reshape(-1)  # (B * K * T,)
        # (B, nb): a new tensor with the standard strides, never a view (one kind of input for compiled blocks)
        self._tables = torch.empty(len(lengths), nb, dtype=tables.dtype, device=tables.device).copy_(tables[:, :nb])
        self._keys = base + t  # (B,)
        return positions, self.step_len

    def begin_decode(self) -> list[int]:
        """begin(1) for the native step, which derives each new key's slot, the key counts and the
        positions from the rows' past lengths (returned, from the host) and their tables (decode_args):
        blocks for the new keys, and nothing else until a layer asks (layer())."""
        c = self.cache
        lengths = c.host_lengths[self.start:self.stop]
        longest = max(lengths, default=0) + 1
        if longest > c.max_len:
            raise ValueError(f"KV cache holds {c.max_len} tokens per row; this step needs {longest}")
        for row, n in enumerate(lengths, self.start):
            if n // c.block >= len(c.host_tables[row]):  # its new key starts a block
                c.ensure(row, n + 1)
        nb = min(blocks_for(longest, c.block), c.width)
        self.step_len = nb * c.block
        self._slots = self._keys = self._tables = None  # built by layer() if a layer asks
        self._past = lengths
        return lengths

    def _begin_decode(self) -> Tensor:
        """begin(1) on the CPU from the host's lengths and tables (a decode step: one token a row),
        without the dozen small tensor operations of the general case; the same values. Returns the
        positions (B, 1)."""
        past = self.begin_decode()
        self._decode_tensors()
        return torch.tensor(past, dtype=torch.long).view(-1, 1)  # (B, 1)

    def _decode_tensors(self) -> None:
        """A decode step's slots and key counts from its past lengths (begin_decode), in one tensor (a
        step's few rows spent more time in small tensor operations than in the host arithmetic)."""
        c, lengths = self.cache, self._past
        slots = [slot for row, n in enumerate(lengths, self.start) for slot in c.key_slots(row, n)]
        flat = torch.tensor(slots + [n + 1 for n in lengths], dtype=torch.long)  # (B * K + B,)
        self._slots, self._keys = flat[:len(slots)], flat[len(slots):]  # (B * K,), (B,)

    def key_positions(self) -> Tensor:
        """The position each of the gathered path's S keys holds: (S,) (slot i of the gathered rows is
        position i)."""
        if self.step_len is None:
            raise RuntimeError("PagedCacheView.key_positions() before begin()")
        return torch.arange(self.step_len, device=self.cache.lengths.device)  # (S,)

    def decode_args(self, layers: int) -> tuple[list[Tensor], list[Tensor], list[int], Tensor, int]:
        """What a native step over the first `layers` layers reads after begin_decode() (or begin(1)):
        the layers' key pools and value pools, the rows' past lengths, their whole tables (B, M)
        (contiguous: the kernel reads each row's first blocks in place), the block size."""
        if self._past is None:
            raise RuntimeError("PagedCacheView.decode_args() before begin_decode()")
        c = self.cache
        return c._flat_k[:layers], c._flat_v[:layers], self._past, c.tables[self.start:self.stop], c.block

    def layer(self, i: int) -> PagedLayerCache:
        c = self.cache
        if self._slots is None and self._past is not None:
            self._decode_tensors()
        if self._tables is None and self._past is not None:  # a decode step's nb blocks a row: a new tensor
            # with the standard strides, as begin's (one kind of input for compiled blocks)
            self._tables = c.tables[self.start:self.stop, :self.step_len // c.block].clone(
                memory_format=torch.contiguous_format)  # (B, nb)
        if self._slots is None or self._tables is None or self._keys is None:
            raise RuntimeError("PagedCacheView.layer() before begin()")
        return PagedLayerCache(c._flat_k[i], c._flat_v[i], self._slots, self._tables, self._keys, c.block,
                               self.decode_kernel, self.prompt_kernel)


@dataclass(frozen=True)
class PagedLayerCache:
    """One layer's pool during a step. Tensors and plain values only (one compiled block serves every
    layer, as models.cache.dense.LayerCache)."""

    flat_k: Tensor  # (N * K * BS + 1, D)
    flat_v: Tensor  # (N * K * BS + 1, D)
    slots: Tensor  # (B * K * T,) where the step's keys go
    tables: Tensor  # (B, nb) the rows' blocks
    keys: Tensor  # (B,) keys per row after this step
    block: int  # BS
    decode_kernel: bool
    prompt_kernel: bool = False

    def _gather(self, flat: Tensor, heads: int) -> Tensor:
        """The rows' blocks, in order: (B, K, nb * BS, D)."""
        b, nb = self.tables.shape
        d = flat.size(-1)
        pool = flat[:-1].view(-1, heads, self.block, d)  # (N, K, BS, D)
        rows = pool.index_select(0, self.tables.reshape(-1))  # (B * nb, K, BS, D)
        return rows.view(b, nb, heads, self.block, d).transpose(1, 2).reshape(b, heads, nb * self.block, d)  # (B, K, S, D)

    def store(self, k: Tensor, v: Tensor) -> None:
        """Store new keys/values (B, K, T, D) at this step's slots, rounded to the pool's dtype."""
        d = k.size(-1)
        self.flat_k.index_copy_(0, self.slots, k.reshape(-1, d).to(self.flat_k.dtype))  # (B*K*T, D) rows copied
        self.flat_v.index_copy_(0, self.slots, v.reshape(-1, d).to(self.flat_v.dtype))  # (B*K*T, D) rows copied

    def _stored(self, heads: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """The rows' stored keys/values (B, K, S, D) each, gathered, in `dtype`."""
        return self._gather(self.flat_k, heads).to(dtype), self._gather(self.flat_v, heads).to(dtype)

    def write(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store new keys/values (B, K, T, D), rounded to the pool's dtype; return the rows' stored
        keys/values (B, K, S, D), gathered, in k's dtype."""
        self.store(k, v)
        return self._stored(k.size(1), k.dtype)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask | Tensor | None, scale: float | None,
               gqa: bool) -> Tensor:
        """Store the step's keys/values (B, K, T, D) and attend q (B, H, T, D): one new token per row
        through the decode kernel (each row its own keys, no mask), rows of several tokens under a mask
        that is causal after each row's past through the prompt kernel (float32 queries; products in
        bfloat16 where the mask says so), else gathered under `mask`."""
        b, h, t, d = q.shape
        self.store(k, v)
        if t == 1 and self.decode_kernel:
            out = torch.ops.ts_panels.paged_decode(
                q.reshape(b, h, d).float().contiguous(), self.flat_k, self.flat_v, self.tables, self.keys,
                k.size(1), self.block, d ** -0.5 if scale is None else scale)  # (B, H, D) float32
            return out.view(b, h, 1, d).to(q.dtype)  # (B, H, T, D)
        if (t > 1 and self.prompt_kernel and q.dtype == torch.float32 and isinstance(mask, AttentionMask)
                and mask.after_past):
            return torch.ops.ts_panels.paged_prompt(
                q, self.flat_k, self.flat_v, self.tables, self.keys, k.size(1), self.block,
                d ** -0.5 if scale is None else scale, mask.bf16_products)  # (B, H, T, D) view of (B, T, H, D)
        k_all, v_all = self._stored(k.size(1), k.dtype)  # (B, K, S, D) each
        return attention(q, k_all, v_all, mask, scale=scale, gqa=gqa)  # (B, H, T, D)


@dataclass
class PagedTokensView(PagedCacheView):
    """One token per entry, entry i at position past[i] of row rows[i] (PagedKVCache.view_tokens): a
    decode step whose entries are given rather than rows [start, stop). Keys written past a row's
    length are not part of it until the caller advances the length (rejected drafts stay unread and
    are overwritten by the row's next tokens: a rollback without copies)."""

    rows: list[int] | None = None  # (B,) the cache row of each entry
    past: list[int] | None = None  # (B,) each entry's position: the keys it attends before its own

    def fresh(self) -> bool:
        return False

    @property
    def lengths(self) -> Tensor:
        return torch.tensor(self.past, dtype=torch.long, device=self.cache.lengths.device)  # (B,)

    def _index(self) -> Tensor:
        return torch.tensor(self.rows, dtype=torch.long, device=self.cache.tables.device)  # (B,)

    def begin(self, t: int, keep: Tensor | None = None) -> tuple[Tensor, int]:
        if t != 1 or keep is not None:
            raise ValueError("a token view takes one token per entry")
        past = self.begin_decode()
        self._decode_tensors()
        return torch.tensor(past, dtype=torch.long, device=self.cache.lengths.device).view(-1, 1), self.step_len  # (B, 1)

    def begin_decode(self) -> list[int]:
        c, past = self.cache, self.past
        longest = max(past, default=0) + 1
        if longest > c.max_len:
            raise ValueError(f"KV cache holds {c.max_len} tokens per row; this step needs {longest}")
        for row, n in zip(self.rows, past, strict=True):
            c.ensure(row, n + 1)
        nb = min(blocks_for(longest, c.block), c.width)
        self.step_len = nb * c.block
        self._slots = self._keys = self._tables = None
        self._past = list(past)
        return self._past

    def _decode_tensors(self) -> None:
        c = self.cache
        slots = [slot for row, n in zip(self.rows, self._past, strict=True) for slot in c.key_slots(row, n)]
        flat = torch.tensor(slots + [n + 1 for n in self._past], dtype=torch.long, device=c.tables.device)  # (B * K + B,)
        self._slots, self._keys = flat[:len(slots)], flat[len(slots):]  # (B * K,), (B,)

    def decode_args(self, layers: int) -> tuple[list[Tensor], list[Tensor], list[int], Tensor, int]:
        if self._past is None:
            raise RuntimeError("PagedTokensView.decode_args() before begin_decode()")
        c = self.cache
        return c._flat_k[:layers], c._flat_v[:layers], self._past, c.tables.index_select(0, self._index()), c.block

    def layer(self, i: int) -> PagedLayerCache:
        c = self.cache
        if self._past is None:
            raise RuntimeError("PagedTokensView.layer() before begin()")
        if self._slots is None:
            self._decode_tensors()
        if self._tables is None:
            self._tables = c.tables.index_select(0, self._index())[:, :self.step_len // c.block].contiguous()  # (B, nb)
        return PagedLayerCache(c._flat_k[i], c._flat_v[i], self._slots, self._tables, self._keys, c.block,
                               self.decode_kernel)
