"""Position schemes: sinusoidal and learned (added to embeddings), rotary (applied in attention),
T5's bucketed relative bias (added to the attention scores).

Positions are always passed in explicitly as a (B, T) tensor, so rows of one batch may sit
at different positions (left padding, or cached rows at different decoding steps).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor, nn

from .config import RopeScaling


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
    """Rotary embeddings in the rotate-half layout used by Llama checkpoints in `transformers`, with
    the RoPE scalings `transformers` defines (config.RopeScaling).

    The frequencies are recomputed in float32 on the positions' device rather than stored as a
    buffer, so casting the model to bf16/fp16 cannot degrade them. Dynamic NTK scaling grows the base
    with each row's own length (its largest position + 1), so a row's rotation never depends on the
    other rows of its batch; keys already cached keep the rotation they were written with, as in
    `transformers`.
    """

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None = None) -> None:
        super().__init__()
        self.head_dim, self.theta, self.scaling = head_dim, theta, scaling
        self.attention_factor = _yarn_attention_factor(scaling) if scaling and scaling.type == "yarn" else 1.0

    def _inv_freq(self, positions: Tensor) -> Tensor:
        """(D/2,) or, for dynamic NTK, (B, 1, D/2) inverse frequencies in float32."""
        d = self.head_dim
        exponents = torch.arange(0, d, 2, dtype=torch.int64, device=positions.device).float() / d  # (D/2,)
        inv_freq = 1.0 / (self.theta ** exponents)  # (D/2,)
        if self.scaling is None:
            return inv_freq
        return SCALINGS[self.scaling.type](inv_freq, self.scaling, self.theta, positions)

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """positions (B, T) -> cos, sin (B, 1, T, D) in `dtype`."""
        angles = positions[..., None].float() * self._inv_freq(positions)  # (B, T, D/2)
        emb = torch.cat((angles, angles), dim=-1)  # (B, T, D)
        cos, sin = emb.cos(), emb.sin()  # (B, T, D) each
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos[:, None].to(dtype), sin[:, None].to(dtype)  # (B, 1, T, D) each


def _linear(inv_freq: Tensor, s: RopeScaling, base: float, positions: Tensor) -> Tensor:
    return inv_freq / s.factor  # (D/2,)


def _frequencies(inv_freq: Tensor, s: RopeScaling, base: float, positions: Tensor) -> Tensor:
    """llama.cpp's rope_freqs: one divisor per frequency."""
    factors = torch.tensor(s.freq_factors, dtype=torch.float32, device=inv_freq.device)  # (D/2,)
    return inv_freq / factors  # (D/2,)


def _dynamic(inv_freq: Tensor, s: RopeScaling, base: float, positions: Tensor) -> Tensor:
    """Dynamic NTK per row: base * ((factor * L / L0) - (factor - 1)) ** (D / (D - 2)), L = max(row length, L0)."""
    d = 2 * inv_freq.numel()
    exponents = torch.arange(0, d, 2, dtype=torch.float64, device=positions.device) / d  # (D/2,)
    original = s.original_max_positions
    length = (positions.amax(dim=-1, keepdim=True) + 1).clamp(min=original).double()  # (B, 1)
    grown = base * ((s.factor * length / original) - (s.factor - 1)) ** (d / (d - 2))  # (B, 1)
    return (1.0 / grown[..., None] ** exponents).float()  # (B, 1, D/2)


def _llama3(inv_freq: Tensor, s: RopeScaling, base: float = 0.0, positions: Tensor | None = None) -> Tensor:
    """Llama 3.1: low frequencies divided by factor, high ones kept, a smooth ramp in between."""
    old = s.original_max_positions
    low_wavelen, high_wavelen = old / s.low_freq_factor, old / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq  # (D/2,)
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)  # (D/2,)
    smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)  # (D/2,)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled  # (D/2,)
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)  # (D/2,)
    return torch.where(medium, smoothed, scaled)  # (D/2,)


def _yarn(inv_freq: Tensor, s: RopeScaling, base: float, positions: Tensor | None = None) -> Tensor:
    """YaRN: interpolated (/factor) below the ramp, extrapolated (as is) above it."""
    dim = 2 * inv_freq.numel()

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(s.original_max_positions / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    dims = torch.arange(dim // 2, dtype=torch.float32, device=inv_freq.device)  # (D/2,)
    ramp = ((dims - low) / (high - low)).clamp(0, 1)  # (D/2,)
    extrapolation = 1 - ramp  # (D/2,)
    return inv_freq / s.factor * (1 - extrapolation) + inv_freq * extrapolation  # (D/2,)


# RopeScaling.type -> (inverse frequencies (D/2,), scaling, base, positions (B, T)) -> scaled ones
SCALINGS: dict[str, Callable[[Tensor, RopeScaling, float, Tensor], Tensor]] = {
    "linear": _linear, "dynamic": _dynamic, "yarn": _yarn, "llama3": _llama3, "frequencies": _frequencies,
}


def _yarn_attention_factor(s: RopeScaling) -> float:
    """The cos/sin multiplier of YaRN: given, or 0.1 * ln(factor) + 1 (with mscale ratios when given)."""
    if s.attention_factor is not None:
        return float(s.attention_factor)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if s.mscale and s.mscale_all_dim:
        return float(mscale(s.factor, s.mscale) / mscale(s.factor, s.mscale_all_dim))
    return mscale(s.factor)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: (B, heads, T, D); cos/sin: (B, 1, T, D). Returns (B, heads, T, D)."""
    half = x.size(-1) // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # (B, heads, T, D)
    return x * cos + rotated * sin  # (B, heads, T, D)


def relative_bucket(relative: Tensor, bidirectional: bool, n_buckets: int, max_distance: int) -> Tensor:
    """T5's bucket of each relative position (key position - query position), exactly as `transformers`
    T5Attention._relative_position_bucket computes it: half of the buckets are exact distances, the
    other half grow logarithmically up to max_distance, and farther distances share the last bucket.
    Bidirectional (encoder): keys after the query get the upper half of the buckets; causal (decoder):
    keys after the query all fall in bucket 0 (the causal mask hides them). Any shape -> same shape, long.
    """
    bucket = torch.zeros_like(relative)  # (...)
    if bidirectional:
        n_buckets //= 2
        bucket = bucket + (relative > 0).long() * n_buckets  # (...): keys ahead of the query
        distance = relative.abs()  # (...)
    else:
        distance = (-relative).clamp(min=0)  # (...): only keys at or before the query count
    exact = n_buckets // 2
    # in float32, operation for operation as transformers, so the floor lands on the same bucket
    log_ratio = torch.log(distance.float() / exact) / math.log(max_distance / exact)  # (...)
    far = (exact + (log_ratio * (n_buckets - exact)).to(torch.long)).clamp(max=n_buckets - 1)  # (...)
    return bucket + torch.where(distance < exact, distance, far)  # (...)


class RelativePositionBias(nn.Module):
    """T5's learned relative position bias: one scalar per head and bucket of (key - query) position,
    added to the self-attention scores. A stack computes it once per forward pass from explicit query
    and key positions (so left padding and cached rows at different steps are exact) and shares it
    with all its layers (T5 stores the table in its first layer)."""

    def __init__(self, n_heads: int, n_buckets: int, max_distance: int, bidirectional: bool) -> None:
        super().__init__()
        self.n_buckets, self.max_distance, self.bidirectional = n_buckets, max_distance, bidirectional
        self.weight = nn.Parameter(torch.zeros(n_buckets, n_heads))  # (buckets, H)
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """q_pos: (B, T) query positions; k_pos: (S,) or (B, S) key positions. Returns the bias
        (B, H, T, S) in the table's dtype."""
        if k_pos.dim() == 1:
            k_pos = k_pos[None, :]  # (1, S)
        relative = k_pos[:, None, :] - q_pos[:, :, None]  # (B, T, S)
        buckets = relative_bucket(relative, self.bidirectional, self.n_buckets, self.max_distance)  # (B, T, S)
        return self.weight[buckets].permute(0, 3, 1, 2).contiguous()  # (B, H, T, S)
