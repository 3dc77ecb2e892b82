"""models/execution/planner.py: one plan per model, chosen at load: every phase of the model's kind named
once with its backend, every other backend with its reason; a backend asked for by name runs or the load
fails naming it; without our kernels "auto" plans the torch backend and says why.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from models.catalog import load_model
from models.execution.plan import BACKENDS, ExecutionPlan, PhasePlan, PlanError
from models.execution.planner import Runtime, plan_model
from models.kernels import native
from models.spec import KIND_PHASES, ModelSpec
from models.tiny import tiny_model
from tests.models.projections.test_quant import needs_kernels

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SPECS = {"encoder": ModelSpec(name="e", tasks=("classify", "embed"), source="tiny:encoder"),
         "translator": ModelSpec(name="t", tasks=("translate",), source="tiny:seq2seq", languages=("en", "es")),
         "generator": ModelSpec(name="g", tasks=("generate",), source="tiny:decoder")}


@pytest.mark.parametrize("kind", list(SPECS))
def test_a_loaded_model_has_one_plan_naming_every_phase_and_why_not_the_others(kind: str) -> None:
    loaded = load_model(SPECS[kind], Path("/nonexistent"))
    plan = loaded.plan
    assert tuple(p.phase for p in plan.phases) == KIND_PHASES[kind]
    for phase in plan.phases:
        assert set(phase.not_taken) == set(BACKENDS) - {phase.backend}
        assert all(reason for reason in phase.not_taken.values())
    last = KIND_PHASES[kind][-1]  # an encoder's pass, a decode step
    if native.available():  # fused and packed as loaded: the native step computes what can be native
        assert plan.backend(last) == "native" and native.isa() in plan[last].detail
    card = json.loads(json.dumps(plan.to_dict()))  # plain data: it crosses to the ingress as it is
    assert set(card) == set(KIND_PHASES[kind]) and all({"backend", "detail", "not_taken"} == set(c) for c in card.values())
    assert plan.summary().startswith(f"{KIND_PHASES[kind][0]}={plan.phases[0].backend}")


def test_a_backend_the_machine_lacks_fails_the_load_naming_it() -> None:
    spec = dataclasses.replace(SPECS["generator"], execution={"decode": "cuda_graphs"})
    with pytest.raises(PlanError, match="decode on cuda_graphs: needs a CUDA device; this model is on cpu"):
        load_model(spec, Path("/nonexistent"))
    with pytest.raises(PlanError, match="prefill on native: decode steps only"):
        load_model(dataclasses.replace(SPECS["generator"], execution={"prefill": "native"}), Path("/nonexistent"))
    with pytest.raises(PlanError, match="encode on compiled"):  # compiling is its own choice, not a fallback
        plan_model(tiny_model("encoder")[0].eval(), "compiled")


def test_a_named_backend_that_runs_is_taken_and_the_others_say_not_asked() -> None:
    loaded = load_model(dataclasses.replace(SPECS["translator"], execution="torch"), Path("/nonexistent"))
    assert [p.backend for p in loaded.plan.phases] == ["torch", "torch"]
    if native.available():
        assert loaded.plan["decode"].not_taken["native"] == "not asked"
    assert loaded.executor.step is None and loaded.executor.blocks is None


def test_the_spec_refuses_unknown_phases_and_backends() -> None:
    with pytest.raises(ValueError, match="execution names phase 'prefill'; a translator runs"):
        dataclasses.replace(SPECS["translator"], execution={"prefill": "torch"})
    with pytest.raises(ValueError, match="execution must be auto, one of"):
        dataclasses.replace(SPECS["encoder"], execution="fast")
    assert dataclasses.replace(SPECS["generator"], execution={"decode": "native"}).requested_backends() == {
        "prefill": "auto", "decode": "native"}


@pytest.mark.skipif(not native.available(), reason="needs the native kernels to switch them off")
def test_without_the_native_kernels_auto_plans_torch_and_says_why(tmp_path: Path) -> None:
    """A machine without our kernels (TS_NATIVE_KERNELS=0 here, as a CPU without AVX2 would be): the plan
    chosen at load is the torch backend, with the reason; it is what serves, not a switch mid-way."""
    code = ("import json; from pathlib import Path; from models.catalog import load_model, ModelSpec;"
            "l = load_model(ModelSpec(name='g', tasks=('generate',), source='tiny:decoder'), Path('/nonexistent'));"
            "print(json.dumps(l.plan.to_dict()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "TS_NATIVE_KERNELS": "0"}, cwd=Path(__file__).parents[3])
    plan = json.loads(out.stdout.splitlines()[-1])
    assert plan["decode"]["backend"] == "torch"
    assert plan["decode"]["not_taken"]["native"] == "needs our CPU kernels, which are off here (TS_NATIVE_KERNELS=0)"
    assert "attention: SDPA" in plan["decode"]["detail"]
    assert plan["prefill"]["detail"].endswith("attention: SDPA (not the prompt kernel: float32 KV on cpu; our CPU "
                                              "kernels: TS_NATIVE_KERNELS=0)")


def test_an_engine_takes_the_plan_of_its_own_cache() -> None:
    """A plan made for a paged cache refuses an engine that keeps rows; one made for it runs there."""
    from service.engine.config import EngineConfig
    from service.engine.core import GenerationEngine, engine_runtime

    loaded = load_model(SPECS["generator"], Path("/nonexistent"))
    rows = EngineConfig(paged=False, max_total_tokens=64, kv_cache_mib=4)
    if loaded.plan.backend("decode") == "native":
        with pytest.raises(PlanError, match="needs a paged KV cache"):
            GenerationEngine(loaded.executor, loaded.tokenizer, rows)
    again = load_model(SPECS["generator"], Path("/nonexistent"), runtime=engine_runtime(rows))
    engine = GenerationEngine(again.executor, again.tokenizer, rows)
    assert engine.plan.backend("decode") == "torch" and engine.plan is again.plan


def test_graphs_that_fail_to_capture_change_the_plan_before_serving() -> None:
    """Graphs the plan chose itself and that fail at warm-up: the decode phase becomes the model's own
    forward, the reason in the plan; graphs asked for by name fail the warm-up."""
    from models.execution.graphs import GraphCaptureError
    from service.engine.config import EngineConfig
    from service.engine.core import GenerationEngine

    model, tok = tiny_model("decoder")
    config = EngineConfig(decode_graphs=True, max_total_tokens=64, kv_cache_mib=4)
    engine = GenerationEngine(model.eval(), tok, config)
    assert engine.plan.backend("decode") == "cuda_graphs"

    def broken() -> int:
        raise GraphCaptureError("an op that synchronizes")

    engine._batch.graphs.capture_all = broken
    with pytest.raises(GraphCaptureError):
        engine.capture_graphs(chosen=False)
    assert engine.capture_graphs(chosen=True) == 0
    assert engine.plan.backend("decode") == "torch"
    assert engine.plan["decode"].not_taken["cuda_graphs"] == "capture failed: an op that synchronizes"
    assert engine._batch.graphs is None


def test_a_plan_is_plain_data_with_one_line_for_the_log() -> None:
    plan = ExecutionPlan((PhasePlan("prefill", "compiled", "float32"),
                          PhasePlan("decode", "native", "avx2, q4_1 blocks", {"torch": "native is preferred"})))
    assert plan.summary() == "prefill=compiled (float32) decode=native (avx2, q4_1 blocks)"
    assert plan.reasons() == "decode: not torch: native is preferred"
    assert plan.backend("decode") == "native"
    with pytest.raises(KeyError, match="no 'encode' phase"):
        plan["encode"]
    with pytest.raises(ValueError, match="at most once"):
        ExecutionPlan((PhasePlan("decode", "torch"), PhasePlan("decode", "native")))


def test_a_bfloat16_model_plans_torch_with_the_reason() -> None:
    model = tiny_model("decoder")[0].eval().to(torch.bfloat16)
    plan = plan_model(model, runtime=Runtime()).plan
    assert plan.backend("decode") == "torch"
    assert plan["decode"].not_taken["native"].startswith("needs ")


@pytest.mark.parametrize(("changes", "runtime", "says"), [
    ({}, Runtime(graphs=False), "attention: paged prompt kernel"),
    ({}, Runtime(graphs=False, paged=False), "attention: SDPA (not the prompt kernel: engine.paged: false)"),
    ({"sliding_window": 8}, Runtime(graphs=False), "attention: SDPA (not the prompt kernel: a sliding window or"),
    ({"n_heads": 3, "n_kv_heads": 1}, Runtime(graphs=False), "attention: paged prompt kernel"),  # head dim 128
    ({"n_heads": 8, "n_kv_heads": 2}, Runtime(graphs=False), "(not the prompt kernel: head dim 48; it takes 32, 64, 128)"),
])
@needs_kernels
def test_a_generators_prefill_names_how_its_prompts_attend(changes: dict, runtime: Runtime, says: str) -> None:
    """Prompts attend through the paged cache's prompt kernel where the cache and model let them (the
    condition PagedLayerCache.attend checks), and the plan says so, or why not."""
    base = tiny_model("decoder")[0].cfg
    model = type(tiny_model("decoder")[0])(base.replace(**({"d_model": 384, "n_heads": 6, "n_kv_heads": 2} | changes)))
    detail = plan_model(model.eval(), "auto", runtime).plan["prefill"].detail
    assert says in detail
    if says == "attention: paged prompt kernel":  # a bfloat16 twin's stack: bfloat16 products
        model.stack.bf16_products = True
        assert plan_model(model, "auto", runtime).plan["prefill"].detail.endswith(
            "attention: paged prompt kernel, bfloat16 products")
