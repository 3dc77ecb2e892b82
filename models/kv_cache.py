"""Preallocated key/value cache with one position per row, and the per-request cross-attention cache.

A row holds one sequence. `lengths[r]` counts the tokens stored in row r; a step that feeds
T new tokens writes them at slots lengths[r] .. lengths[r] + T - 1, so rows may sit at
different steps. Right-padded prompts leave garbage after a row's real tokens; the caller
advances each row by its real token count only, and the next step overwrites that garbage.

Continuous batching keeps the live rows packed at the front: `move_row` fills the slot of a
finished row, `view(start, stop)` hands a contiguous (copy-free) slice of rows to the model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


class KVCache:
    """Keys/values for every layer: (R, K, L, D) each, R rows, L = max tokens per row."""

    def __init__(
        self,
        n_layers: int,
        rows: int,
        kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (rows, kv_heads, max_len, head_dim)
        # ordinary tensors even when built under inference_mode (generate, beam search): the engine
        # builds its cache outside it, and compiled blocks (models/compiled.py) see one kind only
        with torch.inference_mode(False):
            self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]  # (R, K, L, D)
            self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]  # (R, K, L, D)
            self.lengths = torch.zeros(rows, dtype=torch.long, device=device)  # (R,)
        self.rows, self.max_len, self.kv_heads = rows, max_len, kv_heads

    @classmethod
    def for_model(cls, cfg, rows: int, max_len: int | None = None, dtype=None, device=None) -> KVCache:
        """A cache shaped for a decoder config (Seq2SeqConfig: its decoder stack)."""
        n_layers = getattr(cfg, "n_decoder_layers", cfg.n_layers)
        return cls(n_layers, rows, cfg.kv_heads, max_len or cfg.max_positions, cfg.head_dim,
                   dtype or torch.float32, device or "cpu")

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def view(self, start: int = 0, stop: int | None = None) -> CacheView:
        return CacheView(self, start, self.rows if stop is None else stop)

    def reset(self, start: int = 0, stop: int | None = None) -> None:
        """Empty rows [start, stop); their stale keys are masked out by lengths and overwritten."""
        self.lengths[start:stop] = 0

    def advance(self, n_new: Tensor | int, start: int = 0, stop: int | None = None) -> None:
        """Count n_new (int or (B,) long) more tokens in rows [start, stop)."""
        self.lengths[start:stop] += n_new

    def move_row(self, src: int, dst: int) -> None:
        """Copy row src into row dst (to keep live rows packed); src keeps its data."""
        if src == dst:
            return
        n = int(self.lengths[src])
        for buf in self.k + self.v:
            buf[dst, :, :n] = buf[src, :, :n]
        self.lengths[dst] = n

    def reorder(self, index: Tensor, start: int = 0) -> None:
        """Rows [start, start+len(index)) become rows start+index (beam search)."""
        stop = start + index.numel()
        src = index + start
        n = int(self.lengths[src].max()) if stop > start else 0
        for buf in self.k + self.v:
            buf[start:stop, :, :n] = buf[src, :, :n]
        self.lengths[start:stop] = self.lengths[src].clone()


@dataclass
class CacheView:
    """Rows [start, stop) of a KVCache, as one forward pass sees them."""

    cache: KVCache
    start: int
    stop: int
    step_len: int | None = None  # S of the step in progress, set by begin()
    _slots: Tensor | None = None  # flat slot index (B*K*T,) of the step in progress, set by begin()

    @property
    def lengths(self) -> Tensor:
        return self.cache.lengths[self.start:self.stop]  # (B,)

    def positions(self, t: int) -> Tensor:
        """Absolute positions of T new tokens per row: (B, T)."""
        lengths = self.lengths
        return lengths[:, None] + torch.arange(t, device=lengths.device)[None, :]  # (B, T)

    def key_len(self, t: int) -> int:
        """S: slots a step of T new tokens must look at (the longest row's past + T)."""
        s = int(self.lengths.max()) + t
        if s > self.cache.max_len:
            raise ValueError(f"KV cache holds {self.cache.max_len} tokens per row; this step needs {s}")
        return s

    def begin(self, t: int) -> tuple[Tensor, int]:
        """Start a step of T new tokens per row: their positions (B, T) and S (checked once, the
        step's one host synchronisation), and where its keys go in every layer."""
        self.step_len = self.key_len(t)
        positions = self.positions(t)  # (B, T)
        self._slots = self._slot_index(positions, self.cache.kv_heads)
        return positions, self.step_len

    def _slot_index(self, positions: Tensor, kv_heads: int) -> Tensor:
        """Where the step's keys go in a layer buffer seen as (R * K * L, D): row-major offsets of
        (row, head, position) for every row, head and new token, (B * K * T,); the same for every
        layer, so a step computes it once."""
        max_len = self.cache.max_len
        rows = torch.arange(self.start, self.stop, device=positions.device)  # (B,)
        heads = torch.arange(kv_heads, device=rows.device)  # (K,)
        base = (rows[:, None] * kv_heads + heads[None, :]) * max_len  # (B, K)
        return (base[:, :, None] + positions[:, None, :]).reshape(-1)  # (B * K * T,)

    def layer(self, i: int) -> LayerCache:
        """Layer i's buffers for the step begin() started."""
        if self._slots is None or self.step_len is None:
            raise RuntimeError("CacheView.layer() before begin()")
        return LayerCache(self.cache.k[i], self.cache.v[i], self._slots, self.start, self.stop, self.step_len)

    def write(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store new keys/values (B, K, T, D) of layer `layer` (starting the step if begin() was not
        called); return the (B, K, S, D) views of past + new."""
        if self._slots is None:
            self.begin(k.size(2))
        return self.layer(layer).write(k, v)


@dataclass(frozen=True)
class LayerCache:
    """One layer's key/value buffers during a step: what attention reads and writes. Tensors and
    plain ints only (no list indexing by layer), so one compiled block serves every layer."""

    k: Tensor  # (R, K, L, D), contiguous
    v: Tensor  # (R, K, L, D), contiguous
    slots: Tensor  # (B * K * T,) flat offsets of the step's new keys (CacheView._slot_index)
    start: int
    stop: int
    step_len: int  # S

    def write(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store new keys/values (B, K, T, D) at each row's next slots; return (B, K, S, D) views."""
        d = k.size(-1)
        self.k.view(-1, d).index_copy_(0, self.slots, k.reshape(-1, d).to(self.k.dtype))  # (B*K*T, D) rows copied
        self.v.view(-1, d).index_copy_(0, self.slots, v.reshape(-1, d).to(self.v.dtype))  # (B*K*T, D) rows copied
        s = self.step_len
        return self.k[self.start:self.stop, :, :s], self.v[self.start:self.stop, :, :s]  # (B, K, S, D) each


@dataclass
class CrossCache:
    """Encoder keys/values for every decoder layer, computed once per request.

    kv[layer] = (k, v), each (B, K, S_src, D); src_keep: (B, S_src) bool, True = real token.
    """

    kv: list[tuple[Tensor, Tensor]]
    src_keep: Tensor

    def select(self, index: Tensor) -> CrossCache:
        """Rows in a new order (repeats allowed): beams, or dropping finished rows."""
        kv = [(k.index_select(0, index), v.index_select(0, index)) for k, v in self.kv]  # (B', K, S, D)
        return CrossCache(kv, self.src_keep.index_select(0, index))  # (B', S_src)
