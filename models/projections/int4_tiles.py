"""GGUF's Q4_1 blocks on PyTorch's int4 tile kernel (`torch.ops.aten._weight_int4pack_mm`): the 4-bit
path on CUDA, where our block kernels (panels.py) do not run.

Q4_1's codes q in 0..15 with a float16 scale d and minimum m per group of 32 inputs (w = d q + m)
serve as they are with scale = d and zero = m + 8 d (the kernel computes (q - 8) scale + zero). Scales,
zeros and activations are bfloat16, products accumulate in float32: the weights are the file's up to
bfloat16 rounding (relative 2^-9), and a row's result does not depend on the other rows. The CPU form
(`_weight_int4pack_mm_for_cpu`) is for tests only, which check the layout and the formula against
`panels.dequantize`; the CPU service uses `BlockLinear`.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .panels import GROUP, quantize_q4_1

ROWS = 16  # outputs per tile row: the CUDA kernel packs them by 8, the CPU one by 16; padded to 16 for both
TILE_K = 16  # inputs per inner k-tile


def inner_k_tiles(k: int) -> int:
    """The widest inner tiling (8, 4 or 2 k-tiles of 16 inputs) that divides `k` (a multiple of 32)."""
    return next(t for t in (8, 4, 2) if k % (t * TILE_K) == 0)


def pack_codes(q: Tensor, tiles: int) -> Tensor:
    """Codes (N, K) in 0..15 on their device -> the tile kernel's packed weight. CUDA packs two codes
    per byte first (input 2i in the high nibble, 2i + 1 in the low one); the CPU kernel takes int32."""
    if q.is_cuda:
        q = q.to(torch.int32)  # (N, K)
        pairs = ((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8)  # (N, K / 2)
        return torch.ops.aten._convert_weight_to_int4pack(pairs.contiguous(), tiles)
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), tiles)


def scales_and_zeros(d: Tensor, m: Tensor, dtype: torch.dtype) -> Tensor:
    """Q4_1's d and m (N, K / 32) -> the tile kernel's (K / 32, N, 2) scales and zeros in `dtype`:
    scale = d, zero = m + 8 d (computed in float32, rounded once)."""
    d32 = d.float()  # (N, G)
    return torch.stack([d32, m.float() + 8 * d32], dim=-1).transpose(0, 1).contiguous().to(dtype)  # (G, N, 2)


class TiledInt4Linear(nn.Module):
    """A Linear computed from Q4_1 blocks by the int4 tile kernel (see the module docstring): codes q
    (N, K) in 0..15, d and m (N, K / 32) float16, on the device it will run on. `from_weight` quantizes
    a float weight with llama.cpp's Q4_1 quantizer, so a GGUF's dequantized weights give back its blocks."""

    def __init__(self, q: Tensor, d: Tensor, m: Tensor, bias: Tensor | None = None) -> None:
        super().__init__()
        n, k = q.shape
        if k % GROUP:
            raise ValueError(f"q4_1 needs an input size that is a multiple of {GROUP}, got {k}")
        self.out_features, self.in_features = n, k
        pad = -n % ROWS  # outputs padded with zero weights (q = d = m = 0) to whole tiles, cut off after
        if pad:
            q, d, m = (torch.cat([t, t.new_zeros(pad, t.size(1))]) for t in (q, d, m))
        self.packed_for = q.device.type  # each device's kernel has its own layout
        self.register_buffer("packed", pack_codes(q, inner_k_tiles(k)))
        self.register_buffer("scales_zeros", scales_and_zeros(d, m, self.compute_dtype))  # (K / 32, N', 2)
        self.register_buffer("bias", None if bias is None else bias.detach().float())  # (N,)

    @classmethod
    def from_weight(cls, weight: Tensor, bias: Tensor | None) -> TiledInt4Linear:
        return cls(*quantize_q4_1(weight), bias)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The CUDA kernel takes bfloat16 activations and scales; the CPU one computes in float32."""
        return torch.bfloat16 if self.packed_for == "cuda" else torch.float32

    def forward(self, x: Tensor) -> Tensor:
        """x: (..., K) -> (..., N) in x's dtype."""
        if x.device.type != self.packed_for or self.packed.device.type != self.packed_for:
            raise ValueError(f"{type(self).__name__} was packed for {self.packed_for} (each device has its own "
                             "layout): quantize on the device it runs on")
        flat = x.reshape(-1, self.in_features).to(self.compute_dtype).contiguous()  # (M, K)
        # a model cast after quantizing (`.to(dtype)`) casts these too: the kernel reads one dtype
        sz = self.scales_zeros if self.scales_zeros.dtype == self.compute_dtype else self.scales_zeros.to(
            self.compute_dtype)
        if flat.is_cuda:
            y = torch.ops.aten._weight_int4pack_mm(flat, self.packed, GROUP, sz)  # (M, N')
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, GROUP, sz)  # (M, N')
        y = y[:, : self.out_features].to(x.dtype)  # (M, N)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"q4_1 tiles, in_features={self.in_features}, out_features={self.out_features}"

