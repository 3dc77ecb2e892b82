"""The dense key/value cache: `KVCache`, a preallocated row per sequence (base.KeyValueCache).

    R rows, L slots a row, K kv heads, D head dim, W window

`lengths[r]` counts row r's stored tokens; a step of T new tokens writes slots lengths[r] ..
lengths[r] + T - 1, so rows may sit at different steps. Right-padded prompts leave garbage after a
row's real tokens: the caller advances each row by its real count and the next step overwrites it.
With a sliding window shorter than a row (`ring`), a row keeps W slots, position p in slot p mod W;
a multi-token step attends its past slots and its own keys, then stores each row's last W real
tokens (the rest goes to a trash slot), and `key_positions()` lets the causal mask see through the
ring. `move_row` keeps live rows packed at the front; `view(start, stop)` is a copy-free row slice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..attention import AttentionMask, attention
from .base import RowLengths

# KVCache.reorder copies moved rows in groups whose lengths round up to the same multiple of this
REORDER_GROUP = 16
# a key position no query reaches: marks a ring slot not written yet (masked by the causal mask)
UNWRITTEN = torch.iinfo(torch.long).max


def slots_per_row(max_len: int, window: int | None = None) -> int:
    """L: slots a row needs for sequences of up to max_len tokens, W with a shorter window."""
    return min(max_len, window) if window is not None else max_len


class KVCache(RowLengths):
    """Keys/values for every layer: (R, K, L, D) each, R rows, L slots per row: max_len tokens, or
    the window W when it is shorter (a ring, see the module docstring)."""

    paged = False

    def __init__(
        self,
        n_layers: int,
        rows: int,
        kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        window: int | None = None,
    ) -> None:
        self.slots = slots_per_row(max_len, window)  # L
        self.ring = self.slots < max_len
        shape = (rows, kv_heads, self.slots, head_dim)
        trash = rows * kv_heads * self.slots  # flat row index of the trash slot (after every real slot)
        # ordinary tensors even when built under inference_mode (generate, beam search): the engine
        # builds its cache outside it, and compiled blocks (models/execution/compiled.py) see one kind only
        with torch.inference_mode(False):
            # one flat (R*K*L + 1, D) buffer per layer and kind: the last row is the trash slot
            self._flat_k = [torch.zeros(trash + 1, head_dim, dtype=dtype, device=device) for _ in range(n_layers)]
            self._flat_v = [torch.zeros(trash + 1, head_dim, dtype=dtype, device=device) for _ in range(n_layers)]
            RowLengths.__init__(self, rows, device)
        self.k = [f[:trash].view(shape) for f in self._flat_k]  # (R, K, L, D) each
        self.v = [f[:trash].view(shape) for f in self._flat_v]  # (R, K, L, D) each
        self.max_len, self.kv_heads, self.window, self.trash = max_len, kv_heads, window, trash

    @classmethod
    def for_model(cls, cfg, rows: int, max_len: int | None = None, dtype=None, device=None) -> KVCache:
        """A cache shaped for a decoder config (Seq2SeqConfig: its decoder stack); a windowed model's
        rows hold its window."""
        n_layers = getattr(cfg, "n_decoder_layers", cfg.n_layers)
        return cls(n_layers, rows, cfg.kv_heads, max_len or cfg.max_positions, cfg.head_dim,
                   dtype or torch.float32, device or "cpu", getattr(cfg, "sliding_window", None))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def held(self) -> list[int]:
        """Tokens each row holds: its length, at most L (a ring keeps its last W); from the host."""
        return [min(n, self.slots) for n in self.host_lengths]

    def usage(self) -> float:
        """Tokens held / the cache's capacity (rows x L)."""
        return sum(self.held()) / (self.rows * self.slots)

    def view(self, start: int = 0, stop: int | None = None) -> CacheView:
        return CacheView(self, start, self.rows if stop is None else stop)

    def reset(self, start: int = 0, stop: int | None = None) -> None:
        """Empty rows [start, stop); their stale keys are masked out by lengths and overwritten."""
        self.set_lengths(0, start, stop)

    def move_row(self, src: int, dst: int) -> None:
        """Copy row src into row dst (a sibling sharing a prompt); src keeps its data."""
        if src == dst:
            return
        n = self.host_lengths[src]
        held = min(n, self.slots)
        for buf in self.k + self.v:
            buf[dst, :, :held] = buf[src, :, :held]
        self.set_lengths(n, dst, dst + 1)

    def relocate(self, src: int, dst: int) -> None:
        """Row dst takes over row src (to keep live rows packed); src is left to be reset."""
        self.move_row(src, dst)

    def reorder(self, index: Tensor | Sequence[int], start: int = 0) -> None:
        """Rows [start, start+len(index)) become rows start+index (beam search). Only the rows that
        change are copied (a beam that keeps its place costs nothing), each only as far as rows of its
        length need: moved rows are copied in groups of similar length (to the next multiple of
        REORDER_GROUP tokens), every group read before any is written."""
        rows = [start + int(i) for i in (index.tolist() if isinstance(index, Tensor) else index)]
        stop = start + len(rows)
        lengths = [self.host_lengths[r] for r in rows]
        groups: dict[int, list[tuple[int, int]]] = {}  # tokens to copy -> (dst, src) rows
        for i, r in enumerate(rows):
            if r != start + i:
                n = min(-(-self.host_lengths[r] // REORDER_GROUP) * REORDER_GROUP, self.slots)
                groups.setdefault(n, []).append((start + i, r))
        if groups:
            device = self.lengths.device
            moves = [(n, torch.tensor([d for d, _ in pairs], device=device),
                      torch.tensor([r for _, r in pairs], device=device)) for n, pairs in groups.items()]
            for buf in self.k + self.v:
                read = [buf[src, :, :n] for n, _, src in moves]  # (M_g, K, n_g, D) copies
                for (n, dst, _), rows_kv in zip(moves, read, strict=True):
                    buf[dst, :, :n] = rows_kv
        self.set_lengths(lengths, start, stop)


@dataclass
class CacheView:
    """Rows [start, stop) of a KVCache, as one forward pass sees them."""

    cache: KVCache
    start: int
    stop: int
    step_len: int | None = None  # S of the step in progress, set by begin()
    # a ring step of several tokens: the S - T slots of the past it reads before writing (set by begin())
    past: int | None = None
    _positions: Tensor | None = None  # (B, T) of the step in progress, set by begin()
    _slots: Tensor | None = None  # flat slot index (B*K*T,) of the step in progress, set by begin()

    def fresh(self) -> bool:
        """Whether every row starts this step empty (a prefill from the first token; host lengths)."""
        return not any(self.cache.host_lengths[self.start:self.stop])

    @property
    def lengths(self) -> Tensor:
        return self.cache.lengths[self.start:self.stop]  # (B,)

    def positions(self, t: int) -> Tensor:
        """Absolute positions of T new tokens per row: (B, T)."""
        lengths = self.lengths
        return lengths[:, None] + torch.arange(t, device=lengths.device)[None, :]  # (B, T)

    def _key_len(self, t: int) -> tuple[int, int | None]:
        """S, the keys a step of T new tokens attends to, and in a ring with T > 1 how many of them
        are past slots read before the step writes (its own T keys follow them; a step writing
        first could overwrite keys its earlier queries still see). From the host's lengths: no
        device read."""
        longest = max(self.cache.host_lengths[self.start:self.stop], default=0)
        if longest + t > self.cache.max_len:
            raise ValueError(f"KV cache holds {self.cache.max_len} tokens per row; this step needs {longest + t}")
        if not self.cache.ring:
            return longest + t, None
        if t == 1:
            return min(longest + 1, self.cache.slots), None
        past = min(longest, self.cache.slots)
        return past + t, past

    def begin(self, t: int, keep: Tensor | None = None) -> tuple[Tensor, int]:
        """Start a step of T new tokens per row: their positions (B, T) and S (checked once), and
        where its keys go in every layer. keep (B, T) bool marks real tokens (right padding); a ring
        stores only those, and only each row's last L."""
        self.step_len, self.past = self._key_len(t)
        self._positions = self.positions(t)  # (B, T)
        self._slots = self._slot_index(self._positions, self.cache.kv_heads, keep)
        return self._positions, self.step_len

    def key_positions(self) -> Tensor:
        """The position held by each of the step's S keys, for causal_mask: (S,) when slot =
        position, (B, S) in a ring (UNWRITTEN where a slot holds nothing yet)."""
        if self.step_len is None or self._positions is None:
            raise RuntimeError("CacheView.key_positions() before begin()")
        if not self.cache.ring:
            return torch.arange(self.step_len, device=self.cache.lengths.device)  # (S,): a key's slot is its position
        if self.past is None:  # one new token per row, written first: it sits at position lengths
            return self._held(self.lengths, self.step_len)  # (B, S)
        return torch.cat([self._held(self.lengths - 1, self.past), self._positions], dim=1)  # (B, S)

    def _held(self, last: Tensor, s: int) -> Tensor:
        """The position in each of a row's first s ring slots when its newest stored token sits at
        position last (B,): the latest p <= last with p = slot mod L; UNWRITTEN where p < 0. (B, s)"""
        index = torch.arange(s, device=last.device)[None, :]  # (1, s)
        held = last[:, None] - (last[:, None] - index) % self.cache.slots  # (B, s)
        return held.masked_fill(held < 0, UNWRITTEN)  # (B, s)

    def _slot_index(self, positions: Tensor, kv_heads: int, keep: Tensor | None) -> Tensor:
        """Where the step's keys go in a layer buffer seen as (R * K * L + 1, D): row-major offsets of
        (row, head, slot) for every row, head and new token, (B * K * T,); the same for every layer,
        so a step computes it once. In a ring, slot = position mod L, and the tokens a row does not
        keep (padding; a prompt's tokens before its last L) go to the trash slot."""
        slots = self.cache.slots
        rows = torch.arange(self.start, self.stop, device=positions.device)  # (B,)
        heads = torch.arange(kv_heads, device=rows.device)  # (K,)
        base = (rows[:, None] * kv_heads + heads[None, :]) * slots  # (B, K)
        if not self.cache.ring:
            return (base[:, :, None] + positions[:, None, :]).reshape(-1)  # (B * K * T,)
        flat = base[:, :, None] + (positions % slots)[:, None, :]  # (B, K, T)
        if keep is None:
            keep = torch.ones_like(positions, dtype=torch.bool)  # (B, T)
        real = keep.sum(-1, keepdim=True) + self.lengths[:, None]  # (B, 1): position after the row's last real token
        stored = keep & (positions >= real - slots)  # (B, T): real and among the row's last L
        return flat.masked_fill(~stored[:, None, :], self.cache.trash).reshape(-1)  # (B * K * T,)

    def layer(self, i: int) -> LayerCache:
        """Layer i's buffers for the step begin() started."""
        if self._slots is None or self.step_len is None:
            raise RuntimeError("CacheView.layer() before begin()")
        c = self.cache
        return LayerCache(c._flat_k[i], c._flat_v[i], self._slots, self.start, self.stop, self.step_len,
                          c.slots, self.past)

    def write(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store new keys/values (B, K, T, D) of layer `layer` (starting the step if begin() was not
        called); return the (B, K, S, D) keys/values the step attends to."""
        if self._slots is None:
            self.begin(k.size(2))
        return self.layer(layer).write(k, v)


@dataclass(frozen=True)
class LayerCache:
    """One layer's key/value buffers during a step: what attention reads and writes. Tensors and
    plain ints only (no list indexing by layer), so one compiled block serves every layer; the
    flat buffers only (a compiled graph given two aliasing views of one buffer fails to build)."""

    flat_k: Tensor  # (R * K * L + 1, D): every slot, row-major (row, head, slot), then the trash slot
    flat_v: Tensor  # (R * K * L + 1, D)
    slots: Tensor  # (B * K * T,) flat offsets of the step's new keys (CacheView._slot_index)
    start: int
    stop: int
    step_len: int  # S
    row_slots: int  # L
    past: int | None = None  # a ring step of T > 1 tokens: past slots read before writing (CacheView.past)

    def _rows(self, flat: Tensor, kv_heads: int) -> Tensor:
        """The view's rows of a flat buffer: (B, K, L, D)."""
        rows = flat[:-1].view(-1, kv_heads, self.row_slots, flat.size(-1))  # (R, K, L, D)
        return rows[self.start:self.stop]  # (B, K, L, D)

    def write(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store new keys/values (B, K, T, D) at each row's next slots, rounded to the buffers' dtype;
        return the (B, K, S, D) keys and values the step attends to, in k's dtype: views of the buffers
        (copies where the buffers' dtype is narrower), or (ring, T > 1) the past slots read first with
        the new keys after them."""
        d, heads = k.size(-1), k.size(1)
        k_rows, v_rows = self._rows(self.flat_k, heads), self._rows(self.flat_v, heads)  # (B, K, L, D) each
        if self.past is not None:
            k_all = torch.cat([k_rows[:, :, :self.past], k.to(k_rows.dtype)], dim=2).to(k.dtype)  # (B, K, S, D)
            v_all = torch.cat([v_rows[:, :, :self.past], v.to(v_rows.dtype)], dim=2).to(v.dtype)  # (B, K, S, D)
        self.flat_k.index_copy_(0, self.slots, k.reshape(-1, d).to(self.flat_k.dtype))  # (B*K*T, D) rows copied
        self.flat_v.index_copy_(0, self.slots, v.reshape(-1, d).to(self.flat_v.dtype))  # (B*K*T, D) rows copied
        if self.past is not None:
            return k_all, v_all
        s = self.step_len
        return k_rows[:, :, :s].to(k.dtype), v_rows[:, :, :s].to(v.dtype)  # (B, K, S, D) each

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask | Tensor | None, scale: float | None,
               gqa: bool) -> Tensor:
        """Store the step's keys/values (B, K, T, D) and attend q (B, H, T, D) to the row's keys
        under `mask` (the stack's causal mask): (B, H, T, D)."""
        k_all, v_all = self.write(k, v)  # (B, K, S, D) each
        return attention(q, k_all, v_all, mask, scale=scale, gqa=gqa)  # (B, H, T, D)
