"""loadtests.models.prompt_attention runs (tiny sizes, seconds) and prints a row per case."""

from __future__ import annotations

import pytest

from loadtests.models import prompt_attention
from tests.models.projections.test_quant import needs_kernels


@needs_kernels
def test_it_prints_a_row_per_case(capsys: pytest.CaptureFixture[str]) -> None:
    prompt_attention.main(["--threads", "1", "--cases", "1x20,2x5+17", "--repeats", "2"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [[c.strip() for c in r.split("|")[1:4]] for r in rows] == [["1", "20", "0"], ["2", "5", "17"]]
    assert all(float(r.split("|")[4]) > 0 and float(r.split("|")[5]) > 0 for r in rows)
