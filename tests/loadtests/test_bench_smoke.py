"""Smoke test of the serving benchmark: a few seconds of classification on tiny models against ours
(a real local Ray Serve) and the plain baseline, through the command line, as `make bench-serve`
runs it. Checks that results.json, the markdown and the plots come out with sane fields; never speed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from loadtests.report import BEGIN, END, markdown

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
LEAD_SECTION = "## Models\n\nnumbers from `make bench`, not ours to touch\n"


def _bench(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "loadtests.bench", *args],
        cwd=ROOT,
        env=env,
        text=True,
        capture_output=True,
        timeout=timeout,
        check=False,
    )


@pytest.mark.timeout(900)
def test_bench_ours_and_plain_on_tiny_models(tmp_path: Path) -> None:
    out, docs = tmp_path / "bench", tmp_path / "benchmarks.md"
    docs.write_text(f"# Benchmarks\n\n{LEAD_SECTION}")
    done = _bench(
        "--tasks",
        "classify",
        "--systems",
        "ours,plain",
        "--models",
        "tiny",
        "--concurrency",
        "2",
        "--duration",
        "2",
        "--warmup",
        "0.5",
        "--drain",
        "5",
        "--threads",
        "1",
        "--compare-at",
        "2",
        "--progress",
        "1",
        "--out",
        str(out),
        "--docs",
        str(docs),
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "[1/2] ours classify 2 clients" in done.stderr + done.stdout  # progress is shown

    results = json.loads((out / "results.json").read_text())
    meta = results["meta"]
    assert meta["machine"]["nproc"] >= 1 and {"torch", "ray", "transformers"} <= set(meta["versions"])
    assert "--systems ours,plain" in meta["command"] and meta["settings"]["concurrency"] == [2]
    for name in ("ours", "plain"):
        system = results["systems"][name]
        assert system["startup_s"] > 0 and not system.get("error") and system["tasks"] == ["classify"]

    runs = {r["system"]: r for r in results["runs"]}
    assert sorted(runs) == ["ours", "plain"]
    for run in runs.values():
        assert (run["task"], run["mode"], run["concurrency"]) == ("classify", "closed", 2)
        assert run["completed"] > 0 and run["errors"] == 0 and run["unfinished"] == 0
        assert run["throughput_rps"] == pytest.approx(run["completed"] / 2.0)
        lat = run["latency_ms"]
        assert lat["n"] == len(run["latencies_ms"]) > 0
        assert 0 < lat["p50"] <= lat["p95"] <= lat["p99"] <= lat["max"]
        server = run["server"]
        assert server["counters"]["items"] >= run["completed"]
        assert server["mean_batch_size"] >= 1.0 and 0 < server["padding_efficiency"] <= 1.0
    assert runs["plain"]["server"]["mean_batch_size"] == 1.0  # one text per request, no batching
    assert runs["plain"]["server"]["padding_efficiency"] == 1.0

    # a Poisson-only plan (--concurrency "") still gets its generation table
    poisson = {**runs["ours"], "task": "generate", "mode": "poisson", "concurrency": None, "rate": 1.0, "streamed": True}
    settings = {**meta["settings"], "tasks": ["generate"], "concurrency": [], "poisson_rates": [1.0]}
    only = markdown({**results, "runs": [poisson], "meta": {**meta, "settings": settings}})
    assert "Open loop, Poisson arrivals" in only and "| ours | 1.00 |" in only

    section = (out / "results.md").read_text()
    assert section.startswith(BEGIN) and section.rstrip().endswith(END)
    assert "| ours | 2 |" in section and "| plain | 2 |" in section and "| classify | plain |" in section
    for png in ("throughput_classify.png", "latency_classify.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # the docs keep the lead's section; a rerun of the report replaces only the generated block
    assert _bench("--report-only", "--out", str(out), "--docs", str(docs), timeout=120).returncode == 0
    text = docs.read_text()
    assert text.count(BEGIN) == 1 and text.count(END) == 1 and LEAD_SECTION in text
    assert section.strip() in text
