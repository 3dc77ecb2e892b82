"""loadtests.experiments.translate_mix --apart runs end to end (tiny encoder-decoder, seconds): each scheduler's own
code translates the same sentences, and the table counts what each did."""

from __future__ import annotations

import pytest

from loadtests.experiments import translate_mix


def test_apart_prints_a_row_per_scheduler_and_round(capsys: pytest.CaptureFixture[str]) -> None:
    translate_mix.main(["--tiny", "--apart", "12", "--batch", "4", "--rounds", "2", "--threads", "1"])
    lines = capsys.readouterr().out.strip().splitlines()
    header = [i for i, line in enumerate(lines) if line.startswith("| scheduler |")]
    assert header, lines
    rows = [line.split(" | ") for line in lines[header[0] + 2:]]
    assert [(r[0], r[1]) for r in rows] == [("| batches of 4", "1"), ("| steps", "1"),
                                            ("| batches of 4", "2"), ("| steps", "2")]
    for r in rows:
        passes, per_pass = int(r[3]), float(r[4])
        assert passes * per_pass == pytest.approx(12, abs=0.1)  # every sentence encoded once
        if r[0] == "| batches of 4":
            assert passes == 3
        assert int(r[6]) > 0 and float(r[7]) > 0  # decoder steps, rows a step
