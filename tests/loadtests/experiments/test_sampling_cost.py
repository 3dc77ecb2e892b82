"""loadtests.experiments.sampling_cost's synthetic mode runs and prints its table (the model mode needs the weights)."""

from __future__ import annotations

import pytest

from loadtests.experiments.sampling_cost import main

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_the_synthetic_mode_prints_a_row_per_batch_size(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--synthetic", "--rows", "1,3", "--repeat", "1", "--vocab", "500", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "| 1 |" in out and "| 3 |" in out and "+ top_p 0.95" in out and "inside 128 tokens" in out
