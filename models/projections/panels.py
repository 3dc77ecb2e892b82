"""Projections through our CPU kernels (models/kernels/panels.cpp), weights packed once in panels of 32
outputs: x (..., K) -> (..., N) in x's dtype, float32 inside.

- `PanelLinear`: float32 weights and activations (`dense_kernel` picks it per shape: dense.py).
- `Bf16PanelLinear`: weights and activations rounded to bfloat16, products summed in float32 (CPUs
  with AVX512-BF16).
- `BlockLinear`: GGUF's Q8_0 (8-bit codes, a float16 scale d per group of 32 inputs: w = q d) or Q4_1
  (4-bit codes, d and a minimum m: w = q d + m); activations quantized per row and group of 32 in two
  8-bit parts (`quantize_activations`; one part, `activation_bits=8`, flips close calls), products
  summed exactly in int32; `reference` is the same arithmetic in float64. The quantizers round as
  llama.cpp's reference ones and dequantized blocks quantize back to themselves (test_panels.py checks
  the round trip on random weights), so a GGUF's Q4_1 / Q8_0 blocks serve as they are in the file.
A row's result is bitwise the same alone and in any batch (fixed summation order, per-row activations).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .base import RepackedLinear

PANEL = 32  # outputs per panel (the kernels' NR)
GROUP = 32  # inputs per quantization group (Q4_1 and Q8_0)
BLOCK_FORMATS = ("q4_1", "q8_0")
ACTIVATION_BITS = (16, 8)  # the block formats' activations: two 8-bit parts per group (default), or one


def _panels(t: Tensor) -> Tensor:
    """(N, X) -> (P, X, 32): outputs padded with zeros to whole panels, each panel input-major."""
    n, x = t.shape
    p = -(-n // PANEL)
    padded = torch.cat([t, t.new_zeros(p * PANEL - n, x)]) if p * PANEL != n else t
    return padded.view(p, PANEL, x).transpose(1, 2).contiguous()  # (P, X, 32)


STEP = 4  # inputs per step of an 8-bit dot product


def _records(fmt: str, q: Tensor, d: Tensor, m: Tensor | None) -> Tensor:
    """Codes (N, K), d and m (N, K / 32) float16 -> (P, K / 32, record) uint8, the block kernels'
    order: per panel and group of 32 inputs, 8 steps of 4 inputs (byte 4 j + i of a step: input i of
    output j), then the group's 32 scales (and minima), so that a pass reads one stream. Q8_0 codes
    are stored + 128 (unsigned), outputs 0-15 then 16-31 per step; Q4_1 packs output j in the low
    nibble and output 16 + j in the high one."""
    codes = _panels(q.to(torch.int16) + 128 if fmt == "q8_0" else q).to(torch.uint8)  # (P, K, 32)
    p, k, _ = codes.shape
    g = k // GROUP
    steps = codes.reshape(p, g, GROUP // STEP, STEP, 2, 16)  # (P, G, step, input, half, output)
    if fmt == "q4_1":
        steps = steps[..., 0, :] | (steps[..., 1, :] << 4)  # (P, G, step, input, output)
        steps = steps.transpose(-1, -2)  # (P, G, step, output, input)
    else:
        steps = steps.permute(0, 1, 2, 4, 5, 3)  # (P, G, step, half, output, input)
    scales = [_panels(d)] + ([_panels(m)] if fmt == "q4_1" else [])  # (P, G, 32) float16 each
    tail = torch.stack(scales, dim=2).reshape(p, g, -1).contiguous().view(torch.uint8)  # (P, G, 64 or 128)
    return torch.cat([steps.reshape(p, g, -1), tail], dim=-1).contiguous()


def _unrecord(fmt: str, rec: Tensor, n: int) -> tuple[Tensor, Tensor, Tensor | None]:
    """_records undone: (N, K) codes, (N, K / 32) scales and minima (None for q8_0)."""
    p, g, size = rec.shape
    code_bytes = GROUP * PANEL // (2 if fmt == "q4_1" else 1)
    steps, tail = rec.split([code_bytes, size - code_bytes], dim=-1)
    if fmt == "q4_1":
        packed = steps.reshape(p, g, GROUP // STEP, 16, STEP).transpose(-1, -2)  # (P, G, step, input, output)
        codes = torch.stack([packed & 0xF, packed >> 4], dim=-2)  # (P, G, step, input, half, output)
    else:
        codes = steps.reshape(p, g, GROUP // STEP, 2, 16, STEP).permute(0, 1, 2, 5, 3, 4)
    codes = codes.reshape(p, g * GROUP, PANEL)  # (P, K, 32)
    if fmt == "q8_0":
        codes = (codes.to(torch.int16) - 128).to(torch.int8)
    scales = tail.contiguous().view(torch.float16).reshape(p, g, -1, PANEL)  # (P, G, 1 or 2, 32)

    def unpanel(t: Tensor) -> Tensor:
        return t.transpose(1, 2).reshape(-1, t.size(1))[:n]

    return unpanel(codes), unpanel(scales[:, :, 0]), unpanel(scales[:, :, 1]) if fmt == "q4_1" else None


def _flat(x: Tensor) -> Tensor:
    return x.reshape(-1, x.size(-1)).float().contiguous()  # (M, K)


def quantize_q4_1(w: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(N, K) float -> codes (N, K) uint8 in 0..15, d and m (N, K / 32) float16: llama.cpp's
    quantize_row_q4_1_ref (d = (max - min) / 15, q = int((w - min) / d + 0.5) capped at 15)."""
    n, k = w.shape
    g = w.detach().float().reshape(n, k // GROUP, GROUP)  # (N, G, 32)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)  # (N, G)
    d = (hi - lo) / 15
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))  # (N, G)
    q = ((g - lo[..., None]) * inv[..., None] + 0.5).floor_().clamp_(0, 15).to(torch.uint8)  # (N, G, 32)
    return q.reshape(n, k), d.half(), lo.half()


def quantize_q8_0(w: Tensor) -> tuple[Tensor, Tensor]:
    """(N, K) float -> codes (N, K) int8, d (N, K / 32) float16: llama.cpp's quantize_row_q8_0_ref
    (d = max|w| / 127, q = round(w / d), halves away from zero)."""
    n, k = w.shape
    g = w.detach().float().reshape(n, k // GROUP, GROUP)  # (N, G, 32)
    d = g.abs().amax(dim=-1) / 127  # (N, G)
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    s = g * inv[..., None]
    q = (s.sign() * (s.abs() + 0.5).floor()).clamp_(-127, 127).to(torch.int8)  # (N, G, 32)
    return q.reshape(n, k), d.half()


def _part(g: Tensor) -> tuple[Tensor, Tensor]:
    """(M, G, 32) float32 -> codes round(g / d), halves to even, and d = max|g| / 127 per group (M, G)."""
    d = g.abs().amax(dim=-1) / 127  # (M, G)
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    return torch.round(g * inv[..., None]), d  # (M, G, 32), (M, G)


def quantize_activations(x: Tensor) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    """Activations (M, K) float32 -> their two 8-bit parts per row and group of 32, as the block
    kernels make them: ((q, dx), (r, dr)), codes (M, K) int8 and steps (M, K / 32) float32, with
    x = dx q + dr r + a remainder below dr / 2. q is llama.cpp's Q8_1 / Q8_0 of x (float32 step);
    r the same of x - dx q (computed with one rounding, as the kernels' fused multiply-add)."""
    m, k = x.shape
    g = x.float().reshape(m, k // GROUP, GROUP)  # (M, G, 32)
    q, dx = _part(g)
    rest = (g.double() - q.double() * dx.double()[..., None]).float()  # (M, G, 32): one rounding
    r, dr = _part(rest)
    return ((q.to(torch.int8).reshape(m, k), dx), (r.to(torch.int8).reshape(m, k), dr))


def reference(fmt: str, x: Tensor, q: Tensor, d: Tensor, m: Tensor | None = None, activation_bits: int = 16) -> Tensor:
    """What the `fmt` kernel computes, in float64: x (M, K) against the (N, K) codes and (N, K / 32)
    scales (and minima) -> (M, N), each group adding d sum(w x8) (+ m sum(x8)) for x8 = dx q + dr r
    (or dx q alone at 8 activation bits)."""
    n, k = q.shape
    w = q.double().reshape(n, k // GROUP, GROUP)  # (N, G, 32)
    y = torch.zeros(x.size(0), n, dtype=torch.float64)
    for codes, step in quantize_activations(x)[: activation_bits // 8]:
        c = codes.double().reshape(-1, k // GROUP, GROUP)  # (M, G, 32)
        dots = torch.einsum("mgi,ngi->mng", c, w)  # (M, N, G): exact integers
        y = y + (dots * d.double()[None] * step.double()[:, None]).sum(-1)
        if fmt == "q4_1":
            y = y + (m.double()[None] * (step.double() * c.sum(-1))[:, None]).sum(-1)
    return y


def dequantize(fmt: str, q: Tensor, d: Tensor, m: Tensor | None = None) -> Tensor:
    """Codes and scales as above -> the (N, K) float32 weights they stand for."""
    n, k = q.shape
    w = q.float().reshape(n, k // GROUP, GROUP) * d.float()[..., None]  # (N, G, 32)
    if fmt == "q4_1":
        w = w + m.float()[..., None]
    return w.reshape(n, k)


class PanelLinear(RepackedLinear):
    """nn.Linear with float32 weights in panels (CPU); see RepackedLinear."""

    def __init__(self, weight: Tensor, bias: Tensor | None, copy: bool = False) -> None:
        super().__init__(weight, bias, copy)
        self.register_buffer("panels", _panels(weight.detach().float()), persistent=False)  # (P, K, 32)

    def forward(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
        """x: (..., K) -> (..., N) in x's dtype. `bias` (N,) float32, for a layer without its own (a
        model that adds one after its head, as Marian's final_logits_bias): added by the kernel as each
        output is stored, the same float addition as adding it after, without a pass over the outputs."""
        if bias is not None and self.bias is not None:
            raise ValueError("this layer has its own bias")
        y = torch.ops.ts_panels.linear_f32(_flat(x), self.panels, self.bias if bias is None else bias,
                                           self.out_features)  # (M, N)
        return y.view(*x.shape[:-1], self.out_features).to(x.dtype)

    @property
    def weight(self) -> Tensor:
        """The dense (N, K) weight (a copy)."""
        return self.panels.transpose(1, 2).reshape(-1, self.in_features)[: self.out_features].clone()


class Bf16PanelLinear(RepackedLinear):
    """nn.Linear with its weights rounded to bfloat16 (nearest even), in panels of input pairs, on the
    CPU's bfloat16 dot products (AVX512-BF16: `native.has_bf16()`); see RepackedLinear. x is rounded to
    bfloat16 the same way and each output sums its pairs' products in float32, in order of k, so a
    row's result is the same alone and in any batch. Half the bytes of PanelLinear, twice its products
    per instruction; the loss is bfloat16's (8 significant bits per weight and activation)."""

    def __init__(self, weight: Tensor, bias: Tensor | None, copy: bool = False) -> None:
        super().__init__(weight, bias, copy)
        if self.in_features % 2:
            raise ValueError(f"bfloat16 panels need an even input size, got {self.in_features}")
        pairs = weight.detach().to(torch.bfloat16).contiguous().view(torch.int32)  # (N, K / 2)
        self.register_buffer("panels", _panels(pairs), persistent=False)  # (P, K / 2, 32) int32

    def forward(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
        """x: (..., K) -> (..., N) in x's dtype; `bias` as PanelLinear's."""
        if bias is not None and self.bias is not None:
            raise ValueError("this layer has its own bias")
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()  # (M, K)
        y = torch.ops.ts_panels.linear_bf16(rows, self.panels, self.bias if bias is None else bias,
                                            self.out_features)  # (M, N) float32
        return y.view(*x.shape[:-1], self.out_features).to(x.dtype)

    @property
    def weight(self) -> Tensor:
        """The dense (N, K) weight as the kernel multiplies it (bfloat16 values, a float32 copy)."""
        pairs = self.panels.transpose(1, 2).reshape(-1, self.in_features // 2)[: self.out_features]  # (N, K / 2)
        return pairs.contiguous().view(torch.bfloat16).float()


class BlockLinear(nn.Module):
    """A Linear with GGUF-style block-quantized weights (`fmt` in BLOCK_FORMATS); see the module
    docstring. `weight` (N, K), K a multiple of 32, is quantized here."""

    def __init__(self, fmt: str, weight: Tensor, bias: Tensor | None, activation_bits: int = 16) -> None:
        super().__init__()
        if fmt not in BLOCK_FORMATS:
            raise ValueError(f"unknown block format {fmt!r}; known: {list(BLOCK_FORMATS)}")
        self.out_features, self.in_features = weight.shape
        if self.in_features % GROUP:
            raise ValueError(f"{fmt} needs an input size that is a multiple of {GROUP}, got {self.in_features}")
        self.fmt, self.activation_bits = fmt, _checked_bits(activation_bits)
        blocks = quantize_q4_1(weight) if fmt == "q4_1" else (*quantize_q8_0(weight), None)
        self.register_buffer("records", _records(fmt, *blocks))  # (P, K / 32, 640 or 1088) uint8
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())  # (N,)
        self._op = getattr(torch.ops.ts_panels, f"linear_{fmt}")

    def _apply(self, fn, recurse: bool = True):  # noqa: ANN001, ANN202 - nn.Module's
        """A cast of the model (`.to(bfloat16)`) leaves the bias float32: the kernel adds it in float32."""
        out = super()._apply(fn, recurse)
        if self.bias is not None and self.bias.dtype != torch.float32:
            self.bias = self.bias.float()
        return out

    def forward(self, x: Tensor) -> Tensor:
        """x: (..., K) -> (..., N) in x's dtype."""
        y = self._op(_flat(x), self.records, self.bias, self.out_features, self.activation_bits // 8)  # (M, N)
        return y.view(*x.shape[:-1], self.out_features).to(x.dtype)

    def blocks(self) -> tuple[Tensor, Tensor, Tensor | None]:
        """The (N, K) codes and the (N, K / 32) scales (and minima) back out of the records."""
        return _unrecord(self.fmt, self.records, self.out_features)

    @property
    def weight(self) -> Tensor:
        """The dequantized (N, K) float32 weight."""
        return dequantize(self.fmt, *self.blocks())

    def extra_repr(self) -> str:
        return (f"{self.fmt}, in_features={self.in_features}, out_features={self.out_features}, "
                f"activation_bits={self.activation_bits}")


def set_activation_bits(model: nn.Module, bits: int) -> None:
    """Every BlockLinear of `model` quantizes its activations to `bits` (16: two 8-bit parts; 8: one)."""
    bits = _checked_bits(bits)
    for m in model.modules():
        if isinstance(m, BlockLinear):
            m.activation_bits = bits


def _checked_bits(bits: int) -> int:
    if bits not in ACTIVATION_BITS:
        raise ValueError(f"activation_bits must be one of {ACTIVATION_BITS}, got {bits}")
    return bits
