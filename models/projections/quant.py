"""Quantized weights for every family: `quantize(model, mode)` swaps the float32 projections in place.

- "int8": `Int8Linear`, int8 weights with a scale per output channel and int8 activations with a
  scale per row from that row alone, summed exactly in int32 (torch._int_mm, or exact float32 chunks
  where this CPU's int8 GEMM is slower: `int_mm_on_floats`); `calibrate` adds SmoothQuant's
  per-input-channel migration. Exact sums make a row's result bitwise the same alone, batched or padded.
- "q8_0" / "q4_1": GGUF's block formats, `BlockLinear` on our CPU kernels (panels.py), q4_1 as
  `TiledInt4Linear` on CUDA (int4_tiles.py); a GGUF file's own blocks are served as they are.
FLOAT_LAYERS / BLOCK_FLOAT_LAYERS stay float. Results change, so a mode is opt-in (`quantize:` in a
model's settings); speed and measured loss: docs/benchmarks.md, "Quantized quality".
"""

from __future__ import annotations

import copy
import functools
import time
from collections.abc import Callable

import torch
from torch import Tensor, nn

from ..kernels import native
from .base import swap_linears, tied_embedding
from .int4_tiles import TiledInt4Linear
from .panels import GROUP, BlockLinear, dequantize, quantize_q4_1

QMAX = 127.0
CUDA_MIN_ROWS = 16
SMOOTHING_ALPHA = 0.5
# 127 * 127 * 1024 < 2**24: a float32 sum of up to 1024 int8 x int8 products is an exact integer, in any order
EXACT_FLOAT_K = 1024
# Linears kept in float, by model class and name suffix. The encoder's FFN output projection reads
# GELU outputs with the widest channel ranges: quantized, MiniLM's sentiment label matched fp32 on
# 98.0 % of the 1,000 test texts, in float on 99.4 % (the rest of the model still int8); its 3-way
# head is too small to gain anything from int8, and so is a classifier's C x C head_dense (BERT's pooler,
# RoBERTa's classifier.dense), one row per text on the logits path.
FLOAT_LAYERS: dict[str, tuple[str, ...]] = {"EncoderModel": ("ff.down", "head", "head_dense")}
# Model classes whose projections stay unfused (models/projections/fuse.py) when quantized. MiniLM's fused q/k/v
# share one smoothing vector: 98.9 % of labels kept against 99.4 % unfused, at no measurable speed
# gain (its MLP is not gated, so q/k/v is all that fusion would merge).
UNFUSED_WHEN_QUANTIZED = frozenset({"EncoderModel"})


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """(M, K) float -> int8 (M, K) and float32 scales (M, 1): symmetric, one scale per row."""
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / QMAX  # (M, 1)
    return torch.round(x / scale).clamp_(-QMAX, QMAX).to(torch.int8), scale  # (M, K), (M, 1)


@functools.cache
def int_mm_on_floats() -> bool:
    """Whether this CPU multiplies int8 matrices faster as float32 (exactly: `exact_int_mm`) than with
    torch._int_mm. torch's int8 GEMM is fast only with AVX512-VNNI or AMX (docs/benchmarks-history.md,
    "Our own CPU kernels and compiled blocks"). Measured once per process at the first quantization,
    best of 3 on a 32 x 1024 x 1024 product."""
    a = torch.randint(-127, 128, (32, EXACT_FLOAT_K), dtype=torch.int8)  # (M, K)
    b = torch.randint(-127, 128, (EXACT_FLOAT_K, EXACT_FLOAT_K), dtype=torch.int8)  # (K, N)
    bf = b.float()

    def best(fn: Callable[[], Tensor]) -> float:
        fn()
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    return best(lambda: exact_int_mm(a, bf)) < best(lambda: torch._int_mm(a, b))


def exact_int_mm(xq: Tensor, w: Tensor) -> Tensor:
    """xq (M, K) int8 @ w (K, N) (int8 values held as float32) -> (M, N) int32, exactly torch._int_mm's
    integers: float32 products summed in chunks of EXACT_FLOAT_K inputs, each an exact integer."""
    xf = xq.float()  # (M, K)
    acc: Tensor | None = None
    for k0 in range(0, xf.size(1), EXACT_FLOAT_K):
        part = (xf[:, k0:k0 + EXACT_FLOAT_K] @ w[k0:k0 + EXACT_FLOAT_K]).to(torch.int32)  # (M, N)
        acc = part if acc is None else acc.add_(part)
    assert acc is not None
    return acc


class Int8Linear(nn.Module):
    """A Linear with int8 weights and per-row int8 activations, the product summed exactly in int32:

        y[b, n] = (sum_k xq[b, k] * wq[n, k]) * sx[b] * sw[n] + bias[n];  xq = quant(x * m), wq = quant(W / m)

    `smooth` (K,): the input channels' migration factors m (SmoothQuant, from `calibrate`; None: 1)."""

    def __init__(self, weight: Tensor, bias: Tensor | None, smooth: Tensor | None = None) -> None:
        super().__init__()
        w = weight.detach().float()  # (N, K)
        self.in_features, self.out_features = w.size(1), w.size(0)
        if smooth is not None:
            w = w / smooth[None, :]  # (N, K): x * m @ (W / m)^T = x @ W^T
        scale = w.abs().amax(dim=1).clamp_min(1e-12) / QMAX  # (N,)
        wq = torch.round(w / scale[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)  # (N, K)
        self.register_buffer("weight_t", wq.t().contiguous())  # (K, N): _int_mm's layout
        # on a CPU where int8 GEMM is slow, the same values as float32 (4x the bytes; not saved)
        self.register_buffer("weight_f", self.weight_t.float() if weight.device.type == "cpu" and int_mm_on_floats()
                             else None, persistent=False)  # (K, N)
        self.register_buffer("weight_scale", scale)  # (N,)
        self.register_buffer("smooth", None if smooth is None else smooth.float())  # (K,)
        self.register_buffer("bias", None if bias is None else bias.detach().float())  # (N,)

    def forward(self, x: Tensor) -> Tensor:
        """x: (..., K) -> (..., N) in x's dtype."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1]).float()  # (M, K)
        if self.smooth is not None:
            flat = flat * self.smooth
        xq, sx = quantize_rows(flat)  # (M, K) int8, (M, 1)
        m = xq.size(0)
        if xq.is_cuda and m <= CUDA_MIN_ROWS:  # cuBLASLt's int8 kernel wants more than 16 rows: pad with zeros
            xq = torch.cat([xq, xq.new_zeros(CUDA_MIN_ROWS + 1 - m, xq.size(1))])  # (17, K)
        if self.weight_f is not None and not xq.is_cuda:
            acc = exact_int_mm(xq, self.weight_f)  # (M, N) int32, the same integers
        else:
            acc = torch._int_mm(xq, self.weight_t)[:m]  # (M, N) int32, exact
        y = acc.float().mul_(sx).mul_(self.weight_scale)  # (M, N)
        if self.bias is not None:
            y.add_(self.bias)
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)  # (..., N)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"smoothed={self.smooth is not None}")


def smoothing(weight: Tensor, act_max: Tensor, alpha: float = SMOOTHING_ALPHA) -> Tensor:
    """SmoothQuant's per-input-channel factors m (K,) from max|W| per input channel and the
    calibrated max|x| per input channel: m = max|W|^(1-a) / max|x|^a."""
    w_max = weight.detach().float().abs().amax(dim=0).clamp_min(1e-5)  # (K,)
    return (w_max ** (1 - alpha) / act_max.float().clamp_min(1e-5) ** alpha).clamp(1e-3, 1e3)  # (K,)


@torch.inference_mode()
def activation_maxima(model: nn.Module, calibrate: Callable[[nn.Module], object]) -> dict[str, Tensor]:
    """max |input| per input channel of every nn.Linear (by qualified name) while `calibrate(model)` runs."""
    maxima: dict[str, Tensor] = {}

    def record(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> None:
            x = inputs[0].detach().float()
            seen = x.abs().reshape(-1, x.size(-1)).amax(dim=0)  # (K,)
            maxima[name] = torch.maximum(maxima[name], seen) if name in maxima else seen
        return hook

    hooks = [m.register_forward_hook(record(n)) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    try:
        calibrate(model)
    finally:
        for h in hooks:
            h.remove()
    return maxima


def quantize_int8(model: nn.Module, calibrate: Callable[[nn.Module], object] | None = None) -> nn.Module:
    """Swap every nn.Linear of `model` (in place) for an Int8Linear, smoothed when `calibrate` is given,
    except those FLOAT_LAYERS keeps; a decoder with tied embeddings gets an int8 copy of its embedding
    matrix as its head (the lookup stays in float). Returns `model`."""
    maxima = activation_maxima(model, calibrate) if calibrate is not None else {}
    keep = FLOAT_LAYERS.get(type(model).__name__, ())

    def int8(full: str, child: nn.Module) -> Int8Linear | None:
        if not isinstance(child, nn.Linear) or full.endswith(keep):
            return None
        return Int8Linear(child.weight, child.bias, smoothing(child.weight, maxima[full]) if full in maxima else None)

    swap_linears(model, int8)
    tied = tied_embedding(model)
    if tied is not None:
        model.lm_head = Int8Linear(tied, None)  # type: ignore[assignment]
    return model


# Layers the weight-only block formats keep in float: a classifier's tiny heads (one row per text).
BLOCK_FLOAT_LAYERS: dict[str, tuple[str, ...]] = {"EncoderModel": ("head", "head_dense")}


def quantize_blocks(fmt: str, head_fmt: str) -> Callable[[nn.Module, Callable[[nn.Module], object] | None], nn.Module]:
    """A quantizer that swaps every nn.Linear whose input size is a multiple of 32 for a
    BlockLinear(fmt), the output head (an `lm_head`, or a tied embedding's copy: the lookup stays
    float) for a BlockLinear(head_fmt). The kernels quantize activations per group of 32 inputs, fine
    enough to need no calibration."""

    def run(model: nn.Module, calibrate: Callable[[nn.Module], object] | None = None) -> nn.Module:
        weight = next(model.parameters())
        if weight.dtype != torch.float32:  # blocks of bf16-rounded weights would not be the file's own
            raise ValueError(f"quantize: {fmt} is made from float32 weights; the model was cast to {weight.dtype} "
                             "first (on CPU set dtype: float32; elsewhere the loader quantizes before the cast)")
        if weight.device.type == "cuda":
            if fmt != "q4_1":
                raise ValueError(f"quantize: {fmt} has CPU kernels only; on CUDA use q4_1, int8 or a float dtype")
            return quantize_q4_1_tiles(model)
        if weight.device.type != "cpu":
            raise ValueError(f"quantize: {fmt} has CPU and (q4_1) CUDA kernels; not {weight.device.type}")
        if not native.available():
            raise ValueError(f"quantize: {fmt} runs on this project's CPU kernels, which are not available here "
                             "(they need AVX2 or AVX-512 and a C++ compiler; see the log for the reason)")
        keep = BLOCK_FLOAT_LAYERS.get(type(model).__name__, ())
        swap_linears(model, lambda full, child: BlockLinear(head_fmt if full == "lm_head" else fmt, child.weight,
                                                            child.bias)
                     if isinstance(child, nn.Linear) and not full.endswith(keep) and child.in_features % GROUP == 0
                     else None)
        tied = tied_embedding(model)
        if tied is not None and tied.size(1) % GROUP == 0:
            model.lm_head = BlockLinear(head_fmt, tied, None)  # type: ignore[assignment]
        return model

    return run


def _tiles_take(model: nn.Module) -> Callable[[str, nn.Module], bool]:
    """Which layers of `model` q4_1 puts on the int4 tile kernel (by qualified name and module)."""
    keep = BLOCK_FLOAT_LAYERS.get(type(model).__name__, ()) + ("lm_head",)
    return lambda full, child: isinstance(child, nn.Linear) and not full.endswith(keep) and child.in_features % GROUP == 0


def quantize_q4_1_tiles(model: nn.Module) -> nn.Module:
    """q4_1 on PyTorch's int4 tile kernel (models/projections/int4_tiles.py: CUDA; the tests run it on CPU): every
    nn.Linear whose input size is a multiple of 32 becomes a TiledInt4Linear, except the output head
    and the layers BLOCK_FLOAT_LAYERS keeps. The head stays in the model's float dtype: the tile kernel
    has no 8-bit form (a GGUF's Q8_0 head is served as its dequantized values)."""
    take = _tiles_take(model)
    swap_linears(model, lambda full, child: TiledInt4Linear.from_weight(child.weight, child.bias)
                 if take(full, child) else None)
    return model


def with_q4_1_values(model: nn.Module) -> nn.Module:
    """A float copy of `model` whose projections hold the values of the Q4_1 blocks that
    `quantize_q4_1_tiles` makes of them: the dense model the tiles stand for, to compare them with."""
    twin = copy.deepcopy(model)
    take = _tiles_take(twin)
    with torch.no_grad():
        for name, mod in twin.named_modules():
            if take(name, mod):
                mod.weight.copy_(dequantize("q4_1", *quantize_q4_1(mod.weight)))
    return twin


QUANTIZERS: dict[str, Callable[[nn.Module, Callable[[nn.Module], object] | None], nn.Module]] = {
    "int8": quantize_int8,
    # GGUF's formats; in q4_1 the output head is Q8_0, as in the shipped SmolLM2 file (and llama.cpp's
    # own Q4_1 conversions): the head's errors reach every logit directly
    "q8_0": quantize_blocks("q8_0", "q8_0"),
    "q4_1": quantize_blocks("q4_1", "q8_0"),
}
FUSE_SAFE = frozenset({"q8_0", "q4_1"})  # group-wise per output row: fusing changes no block


def keeps_fusion(mode: str | None, model: nn.Module) -> bool:
    """Whether `model`'s projections may be fused (models/projections/fuse.py) before quantizing in `mode`."""
    return mode is None or mode in FUSE_SAFE or type(model).__name__ not in UNFUSED_WHEN_QUANTIZED


def quantize(model: nn.Module, mode: str | None, calibrate: Callable[[nn.Module], object] | None = None) -> nn.Module:
    """`model` in quantization mode `mode` (None: unchanged)."""
    if mode is None:
        return model
    if mode not in QUANTIZERS:
        raise ValueError(f"unknown quantization {mode!r}; known: {sorted(QUANTIZERS)}")
    return QUANTIZERS[mode](model, calibrate)
