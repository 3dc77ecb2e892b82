"""`dtype: bfloat16` on a CPU, for every kind of model (models/catalog.py): where our bfloat16 panels
run (AVX512-BF16), the projections go onto them and the model around them stays float32, on the
native backends; elsewhere the model is cast (torch's kernels), block formats quantized first. Either
way it loads, reports bfloat16, and computes what float32 computes within bfloat16's rounding."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from models.catalog import load_model
from models.kernels import native
from models.projections.panels import Bf16PanelLinear, BlockLinear
from models.spec import ModelSpec

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SPECS = {
    "generator": ModelSpec(name="g", tasks=("generate",), source="tiny:decoder"),
    "generator-q4_1": ModelSpec(name="g", tasks=("generate",), source="tiny:decoder", quantize="q4_1"),
    "encoder": ModelSpec(name="e", tasks=("embed",), source="tiny:encoder"),
    "translator": ModelSpec(name="t", tasks=("translate",), source="tiny:seq2seq", languages=("en", "es")),
}


def _outputs(lm, ids: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
    with torch.inference_mode():
        if lm.spec.kind == "translator":
            return lm.model(ids, torch.ones_like(ids, dtype=torch.bool), ids[:, :3]).float()  # (1, 3, V)
        return lm.model(ids).float() if lm.spec.kind == "generator" else lm.model(ids)[0].float()


@pytest.mark.parametrize("name", list(SPECS))
def test_bfloat16_on_a_cpu_loads_every_kind_and_computes_float32_within_its_rounding(name: str) -> None:
    spec = SPECS[name]
    exact = load_model(spec, Path("/nonexistent"), "cpu", torch.float32)
    lm = load_model(spec, Path("/nonexistent"), "cpu", torch.bfloat16)
    assert lm.dtype == torch.bfloat16  # what /v1/models and the log report
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    torch.testing.assert_close(_outputs(lm, ids), _outputs(exact, ids), atol=0.15, rtol=0.05)
    modules = list(lm.model.modules())
    if native.has_bf16():  # our panels, the parameters around them float32, the native backends
        assert next(lm.model.parameters()).dtype == torch.float32
        assert any(isinstance(m, Bf16PanelLinear) for m in modules) or name.endswith("q4_1")
        assert all(p.backend == "native" for p in lm.plan.phases if p.phase != "prefill")
        assert "bfloat16 panels" in lm.plan.summary() or name.endswith("q4_1")
    else:  # cast: torch's bfloat16 kernels
        assert next(lm.model.parameters()).dtype == torch.bfloat16
    if name.endswith("q4_1"):  # the blocks stay the blocks, their bias float32 whatever the cast
        blocks = [m for m in modules if isinstance(m, BlockLinear)]
        assert blocks and all(m.bias is None or m.bias.dtype == torch.float32 for m in blocks)


@pytest.mark.skipif(not native.has_bf16(), reason="the cast path is this CPU's path: the test above covers it")
def test_without_bfloat16_panels_the_model_is_cast_and_block_formats_still_load() -> None:
    """The same loads on this CPU's narrower build of the kernels (no bfloat16 panels): cast models."""
    script = ("import torch\nfrom pathlib import Path\nfrom models.catalog import load_model\n"
              "from models.spec import ModelSpec\n"
              "spec = ModelSpec(name='g', tasks=('generate',), source='tiny:decoder', quantize='q4_1')\n"
              "lm = load_model(spec, Path('/nonexistent'), 'cpu', torch.bfloat16)\n"
              "with torch.inference_mode():\n    y = lm.model(torch.tensor([[5, 6, 7]]))\n"
              "print(next(lm.model.parameters()).dtype, y.dtype, bool(torch.isfinite(y).all()))\n")
    narrower = next(isa for isa in native.cpu_isas() if isa != "avx512_bf16")
    done = subprocess.run([sys.executable, "-c", script], env={**__import__("os").environ, native.ISA_ENV: narrower},
                          capture_output=True, text=True, timeout=300, check=True)
    assert done.stdout.split()[-3:] == ["torch.bfloat16", "torch.bfloat16", "True"]
