"""What replicas report to Serve's autoscaler and the replica count our policy asks for."""

from __future__ import annotations

from typing import Any

import pytest
from ray.serve.config import AutoscalingContext

from service.fleet.autoscaling import LoadPolicy
from service.fleet.load import LoadReport
from service.telemetry.hooks import EngineStats


def context(replicas: int, metrics: dict[str, list[float]], handle_queued: float = 0.0) -> AutoscalingContext:
    running = [f"r{i}" for i in range(replicas)]
    return AutoscalingContext(
        deployment_id=None, deployment_name="generator", app_name="app",  # type: ignore[arg-type]
        current_num_replicas=replicas, target_num_replicas=replicas, running_replicas=running,  # type: ignore[arg-type]
        total_num_requests=0.0, total_queued_requests=handle_queued,
        aggregated_metrics={name: dict(zip(running, values, strict=True)) for name, values in metrics.items()},
        raw_metrics={}, capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=8, policy_state={},
        last_scale_up_time=None, last_scale_down_time=None, current_time=0.0, config=None)


POLICY = LoadPolicy({"queued": 2, "kv_usage": 0.7, "ttft_s": 2.0, "itl_s": 0.1})


def test_queued_requests_scale_up_where_ongoing_ones_do_not() -> None:
    # many streams decoding, none waiting, cache half full, fast first tokens: one replica is enough
    assert POLICY(context(1, {"queued": [0], "kv_usage": [0.35], "ttft_s": [0.2]}))[0] == pytest.approx(0.5)
    # requests waiting for a row: 6 per replica against a target of 2 -> 3x the replicas
    desired, state = POLICY(context(2, {"queued": [5, 7], "kv_usage": [0.3, 0.3], "ttft_s": [1.0, 1.0]}))
    assert desired == pytest.approx(6) and state["ratios"]["queued"] == pytest.approx(3)
    # requests queued at the handles (every replica at max_ongoing_requests) count as queued work
    assert POLICY(context(1, {"queued": [0]}, handle_queued=4))[0] == pytest.approx(2)


def test_the_largest_ratio_decides_and_missing_signals_keep_the_count() -> None:
    assert POLICY(context(2, {"queued": [0, 0], "kv_usage": [0.9, 0.5]}))[0] == pytest.approx(2 * 0.7 / 0.7)
    assert POLICY(context(1, {"ttft_s": [5.0]}))[0] == pytest.approx(2.5)
    # streams slowed to 5 tokens/s where 10 are the target: twice the replicas
    assert POLICY(context(2, {"queued": [0, 0], "itl_s": [0.2, 0.2]}))[0] == pytest.approx(4)
    assert POLICY(context(3, {}))[0] == 3
    assert POLICY(context(0, {}))[0] == 0


@pytest.mark.parametrize("targets", [{}, {"ongoing": 3}, {"queued": 0}])
def test_bad_targets_are_refused(targets: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        LoadPolicy(targets)


def test_a_generator_reports_waiting_blocks_held_and_recent_ttft() -> None:
    report = LoadReport(generator=True)
    stats = EngineStats(running=40, waiting=3, rows=128, cache_usage=0.9, cache_bytes=1, prompt_tokens=0,
                        generated_tokens=0, steps=0, kv_blocks=100, kv_blocks_free=75, first_tokens=4, ttft_ms=2000,
                        inter_tokens=100, itl_ms=5000)
    assert report(vars(stats)) == {"queued": 3.0, "kv_usage": 0.25, "ttft_s": 0.5, "itl_s": 0.05}
    later = vars(stats) | {"first_tokens": 5, "ttft_ms": 4000, "inter_tokens": 110, "itl_ms": 7000}
    assert report(later)["ttft_s"] == pytest.approx(2.0)  # one more first token, after 2 s
    assert report(later)["itl_s"] == 0.0  # none since the last report
    again = later | {"inter_tokens": 120, "itl_ms": 9000}
    assert report(again)["itl_s"] == pytest.approx(0.2)
    dense = vars(stats) | {"kv_blocks": 0}
    assert LoadReport(generator=True)(dense)["kv_usage"] == 0.9


def test_batchers_and_the_translation_engine_report_queued_work() -> None:
    assert LoadReport(generator=False)({"queued": 17, "batches": 3}) == {"queued": 17.0}
    assert LoadReport(generator=False)({"waiting": 2, "running": 9, "first_tokens": 0}) == {"queued": 2.0}
