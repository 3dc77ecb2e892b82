"""Projections through our own CPU kernels (models/kernels/panels.cpp), weights packed once in panels.

Three weight formats, all with float32 activations:
- `PanelLinear`: float32 weights. At one row it streams the weights at ~2x the rate of oneDNN's
  packed path on the AMD EPYC this was measured on (docs/benchmarks.md); `dense_kernel: auto` times
  it against MKL and oneDNN at load (models/dense.py) and keeps the fastest per weight shape.
- `BlockLinear("q4_1")`: GGUF's Q4_1, 4-bit codes with a float16 scale and minimum per group of 32
  inputs: w = q * d + m. `BlockLinear("q8_0")`: GGUF's Q8_0, 8-bit codes with a float16 scale per
  group of 32: w = q * d. The quantizers below are llama.cpp's reference ones, so re-quantizing a
  GGUF's dequantized Q4_1 / Q8_0 weights gives back the file's own blocks (tests check this on the
  shipped SmolLM2), and serving `quantize: q4_1` from that file computes with exactly its weights.

Each output is summed over the inputs in one fixed order whatever the number of rows, so results
are bitwise the same alone and in a batch; against F.linear on the same (dequantized) weights they
differ in summation order only (~1e-6 relative).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .projections import RepackedLinear

PANEL = 32  # outputs per panel (the kernels' NR)
GROUP = 32  # inputs per quantization group (Q4_1 and Q8_0)
BLOCK_FORMATS = ("q4_1", "q8_0")


def _panels(t: Tensor) -> Tensor:
    """(N, X) -> (P, X, 32): outputs padded with zeros to whole panels, each panel input-major."""
    n, x = t.shape
    p = -(-n // PANEL)
    padded = torch.cat([t, t.new_zeros(p * PANEL - n, x)]) if p * PANEL != n else t
    return padded.view(p, PANEL, x).transpose(1, 2).contiguous()  # (P, X, 32)


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

    def forward(self, x: Tensor) -> Tensor:
        """x: (..., K) -> (..., N) in x's dtype."""
        y = torch.ops.ts_panels.linear_f32(_flat(x), self.panels, self.bias, self.out_features)  # (M, N)
        return y.view(*x.shape[:-1], self.out_features).to(x.dtype)

    @property
    def weight(self) -> Tensor:
        """The dense (N, K) weight (a copy)."""
        return self.panels.transpose(1, 2).reshape(-1, self.in_features)[: self.out_features].clone()


class BlockLinear(nn.Module):
    """A Linear with GGUF-style block-quantized weights (`fmt` in BLOCK_FORMATS) and float32
    activations; see the module docstring. `weight` (N, K), K a multiple of 32, is quantized here."""

    def __init__(self, fmt: str, weight: Tensor, bias: Tensor | None) -> None:
        super().__init__()
        if fmt not in BLOCK_FORMATS:
            raise ValueError(f"unknown block format {fmt!r}; known: {list(BLOCK_FORMATS)}")
        self.out_features, self.in_features = weight.shape
        if self.in_features % GROUP:
            raise ValueError(f"{fmt} needs an input size that is a multiple of {GROUP}, got {self.in_features}")
        self.fmt = fmt
        if fmt == "q4_1":
            q, d, m = quantize_q4_1(weight)
            codes = _panels(q)  # (P, K, 32) in 0..15
            self.register_buffer("codes", codes[..., :16] | (codes[..., 16:] << 4))  # (P, K, 16)
            self.register_buffer("mins", _panels(m))  # (P, K / 32, 32) float16
        else:
            q, d = quantize_q8_0(weight)
            self.register_buffer("codes", _panels(q))  # (P, K, 32) int8
            self.mins = None
        self.register_buffer("scales", _panels(d))  # (P, K / 32, 32) float16
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())  # (N,)

    def forward(self, x: Tensor) -> Tensor:
        """x: (..., K) -> (..., N) in x's dtype."""
        flat = _flat(x)  # (M, K)
        if self.fmt == "q4_1":
            y = torch.ops.ts_panels.linear_q4_1(flat, self.codes, self.scales, self.mins, self.bias,
                                                self.out_features)  # (M, N)
        else:
            y = torch.ops.ts_panels.linear_q8_0(flat, self.codes, self.scales, self.bias, self.out_features)
        return y.view(*x.shape[:-1], self.out_features).to(x.dtype)

    def blocks(self) -> tuple[Tensor, Tensor, Tensor | None]:
        """The (N, K) codes and the (N, K / 32) scales (and minima) back out of the panels."""
        n = self.out_features

        def unpanel(t: Tensor) -> Tensor:
            return t.transpose(1, 2).reshape(-1, t.size(1))[:n]

        if self.fmt == "q4_1":
            codes = torch.cat([self.codes & 0xF, self.codes >> 4], dim=-1)  # (P, K, 32)
            return unpanel(codes), unpanel(self.scales), unpanel(self.mins)
        return unpanel(self.codes), unpanel(self.scales), None

    @property
    def weight(self) -> Tensor:
        """The dequantized (N, K) float32 weight."""
        return dequantize(self.fmt, *self.blocks())

    def extra_repr(self) -> str:
        return f"{self.fmt}, in_features={self.in_features}, out_features={self.out_features}"
