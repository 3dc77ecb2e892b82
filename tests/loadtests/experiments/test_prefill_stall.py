"""loadtests.experiments.prefill_stall runs end to end (tiny decoder, seconds) and prints one row per chunk setting."""

from __future__ import annotations

import pytest

from loadtests.experiments import prefill_stall


def test_inter_token_gaps_are_taken_inside_the_window() -> None:
    times = (0.1, 0.2, 0.4, 0.7, 1.1)
    assert prefill_stall.inter_token(times, 0.3, 1.0) == pytest.approx([0.2, 0.3])


def test_prefill_stall_prints_a_row_per_chunk_setting(capsys: pytest.CaptureFixture[str]) -> None:
    prefill_stall.main(["--tiny", "--chunks", "none,16", "--streams", "2", "--prompt-tokens", "60",
                        "--every", "0.2", "--seconds", "0.5", "--threads", "1"])
    lines = capsys.readouterr().out.strip().splitlines()
    header = [i for i, line in enumerate(lines) if line.startswith("| prefill_chunk |")]
    assert header, lines
    rows = lines[header[0] + 2:]
    assert [r.split(" | ")[0] for r in rows] == ["| none", "| 16"]
