"""loadtests.experiments.prefix_reuse runs end to end (tiny decoder, seconds): one row per setting, and the hit
rate it reports comes from the engine's counters (0 with the cache off, most of the prompt with it on)."""

from __future__ import annotations

import pytest

from loadtests.experiments import prefix_reuse


def test_prefix_reuse_prints_a_row_per_setting_with_the_hit_rate(capsys: pytest.CaptureFixture[str]) -> None:
    prefix_reuse.main(["--tiny", "--cache-mib", "0,8", "--system-tokens", "64", "--user-tokens", "8",
                       "--new-tokens", "2", "--requests", "6", "--clients", "1", "--threads", "1"])
    lines = capsys.readouterr().out.strip().splitlines()
    rows = [line.strip("| ").split(" | ") for line in lines if line.startswith(("| 0 ", "| 8 "))]
    assert [r[0] for r in rows] == ["0", "8"]
    assert all(0 <= int(r[5]) <= 1 for r in rows)  # most running (sampled): one client at most
    hit_off, hit_on = float(rows[0][4]), float(rows[1][4])
    # on: after the first request, 64 of each 72-token prompt come from the cache: 5 * 64 / (6 * 72)
    assert hit_off == 0.0 and hit_on == pytest.approx(5 * 64 / (6 * 72), abs=0.01)
