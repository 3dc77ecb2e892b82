"""loadtests.experiments.concurrency runs end to end (tiny decoder, seconds): a row per cache kind and client count,
with the shipped engine settings but the ones it varies."""

from __future__ import annotations

import pytest

from loadtests.experiments import concurrency
from loadtests.experiments.engine_models import shipped_generator_engine


def test_the_shipped_engine_settings_are_read_and_changed() -> None:
    config = shipped_generator_engine(max_running=3, paged=False)
    assert config["max_running"] == 3 and config["paged"] is False
    assert config["prefill_chunk"] == shipped_generator_engine()["prefill_chunk"]


def test_concurrency_prints_a_row_per_cache_and_client_count(capsys: pytest.CaptureFixture[str]) -> None:
    assert concurrency.main(["--tiny", "--clients", "1,3", "--caches", "paged,rows", "--seconds", "1",
                             "--warmup", "2"]) == 0  # past the first request's one-time costs
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith(("| paged", "| rows"))]
    assert [[line.split("|")[i] for i in (1, 3)] for line in rows] == [[" paged ", " 1 "], [" rows ", " 1 "],
                                                                       [" paged ", " 3 "], [" rows ", " 3 "]]
    assert all(line.split("|")[2] == " shipped " for line in rows)  # the shipped config's prompt weights
    assert all(float(line.split("|")[4]) > 0 for line in rows)  # tokens were generated
