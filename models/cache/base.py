"""What every key/value cache of a decoder is: the interface the stacks, the engines and the searches
use, and the row lengths the dense and the paged cache share.

`KeyValueCache` (R rows of up to L tokens each, a row per sequence) is implemented by
dense.KVCache (a preallocated row each; a ring for a sliding window) and paged.PagedKVCache (a pool
of blocks with a table per row). A step runs on a `CacheStep`, a view of rows [start, stop) that the
attention layers read and write. `paged` and `ring` are the capabilities callers may ask for: a paged
cache allocates blocks (`ensure`, `blocks_free`) and shares full ones; a ring keeps a window only.
Lengths are kept on the device and on the host (RowLengths) so a step never reads the device.

    R rows, L tokens a row, B rows in a step, T new tokens a row, S keys a step attends
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import Tensor

KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def kv_dtype(name: str, model_dtype: torch.dtype | None) -> torch.dtype | None:
    """The dtype a cache keeps keys/values in: "auto" the model's (its weights'), else one of KV_DTYPES."""
    if name == "auto":
        return model_dtype
    if name not in KV_DTYPES:
        raise ValueError(f"a KV cache dtype is 'auto' or one of {sorted(KV_DTYPES)}, got {name!r}")
    return KV_DTYPES[name]


class CacheStep(Protocol):
    """Rows [start, stop) of a cache as one forward pass sees them (its layers read and write them)."""

    start: int
    stop: int

    @property
    def lengths(self) -> Tensor:
        """(B,) tokens each row held before this step."""

    def fresh(self) -> bool:
        """Whether every row starts this step empty (from the host's lengths)."""

    def begin(self, t: int, keep: Tensor | None = None) -> tuple[Tensor, int]:
        """Start a step of T new tokens per row (keep (B, T): the real ones): positions (B, T) and S."""

    def key_positions(self) -> Tensor:
        """The position each of the S keys holds: (S,), or (B, S) in a ring."""

    def layer(self, i: int) -> object:
        """Layer i's buffers during this step (what attention writes its keys to and attends)."""


class KeyValueCache(Protocol):
    """A decoder's key/value cache of R rows; what the stacks, the engines and the searches call."""

    rows: int
    max_len: int
    paged: bool  # blocks from a pool (ensure, blocks_free, share); else a preallocated row each
    ring: bool  # a sliding window's ring: a row keeps its last W tokens only
    lengths: Tensor  # (R,) on the device
    host_lengths: list[int]  # the same on the host

    def view(self, start: int = 0, stop: int | None = None) -> CacheStep: ...
    def reset(self, start: int = 0, stop: int | None = None) -> None: ...
    def set_lengths(self, n: int | Sequence[int], start: int = 0, stop: int | None = None) -> None: ...
    def advance(self, n_new: Tensor | Sequence[int] | int, start: int = 0, stop: int | None = None) -> None: ...
    def move_row(self, src: int, dst: int) -> None: ...
    def relocate(self, src: int, dst: int) -> None: ...
    def reorder(self, index: Tensor | Sequence[int], start: int = 0) -> None: ...
    def usage(self) -> float: ...
    def held(self) -> list[int]: ...
    def nbytes(self) -> int: ...


class RowLengths:
    """The tokens each of R rows holds, on the device (what a step reads) and the same on the host,
    kept by every method that changes them, so a step sizes its keys without reading the device (no
    host synchronisation inside a decode step). Shared by the dense and the paged cache."""

    def __init__(self, rows: int, device: torch.device | str) -> None:
        self.lengths = torch.zeros(rows, dtype=torch.long, device=device)  # (R,)
        # on the CPU the same memory as a numpy array: a decode step's small writes without a torch op each
        self._lengths_np = self.lengths.numpy() if self.lengths.device.type == "cpu" else None
        self.host_lengths = [0] * rows
        self.rows = rows

    def set_lengths(self, n: int | Sequence[int], start: int = 0, stop: int | None = None) -> None:
        """Rows [start, stop) hold n tokens (one int for all, or one per row): device and host."""
        stop = self.rows if stop is None else stop
        values = [n] * (stop - start) if isinstance(n, int) else [int(x) for x in n]
        if len(values) != stop - start:
            raise ValueError(f"{len(values)} lengths for rows [{start}, {stop})")
        self.host_lengths[start:stop] = values
        if self._lengths_np is not None:
            self._lengths_np[start:stop] = values
        else:
            self.lengths[start:stop] = torch.tensor(values, dtype=torch.long) if values else 0

    def advance(self, n_new: Tensor | Sequence[int] | int, start: int = 0, stop: int | None = None) -> None:
        """Count n_new (an int, or one per row) more tokens in rows [start, stop). A tensor is read
        back to the host once (prefills; a decode step advances by an int)."""
        stop = self.rows if stop is None else stop
        if isinstance(n_new, int):
            if self._lengths_np is not None:
                self._lengths_np[start:stop] += n_new
            else:
                self.lengths[start:stop] += n_new
            self.host_lengths[start:stop] = [n + n_new for n in self.host_lengths[start:stop]]
            return
        added = n_new.tolist() if isinstance(n_new, Tensor) else [int(x) for x in n_new]
        self.set_lengths([n + a for n, a in zip(self.host_lengths[start:stop], added, strict=True)], start, stop)
