"""The adapters benchmark's table (loadtests/models/adapters.py): each round's windows are paired."""

from __future__ import annotations

from loadtests.models.adapters import markdown, round_ratios


def runs(rates: list[tuple[float, float]], streams: int = 1) -> list[dict]:
    """(bare, adapters) tok/s of each round, as run_ours records them."""
    out = []
    for n, (base, adapted) in enumerate(rates):
        out += [{"round": n, "label": "base", "streams": streams, "tok_s": base},
                {"round": n, "label": "adapters", "streams": streams, "tok_s": adapted}]
    return out


def test_each_round_is_its_own_pair() -> None:
    # a machine that slows down between rounds: the medians mix rounds, each round's pair does not
    rates = [(200.0, 180.0), (100.0, 90.0), (150.0, 120.0)]
    assert round_ratios(runs(rates), 1) == [0.9, 0.9, 0.8]
    assert round_ratios(runs(rates), 32) == []


def test_the_table_shows_the_median_of_the_rounds_next_to_the_ratio_of_medians() -> None:
    result = {"machine": {"cpu_model": "cpu", "nproc": 2}, "date": "today", "adapters": 8, "rank": 16,
              "rounds": 3, "seconds": 15.0, "streams": 32,
              "ours": {"runs": runs([(200.0, 180.0), (100.0, 90.0), (150.0, 120.0)])
                       + runs([(600.0, 480.0), (500.0, 450.0), (700.0, 560.0)], streams=32)}}
    result["ours"]["interleaved"] = [{"round": 0, "base": 100.0, "adapters": 85.0, "pairs": 9},
                                     {"round": 1, "base": 80.0, "adapters": 72.0, "pairs": 7},
                                     {"round": 2, "base": 90.0, "adapters": 72.0, "pairs": 8}]
    table = markdown(result)
    assert ("| ours, requests alternating bare / adapter | 1 (adapter 0) | 90.0 | 72.0 | 0.80x | 0.85x, 0.90x, "
            "0.80x | **0.85x** |") in table
    assert "| 1 (adapter 0) | 150.0 | 120.0 | 0.80x | 0.90x, 0.90x, 0.80x | **0.90x** |" in table
    assert "| 32 (8 adapters) | 600.0 | 480.0 | 0.80x | 0.80x, 0.90x, 0.80x | **0.80x** |" in table
