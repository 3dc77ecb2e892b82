"""q4_1 on PyTorch's int4 tile kernel (models/projections/int4_tiles.py), the 4-bit path on CUDA. Run here on
the kernel's CPU form (`_weight_int4pack_mm_for_cpu`, float32): the Q4_1 -> (scale, zero) identity,
the group layout, padding to whole tiles and a whole tiny decoder against the same blocks dequantized.
The CUDA form (its own byte packing, bfloat16) is checked by the prepared GPU check
(loadtests/gpu/check.py, section q4_1_tiles)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from models.projections.int4_tiles import TiledInt4Linear, inner_k_tiles
from models.projections.panels import dequantize, quantize_q4_1
from models.projections.quant import quantize, quantize_q4_1_tiles, with_q4_1_values
from models.tiny import tiny_model
from tests.models.projections.test_quant import assert_cached_equals_uncached_and_batched_equals_alone

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize(("n", "k"), [(64, 576), (20, 1536), (8, 32), (200, 96)])
def test_the_tiles_compute_the_q4_1_weights(n: int, k: int) -> None:
    """w = (q - 8) scale + zero with scale = d, zero = m + 8 d is Q4_1's d q + m: the layer equals
    x @ dequantize(q, d, m).T to float32 rounding, also where N is no multiple of the 8-row tiles."""
    torch.manual_seed(0)
    q, d, m = quantize_q4_1(torch.randn(n, k))
    layer = TiledInt4Linear(q, d, m, bias=torch.randn(n))
    x = torch.randn(3, 5, k)
    with torch.inference_mode():
        out = layer(x)
    want = x @ dequantize("q4_1", q, d, m).T + layer.bias
    assert out.shape == (3, 5, n) and out.dtype == x.dtype
    assert rel(out, want) < 1e-5
    # a wrong zero (m instead of m + 8 d) or a wrong group order is far off
    shifted = TiledInt4Linear(q, d, m - 8 * d.float().half())
    assert rel(shifted(x), want - layer.bias) > 1e-2 or torch.all(d == 0)


def test_a_gguf_s_dequantized_weights_give_back_its_blocks() -> None:
    """Built from the float weights of Q4_1 blocks (as a GGUF loads), the layer computes with exactly
    those blocks: the same outputs as built from the blocks."""
    torch.manual_seed(1)
    q, d, m = quantize_q4_1(torch.randn(48, 256))
    x = torch.randn(4, 256)
    with torch.inference_mode():
        assert torch.equal(TiledInt4Linear.from_weight(dequantize("q4_1", q, d, m), None)(x),
                           TiledInt4Linear(q, d, m)(x))


def test_inner_tiling_divides_the_inputs() -> None:
    assert [inner_k_tiles(k) for k in (32, 64, 96, 576, 1536, 2048)] == [2, 4, 2, 4, 8, 8]


def test_a_tiled_decoder_is_its_dequantized_blocks_and_keeps_the_invariants() -> None:
    model, _ = tiny_model("decoder")
    ref = with_q4_1_values(model)
    quantize_q4_1_tiles(model)
    tiled = [n for n, m in model.named_modules() if isinstance(m, TiledInt4Linear)]
    floats = [n for n, m in model.named_modules() if type(m) is nn.Linear]
    assert tiled and all(n.endswith("lm_head") for n in floats), floats  # every projection but the head
    ids = torch.randint(3, 200, (1, 9))
    full = assert_cached_equals_uncached_and_batched_equals_alone(model, ids)
    with torch.inference_mode():
        assert rel(full, ref(ids)) < 1e-4


def test_block_formats_are_made_from_float32_weights() -> None:
    model, _ = tiny_model("decoder")
    with pytest.raises(ValueError, match="made from float32 weights"):
        quantize(model.to(torch.bfloat16), "q4_1")


def test_tiles_packed_for_one_device_refuse_another() -> None:
    q, d, m = quantize_q4_1(torch.randn(16, 64))
    layer = TiledInt4Linear(q, d, m)
    layer.packed_for = "cuda"  # as if packed on a GPU and then moved: the CPU kernel would misread it
    with pytest.raises(ValueError, match="packed for cuda"):
        layer(torch.randn(1, 64))
