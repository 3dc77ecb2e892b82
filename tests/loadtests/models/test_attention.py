"""loadtests.models.attention runs (tiny sizes, seconds) and prints a row per rows x longest."""

from __future__ import annotations

import pytest

from loadtests.models import attention
from tests.models.projections.test_quant import needs_kernels


@needs_kernels
def test_it_prints_a_row_per_size(capsys: pytest.CaptureFixture[str]) -> None:
    attention.main(["--threads", "1", "--rows", "1,4", "--longest", "20", "--repeats", "2"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [r.split("|")[1:3] for r in rows] == [[" 1 ", " 20 "], [" 4 ", " 20 "]]
    assert all(float(r.split("|")[4]) > 0 and float(r.split("|")[5]) > 0 for r in rows)  # float32, bfloat16 pools
