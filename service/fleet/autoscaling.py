"""Serve's autoscaling policy for our deployments: replicas from the load signals replicas report
(load.py), in Serve's controller. Configured per deployment in the Serve config:

    autoscaling_config:
      policy:
        policy_function: service.fleet.autoscaling:LoadPolicy
        policy_kwargs: {targets: {queued: 2, kv_usage: 0.7, ttft_s: 2.0}}

Each signal's mean over the running replicas (each replica's value as Serve aggregates it over
`look_back_period_s`) is divided by its target; the fleet wants `replicas x` the largest ratio
(requests waiting at the handles, `AutoscalingContext.total_queued_requests`, count as `queued`
spread over the replicas). Serve then applies min/max_replicas, upscale/downscale_delay_s and the
scaling factors, as for its own policy. Signals no replica reported yet are left out; with none at
all the count stays.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ray.serve.config import AutoscalingContext

from .load import QUEUED, SIGNALS


class LoadPolicy:
    """A class-callable policy (Serve builds it once with `policy_kwargs`)."""

    def __init__(self, targets: Mapping[str, float]) -> None:
        unknown = sorted(set(targets) - set(SIGNALS))
        if unknown or not targets:
            raise ValueError(f"LoadPolicy targets: unknown signals {unknown}; known {list(SIGNALS)}")
        if any(t <= 0 for t in targets.values()):
            raise ValueError(f"LoadPolicy targets must be > 0: {dict(targets)}")
        self.targets = dict(targets)

    def __call__(self, ctx: AutoscalingContext) -> tuple[float, dict[str, Any]]:
        replicas = ctx.current_num_replicas
        if replicas == 0:
            return ctx.target_num_replicas, {}
        ratios = self.ratios(ctx.aggregated_metrics or {}, ctx.running_replicas, ctx.total_queued_requests or 0.0)
        if not ratios:
            return ctx.target_num_replicas, {}
        return replicas * max(ratios.values()), {"ratios": ratios}

    def ratios(self, metrics: Mapping[str, Mapping[Any, float]], running: list[Any],
               handle_queued: float) -> dict[str, float]:
        """signal -> (its mean per running replica) / target, for the signals reported."""
        ratios = {}
        for name, target in self.targets.items():
            values = [metrics[name][r] for r in running if r in metrics.get(name, {})]
            if not values:
                continue
            total = sum(values) + (handle_queued if name == QUEUED else 0.0)
            ratios[name] = total / len(values) / target
        return ratios
