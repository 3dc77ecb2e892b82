"""The prepared GPU check in its tiny CPU mode: every section runs and the correctness checks hold,
so the command a lent GPU runs (`python -m loadtests.gpu.check`) cannot rot unseen."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtests.gpu.check import main

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_tiny_mode_runs_every_section(tmp_path: Path) -> None:
    assert main(["--tiny", "--device", "cpu", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "gpu-check.json").read_text())
    sections = ("environment", "correctness", "generation_smollm2", "generation_llama_1b", "q4_1_tiles",
                "q4_1_tiles_llama_1b", "encoder", "translator", "adapters")
    errors = {name: results[name].get("error") for name in sections if "error" in results[name]}
    assert errors == {}
    corr = results["correctness"]
    assert corr["pass_fp32"] and corr["decoder_cached_eq_uncached"] and corr["engine_alone_eq_among_31_bf16"]
    for name in ("generation_smollm2", "generation_llama_1b"):
        assert [r["sequences"] for r in results[name]["rows"]] == [1, 4, 8]
        assert all(r["ours_tok_s"] > 0 and r["transformers_tok_s"] > 0 for r in results[name]["rows"])
    tiles = results["q4_1_tiles"]  # the int4 tile kernel's CPU form, against the same blocks dense
    assert tiles["tiled_layers"] > 0 and tiles["logits_rel_err_vs_dense"] < 1e-4
    assert tiles["greedy_agreement_vs_dense"] == 1.0 and tiles["engine_alone_eq_among_31"]
    assert [r["sequences"] for r in tiles["rows"]] == [1, 4] and all(r["tiles_tok_s"] > 0 for r in tiles["rows"])
    lora = results["adapters"]  # rows of three adapters and the base against merged copies
    assert lora["mixed_rows_vs_merged_fp32_rel_err"] < 1e-4 and lora["engine_alone_eq_among_31_on_8_adapters_bf16"]
    assert lora["adapters_change_tokens"] and lora["rows"][0]["8_adapters_tok_s"] > 0
    assert "## Correctness" in (tmp_path / "gpu-check.md").read_text()
