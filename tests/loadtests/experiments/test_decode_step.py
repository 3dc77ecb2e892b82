"""loadtests.experiments.decode_step runs end to end (tiny decoder, seconds): a row per row count, every decode step
of the "one op" side took the op, and both sides gave the same tokens."""

from __future__ import annotations

import pytest

from tests.models.projections.test_quant import needs_kernels


@needs_kernels
def test_decode_step_prints_a_row_per_row_count(capsys: pytest.CaptureFixture[str]) -> None:
    from loadtests.experiments import decode_step

    decode_step.main(["--tiny", "--rounds", "1", "--steps", "4", "--prompt", "5", "--rows", "1,3", "--threads", "1"])
    lines = capsys.readouterr().out.strip().splitlines()
    header = [i for i, line in enumerate(lines) if line.startswith("| rows |")]
    assert header, lines
    rows = [[c.strip() for c in r.strip("|").split("|")] for r in lines[header[0] + 2:]]
    assert [r[0] for r in rows] == ["1", "3"]
    assert all(r[4] == "4 / 4" and r[5] == "yes" for r in rows), rows


@needs_kernels
def test_decode_step_times_each_plan_on_each_kv_cache_dtype(capsys: pytest.CaptureFixture[str]) -> None:
    from loadtests.experiments import decode_step

    decode_step.main(["--tiny", "--rounds", "1", "--steps", "4", "--prompt", "5", "--rows", "1", "--threads", "1",
                      "--kv", "float32,bfloat16"])
    lines = capsys.readouterr().out.strip().splitlines()
    (header,) = [line for line in lines if line.startswith("| rows |")]
    assert "native, bfloat16 KV (ms/step)" in header and "torch, bfloat16 KV gain" in header
    (row,) = [[c.strip() for c in r.strip("|").split("|")] for r in lines if r.startswith("| 1 |")]
    assert len(row) == 1 + 4 + 3 + 2 and row[-2:] == ["4 / 4", "yes"] and all(float(c) > 0 for c in row[1:5])
