"""Position schemes: sinusoidal and learned (added to embeddings), rotary (applied in attention).

Positions are always passed in explicitly as a (B, T) tensor, so rows of one batch may sit
at different positions (left padding, or cached rows at different decoding steps).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


def sinusoidal_table(n_positions: int, dim: int) -> Tensor:
    """(n_positions, dim) table: sines in the first half, cosines in the second (Marian's layout)."""
    pos = torch.arange(n_positions, dtype=torch.float64)[:, None]  # (P, 1)
    freq = torch.exp(-math.log(10000.0) * torch.arange(0, dim, 2, dtype=torch.float64) / dim)  # (ceil(dim/2),)
    angles = pos * freq[None, :]  # (P, ceil(dim/2))
    table = torch.zeros(n_positions, dim, dtype=torch.float64)  # (P, dim)
    half = dim // 2 + dim % 2
    table[:, :half] = torch.sin(angles)
    table[:, half:] = torch.cos(angles[:, : dim // 2])
    return table.float()


class SinusoidalPositions(nn.Module):
    """Fixed table, stored as a non-persistent buffer (not part of checkpoints)."""

    def __init__(self, n_positions: int, dim: int) -> None:
        super().__init__()
        self.register_buffer("table", sinusoidal_table(n_positions, dim), persistent=False)

    def forward(self, positions: Tensor) -> Tensor:
        return self.table[positions]  # (B, T, C)


class LearnedPositions(nn.Module):
    def __init__(self, n_positions: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n_positions, dim))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, positions: Tensor) -> Tensor:
        return self.weight[positions]  # (B, T, C)


class RotaryPositions(nn.Module):
    """Rotary embeddings in the rotate-half layout used by Llama checkpoints in `transformers`.

    The frequencies are recomputed in float32 on the positions' device rather than stored as a
    buffer, so casting the model to bf16/fp16 cannot degrade them.
    """

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.head_dim, self.theta = head_dim, theta

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """positions (B, T) -> cos, sin (B, 1, T, D) in `dtype`."""
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=positions.device)
        inv_freq = 1.0 / (self.theta ** (exponents / self.head_dim))  # (D/2,)
        angles = positions[..., None].float() * inv_freq  # (B, T, D/2)
        emb = torch.cat((angles, angles), dim=-1)  # (B, T, D)
        return emb.cos()[:, None].to(dtype), emb.sin()[:, None].to(dtype)  # (B, 1, T, D) each


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: (B, heads, T, D); cos/sin: (B, 1, T, D). Returns (B, heads, T, D)."""
    half = x.size(-1) // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # (B, heads, T, D)
    return x * cos + rotated * sin  # (B, heads, T, D)
