"""loadtests.experiments.prefill_padding runs end to end (tiny decoder, seconds): a row per multiple, and the
padding it reports is the padding the engine computed."""

from __future__ import annotations

import pytest

from loadtests.experiments import prefill_padding


def test_prefill_padding_prints_a_row_per_multiple(capsys: pytest.CaptureFixture[str]) -> None:
    prefill_padding.main(["--tiny", "--rounds", "1", "--requests", "6", "--multiples", "32,1", "--threads", "1"])
    lines = capsys.readouterr().out.strip().splitlines()
    header = [i for i, line in enumerate(lines) if line.startswith("| padding multiple |")]
    assert header, lines
    rows = [r.strip("|").split("|") for r in lines[header[0] + 2:]]
    assert [r[0].strip() for r in rows] == ["32", "1"]
    real = {r[0].strip(): float(r[2]) for r in rows}
    assert real["1"] > real["32"] and real["32"] < 1.0  # one prompt per forward at worst: some padding at 32
