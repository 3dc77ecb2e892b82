"""What a DynamicBatcher reports: observer hooks free of any metrics library (and of torch, so the
ingress can import the Prometheus wiring in service/metrics.py, which subclasses BatchObserver)."""

from __future__ import annotations

from collections.abc import Sequence


class BatchObserver:
    """Metrics hooks of a DynamicBatcher; the defaults do nothing (the Prometheus wiring subclasses it,
    so this module stays free of any metrics library). Called on the replica's event loop; keep them
    cheap. An exception in a hook is logged and ignored."""

    def on_queue(self, queued: int) -> None:
        """The number of items waiting changed (after a submit, a batch was taken, items were dropped)."""

    def on_batch(self, items: int, real_tokens: int, computed_tokens: int, inference_s: float,
                 queue_waits_s: Sequence[float]) -> None:
        """A batch was computed: its rows, real and padded tokens, the seconds run_batch took, and how
        long each of its items waited in the queue."""

    def on_dropped(self, reason: str, items: int) -> None:
        """Items that never reached the model: reason is "rejected" (queue full), "cancelled" or "expired"."""
