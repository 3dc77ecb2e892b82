"""Our CPU projection kernels (models/kernels/panels.cpp, models/projections/panels.py): float32 panels give the
products F.linear computes; the block formats compute exactly their reference arithmetic (8-bit
activations per group of 32, exact integer sums), with every instruction set's build giving the
same bits; every format is bitwise the same for a row alone and in any batch, and GGUF's Q4_1 / Q8_0
blocks come out exactly as llama.cpp's reference quantizers make them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from models.kernels import native
from models.projections.panels import (
    Bf16PanelLinear,
    BlockLinear,
    PanelLinear,
    dequantize,
    quantize_q4_1,
    quantize_q8_0,
    reference,
)

# CI sets REQUIRE_NATIVE_KERNELS=1 (.ci/run): there a missing build fails instead of skipping
pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.skipif(not native.available() and not os.environ.get("REQUIRE_NATIVE_KERNELS"),
                                 reason="no AVX2 or AVX-512 CPU, or no compiler, for the native kernels")]

SHAPES = [(96, 64), (40, 32), (3, 384), (257, 128)]  # whole panels, a partial one, a tiny head, a 1-output tail
ROWS = (1, 2, 7, 8, 9, 17)  # one pass, a partial pass, several passes of 8 rows


def test_the_kernels_are_built_here() -> None:
    assert native.available()


@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("bias", [True, False])
def test_float_panels_match_linear_and_give_the_weight_back(n: int, k: int, bias: bool) -> None:
    torch.manual_seed(n + k)
    lin = nn.Linear(k, n, bias=bias)
    panel = PanelLinear(lin.weight, lin.bias)
    with torch.inference_mode():
        for m in ROWS:
            x = torch.randn(m, k)
            torch.testing.assert_close(panel(x), lin(x), atol=1e-5, rtol=1e-5)
        x = torch.randn(2, 5, k)
        assert panel(x).shape == (2, 5, n)
    assert torch.equal(panel.weight, lin.weight.detach())
    fresh = nn.Linear(k, n, bias=bias)
    fresh.load_state_dict(panel.state_dict(), strict=True)
    assert torch.equal(fresh.weight, lin.weight)


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_a_bias_given_to_the_kernel_is_the_addition_after_it(n: int, k: int) -> None:
    """A model's own bias after its head (Marian's final_logits_bias), given to the panels' kernel: the
    same bits as adding it to their output, at every row count (a whole panel's outputs and a tail's)."""
    torch.manual_seed(n * k)
    panel, bias = PanelLinear(torch.randn(n, k), None), torch.randn(n)
    with torch.inference_mode():
        for m in ROWS:
            x = torch.randn(m, k)
            assert torch.equal(panel(x, bias=bias), panel(x) + bias)
    with pytest.raises(ValueError, match="own bias"):
        PanelLinear(torch.randn(n, k), torch.randn(n))(torch.randn(1, k), bias=bias)


@pytest.mark.parametrize("bits", [16, 8])
@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_block_formats_compute_their_reference_arithmetic(fmt: str, n: int, k: int, bits: int) -> None:
    torch.manual_seed(n * k)
    w, b = torch.randn(n, k), torch.randn(n)
    lin = BlockLinear(fmt, w, b, activation_bits=bits)
    dense = lin.weight  # (N, K): what the blocks stand for
    step = 1 / 15 if fmt == "q4_1" else 1 / 127  # half a quantization step of the widest group, relative
    assert (dense - w).abs().max() <= (w.abs().max() * 2) * step / 2 + 1e-6
    with torch.inference_mode():
        for m in ROWS:
            x = torch.randn(m, k) * 3
            y = lin(x)
            exact = reference(fmt, x, *lin.blocks(), activation_bits=bits) + b.double()  # (M, N) float64
            scale = exact.abs().amax()
            assert ((y.double() - exact).abs() <= 1e-6 * scale).all()  # float32 rounding only
            # against the float product on the same weights: 16-bit activations ~1e-5, 8-bit ~1e-2
            assert (y - F.linear(x, dense, b)).abs().max() <= (1e-4 if bits == 16 else 0.02) * scale


def test_every_build_this_cpu_runs_gives_the_same_bits() -> None:
    """Each instruction set's build (TS_NATIVE_ISA: AVX-512 with VNNI, AVX-512 by multiply-adds, AVX2
    with half the lanes) must give the very bits of the widest: exact integer sums, float work lane by
    lane (the projections, and prompt attention). On a CPU that runs one build this checks that build alone."""
    script = (
        "import json, sys, torch\n"
        "from models.kernels import native\n"
        "assert native.available()\n"
        "from models.projections.panels import BlockLinear, PanelLinear\n"
        "torch.manual_seed(0)\n"
        "x = torch.randn(9, 256) * 3\n"
        "out = {'f32': PanelLinear(torch.randn(100, 256), torch.randn(100))(x).tolist()}\n"
        "for fmt in ('q4_1', 'q8_0'):\n"
        "    for bits in (16, 8):\n"
        "        lin = BlockLinear(fmt, torch.randn(100, 256), torch.randn(100), activation_bits=bits)\n"
        "        with torch.inference_mode():\n"
        "            out[f'{fmt} {bits}'] = lin(x).tolist()\n"
        "pool = torch.randn(4 * 2 * 16 + 1, 64)\n"  # prompt attention (prompt_attention.cpp): lane by lane too
        "q = torch.randn(1, 6, 40, 64)\n"
        "out['prompt'] = torch.ops.ts_panels.paged_prompt(q, pool, pool.flip(0), torch.tensor([[3, 1, 2]]),\n"
        "                                                 torch.tensor([45]), 2, 16, 0.125).tolist()\n"
        "print(json.dumps([native.isa(), out]))\n")
    runs = {}
    for isa in native.cpu_isas():
        env = {**os.environ, native.ISA_ENV: isa}
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300,
                              check=True)
        runs[isa] = json.loads(done.stdout.strip().splitlines()[-1])
        assert runs[isa][0] == isa  # that build really ran
    assert runs, "the kernels are available, so this CPU runs at least one build"
    widest = runs[native.cpu_isas()[0]][1]
    for isa, (_, out) in runs.items():
        assert out == widest, isa  # bit for bit (float lists compare exactly)


@pytest.mark.parametrize(("caps", "env", "want"), [
    ({"avx512_f": 1, "avx512_bw": 1, "avx512_vl": 1, "avx512_dq": 1, "avx512_vnni": 1, "avx2": 1, "fma3": 1,
      "f16c": 1}, "", "avx512_vnni"),
    ({"avx512_f": 1, "avx512_bw": 1, "avx512_vl": 1, "avx512_dq": 1, "avx2": 1, "fma3": 1, "f16c": 1}, "", "avx512"),
    ({"avx512_f": 1, "avx512_bw": 1, "avx512_vl": 1, "avx512_dq": 1, "avx512_vnni": 1, "avx2": 1, "fma3": 1,
      "f16c": 1}, "avx2", "avx2"),
    ({"avx2": 1, "fma3": 1, "f16c": 1}, "", "avx2"),
    ({"avx2": 1, "fma3": 1, "f16c": 1}, "avx512", None),  # never a build wider than the CPU
    ({"avx512_f": 1, "avx2": 1, "fma3": 1, "f16c": 1}, "", "avx2"),  # AVX-512F without BW/VL/DQ
    ({"avx2": 1, "f16c": 1}, "", None),
    ({"avx512_f": 1, "avx512_bw": 1, "avx512_vl": 1, "avx512_dq": 1, "avx512_vnni": 1, "avx512_bf16": 1, "avx2": 1,
      "fma3": 1, "f16c": 1}, "", "avx512_bf16"),
    ({"avx512_f": 1, "avx512_bw": 1, "avx512_vl": 1, "avx512_dq": 1, "avx512_vnni": 1, "avx512_bf16": 1, "avx2": 1,
      "fma3": 1, "f16c": 1}, "avx512_vnni", "avx512_vnni"),
], ids=["vnni", "avx512", "asked-avx2", "zen3", "asked-wider", "knl-like", "no-fma", "bf16", "asked-vnni"])
def test_the_build_is_the_widest_the_cpu_runs(monkeypatch, caps, env, want) -> None:  # noqa: ANN001
    monkeypatch.setattr(native.torch.cpu, "get_capabilities", lambda: caps)
    monkeypatch.setenv(native.ISA_ENV, env)
    assert native.isa() == want


@pytest.mark.parametrize("make", [lambda w: PanelLinear(w, None), lambda w: BlockLinear("q4_1", w, None),
                                  lambda w: BlockLinear("q8_0", w, None),
                                  lambda w: BlockLinear("q4_1", w, None, activation_bits=8),
                                  lambda w: BlockLinear("q8_0", w, None, activation_bits=8)],
                         ids=["f32", "q4_1", "q8_0", "q4_1-a8", "q8_0-a8"])
def test_a_row_gives_the_same_bits_alone_and_in_any_batch(make) -> None:  # noqa: ANN001
    torch.manual_seed(0)
    lin = make(torch.randn(200, 256))
    x = torch.randn(33, 256)
    with torch.inference_mode():
        alone = torch.cat([lin(x[i:i + 1]) for i in range(33)])
        for m in (2, 8, 9, 33):
            assert torch.equal(lin(x[:m]), alone[:m])


needs_bf16 = pytest.mark.skipif(not native.has_bf16(), reason="no AVX512-BF16 here: "
                                "test_bfloat16_panels_are_refused_by_builds_without_them covers this CPU")


@needs_bf16
@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("bias", [True, False])
def test_bfloat16_panels_sum_the_rounded_products_in_float32(n: int, k: int, bias: bool) -> None:
    """Weights and activations rounded to bfloat16 (nearest even), products summed in float32: within
    float32's rounding of the exact sum of the rounded values; the weight comes back rounded."""
    torch.manual_seed(0)
    w, b = torch.randn(n, k), torch.randn(n) if bias else None
    lin = Bf16PanelLinear(w, b)
    assert torch.equal(lin.weight, w.bfloat16().float()) and lin.weight.shape == (n, k)
    for m in ROWS + (12, 13, 25):
        x = torch.randn(m, k) * 3
        exact = x.bfloat16().double() @ w.bfloat16().double().T + (b.double() if bias else 0)  # (M, N)
        y = lin(x)
        assert y.dtype == torch.float32 and y.shape == (m, n)
        torch.testing.assert_close(y.double(), exact, atol=1e-5 * k ** 0.5, rtol=1e-5)
        assert lin(x.bfloat16()).dtype == torch.bfloat16  # out in x's dtype


@needs_bf16
def test_bfloat16_panels_give_a_row_the_same_bits_alone_and_in_any_batch() -> None:
    torch.manual_seed(0)
    lin = Bf16PanelLinear(torch.randn(200, 256), torch.randn(200))
    x = torch.randn(40, 256)
    with torch.inference_mode():
        alone = torch.cat([lin(x[i:i + 1]) for i in range(40)])
        for m in (2, 11, 12, 13, 25, 40):  # passes of 12 rows and their remainders
            assert torch.equal(lin(x[:m]), alone[:m])
        bias = torch.randn(200)
        torch.testing.assert_close(Bf16PanelLinear(lin.weight, None)(x, bias=bias), lin(x) - lin.bias + bias)


def test_bfloat16_panels_are_refused_by_builds_without_them() -> None:
    """A build without AVX512-BF16 (this CPU's narrower ones) says so instead of computing anything;
    an odd input size is refused when packing."""
    with pytest.raises(ValueError, match="even input size"):
        Bf16PanelLinear(torch.randn(4, 3), None)
    script = ("import torch\nfrom models.kernels import native\nassert native.available()\n"
              "from models.projections.panels import Bf16PanelLinear\n"
              "try:\n    Bf16PanelLinear(torch.randn(40, 32), None)(torch.randn(2, 32))\n"
              "except RuntimeError as e:\n    print('refused:', str(e).splitlines()[0])\n")
    narrower = [isa for isa in native.cpu_isas() if isa != "avx512_bf16"]
    assert narrower, "every CPU with the kernels runs a build without bfloat16 panels"
    done = subprocess.run([sys.executable, "-c", script], env={**os.environ, native.ISA_ENV: narrower[0]},
                          capture_output=True, text=True, timeout=300, check=True)
    assert "refused: this build of the kernels has no bfloat16 panels (they need AVX512-BF16)" in done.stdout


def test_quantizers_follow_llama_cpp_reference_rounding() -> None:
    group = torch.linspace(-1.0, 2.0, 32)[None, :]  # (1, 32): min -1, max 2
    q, d, m = quantize_q4_1(group)
    assert d.item() == pytest.approx(3 / 15, rel=1e-3) and m.item() == -1.0
    assert q.min().item() == 0 and q.max().item() == 15  # the group's ends map to the ends of the code range
    expected = ((group - group.min()) / (3 / 15) + 0.5).floor().clamp(0, 15)
    assert torch.equal(q.float(), expected)
    q8, d8 = quantize_q8_0(torch.tensor([[0.5, -1.0, 0.25] + [0.0] * 29]))
    assert d8.item() == pytest.approx(1 / 127, rel=1e-3) and q8[0, :3].tolist() == [64, -127, 32]  # 63.5 -> 64


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_requantizing_dequantized_blocks_gives_the_same_blocks(fmt: str) -> None:
    """What lets `quantize: q4_1` serve a Q4_1 GGUF with exactly its weights: the file's blocks,
    dequantized to float by our importer, quantize back to themselves."""
    torch.manual_seed(1)
    w = torch.randn(64, 128)
    if fmt == "q4_1":
        q, d, m = quantize_q4_1(w)
        again = quantize_q4_1(dequantize(fmt, q, d, m))
        original = (q, d, m)
    else:
        q, d = quantize_q8_0(w)
        again = quantize_q8_0(dequantize(fmt, q, d))
        original = (q, d)
    assert all(torch.equal(a, b) for a, b in zip(original, again, strict=True))


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_the_blocks_come_back_out_of_the_records(fmt: str) -> None:
    torch.manual_seed(2)
    w = torch.randn(70, 96)
    expected = quantize_q4_1(w) if fmt == "q4_1" else (*quantize_q8_0(w), None)
    back = BlockLinear(fmt, w, None).blocks()
    assert all(a is None and e is None or torch.equal(a, e) for a, e in zip(back, expected, strict=True))


def test_wrong_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        BlockLinear("q4_1", torch.randn(8, 48), None)
    with pytest.raises(ValueError, match="unknown block format"):
        BlockLinear("q5_0", torch.randn(8, 64), None)
    with pytest.raises(ValueError, match="activation_bits must be one of"):
        BlockLinear("q4_1", torch.randn(8, 64), None, activation_bits=4)
    lin = PanelLinear(torch.randn(8, 64), None)
    with pytest.raises(RuntimeError, match="wrong dtype, layout or shape"):
        torch.ops.ts_panels.linear_f32(torch.randn(2, 63), lin.panels, None, 8)
    q8 = BlockLinear("q8_0", torch.randn(8, 64), None)
    with pytest.raises(RuntimeError, match="wrong dtype, layout or shape"):
        torch.ops.ts_panels.linear_q4_1(torch.randn(2, 64), q8.records, None, 8, 2)  # q8_0 records as q4_1
