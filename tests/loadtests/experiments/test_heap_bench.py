"""loadtests.experiments.heap runs end to end on the default encoder and prints one table row per interval."""

from __future__ import annotations

import pytest

from loadtests.experiments import heap


def test_heap_bench_prints_a_row_per_interval(capsys: pytest.CaptureFixture[str]) -> None:
    heap.main(["--models", "encoder", "--batches", "8", "--intervals", "0,0.001"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("| model | trim interval | RSS loaded | after 2 | after 4 | after 6 | after 8 |")
    never, often = lines[2].split(" | "), lines[3].split(" | ")
    assert never[:2] == ["| encoder", "never"] and never[-2:] == ["0", "- |"]
    assert often[1] == "0.001 s" and int(often[-2]) >= 7  # a trim after each batch but the first
