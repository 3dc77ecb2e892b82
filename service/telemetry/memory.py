"""A process's resident memory, read from /proc (the replica memory metric and the load tests)."""

from __future__ import annotations

import os


def resident_bytes(statm: str = "/proc/self/statm") -> int:
    """This process's resident set size in bytes (0 where /proc is missing)."""
    try:
        with open(statm) as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
