"""Smoke run of `make bench-peers` (loadtests/peers): the peers' own environment is set up, our
encoder and translator are converted for ONNX Runtime and CTranslate2, each conversion is checked
against our outputs, and every engine is timed in its own process. Asserts the conversions agree and
the tables come out; never speed. llama.cpp is not built here (about 10 minutes); its parts run in
`make bench-peers`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from loadtests.peers.bench import markdown
from loadtests.report import update_docs

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(900)
def test_peers_smoke_converts_checks_and_tabulates(tmp_path: Path) -> None:
    docs = tmp_path / "benchmarks.md"
    docs.write_text("# Benchmarks\n\n## Models\n\nnot ours to touch\n")
    done = subprocess.run([sys.executable, "-m", "loadtests.peers", "--smoke", "--models", "encoder,translator",
                           "--out", str(tmp_path / "out"), "--docs", str(docs)], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, text=True, capture_output=True, timeout=850)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "out" / "results.json").read_text())
    enc, tr = result["encoder"], result["translator"]
    # the ONNX export is our fp32 encoder: embeddings within 1e-5, the same labels
    assert enc["quality"]["onnxruntime fp32"]["max_abs_diff"] <= 1e-5
    assert enc["quality"]["onnxruntime fp32"]["same_label"] == 1.0
    # int8 is a different computation: measurably different embeddings (so the check can fail)
    assert enc["quality"]["onnxruntime int8"]["max_abs_diff"] > 1e-4
    # CTranslate2 fp32 from our Marian export gives our tokens, beam 4 and greedy
    n = tr["check_sentences"]
    assert n >= 8 and tr["identical"]["beam 4"]["ctranslate2 fp32"] == n
    assert tr["identical"]["beam 1"]["ctranslate2 fp32"] == n
    for table, unit in ((enc["texts_per_s"], "batch"), (tr["sentences_per_s"], "batch")):
        assert set(table) >= {"ours fp32", "ours int8"} and {"ours q8_0+a8", "ours q8_0+a8+compiled"} & set(table)
        assert all(v > 0 and unit in k for per in table.values() for k, v in per.items())
    assert result["versions"]["ctranslate2"] and result["versions"]["onnxruntime"]
    text = docs.read_text()
    assert "not ours to touch" in text and text.count("bench-peers:begin") == 1
    assert "| 1 |" in text and "best float / ORT fp32" in text and "best 8-bit / CT2 int8" in text
    # a rerun replaces the block instead of adding a second one
    update_docs(docs, markdown(result, "a rerun"), marker="bench-peers")
    text = docs.read_text()
    assert text.count("bench-peers:begin") == 1 and "a rerun" in text and "not ours to touch" in text


def test_an_unknown_model_name_is_refused_not_skipped(capsys: pytest.CaptureFixture[str]) -> None:
    from loadtests.peers.bench import main

    with pytest.raises(SystemExit):
        main(["--models", "decoder"])  # before, an empty table and exit 0
    assert "unknown model(s) ['decoder']" in capsys.readouterr().err
