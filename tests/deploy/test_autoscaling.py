"""Autoscaling on a real local Ray (loadtests/experiments/autoscale.py runs the same scenario and plots it): under
sustained load a deployment with fractional CPUs goes from 1 replica to 2 and back to 1 once the load
stops, and every request during both transitions gets the answer its text gets alone."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtests.experiments import autoscale
from loadtests.experiments.autoscale import Scenario, Timeline
from service.testing.cluster import deploy, local_cluster, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.e2e]
SCENARIO = Scenario()
APP = "autoscale"


@pytest.fixture(scope="module")
def timeline() -> Iterator[Timeline]:
    with local_cluster(num_cpus=4, env=autoscale.cluster_env(SCENARIO)) as url:
        deploy(autoscale.app_args(SCENARIO), name=APP, prefix="/")
        wait_for(url, "/readyz", 200, timeout_s=120)
        yield autoscale.run(url, APP, SCENARIO)


def _runs(replicas: list[int]) -> list[int]:
    """The sequence of distinct replica counts, e.g. [1, 1, 2, 2, 1] -> [1, 2, 1]."""
    return [n for i, n in enumerate(replicas) if i == 0 or replicas[i - 1] != n]


@pytest.mark.timeout(240)
def test_scales_up_under_load_and_back_down_after_it(timeline: Timeline) -> None:
    e = timeline.events
    assert _runs(timeline.replicas()) == [1, 2, 1], timeline.summary()
    assert e["load_start"] < e["scaled_up"] < e["load_stop"] < e["scaled_down"] < e["end"]
    # the delays are respected: no replica added before upscale_delay_s of load, none removed before
    # downscale_delay_s after it
    assert e["scaled_up"] - e["load_start"] >= SCENARIO.upscale_delay_s
    assert e["scaled_down"] - e["load_stop"] >= SCENARIO.downscale_delay_s
    assert e["end"] < 90, f"the scenario took {e['end']:.0f} s"


def test_every_request_gets_the_right_answer_throughout(timeline: Timeline) -> None:
    assert timeline.wrong() == [], timeline.wrong()[:5]
    e = timeline.events
    two = [s.t for s in timeline.samples if s.running == 2]
    during_two = timeline.calls_during(min(two), max(two))
    during_up = timeline.calls_during(e["load_start"], e["scaled_up"])
    during_down = timeline.calls_during(e["load_stop"], e["scaled_down"])
    after = timeline.calls_during(e["scaled_down"], e["end"])
    assert min(len(during_up), len(during_two), len(during_down), len(after)) >= 5, \
        (len(during_up), len(during_two), len(during_down), len(after))
    assert {c.phase for c in timeline.calls} == {"load", "trickle"}


def test_the_timeline_plots(timeline: Timeline, tmp_path: Path) -> None:
    centres, p50, p99 = timeline.latency_windows()
    assert len(centres) == len(p50) == len(p99) > 10
    autoscale.plot(timeline, tmp_path / "autoscaling.png")
    assert (tmp_path / "autoscaling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
