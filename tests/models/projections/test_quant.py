"""Quantized weights (models/projections/quant.py): int8 with per-token activations and GGUF's weight-only
q8_0 / q4_1 blocks; close to fp32, rows independent of their batch (bitwise: exact integer matmuls,
and the block kernels' fixed summation order), every Linear of every family swapped, and the
invariants of the serving paths kept on quantized tiny models."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from models.cache.dense import KVCache
from models.catalog import ModelSpec, load_model
from models.config import EncoderConfig
from models.decoding import SamplingParams
from models.encoder import EncoderModel
from models.generate import generate
from models.kernels import native
from models.projections import quant
from models.projections.panels import BlockLinear
from models.projections.quant import (
    BLOCK_FLOAT_LAYERS,
    FLOAT_LAYERS,
    Int8Linear,
    quantize,
    quantize_int8,
    quantize_rows,
)
from models.tiny import tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_rows_are_quantized_on_their_own_scale() -> None:
    x = torch.tensor([[1.0, -2.0, 0.5], [100.0, 0.0, -50.0], [0.0, 0.0, 0.0]])
    q, s = quantize_rows(x)
    assert q.dtype == torch.int8 and s.shape == (3, 1)
    assert q[0].tolist() == [64, -127, 32] and q[1].tolist() == [127, 0, -64] and q[2].tolist() == [0, 0, 0]
    assert torch.allclose(q.float() * s, x, atol=float(s.max()) / 2)


def test_int8_linear_is_close_to_fp32_and_each_row_is_independent_of_its_batch() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(96, 40)
    q = Int8Linear(linear.weight, linear.bias)
    x = torch.randn(5, 7, 96)
    with torch.inference_mode():
        ref, out = linear(x), q(x)
        assert out.shape == ref.shape == (5, 7, 40) and out.dtype == x.dtype
        assert (out - ref).abs().max() / ref.abs().max() < 0.02
        alone = torch.cat([q(x[i:i + 1]) for i in range(5)])  # each row with no company
        assert torch.equal(alone, out)  # bitwise: per-row scales, exact int32 accumulation
        mixed = q(torch.cat([x[:2], 1000 * torch.randn(3, 7, 96)]))  # batched with huge rows
        assert torch.equal(mixed[:2], out[:2])
        assert q(x.bfloat16()).dtype == torch.bfloat16


@pytest.mark.parametrize("family", ["encoder", "decoder", "seq2seq"])
def test_every_linear_of_every_family_is_swapped(family: str) -> None:
    model, _ = tiny_model(family)
    quantize_int8(model)
    floats = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert all(n.endswith(FLOAT_LAYERS.get(type(model).__name__, ("-",))) for n in floats), floats
    assert bool(floats) == (family == "encoder")  # only the encoder keeps layers in float
    assert any(isinstance(m, Int8Linear) for m in model.modules())
    if family != "encoder":
        assert isinstance(model.lm_head, Int8Linear)  # the tied head gets an int8 copy of the embeddings
    with pytest.raises(ValueError, match="unknown quantization"):
        quantize(model, "int3")


def test_a_quantized_classifier_keeps_its_head_dense_and_head_in_float() -> None:
    """A Hugging Face classifier's C x C pooler dense sits on the logits path, as the head does."""
    cfg = EncoderConfig(vocab_size=100, d_model=16, n_heads=2, d_ff=32, n_layers=1, max_positions=32,
                        labels=("a", "b"), head_pooling="cls", head_dense="tanh")
    model = EncoderModel(cfg).eval()
    dense = model.head_dense.weight.detach().clone()  # (C, C)
    quantize_int8(model)
    assert type(model.head_dense) is nn.Linear and type(model.head) is nn.Linear
    assert torch.equal(model.head_dense.weight, dense)
    assert isinstance(model.stack.blocks[0].self_attn.q_proj, Int8Linear)  # the rest is int8


def assert_cached_equals_uncached_and_batched_equals_alone(model: nn.Module, ids: torch.Tensor,
                                                           atol: float = 1e-5) -> torch.Tensor:
    """The serving invariants on a quantized decoder; returns its uncached logits (1, T, V) of ids.
    Cached and uncached attention round differently, which can move an activation across a
    quantization step: `atol` bounds what that costs."""
    with torch.inference_mode():
        full = model(ids)  # (1, T, V)
        cache = KVCache.for_model(model.cfg, 1, 16)
        steps = []
        for t in range(ids.size(1)):
            steps.append(model(ids[:, t:t + 1], cache=cache.view())[:, 0])
            cache.advance(1)
        torch.testing.assert_close(torch.stack(steps, 1), full, atol=atol, rtol=1e-5)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14]]
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    together = generate(model, prompts, params)
    alone = [generate(model, [p], params)[0] for p in prompts]
    assert [g.tokens for g in together] == [g.tokens for g in alone]
    return full


def test_quantized_decoder_keeps_cached_equal_uncached_and_batched_equal_alone() -> None:
    torch.manual_seed(0)
    fp32, _ = tiny_model("decoder")
    model, _ = tiny_model("decoder")
    quantize_int8(model)
    ids = torch.randint(3, 200, (1, 9))
    full = assert_cached_equals_uncached_and_batched_equals_alone(model, ids)
    with torch.inference_mode():
        ref = fp32(ids)
    assert ((full - ref).abs().max() / ref.abs().max()) < 0.05


def test_smoothing_moves_an_outlier_channel_into_the_weights() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(64, 32, bias=False)
    x = torch.randn(16, 64)
    x[:, 3] *= 80  # one channel far larger than the rest, as in real activations
    plain = Int8Linear(linear.weight, None)
    smoothed = quantize_int8(nn.Sequential(linear), calibrate=lambda m: m(x))[0]
    assert isinstance(smoothed, Int8Linear) and smoothed.smooth is not None
    with torch.inference_mode():
        ref = linear(x)
        err_plain, err_smooth = ((q(x) - ref).abs().mean().item() for q in (plain, smoothed))
    assert err_smooth < 0.5 * err_plain


@pytest.mark.parametrize(("family", "tasks", "extra"), [
    ("decoder", ("generate",), {}), ("encoder", ("embed",), {}),
    ("seq2seq", ("translate",), {"languages": ("en", "es")})])
def test_a_model_spec_selects_int8_at_load_calibrated_on_sample_text(family: str, tasks: tuple[str, ...],
                                                                     extra: dict[str, object]) -> None:
    spec = ModelSpec(name="q", tasks=tasks, source=f"tiny:{family}", quantize="int8", **extra)  # type: ignore[arg-type]
    loaded = load_model(spec, Path("/nonexistent"))
    linears = [m for m in loaded.model.modules() if isinstance(m, Int8Linear)]
    assert linears and all(m.smooth is not None for m in linears if m is not getattr(loaded.model, "lm_head", None))
    assert loaded.dtype == torch.float32
    with pytest.raises(ValueError, match="quantize must be one of"):
        ModelSpec(name="q", tasks=("generate",), source="tiny:decoder", quantize="int3")  # type: ignore[arg-type]


# -- GGUF's weight-only block formats on our CPU kernels (quantize: q8_0 / q4_1) ------------------------

needs_kernels = pytest.mark.skipif(not native.available() and not os.environ.get("REQUIRE_NATIVE_KERNELS"),
                                   reason="no AVX2 or AVX-512 CPU, or no compiler, for the native kernels")


@needs_kernels
@pytest.mark.parametrize("mode", ["q8_0", "q4_1"])
@pytest.mark.parametrize("family", ["encoder", "decoder", "seq2seq"])
def test_block_modes_swap_every_projection_and_stay_close_to_float(mode: str, family: str) -> None:
    torch.manual_seed(0)
    fp32, _ = tiny_model(family)
    model, _ = tiny_model(family)
    quantize(model, mode)
    blocks = {n: m for n, m in model.named_modules() if isinstance(m, BlockLinear)}
    floats = [n for n, m in model.named_modules() if type(m) is nn.Linear]
    assert blocks and all(n.endswith(BLOCK_FLOAT_LAYERS.get(type(model).__name__, ("-",))) for n in floats), floats
    if family != "encoder":
        assert model.lm_head.fmt == "q8_0"  # the (tied) head: 8-bit in both modes
        assert {m.fmt for n, m in blocks.items() if n != "lm_head"} == {mode}
    ids = torch.randint(3, 200, (2, 9))
    keep = torch.ones_like(ids, dtype=torch.bool)
    with torch.inference_mode():
        if family == "encoder":
            out, ref = model.embed(ids, keep), fp32.embed(ids, keep)
        elif family == "decoder":
            out, ref = model(ids), fp32(ids)
        else:
            tgt = torch.randint(3, 200, (2, 5))
            out, ref = model(ids, keep, tgt), fp32(ids, keep, tgt)
    # relative error of the outputs: random tiny weights lose ~12 % to 4-bit groups, ~1 % to 8-bit ones
    # (the shipped models' measured losses: docs/benchmarks.md); a broken kernel gives ~100 %
    assert (out - ref).norm() / ref.norm() < (0.2 if mode == "q4_1" else 0.02)


@needs_kernels
@pytest.mark.parametrize("mode", ["q8_0", "q4_1"])
def test_a_block_quantized_decoder_keeps_cached_equal_uncached_and_batched_equal_alone(mode: str) -> None:
    model, _ = tiny_model("decoder")
    quantize(model, mode)
    # 16-bit activations: a step of the second part is ~1e-5 of a group's largest input
    assert_cached_equals_uncached_and_batched_equals_alone(model, torch.randint(3, 200, (1, 9)), atol=1e-4)


@needs_kernels
def test_a_spec_selects_a_block_mode_and_keeps_fusion() -> None:
    spec = ModelSpec(name="q", tasks=("generate",), source="tiny:decoder", quantize="q4_1")
    model = load_model(spec, Path("/nonexistent")).model
    attn = model.stack.blocks[0].self_attn
    assert attn.qkv is not None and isinstance(attn.qkv, BlockLinear)  # fused first: groups are per output row


@needs_kernels
def test_a_spec_chooses_the_block_formats_activation_bits() -> None:
    spec = ModelSpec(name="q", tasks=("generate",), source="tiny:decoder", quantize="q8_0")
    loaded = load_model(spec, Path("/nonexistent"))
    blocks = [m for m in loaded.model.modules() if isinstance(m, BlockLinear)]
    assert blocks and all(m.activation_bits == 16 for m in blocks)  # default: two 8-bit parts
    assert loaded.block_activation_bits == 16  # what /v1/models reports
    fast = dataclasses.replace(spec, block_activation_bits=8)
    assert all(m.activation_bits == 8 for m in load_model(fast, Path("/nonexistent")).model.modules()
               if isinstance(m, BlockLinear))
    with pytest.raises(ValueError, match="block_activation_bits must be 16 or 8"):
        dataclasses.replace(spec, block_activation_bits=4)


def test_block_modes_say_why_they_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "available", lambda: False)
    model, _ = tiny_model("decoder")
    with pytest.raises(ValueError, match="quantize: q4_1 runs on this project's CPU kernels"):
        quantize(model, "q4_1")


def test_load_model_serves_float_weights_where_the_block_kernels_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """A machine without AVX2 or g++ still serves the model (for a GGUF of these blocks: the same
    weight values), and says which quantization is in effect."""
    monkeypatch.setattr(native, "available", lambda: False)
    loaded = load_model(ModelSpec(name="q", tasks=("generate",), source="tiny:decoder", quantize="q4_1"),
                        Path("/nonexistent"))
    assert loaded.quantize is None and not any(isinstance(m, BlockLinear) for m in loaded.model.modules())
    assert loaded.block_activation_bits is None
    assert load_model(ModelSpec(name="q", tasks=("generate",), source="tiny:decoder", quantize="int8"),
                      Path("/nonexistent")).quantize == "int8"


@pytest.mark.parametrize("k", [64, 1024, 1025, 3072])
def test_int8_products_on_floats_are_exactly_int_mm(k: int) -> None:
    """Where torch's int8 GEMM is slow (CPUs without VNNI or AMX) Int8Linear multiplies the same int8
    values as float32 in chunks whose sums stay exact: the integers must be _int_mm's, at the worst
    case (every product 127 * 127 or -127 * 127) and on random codes."""
    torch.manual_seed(0)
    worst = torch.full((3, k), 127, dtype=torch.int8), torch.full((k, 17), -127, dtype=torch.int8)
    codes = torch.randint(-127, 128, (33, k), dtype=torch.int8), torch.randint(-127, 128, (k, 40), dtype=torch.int8)
    for xq, wq in (worst, codes):
        assert torch.equal(quant.exact_int_mm(xq, wq.float()), torch._int_mm(xq, wq))


def test_int8_linear_gives_the_same_bits_either_way(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(1)
    w, b, x = torch.randn(48, 2100), torch.randn(48), torch.randn(5, 2100)
    out = {}
    for floats in (True, False):
        monkeypatch.setattr(quant, "int_mm_on_floats", lambda floats=floats: floats)
        lin = quant.Int8Linear(w, b)
        assert (lin.weight_f is not None) == floats and "weight_f" not in lin.state_dict()
        out[floats] = lin(x)
    assert torch.equal(out[True], out[False])


@needs_kernels
def test_prompt_weights_float_loads_a_float_twin_for_prompts() -> None:
    """prompt_weights "float": the blocks decode, a float32 copy on our panel kernels computes
    prompts; the two agree to the blocks' rounding. Other models and modes refuse the setting."""
    from models.projections.panels import PanelLinear

    spec = ModelSpec(name="g", tasks=("generate",), source="tiny:decoder", quantize="q4_1", prompt_weights="float")
    loaded = load_model(spec, Path("/nonexistent"))
    assert any(isinstance(m, BlockLinear) for m in loaded.model.modules())
    twin = loaded.prompt_model
    assert twin is not None and not any(isinstance(m, BlockLinear) for m in twin.modules())
    assert any(isinstance(m, PanelLinear) for m in twin.modules())
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.inference_mode():
        torch.testing.assert_close(twin(ids), loaded.model(ids), atol=0.1, rtol=0.1)
    assert load_model(dataclasses.replace(spec, prompt_weights="same"), Path("/nonexistent")).prompt_model is None
    with pytest.raises(ValueError, match="prompt_weights: float needs quantize"):
        ModelSpec(name="g", tasks=("generate",), source="tiny:decoder", prompt_weights="float")
    with pytest.raises(ValueError, match="for generators"):
        ModelSpec(name="e", tasks=("embed",), source="tiny:encoder", quantize="q8_0", prompt_weights="float")


@needs_kernels
@pytest.mark.parametrize(("measured", "twin"), [(0.8, False), (1.3, True)])
def test_prompt_weights_auto_keeps_the_twin_only_where_it_measured_faster(
        monkeypatch: pytest.MonkeyPatch, measured: float, twin: bool) -> None:
    import models.catalog
    from models.projections.prompt_weights import prompt_speedup

    tiny, _ = tiny_model("decoder")
    assert prompt_speedup(tiny, tiny, tokens=8, rounds=1) > 0
    monkeypatch.setattr(models.catalog, "prompt_speedup", lambda blocks, floats: measured)
    spec = ModelSpec(name="g", tasks=("generate",), source="tiny:decoder", quantize="q4_1", prompt_weights="auto")
    loaded = load_model(spec, Path("/nonexistent"))
    assert (loaded.prompt_model is not None) is twin and loaded.prompt_speedup == measured
    assert loaded.prompt_weights == ("float32" if twin else None)  # equal speeds: the first twin measured
    forced = load_model(dataclasses.replace(spec, prompt_weights="float"), Path("/nonexistent"))
    assert forced.prompt_model is not None  # "float" keeps it whatever it measured
    assert forced.prompt_weights == "float32" and forced.prompt_speedup is None


@needs_kernels
def test_prompt_weights_auto_measures_every_twin_this_cpu_runs_and_keeps_the_fastest(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """"auto" measures the float32 twin and, where our bfloat16 panels run, the bfloat16 one; the
    plan's prefill detail names what it measured and what it kept."""
    import models.catalog
    from models.kernels import native

    measured = {"float32": 1.2, "bfloat16": 1.7}
    monkeypatch.setattr(models.catalog, "prompt_speedup",
                        lambda blocks, twin: measured[_twin_kind(twin)])
    spec = ModelSpec(name="g", tasks=("generate",), source="tiny:decoder", quantize="q4_1", prompt_weights="auto")
    loaded = load_model(spec, Path("/nonexistent"))
    detail = loaded.plan["prefill"].detail
    if native.has_bf16():
        assert loaded.prompt_weights == "bfloat16" and loaded.prompt_speedup == 1.7
        assert _twin_kind(loaded.prompt_model) == "bfloat16"
        assert detail.startswith("bfloat16 panels, prompt_weights: auto -> bfloat16, float32 1.20x the blocks, "
                                 "bfloat16 1.70x the blocks, attention: ")
    else:  # the bfloat16 twin is not a candidate on this CPU
        assert loaded.prompt_weights == "float32" and "-> float32, float32 1.20x the blocks, attention: " in detail


@needs_kernels
def test_prompt_weights_auto_measures_the_twins_eager_and_compiles_only_the_one_kept(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Compiling and warming up a twin takes seconds of a replica's start: the twins are timed before any
    model is compiled, then the model and the kept twin are compiled, the others never."""
    import models.catalog
    from models.execution.compiled import is_compiled

    timed, warmed = [], []
    monkeypatch.setattr(models.catalog, "prompt_speedup",
                        lambda blocks, twin: timed.append((is_compiled(blocks), is_compiled(twin))) or 1.5)
    monkeypatch.setattr(models.catalog, "warm_up", lambda model, kv_dtype=None: warmed.append(model) or 0.5)
    spec = ModelSpec(name="g", tasks=("generate",), source="tiny:decoder", quantize="q4_1", prompt_weights="auto",
                     compile=True)
    loaded = load_model(spec, Path("/nonexistent"))
    assert timed and all(t == (False, False) for t in timed)  # every twin measured, none compiled yet
    assert warmed == [loaded.model, loaded.prompt_model] and loaded.compile_seconds == 1.0
    assert is_compiled(loaded.model) and is_compiled(loaded.prompt_model)


def _twin_kind(model: torch.nn.Module) -> str:
    from models.projections.panels import Bf16PanelLinear

    return "bfloat16" if any(isinstance(m, Bf16PanelLinear) for m in model.modules()) else "float32"


@needs_kernels
def test_prompt_weights_bfloat16_computes_prompts_on_bfloat16_panels_or_refuses_to_load() -> None:
    """prompt_weights "bfloat16": a twin on our bfloat16 panels, its logits within bfloat16's rounding
    of the blocks'; on a CPU without AVX512-BF16 the load fails, naming what it needs."""
    from models.kernels import native
    from models.projections.dense import KernelUnavailable
    from models.projections.panels import Bf16PanelLinear

    spec = ModelSpec(name="g", tasks=("generate",), source="tiny:decoder", quantize="q4_1", prompt_weights="bfloat16")
    if not native.has_bf16():
        with pytest.raises(KernelUnavailable, match="AVX512-BF16"):
            load_model(spec, Path("/nonexistent"))
        return
    loaded = load_model(spec, Path("/nonexistent"))
    twin = loaded.prompt_model
    assert loaded.prompt_weights == "bfloat16" and any(isinstance(m, Bf16PanelLinear) for m in twin.modules())
    assert twin.stack.bf16_products and not loaded.model.stack.bf16_products  # its prompt attention too
    assert loaded.plan["prefill"].detail == ("bfloat16 panels, prompt_weights: bfloat16, attention: SDPA (not the "
                                             "prompt kernel: head dim 8; it takes 32, 64, 128)")
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.inference_mode():
        torch.testing.assert_close(twin(ids), loaded.model(ids), atol=0.1, rtol=0.1)
