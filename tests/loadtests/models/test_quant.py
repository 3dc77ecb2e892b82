"""`python -m loadtests.models.quant --quick` on the real default models: the benchmark runs end to end
and its quality measures are sane (speed is never asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtests.models import quant

pytestmark = pytest.mark.slow


def test_the_quick_quantization_benchmark_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "quant.json"
    # int8 and the shipped generator's q4_1 (q8_0 runs in the peers smoke test): a minute less
    quant.main(["--quick", "--threads", "2", "--modes", "int8,q4_1", "--kv", "bfloat16", "--json", str(out)])
    result = json.loads(out.read_text())
    gen, enc, tr = result["generator"], result["encoder"], result["translator"]
    assert [r["batch"] for r in gen["speed_tokens_per_s"]] == [1, 8, 32]
    assert all(r[m] > 0 for r in gen["speed_tokens_per_s"] for m in ("fp32", "int8", "q4_1"))
    fp32, int8 = gen["quality"]["fp32"]["perplexity"], gen["quality"]["int8"]["perplexity"]
    assert 1 < fp32 < int8 * 1.2 and int8 < fp32 * 1.2  # int8 is close to, not equal to, fp32
    # the shipped SmolLM2 is a Q4_1 GGUF: q4_1 computes with exactly its weights, and its 16-bit
    # activations (two 8-bit parts) give the float activations' results to ~1e-5
    assert gen["quality"]["q4_1"]["perplexity"] == pytest.approx(fp32, rel=1e-4)
    # through a bfloat16 KV cache (the shipped kv_cache_dtype): within 0.5 % of the float32 keys' figure,
    # and not the same number (the cache really was narrower)
    narrow = gen["quality"]["q4_1"]["perplexity_kv"]["bfloat16"]
    assert narrow == pytest.approx(gen["quality"]["q4_1"]["perplexity"], rel=5e-3) and narrow != gen["quality"]["q4_1"]["perplexity"]
    # the shipped q4_1 keeps the answer; int8's measured loss is its perplexity (within 2 %, issue #15):
    # its capital answer is reported, not asserted, as it depends on the CPU's kernels (Paris on the AMD
    # EPYC of earlier sessions, "L'Étoile, la Cité, ..." on the Intel Xeon with AMX of 2 Dec 2026)
    assert "Paris" in gen["quality"]["q4_1"]["capital_answer"] and gen["quality"]["int8"]["capital_answer"]
    # #15's bound is 2 % on the full held-out text (14,037 tokens; +1.5 % on the AVX2 AMD EPYC of 3 Dec
    # 2026, +1.6 % on the Intel Xeon): --quick scores 597 tokens, where the same models measure +2.5 %
    assert int8 < fp32 * 1.05
    assert enc["quality"]["int8"]["same_label"] > 0.9 and enc["quality"]["int8"]["min_cosine"] > 0.9
    assert enc["quality"]["q4_1"]["min_cosine"] > 0.5  # 4-bit is for the GGUF decoder, not the encoder
    assert all(abs(tr["chrf_beam4"]["fp32"] - tr["chrf_beam4"][m]) < 5 for m in ("int8", "q4_1"))
    assert "| SmolLM2-135M | greedy decode, tokens/s | 32 |" in capsys.readouterr().out
