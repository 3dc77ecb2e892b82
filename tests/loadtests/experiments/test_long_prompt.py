"""loadtests.experiments.long_prompt: the streams' gaps are taken per stream inside each phase, and the table reads
the rise of p95 and the skipped systems. (The servers themselves run in the benchmark, not here.)"""

from __future__ import annotations

import argparse

import pytest

from loadtests.experiments import long_prompt


def test_gaps_are_per_stream_and_inside_the_window() -> None:
    a, b = [0.1, 0.2, 0.4], [0.35, 0.9, 1.5]  # no gap across the two streams
    assert sorted(long_prompt.gaps([a, b], 0.3, 1.0)) == pytest.approx([0.2, 0.55])


def test_the_table_gives_the_rise_and_the_skipped() -> None:
    args = argparse.Namespace(streams=16, prompt_tokens=2000, every=3.0, seconds=20.0, threads=1)
    row = {"alone": {50: 80.0, 95: 100.0, "max": 120.0}, "long": {50: 90.0, 95: 250.0, "max": 900.0},
           "p95_rise": 1.5, "long_ttft_p50_s": 2.5, "long_prompts": 7, "long_failed": 0, "streams_failed": 0}
    text = long_prompt.table({"ours": row, "peer": {"skipped": "not installed"}}, args)
    assert "| ours | 80 / 100 / 120 | 90 / 250 / 900 | +150% | 2.50 | 7 (0) | 0 |" in text
    assert "| peer | skipped: not installed |" in text
