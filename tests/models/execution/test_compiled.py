"""Compiled blocks (models/execution/compiled.py): the eager model's results to fp32 rounding for every family,
greedy and beam outputs unchanged, no recompilation once warmed up (new batch sizes, longer caches),
and blocks of different structure in one process each running their own graph."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from models.beam_search import BeamParams, translate_ids
from models.cache.dense import KVCache
from models.cache.paged import PagedKVCache
from models.catalog import ModelSpec, load_model
from models.decoding import SamplingParams
from models.execution.compiled import compile_blocks, warm_up
from models.execution.plan import PlanError
from models.generate import generate
from models.kernels import native
from models.projections.quant import quantize
from models.tiny import tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")
CLOSE = dict(atol=1e-5, rtol=1e-5)


def compiled(family: str, mode: str | None = None, kv: torch.dtype | None = None):  # noqa: ANN201
    """(eager, compiled) copies of one tiny model, the compiled one warmed up (on KV caches of `kv`)."""
    eager, _ = tiny_model(family)
    model, _ = tiny_model(family)
    if mode is not None:
        quantize(eager, mode)
        quantize(model, mode)
    compile_blocks(model)
    warm_up(model, kv)
    return eager, model


def graphs() -> int:
    return counters["stats"]["unique_graphs"]


def decode_steps(model, prompts: list[list[int]], steps: int) -> torch.Tensor:  # noqa: ANN001
    """Prefill right-padded prompts on a cache, then `steps` decode steps: logits (B, steps + 1, V)."""
    b, t = len(prompts), max(map(len, prompts))
    ids = torch.tensor([p + [0] * (t - len(p)) for p in prompts])  # (B, T)
    last = torch.tensor([len(p) - 1 for p in prompts])
    cache = KVCache.for_model(model.cfg, b, t + steps + 1)
    with torch.inference_mode():
        out = [model(ids, cache=cache.view(), last=last)[:, 0]]
        cache.advance(last + 1)
        for i in range(steps):
            out.append(model(torch.full((b, 1), 5 + i), cache=cache.view())[:, 0])
            cache.advance(1)
    return torch.stack(out, 1)


def test_a_compiled_decoder_matches_eager_and_does_not_recompile_once_warm() -> None:
    eager, model = compiled("decoder")
    before = graphs()
    for prompts in ([[5, 6, 7]], [[5, 6, 7], [8, 9, 10, 11, 12], [13, 14]], [[20 + i] * (i + 2) for i in range(5)]):
        torch.testing.assert_close(decode_steps(model, prompts, 6), decode_steps(eager, prompts, 6), **CLOSE)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14, 15]]
    assert [g.tokens for g in generate(model, prompts, params)] == [g.tokens for g in generate(eager, prompts, params)]
    caches = {m: KVCache.for_model(m.cfg, 1, 32) for m in (model, eager)}
    with torch.inference_mode():
        for t in (7, 5, 1, 4):  # a prompt in chunks (the engine's chunked prefill), a step, a chunk again
            ids = torch.arange(5, 5 + t)[None, :]  # (1, T)
            got = {m: m(ids, cache=c.view()) for m, c in caches.items()}
            torch.testing.assert_close(got[model], got[eager], **CLOSE)
            for c in caches.values():
                c.advance(t)
    assert graphs() == before  # batch sizes 1-5, prompts 2-7 tokens, chunks after a past: the warm-up's graphs


@pytest.mark.parametrize("kv", [torch.float32, torch.bfloat16])
def test_a_compiled_decoder_serves_the_engine_s_paged_steps_on_the_warm_up_s_graphs(kv: torch.dtype) -> None:
    """What a replica's first requests run: prompts over several blocks on empty paged rows (one row and
    three), decode steps, then a chunk after a past; equal to eager and no graph compiled after warm_up
    (a table of one block specialises: a warm-up prompt within one block left a served prompt of two
    blocks to compile on its first request; a pool's dtype does too: the warm-up runs the engine's)."""
    eager, model = compiled("decoder", kv=kv)
    before = graphs()
    for rows, prompt in ((1, 40), (3, 23), (1, 17)):
        caches = {m: PagedKVCache.for_model(m.cfg, rows, 8 * rows + 1, 128, dtype=kv) for m in (model, eager)}
        with torch.inference_mode():
            for t in (prompt, 1, 1, 20):  # the prompt, two steps, a chunk after a past
                got = {}
                for m, c in caches.items():
                    for row in range(rows):
                        c.ensure(row, c.host_lengths[row] + t)
                    got[m] = m(torch.arange(5, 5 + rows * t).view(rows, t), cache=c.view())
                    c.advance(t)
                torch.testing.assert_close(got[model], got[eager], **CLOSE)
    assert graphs() == before


def test_a_compiled_translator_gives_the_same_beams() -> None:
    eager, model = compiled("seq2seq")
    before = graphs()
    sources = [[5, 6, 7, 2], [8, 9, 10, 11, 12, 2], [13, 2]]
    for beam in (1, 4):
        params = BeamParams(beam, 10)
        assert translate_ids(model, sources, params) == translate_ids(eager, sources, params)
        assert translate_ids(model, sources[:1], params) == translate_ids(eager, sources[:1], params)
    assert graphs() == before


def test_a_compiled_encoder_matches_eager_on_padded_batches() -> None:
    eager, model = compiled("encoder")
    ids = torch.randint(3, 200, (4, 9))
    keep = torch.arange(9)[None, :] < torch.tensor([[9], [4], [1], [7]])  # (4, 9)
    with torch.inference_mode():
        torch.testing.assert_close(model.embed(ids, keep), eager.embed(ids, keep), **CLOSE)
        torch.testing.assert_close(model.embed(ids[:1], keep[:1]), eager.embed(ids[:1], keep[:1]), **CLOSE)


@pytest.mark.skipif(not native.available() and not os.environ.get("REQUIRE_NATIVE_KERNELS"),
                    reason="no AVX2 or AVX-512 CPU, or no compiler, for the native kernels")
def test_blocks_of_another_structure_in_the_same_process_get_their_own_graphs() -> None:
    """Guards on module state are reduced to the structural ones: a float and a 4-bit decoder
    (different projection modules, same Block code) must not share a graph."""
    float_eager, float_model = compiled("decoder")
    q4_eager, q4_model = compiled("decoder", "q4_1")
    prompts = [[5, 6, 7], [8, 9]]
    # the 4-bit blocks quantize activations: fp32 rounding that differs can move one across a step of
    # its 16-bit (two-part) codes, ~1e-5 of the group's largest input
    quantized = {**CLOSE, "atol": 1e-4}
    for eager, model, close in ((float_eager, float_model, CLOSE), (q4_eager, q4_model, quantized),
                                (float_eager, float_model, CLOSE)):
        torch.testing.assert_close(decode_steps(model, prompts, 4), decode_steps(eager, prompts, 4), **close)


def test_load_model_compiles_when_the_spec_says_so() -> None:
    spec = ModelSpec(name="g", tasks=("generate",), source="tiny:decoder", compile=True)
    loaded = load_model(spec, Path("/nonexistent"))
    assert 0 < loaded.compile_seconds <= loaded.load_seconds and loaded.compiled
    assert all(hasattr(b, "_compiled_call_impl") and b._compiled_call_impl is not None
               for b in loaded.model.stack.blocks)
    # fused and packed as loaded, the decode steps run natively where the kernels do; the prompts compiled
    assert loaded.plan.backend("prefill") == "compiled"
    assert loaded.plan.backend("decode") == ("native" if native.available() else "compiled")
    eager = load_model(ModelSpec(name="g", tasks=("generate",), source="tiny:decoder"), Path("/nonexistent"))
    assert eager.compile_seconds == 0.0 and not eager.compiled
    assert eager.plan.backend("prefill") == "torch"
    # a phase that names the compiled backend compiles the blocks without compile: true
    named = load_model(ModelSpec(name="g", tasks=("generate",), source="tiny:decoder", execution={"prefill": "compiled"}),
                       Path("/nonexistent"))
    assert named.compiled and named.plan.backend("prefill") == "compiled"


def test_a_model_whose_blocks_fail_to_compile_is_served_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    import models.catalog

    def broken(model, kv_dtype=None) -> float:  # noqa: ANN001 - as when inductor finds no C++ compiler
        raise RuntimeError("no working C++ compiler found")

    monkeypatch.setattr(models.catalog, "warm_up", broken)
    loaded = load_model(ModelSpec(name="g", tasks=("generate",), source="tiny:decoder", compile=True),
                        Path("/nonexistent"))
    assert loaded.compile_seconds == 0.0 and not loaded.compiled  # /v1/models says so, and its plan why
    assert loaded.plan.backend("prefill") == "torch"
    assert loaded.plan["prefill"].not_taken["compiled"] == "compiling failed here: no working C++ compiler found"
    assert all(b._compiled_call_impl is None for b in loaded.model.stack.blocks)
    with pytest.raises(PlanError, match="prefill on compiled: compiling failed here: no working C"):
        load_model(ModelSpec(name="g", tasks=("generate",), source="tiny:decoder", execution="compiled"),
                   Path("/nonexistent"))
    eager, _ = tiny_model("decoder")
    torch.testing.assert_close(decode_steps(loaded.model, [[5, 6]], 2), decode_steps(eager, [[5, 6]], 2), **CLOSE)


def test_warming_up_past_the_recompile_limit_serves_eager_and_the_plan_says_so() -> None:
    """Past torch's recompile limit a block's new shapes would run eager without a word: a warm-up that
    passes it fails the compilation, so the plan names the reason and the model is served eager. In a
    process of its own (the limit's hit marks the block's code object there)."""
    code = ("import json, torch; from pathlib import Path; import models.execution.compiled as c;"
            "c.RECOMPILE_LIMIT = 2; torch._dynamo.config.recompile_limit = 2;"
            "from models.catalog import load_model, ModelSpec;"
            "l = load_model(ModelSpec(name='g', tasks=('generate',), source='tiny:decoder', compile=True), Path('/n'));"
            "print(json.dumps([l.plan.to_dict(), l.compiled, c.recompile_limit_hits()]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).parents[3])
    plan, compiled, hits = json.loads(out.stdout.splitlines()[-1])
    assert hits >= 1 and not compiled
    assert plan["prefill"]["backend"] == "torch"
    assert "passed torch's recompile limit of 2 graphs a block" in plan["prefill"]["not_taken"]["compiled"]
    assert "its new shapes run eager from now on" in out.stderr  # logged as an error where it happens
