"""Numbers from samples: throughput, latency percentiles, errors; batching counters from /v1/models.

Definitions (one run, window = [warm-up end, warm-up end + duration]):
- throughput: successful requests that *finished* inside the window / its length (steady state);
- generation tokens/s: output tokens that reached the client inside the window / its length. A
  streamed answer's tokens count as its pieces arrive (spread evenly over its pieces), so a long
  stream still running at the window's end counts its part; an answer sent whole counts when it
  finishes, as its client sees it;
- latency, TTFT, TPOT percentiles: successful requests that *started* inside the window (including
  those that finished during the drain); requests still in flight when the drain ended are
  `unfinished` and not in the percentiles (so under overload the percentiles are a lower bound);
- errors: requests started inside the window that failed (non-200 or connection errors).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from .loadgen import RunOutcome, Sample

# /v1/models stats that are levels, not counters (reported as they are after the run)
# stats that are a state, not a running total: reported as they are after a run, never differenced
GAUGE_HINTS = ("largest", "efficiency", "usage", "running", "queued", "waiting", "rows", "loaded", "kv_blocks",
               "_bytes")


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), q in [0, 100]."""
    if not sorted_values:
        return math.nan
    pos = (len(sorted_values) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def dist_ms(values_s: Sequence[float]) -> dict[str, float | int | None]:
    xs = sorted(v * 1000.0 for v in values_s)
    if not xs:
        return {"n": 0, "p50": None, "p95": None, "p99": None, "mean": None, "max": None}
    return {
        "n": len(xs),
        "p50": percentile(xs, 50),
        "p95": percentile(xs, 95),
        "p99": percentile(xs, 99),
        "mean": sum(xs) / len(xs),
        "max": xs[-1],
    }


def summarize(outcome: RunOutcome, generation: bool) -> dict[str, Any]:
    start, end = outcome.window
    length = end - start
    finished = [s for s in outcome.samples if s.ok and start <= s.end <= end]
    measured = [s for s in outcome.samples if start <= s.start < end]
    ok = [s for s in measured if s.ok]
    failed = [s for s in measured if not s.ok]
    kinds = Counter(str(s.status) if s.status is not None else (s.error or "?").split(":")[0] for s in failed)
    out: dict[str, Any] = {
        "completed": len(finished),
        "throughput_rps": len(finished) / length if length > 0 else math.nan,
        "measured": len(measured),
        "errors": len(failed),
        "error_kinds": dict(kinds.most_common(5)),
        "error_samples": list(dict.fromkeys(s.error or "" for s in failed))[:3],
        "unfinished": outcome.unfinished,
        "latency_ms": dist_ms([s.end - s.start for s in ok]),
        "latencies_ms": [round((s.end - s.start) * 1000.0, 2) for s in ok],
    }
    if generation:
        delivered = sum(_tokens_between(s, start, end) for s in outcome.samples if s.ok)
        out.update(_generation(delivered, ok, length))
    return out


def _tokens_between(s: Sample, start: float, end: float) -> float:
    """Output tokens of one answer that reached its client in [start, end]."""
    if s.piece_times:
        inside = sum(1 for t in s.piece_times if start <= t <= end)
        return (s.tokens or 0) * inside / len(s.piece_times)
    return float(s.tokens or 0) if start <= s.end <= end else 0.0


def _generation(delivered: float, ok: list[Sample], length: float) -> dict[str, Any]:
    streamed = [s for s in ok if s.ttft is not None]
    with_tokens = [s for s in ok if s.tokens]
    tpot = [
        (s.end - s.start - s.ttft) / (s.tokens - 1)
        for s in streamed
        if s.tokens and s.tokens > 1 and s.ttft is not None
    ]
    return {
        "output_tokens_per_s": delivered / length if length > 0 else math.nan,
        "streamed": bool(streamed),
        # without streaming the first token reaches the client with the last one
        "ttft_ms": dist_ms(ttfts := [s.ttft if s.ttft is not None else s.end - s.start for s in ok]),
        "ttfts_ms": [round(t * 1000.0, 2) for t in ttfts],
        "tpot_ms": dist_ms(tpot),
        "latency_per_token_ms": dist_ms([(s.end - s.start) / s.tokens for s in with_tokens if s.tokens]),
        "output_tokens_mean": sum(s.tokens or 0 for s in with_tokens) / len(with_tokens)
        if with_tokens
        else None,
    }


def stats_for_task(models_payload: Mapping[str, Any], task: str) -> dict[str, float]:
    """Numeric batching counters of the cards serving `task` in a /v1/models answer, summed."""
    total: Counter[str] = Counter()
    for card in models_payload.get("data", []):
        if task in (card.get("tasks") or []):
            for key, value in (card.get("stats") or {}).items():
                if isinstance(value, int | float) and not isinstance(value, bool):
                    total[key] += value
    return dict(total)


def stats_delta(
    before: Mapping[str, float] | None, after: Mapping[str, float] | None
) -> dict[str, Any] | None:
    """Counter increases over a run, gauges as they are after it, and the derived batching numbers."""
    if not after:
        return None
    before = before or {}
    counters = {k: v - before.get(k, 0) for k, v in after.items() if not any(h in k for h in GAUGE_HINTS)}
    gauges = {k: v for k, v in after.items() if any(h in k for h in GAUGE_HINTS)}
    out: dict[str, Any] = {"counters": counters, "gauges": gauges}
    if counters.get("batches"):
        out["mean_batch_size"] = counters.get("items", 0) / counters["batches"]
    if counters.get("computed_tokens"):
        out["padding_efficiency"] = counters.get("real_tokens", 0) / counters["computed_tokens"]
    if counters.get("steps") and counters.get("generated_tokens"):
        out["tokens_per_decode_step"] = counters["generated_tokens"] / counters["steps"]
    return out
