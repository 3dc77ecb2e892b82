"""`python -m loadtests.burst`'s summary and its refusal to aim anywhere but this machine (the burst
itself runs against the shipped models by hand: docs/reliability.md)."""

from __future__ import annotations

import pytest

from loadtests import burst


def test_the_summary_groups_answers_by_status() -> None:
    answers = [burst.Answer(200, s) for s in (1.0, 2.0, 3.0)] + [burst.Answer(503, 0.2, "overloaded_error", "1")]
    rows = burst.summary(answers)
    assert [(r["status"], r["n"], r["p50_s"], r["max_s"]) for r in rows] == [(200, 3, 2.0, 3.0), (503, 1, 0.2, 0.2)]
    assert rows[1]["errors"] == ["overloaded_error"] and rows[1]["retry_after"] == ["1"]


def test_a_burst_goes_to_this_machine_only() -> None:
    with pytest.raises(SystemExit):
        burst.main(["--url", "http://10.0.0.1:8000"])
