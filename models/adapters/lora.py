"""Low-rank adapters beside a projection, chosen per row: `LoraLinear` and `project`.

    R rows (B batch rows, or B*T tokens), I inputs, O outputs, N adapter slots, P parts, r the slots'
    rank per part

A LoraLinear holds a serving projection (any format: float, blocks, panels) unchanged and, for each
of N slots, one adapter's factors: y = base(x) + (x A_s^T) Bt_s for the row's slot s, nothing for a
row without one (slot -1). The factors are never merged into the base weights, so rows of different
adapters and of the bare base share a batch. A fused projection (q/k/v, gate/up) has P parts, one per
output range, each with its own r ranks of the slot: part p's ranks write only its outputs.

Storage, updated in place by models/adapters/resident.py (the native step reads the same tensors): `a`
(N, P*r, I), `bt` (N, P*r, O) with the adapter's scale folded in, a slot's unused ranks zeros, in
float32, bfloat16 or int8 (`dtype`: a half or a quarter of the bytes a step reads; widened exactly, the
products in float32); int8 factors are rounded per rank row (each row of `a` and of `bt` over its
absolute maximum / 127) and `scales` (N, P*r) float32 holds each rank's two row scales multiplied, applied
to its first product (empty for float factors). `ranks` (N, P) int64 the ranks each part uses.
`forward(x, slots)` is pure (our kernel adds the updates to the base's own new output in place): slots
(B,) int64 names each row's adapter.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class LoraLinear(nn.Module):
    """`base` plus the low-rank update of each row's adapter slot. `bounds` (P + 1,): the parts' output
    ranges (0 ... O); `capacity` slots of `rank` ranks a part."""

    def __init__(self, base: nn.Module, bounds: tuple[int, ...], capacity: int, rank: int,
                 shared: LoraLinear | None = None, dtype: torch.dtype = torch.float32, kernel: bool = False) -> None:
        super().__init__()
        self.base = base
        self.bounds = tuple(bounds)
        self.in_features, self.out_features = _features(base)
        if self.bounds[0] != 0 or self.bounds[-1] != self.out_features or list(self.bounds) != sorted(self.bounds):
            raise ValueError(f"part bounds {self.bounds} do not cover the {self.out_features} outputs")
        self.capacity, self.rank = capacity, rank
        self.kernel = kernel  # the updates through our CPU kernel (models/kernels/lora.cpp), else torch's bmm
        parts = len(self.bounds) - 1
        if dtype not in (torch.float32, torch.bfloat16, torch.int8):
            raise ValueError(f"adapter factors are float32, bfloat16 or int8, not {dtype}")
        if shared is not None:  # a twin of the same model (other weights, same adapters): one storage
            if (shared.bounds, shared.capacity, shared.rank, shared.a.dtype) != (self.bounds, capacity, rank, dtype):
                raise ValueError("a shared LoraLinear must have the same parts, slots, rank and dtype")
            a, bt, ranks, scales = shared.a, shared.bt, shared.ranks, shared.scales
        else:
            a = torch.zeros(capacity, parts * rank, self.in_features, dtype=dtype)  # (N, P r, I)
            bt = torch.zeros(capacity, parts * rank, self.out_features, dtype=dtype)  # (N, P r, O)
            ranks = torch.zeros(capacity, parts, dtype=torch.long)  # (N, P): each part's ranks in use
            scales = torch.zeros(capacity, parts * rank) if dtype == torch.int8 else torch.zeros(0)  # (N, P r)
        self.register_buffer("a", a, persistent=False)
        self.register_buffer("bt", bt, persistent=False)
        self.register_buffer("ranks", ranks, persistent=False)
        self.register_buffer("scales", scales, persistent=False)

    @property
    def parts(self) -> int:
        return len(self.bounds) - 1

    @property
    def quantized(self) -> bool:
        """int8 factors with per-rank scales."""
        return self.a.dtype == torch.int8

    @torch.no_grad()
    def clear(self, slot: int) -> None:
        """Slot `slot` adds nothing."""
        self.a[slot].zero_()
        self.bt[slot].zero_()
        self.ranks[slot].zero_()
        if self.quantized:
            self.scales[slot].zero_()

    @torch.no_grad()
    def put(self, slot: int, part: int, a: Tensor, b: Tensor, scale: float) -> None:
        """Part `part` of slot `slot` becomes a (r', I) and b (O_part, r') times `scale` (r' <= rank)."""
        r = a.size(0)
        o0, o1 = self.bounds[part], self.bounds[part + 1]
        if r > self.rank or a.shape != (r, self.in_features) or b.shape != (o1 - o0, r):
            raise ValueError(f"factors {tuple(a.shape)} and {tuple(b.shape)} do not fit a rank-{self.rank} part of "
                             f"{self.in_features} inputs and {o1 - o0} outputs")
        lo = part * self.rank
        a, bt = a.float(), (b.float() * scale).t()  # (r, I), (r, O_part)
        if self.quantized:
            (a, sa), (bt, sb) = _rows_to_int8(a), _rows_to_int8(bt)
            self.scales[slot, lo:lo + r] = sa * sb
        self.a[slot, lo:lo + r] = a  # rounded to the storage's dtype
        self.bt[slot, lo:lo + r, o0:o1] = bt
        self.ranks[slot, part] = r

    def delta(self, x: Tensor, slots: Tensor) -> Tensor:
        """x (B, T, I) or (B, I), slots (B,) -> the rows' low-rank updates, x's shape with O features."""
        flat = x.dim() == 2
        xs = x.unsqueeze(1) if flat else x  # (B, T, I)
        use = slots >= 0  # (B,)
        index = slots.clamp(min=0)  # (B,)
        t = torch.bmm(xs.float(), self.a[index].float().transpose(1, 2))  # (B, T, P r)
        if self.quantized:
            t = t * self.scales[index].unsqueeze(1)  # (B, 1, P r): each rank's scales
        t = t * use.view(-1, 1, 1)  # rows of the base: nothing
        d = torch.bmm(t, self.bt[index].float()).to(x.dtype)  # (B, T, O)
        return d.squeeze(1) if flat else d

    def forward(self, x: Tensor, slots: Tensor | None = None) -> Tensor:
        """x (B, T, I) or (B, I) -> (..., O); slots (B,) int64 each row's adapter (-1: none), None: every
        row none."""
        y = self.base(x)
        if slots is None:
            return y
        if not self.kernel:
            return y + self.delta(x, slots)
        per_token = slots.repeat_interleave(x.size(1)) if x.dim() == 3 else slots  # (B T,) or (B,)
        args = (self.a, self.bt, self.ranks, list(self.bounds), self.rank, per_token,
                self.scales if self.quantized else None)
        rows = x.reshape(-1, self.in_features).float().contiguous()  # (M, I)
        out = y.reshape(-1, self.out_features).float().contiguous()  # (M, O): y itself when float32 (no copy)
        torch.ops.ts_panels.lora_update_(rows, out, *args)  # the base's own new output, updated in place
        return out.view(y.shape).to(y.dtype)


def project(m: nn.Module, x: Tensor, slots: Tensor | None) -> Tensor:
    """m(x), with each row's adapter when m carries adapters and `slots` says which."""
    if slots is not None and isinstance(m, LoraLinear):
        return m(x, slots)
    return m(x)


def _rows_to_int8(w: Tensor) -> tuple[Tensor, Tensor]:
    """w (r, n) float32 -> (its rows rounded to int8 over absmax / 127, (r,) the scales); a row of zeros
    keeps scale 0."""
    scale = w.abs().amax(dim=1) / 127.0  # (r,)
    q = torch.where(scale[:, None] > 0, w / scale.clamp(min=torch.finfo(torch.float32).tiny)[:, None], 0.0)
    return q.round().clamp(-127, 127).to(torch.int8), scale


def _features(m: nn.Module) -> tuple[int, int]:
    """(in, out) features of a projection in any of our formats."""
    try:
        return int(m.in_features), int(m.out_features)
    except AttributeError as e:
        raise TypeError(f"{type(m).__name__} is not a projection with in_features and out_features") from e
