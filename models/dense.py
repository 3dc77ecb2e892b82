"""Float projections through oneDNN with prepacked weights, chosen per weight shape by measurement.

`torch.nn.functional.linear` on CPU calls MKL's sgemm. On the AMD EPYC this project was measured on
(AVX-512, 2 threads), MKL runs SmolLM2's 30 layers of projections plus its head at 10 GB/s at one row
and 6-9 GB/s at 2-32 rows, while oneDNN with the weight reordered once into its blocked layout
(`torch.ops.mkldnn._reorder_linear_weight`, the path inductor's freezing uses) reaches 17-21 GB/s: a
1.8-2.8x faster decode step at the same fp32 precision. Which library wins depends on the CPU (MKL
is at its best on Intel), so `pack_dense(model, "auto")` times both at load on every projection, in
sweeps over the model's layers in order (so the caches hold what a forward pass leaves in them), and
packs the weight shapes oneDNN runs faster; "onednn" packs every float layer, "aten" leaves the
model as it is. Only float32 weights on the CPU are packed (bf16 and CUDA keep F.linear).

Results: the same fp32 arithmetic in another summation order, so logits differ from F.linear's in the
last bits (~1e-6 relative); neither library gives a row bitwise the same result at every batch size.
A tied output head (the embedding matrix, lm_head None) gets a packed copy as its head, the lookup
keeps the dense table: one extra head-sized matrix of memory (SmolLM2: 113 MB).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .projections import tied_embedding
from .spec import DenseKernel

log = logging.getLogger("models.dense")

PACK_ROWS = 32  # oneDNN's batch-size hint when reordering; the result does not depend on it
PROBE_ROWS = (1, 8, 32)  # rows the choice is measured at: a decode step alone, a few rows, a batch
PROBE_SWEEPS = 3


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class PackedLinear(nn.Module):
    """nn.Linear with its weight held in oneDNN's blocked layout (CPU, float32). state_dict() gives
    the dense `weight` back, so exporters and checkpoints see an ordinary Linear; a `copy` (a tied
    head's packed copy of the embedding matrix) adds nothing to the state_dict."""

    def __init__(self, weight: Tensor, bias: Tensor | None, copy: bool = False) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.copy = copy
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().float().contiguous(), PACK_ROWS)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        """x: (..., K) -> (..., N)."""
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")  # (..., N)

    @property
    def weight(self) -> Tensor:
        """The dense (N, K) weight (a copy)."""
        return self.packed.to_dense()

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:  # noqa: ANN001
        if self.copy:
            return
        destination[prefix + "weight"] = self.weight
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


Shape = tuple[int, int]  # (N, K)


@dataclass(frozen=True)
class Slot:
    """A float projection of the model: where it lives, its weights, and whether it is a tied copy."""

    parent: nn.Module
    name: str
    weight: Tensor  # (N, K)
    bias: Tensor | None
    copy: bool = False

    @property
    def shape(self) -> Shape:
        return tuple(self.weight.shape)  # type: ignore[return-value]


def measure(slots: list[Slot], packed: list[PackedLinear]) -> dict[Shape, tuple[float, float]]:
    """(aten seconds, oneDNN seconds) per weight shape, from sweeps over all the model's projections in
    model order at PROBE_ROWS rows: each layer is timed where the model would run it, after the
    others, so the caches hold what they would hold in a forward pass (a decoder's weights stream
    from memory; a small translator's stay in cache, except what its output head evicts)."""
    totals: dict[Shape, list[float]] = {slot.shape: [0.0, 0.0] for slot in slots}
    with torch.inference_mode():
        for rows in PROBE_ROWS:
            xs = {k: torch.randn(rows, k) for k in {slot.shape[1] for slot in slots}}
            for sweep in range(PROBE_SWEEPS + 1):  # the first sweep warms up
                for slot in slots:
                    start = time.perf_counter()
                    F.linear(xs[slot.shape[1]], slot.weight, slot.bias)
                    if sweep:
                        totals[slot.shape][0] += time.perf_counter() - start
                for slot, lin in zip(slots, packed, strict=True):
                    start = time.perf_counter()
                    lin(xs[slot.shape[1]])
                    if sweep:
                        totals[slot.shape][1] += time.perf_counter() - start
    return {k: (aten, onednn) for k, (aten, onednn) in totals.items()}


def _slots(model: nn.Module) -> list[Slot]:
    slots = [Slot(parent, name, child.weight, child.bias) for parent in model.modules()
             for name, child in parent.named_children()
             if type(child) is nn.Linear and child.weight.dtype == torch.float32 and child.weight.device.type == "cpu"]
    tied = tied_embedding(model)
    if tied is not None and tied.dtype == torch.float32 and tied.device.type == "cpu":
        slots.append(Slot(model, "lm_head", tied, None, copy=True))
    return slots


def pack_dense(model: nn.Module, kernel: DenseKernel = "auto",
               timer: Callable[[list[Slot], list[PackedLinear]], dict[Shape, tuple[float, float]]] = measure,
               ) -> dict[str, str]:
    """Swap float32 CPU nn.Linear layers of `model` (in place) for PackedLinear where `kernel` says:
    "onednn" all, "auto" the weight shapes `timer` measures faster packed, "aten" none. A tied head
    is packed as a copy. For inference only (a packed copy does not follow training updates).
    Returns the choice per weight shape ("NxK" -> "onednn 1.9x" | "aten 1.1x" | "onednn")."""
    if kernel == "aten" or not onednn_available():
        return {}
    slots = _slots(model)
    packed = [PackedLinear(slot.weight, slot.bias, copy=slot.copy) for slot in slots]
    if kernel == "onednn":
        use = dict.fromkeys((slot.shape for slot in slots), True)
        report = {f"{n}x{k}": "onednn" for n, k in use}
    else:
        times = timer(slots, packed)
        use = {shape: onednn < aten for shape, (aten, onednn) in times.items()}
        report = {f"{n}x{k}": f"onednn {aten / onednn:.2f}x" if use[(n, k)] else f"aten {onednn / aten:.2f}x"
                  for (n, k), (aten, onednn) in times.items()}
    for slot, lin in zip(slots, packed, strict=True):
        if use[slot.shape]:
            setattr(slot.parent, slot.name, lin)
    log.info("dense kernels (%s): %s", kernel, report)
    return report
