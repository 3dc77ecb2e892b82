"""What a model replica reports to Serve's autoscaler (its deployment's `record_autoscaling_stats`):
load signals from its runner's stats, per report. No Ray, no torch.

- `queued`: work waiting for computation: requests waiting for a KV-cache row or a beam slot (the
  engines), inputs waiting for a batch (the batchers). Ongoing requests are no load signal for a
  generator: 40 short streams and 40 long ones look alike, and a replica decodes all it admitted.
- `kv_usage`: generators: the share of KV-cache blocks held (tokens held / capacity without pages).
- `ttft_s`: generators: the mean time to first token of the requests that got theirs since the last
  report (0 when none did).
autoscaling.py turns them into a replica count.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

QUEUED, KV_USAGE, TTFT = "queued", "kv_usage", "ttft_s"
SIGNALS = (QUEUED, KV_USAGE, TTFT)


class LoadReport:
    """One replica's reports; remembers the TTFT counters of the previous report. Not thread-safe
    (Serve calls it on the replica's event loop)."""

    def __init__(self, generator: bool) -> None:
        self.generator = generator
        self._first_tokens, self._ttft_ms = 0, 0

    def __call__(self, stats: Mapping[str, Any]) -> dict[str, float]:
        """`stats`: a runner's stats() (EngineStats' fields for an engine, a batcher's with `queued`)."""
        if "waiting" not in stats:  # a batcher
            return {QUEUED: float(stats.get("queued", 0))}
        report = {QUEUED: float(stats["waiting"])}
        if not self.generator:  # the translation engine
            return report
        blocks = stats.get("kv_blocks", 0)
        report[KV_USAGE] = (1 - stats["kv_blocks_free"] / blocks) if blocks else float(stats["cache_usage"])
        firsts = stats["first_tokens"] - self._first_tokens
        report[TTFT] = (stats["ttft_ms"] - self._ttft_ms) / firsts / 1000 if firsts > 0 else 0.0
        self._first_tokens, self._ttft_ms = stats["first_tokens"], stats["ttft_ms"]
        return report
