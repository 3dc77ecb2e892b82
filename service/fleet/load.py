"""What a model replica reports to Serve's autoscaler (its deployment's `record_autoscaling_stats`):
load signals from its runner's stats, per report. No Ray, no torch.

- `queued`: work waiting for computation: requests waiting for a KV-cache row or a beam slot (the
  engines), inputs waiting for a batch (the batchers). Ongoing requests are no load signal for a
  generator: 40 short streams and 40 long ones look alike, and a replica decodes all it admitted.
- `kv_usage`: generators: the share of KV-cache blocks held (tokens held / capacity without pages).
- `ttft_s`: generators: the mean time to first token of the requests that got theirs since the last
  report (0 when none did);
- `itl_s`: generators: the mean gap between a stream's tokens since the last report (0 when no
  stream got one): what every stream feels when a replica decodes more rows than it computes quickly.
autoscaling.py turns them into a replica count.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

QUEUED, KV_USAGE, TTFT, ITL = "queued", "kv_usage", "ttft_s", "itl_s"
SIGNALS = (QUEUED, KV_USAGE, TTFT, ITL)
# a generator's mean over the last report's events: signal -> (EngineStats' count, its summed milliseconds)
MEANS = {TTFT: ("first_tokens", "ttft_ms"), ITL: ("inter_tokens", "itl_ms")}


class LoadReport:
    """One replica's reports; remembers the TTFT counters of the previous report. Not thread-safe
    (Serve calls it on the replica's event loop)."""

    def __init__(self, generator: bool) -> None:
        self.generator = generator
        self._seen: dict[str, int] = {}  # EngineStats' counters at the last report

    def __call__(self, stats: Mapping[str, Any]) -> dict[str, float]:
        """`stats`: a runner's stats() (EngineStats' fields for an engine, a batcher's with `queued`)."""
        if "waiting" not in stats:  # a batcher
            return {QUEUED: float(stats.get("queued", 0))}
        report = {QUEUED: float(stats["waiting"])}
        if not self.generator:  # the translation engine
            return report
        blocks = stats.get("kv_blocks", 0)
        report[KV_USAGE] = (1 - stats["kv_blocks_free"] / blocks) if blocks else float(stats["cache_usage"])
        for signal, (count, summed) in MEANS.items():
            events = stats[count] - self._seen.get(count, 0)
            report[signal] = (stats[summed] - self._seen.get(summed, 0)) / events / 1000 if events > 0 else 0.0
            self._seen[count], self._seen[summed] = stats[count], stats[summed]
        return report
