"""`python -m loadtests.experiments.asgi_cost` runs (a few calls; its figures are never asserted)."""

from __future__ import annotations

import pytest

from loadtests.experiments import asgi_cost


def test_the_asgi_cost_tool_runs(capsys: pytest.CaptureFixture[str]) -> None:
    assert asgi_cost.main(["--n", "20", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert "ours:" in out and "plain FastAPI:" in out and "us per POST /v1/classify" in out
