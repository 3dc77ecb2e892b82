"""Give the C heap's free memory back to the operating system, at most once per interval.

A replica allocates activations of a new shape for almost every batch, and glibc's malloc keeps what
is freed in its heaps, so the resident set grows with the variety of shapes seen, not with the load.
`malloc_trim(0)` every `heap_trim_interval_s` (1 s by default) bounds it cheaply (docs/reliability.md,
"Heap trimming"); a fixed MALLOC_MMAP_THRESHOLD_ would cost a page fault per tensor, and
MALLOC_ARENA_MAX does not help. The replica's inference thread (a batcher's, or the engine's) calls
`HeapTrimmer.maybe_trim()` after each batch or step. Elsewhere than glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


def glibc_malloc_trim() -> Callable[[], object] | None:
    """glibc's malloc_trim(0) as a callable; None where the C library has none."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: trim(0)


class HeapTrimmer:
    """Calls `trim` from `maybe_trim()` when `interval_s` passed since the last call; 0 = never."""

    def __init__(self, interval_s: float, trim: Callable[[], object] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if interval_s < 0:
            raise ValueError(f"HeapTrimmer: interval_s must be >= 0, got {interval_s}")
        self.trim = (trim or glibc_malloc_trim()) if interval_s > 0 else None
        self.interval_s, self.clock = interval_s, clock
        self.last = clock()
        self.calls, self.seconds = 0, 0.0  # trims so far and the time they took

    @property
    def enabled(self) -> bool:
        return self.trim is not None

    def maybe_trim(self) -> bool:
        """Trim if the interval passed; whether it did. Never raises: a failed trim is logged once."""
        if self.trim is None or self.clock() - self.last < self.interval_s:
            return False
        started = time.perf_counter()
        try:
            self.trim()
        except Exception:
            log.exception("malloc_trim failed; heap trimming is off for this process")
            self.trim = None
            return False
        self.seconds += time.perf_counter() - started
        self.calls += 1
        self.last = self.clock()
        return True
