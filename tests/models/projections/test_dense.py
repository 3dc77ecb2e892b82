"""oneDNN-packed float projections (models/projections/dense.py): the same results as F.linear to fp32 rounding,
an ordinary state_dict, and a kernel chosen per weight shape by what the timer measures."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from models.cache.dense import KVCache
from models.catalog import ModelSpec, load_model
from models.projections import dense
from models.projections.base import RepackedLinear
from models.projections.dense import (
    PackedLinear,
    kernels_here,
    kernels_per_shape,
    onednn_available,
    pack_dense,
)
from models.projections.fuse import unfused_state_dict
from models.projections.panels import PanelLinear
from models.tiny import tiny_model
from tests.models.projections.test_quant import needs_kernels

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN")]


@pytest.mark.parametrize("bias", [True, False])
def test_packed_linear_matches_linear_and_gives_its_weight_back(bias: bool) -> None:
    torch.manual_seed(0)
    lin = nn.Linear(48, 80, bias=bias)
    packed = PackedLinear(lin.weight, lin.bias)
    for shape in ((1, 48), (7, 48), (2, 5, 48)):
        x = torch.randn(shape)
        with torch.inference_mode():
            torch.testing.assert_close(packed(x), lin(x), atol=1e-5, rtol=1e-5)
    assert torch.equal(packed.weight, lin.weight.detach())
    fresh = nn.Linear(48, 80, bias=bias)
    fresh.load_state_dict(packed.state_dict(), strict=True)
    assert torch.equal(fresh.weight, lin.weight)


@pytest.mark.parametrize("family", ["encoder", "decoder", "seq2seq"])
def test_packed_models_match_and_keep_their_checkpoint_layout(family: str) -> None:
    plain, _ = tiny_model(family)
    packed, _ = tiny_model(family)
    before = unfused_state_dict(packed)
    report = pack_dense(packed, "onednn")
    assert report and not any(type(m) is nn.Linear for m in packed.modules())
    state = unfused_state_dict(packed)
    assert all(torch.equal(state[k], v) for k, v in before.items())
    ids = torch.randint(3, 200, (3, 9))
    keep = torch.arange(9)[None, :] < torch.tensor([[9], [4], [1]])  # (3, 9) padded rows
    close = dict(atol=1e-5, rtol=1e-5)
    with torch.inference_mode():
        if family == "encoder":
            torch.testing.assert_close(packed.embed(ids, keep), plain.embed(ids, keep), **close)
        elif family == "decoder":
            assert isinstance(packed.lm_head, PackedLinear)  # the tied head got a packed copy
            torch.testing.assert_close(packed(ids, keep), plain(ids, keep), **close)
            cache = KVCache.for_model(packed.cfg, 1, 16)
            steps = []
            for t in range(9):
                steps.append(packed(ids[:1, t:t + 1], cache=cache.view())[:, 0])
                cache.advance(1)
            torch.testing.assert_close(torch.stack(steps, 1), plain(ids[:1]), **close)
        else:
            tgt = torch.randint(3, 200, (3, 5))
            torch.testing.assert_close(packed(ids, keep, tgt), plain(ids, keep, tgt), **close)


def test_auto_packs_only_the_shapes_the_timer_measures_faster(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without our panels (no compiler, no AVX2), every projection's kernel is the timer's choice."""
    from models.projections import dense

    monkeypatch.setattr(dense, "kernels_here", lambda: [k for k in kernels_here() if k != "panels"])
    model, _ = tiny_model("decoder")
    shapes = {tuple(m.weight.shape) for m in model.modules() if type(m) is nn.Linear}
    slow_shape = max(shapes)  # oneDNN "slower" than MKL on this one shape only
    seen: list[int] = []

    def timer(slots, candidates):  # noqa: ANN001, ANN202
        seen.append(len(slots))
        assert set(candidates) == set(dense.kernels_here()) and all(len(c) == len(slots) for c in candidates.values())
        assert slots[-1].copy  # the tied head comes last, as a copy
        others = {k: 3.0 for k in candidates if k not in ("aten", "onednn")}  # our panels: slowest here
        return {s.shape: {"aten": 1.0, "onednn": 2.0, **others} if s.shape == slow_shape
                else {"aten": 2.0, "onednn": 1.0, **others} for s in slots}

    report = pack_dense(model, "auto", timer=timer)
    assert seen == [sum(type(m) is nn.Linear for m in tiny_model("decoder")[0].modules()) + 1]
    for m in model.modules():
        if type(m) is nn.Linear:
            assert tuple(m.weight.shape) == slow_shape
        elif isinstance(m, PackedLinear):
            assert (m.out_features, m.in_features) != slow_shape
    assert report[f"{slow_shape[0]}x{slow_shape[1]}"] == "aten 2.00x"
    assert {v for k, v in report.items() if k != f"{slow_shape[0]}x{slow_shape[1]}"} == {"onednn 2.00x"}


@needs_kernels
def test_auto_gives_the_blocks_the_panels_and_the_timer_the_rest() -> None:
    """With our panels, a block's projections take them whatever the timer says (the native op that runs
    a whole block needs them), and so does an encoder-decoder's head (the decoder's native step applies
    it); the timer still sweeps every projection in model order (the caches as a forward pass leaves
    them) and decides the others (here a decoder-only model's tied head)."""
    from models.execution.planner import plan_model
    from models.projections.dense import _slots
    from models.projections.fuse import fuse_projections

    model = fuse_projections(tiny_model("seq2seq")[0].eval())  # as load_model leaves it before packing
    every = len(_slots(model))
    seen: list = []

    def timer(slots, candidates):  # noqa: ANN001, ANN202
        seen.extend(slots)
        return {s.shape: {k: (0.5 if k == "onednn" else 1.0) for k in candidates} for s in slots}

    report = pack_dense(model, "auto", timer=timer)
    assert len(seen) == every and seen[-1].name == "lm_head" and seen[-1].copy
    assert isinstance(model.lm_head, PanelLinear)  # not the timer's choice: the native step applies it
    blocks = [*model.encoder.blocks, *model.decoder.blocks]
    assert all(isinstance(m, PanelLinear) for b in blocks for m in b.modules() if isinstance(m, RepackedLinear))
    step = plan_model(model).step  # the one-op step runs, with the head inside
    assert step is not None and step.head is not None
    assert "panels (blocks)" in report.values()
    decoder = fuse_projections(tiny_model("decoder")[0].eval())
    pack_dense(decoder, "auto", timer=timer)
    assert seen[-1].name == "lm_head" and isinstance(decoder.lm_head, PackedLinear)  # the timer's choice
    assert isinstance(decoder.stack.blocks[0].ff.down, PanelLinear)


def test_the_real_timer_measures_every_shape_and_kernel() -> None:
    from models.projections.dense import BUILDERS, _slots, measure

    model, _ = tiny_model("seq2seq")
    slots = _slots(model)
    times = measure(slots, {k: [BUILDERS[k](s.weight, s.bias, copy=s.copy) for s in slots] for k in kernels_here()})
    assert set(times) == {s.shape for s in slots}
    assert all(set(t) == set(kernels_here()) and all(v > 0 for v in t.values()) for t in times.values())


def test_aten_leaves_the_model_alone_and_load_model_reports_its_choice() -> None:
    model, _ = tiny_model("encoder")
    assert pack_dense(model, "aten") == {} and not any(isinstance(m, PackedLinear) for m in model.modules())
    spec = ModelSpec(name="g", tasks=("generate",), source="tiny:decoder", dense_kernel="onednn")
    loaded = load_model(spec, Path("/nonexistent"))
    assert loaded.kernels and set(loaded.kernels.values()) == {"onednn"}
    assert isinstance(loaded.model.stack.blocks[0].self_attn.qkv, PackedLinear)
    with pytest.raises(ValueError, match="dense_kernel must be one of"):
        ModelSpec(name="g", tasks=("generate",), source="tiny:decoder", dense_kernel="mkl")  # type: ignore[arg-type]


def test_quantized_models_pack_only_the_layers_left_in_float() -> None:
    from models.projections.quant import Int8Linear

    spec = ModelSpec(name="e", tasks=("embed",), source="tiny:encoder", quantize="int8", dense_kernel="onednn")
    model = load_model(spec, Path("/nonexistent")).model
    block = model.stack.blocks[0]
    assert isinstance(block.self_attn.q_proj, Int8Linear)
    assert isinstance(block.ff.down, PackedLinear)  # kept in float by quant.FLOAT_LAYERS, then packed
    x = torch.randn(2, 5, block.ff.down.in_features)
    with torch.inference_mode():
        torch.testing.assert_close(block.ff.down(x), F.linear(x, block.ff.down.weight, block.ff.down.bias),
                                   atol=1e-5, rtol=1e-5)


def test_kernels_per_shape_names_the_models_whose_projections_keep_one_per_row_count() -> None:
    """oneDNN keeps a kernel per input shape: 16-bit float Linears on CPU and PackedLinear; float32
    F.linear (MKL) and our panels keep none (service/engine/batch.py pads prefills accordingly)."""
    model, _ = tiny_model("decoder")
    assert not kernels_per_shape(model)
    assert kernels_per_shape(copy.deepcopy(model).to(torch.bfloat16))
    assert kernels_per_shape(copy.deepcopy(model).to(torch.float16))
    if kernels_here() != ["aten"]:
        panels = copy.deepcopy(model)
        pack_dense(panels, "panels" if "panels" in kernels_here() else "onednn")
        assert kernels_per_shape(panels) == ("panels" not in kernels_here())
    if onednn_available():
        packed = copy.deepcopy(model)
        pack_dense(packed, "onednn")
        assert kernels_per_shape(packed)


def test_nothing_to_pack_builds_and_times_no_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model with no float32 CPU projection (bfloat16 here, or one on a GPU) packs nothing, and never
    asks for the kernels: building them would cost a GPU machine's start-up for nothing."""
    def no(*_: object) -> list[str]:
        raise AssertionError("kernels_here was called")

    monkeypatch.setattr(dense, "kernels_here", no)
    model, _ = tiny_model("decoder")
    assert dense.pack_dense(model.to(torch.bfloat16), "auto") == {}
