"""The cross-attention cache of an encoder-decoder: each source's encoder keys and values for every
decoder layer, computed once per request (CrossCache), and the slots a search keeps them in while
sources join and leave (CrossSlots).

    N sources, R decoder rows, K kv heads, S_src source tokens, D head dim
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..attention import AttentionMask, padding_mask


@dataclass
class CrossCache:
    """Encoder keys/values for every decoder layer, computed once per request.

    kv[layer] = (k, v), each (B, K, S_src, D); src_keep: (B, S_src) bool, True = real token; mask:
    the cross-attention mask built from it once (AttentionMask.build reads the device; built here,
    every decode step uses it without a host synchronisation), None = build it when used.

    Grouped (`rows` set, see `grouped`): one row per *source* (N of them), and the decoder's rows (a
    source's beams) find theirs through `rows`: decoder row r is slot rows[r] of an (N, width) grid,
    source rows[r] // width. Cross-attention then attends each source's beams together against its
    keys once (attention.group_queries), instead of copying the keys to every beam.
    """

    kv: list[tuple[Tensor, Tensor]]
    src_keep: Tensor
    mask: AttentionMask | None = None
    rows: Tensor | None = None  # (R,) long: each decoder row's grid slot; None = one kv row per decoder row
    width: int = 1  # grid slots per source
    _row_sources: tuple | None = field(default=None, repr=False, compare=False)  # row_sources(); () = none

    def row_sources(self) -> tuple[Tensor, Tensor] | None:
        """For the native decode step (models/execution/native.py): each decoder row's source (R, 1) long
        and its real key count (R,) long; None when a source's real keys are not a prefix of S_src (left
        padding) or a row's source has none. Computed once per cache object (a row layout), with one host sync."""
        if self._row_sources is None:
            keep = self.src_keep  # (N, S_src)
            lengths = keep.sum(-1)  # (N,)
            prefix = torch.arange(keep.size(1), device=keep.device)[None, :] < lengths[:, None]  # (N, S_src)
            n = keep.size(0)
            sources = torch.arange(n, device=keep.device) if self.rows is None else self.rows // self.width  # (R,)
            counts = lengths[sources]  # (R,): a source no row reads (a free CrossSlots slot) may have none
            ok = bool(torch.equal(prefix, keep)) and bool((counts > 0).all())
            self._row_sources = (sources[:, None].contiguous(), counts.contiguous()) if ok else ()
        return self._row_sources or None

    def grouped(self, rows: Tensor, width: int) -> CrossCache:
        """These per-source keys/values for decoder rows in grid slots `rows` (R,) of width `width`."""
        return CrossCache(self.kv, self.src_keep, self.mask, rows, width)

    def layer_kv(self, i: int) -> tuple:
        """What layer i's cross-attention takes: (k, v), or grouped (k, v, rows, width)."""
        k, v = self.kv[i]
        return (k, v) if self.rows is None else (k, v, self.rows, self.width)

    @classmethod
    def build(cls, kv: list[tuple[Tensor, Tensor]], src_keep: Tensor) -> CrossCache:
        keep = src_keep.bool()  # (B, S_src)
        return cls(kv, keep, AttentionMask.build(padding_mask(keep)))

    def select(self, index: Tensor) -> CrossCache:
        """Rows in a new order (repeats allowed): beams, or dropping finished rows."""
        kv = [(k.index_select(0, index), v.index_select(0, index)) for k, v in self.kv]  # (B', K, S, D)
        mask = None
        if self.mask is not None:
            dead = self.mask.dead.index_select(0, index) if self.mask.dead is not None else None  # (B', 1, 1, 1)
            mask = AttentionMask(self.mask.safe.index_select(0, index), dead)  # (B', 1, 1, S_src)
        return CrossCache(kv, self.src_keep.index_select(0, index), mask)  # (B', S_src)


class CrossSlots:
    """The cross-attention keys/values of a changing set of sources, each at a fixed slot (the
    encoder-decoder's continuous batching, models.beam_search.BeamSearch): a source joining is
    written into a free slot and one leaving frees its slot; no other source's keys move (a store
    concatenated on every join and compacted on every leave copies all of them each time).

    `cache` is a CrossCache over the slots up to the highest one in use, (N, K, S, D) per layer (views
    of the store; joins take the lowest free slots, so N stays near the sources live): a free slot has
    no real key (src_keep all False; its keys are whatever its last source left), and the decoder's rows reach their sources' slots through
    CrossCache.grouped. The store grows by one copy when a join needs it: C doubling up to `limit`
    sources, S to the longest source seen (rounded up to `S_STEP`)."""

    S_STEP = 16

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._kv: list[tuple[Tensor, Tensor]] = []  # (C, K, S, D) each, per layer
        self._keep: Tensor | None = None  # (C, S) bool
        self._free: list[int] = []  # free slots, lowest first
        self._cache: CrossCache | None = None  # built from _kv and _keep when asked; None: rebuild

    @property
    def capacity(self) -> int:
        return 0 if self._keep is None else self._keep.size(0)

    @property
    def cache(self) -> CrossCache:
        if self._keep is None:
            raise RuntimeError("no source was written")
        if self._cache is None:
            free, top = set(self._free), self.capacity
            while top > 1 and top - 1 in free:
                top -= 1
            self._cache = CrossCache.build([(k[:top], v[:top]) for k, v in self._kv],
                                           self._keep[:top])  # (N, K, S, D) per layer, (N, S)
        return self._cache

    def put(self, cross: CrossCache) -> list[int]:
        """Write cross's sources (B of them, one row each) into free slots; returns their slots."""
        b, s = cross.src_keep.shape
        used = self.capacity - len(self._free)
        if used + b > self.limit:
            raise ValueError(f"{used + b} sources do not fit {self.limit} slots")
        if len(self._free) < b or s > self._keep.size(1):
            grown = self.capacity if len(self._free) >= b else min(self.limit, max(used + b, 2 * self.capacity))
            self._grow(grown, s, cross)
        slots = self._free[:b]
        del self._free[:b]
        index = torch.tensor(slots, device=self._keep.device)  # (B,)
        # only the first s positions: past them a free slot's src_keep is already False (release, _grow),
        # so a keys' tail left by an earlier source is masked and never read
        for (k, v), (ck, cv) in zip(self._kv, cross.kv, strict=True):
            k[index, :, :s] = ck.to(k.dtype)  # (B, K, s, D) into their slots
            v[index, :, :s] = cv.to(v.dtype)
        self._keep[index, :s] = cross.src_keep.bool()  # (B, s)
        self._cache = None
        return slots

    def release(self, slots: Sequence[int]) -> None:
        """Free these slots (their sources left); their keys stay but are no source's."""
        if not slots:
            return
        self._keep[torch.tensor(list(slots), device=self._keep.device)] = False  # (n, S)
        self._free = sorted(self._free + list(slots))
        self._cache = None

    def _grow(self, capacity: int, s: int, like: CrossCache) -> None:
        """Buffers of `capacity` slots and S >= s (rounded up), the old slots copied in."""
        old = self.capacity
        if self._keep is not None:
            s = max(s, self._keep.size(1))
        s = -(-s // self.S_STEP) * self.S_STEP
        keep = like.src_keep.new_zeros(capacity, s, dtype=torch.bool)  # (C, S)
        kv = [(k.new_zeros(capacity, k.size(1), s, k.size(3)), v.new_zeros(capacity, v.size(1), s, v.size(3)))
              for k, v in like.kv]  # (C, K, S, D) each
        if old:
            width = self._keep.size(1)
            keep[:old, :width] = self._keep
            for (k, v), (k0, v0) in zip(kv, self._kv, strict=True):
                k[:old, :, :width] = k0  # (old, K, S_old, D)
                v[:old, :, :width] = v0
        self._kv, self._keep = kv, keep
        self._free = sorted(self._free + list(range(old, capacity)))
        self._cache = None
