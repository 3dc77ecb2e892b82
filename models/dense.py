"""Float projections through oneDNN with prepacked weights, chosen per weight shape by measurement.

`torch.nn.functional.linear` on CPU calls MKL's sgemm. On the AMD EPYC this project was measured on
(AVX-512, 2 threads), MKL runs SmolLM2's 30 layers of projections plus its head at 10 GB/s at one row
and 6-9 GB/s at 2-32 rows, while oneDNN with the weight reordered once into its blocked layout
(`torch.ops.mkldnn._reorder_linear_weight`, the path inductor's freezing uses) reaches 17-21 GB/s: a
1.8-2.8x faster decode step at the same fp32 precision. Which library wins depends on the CPU (MKL
is at its best on Intel), so `pack_dense(model, "auto")` times both on every distinct weight shape at
load and packs a layer only where oneDNN is faster; "onednn" packs every float layer, "aten" leaves
the model as it is.

Results: the same fp32 arithmetic in another summation order, so logits differ from F.linear's in the
last bits (~1e-6 relative); neither library gives a row bitwise the same result at every batch size.
A tied output head (the embedding matrix, lm_head None) gets a packed copy as its head, the lookup
keeps the dense table: one extra head-sized matrix of memory (SmolLM2: 113 MB).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .projections import tied_embedding
from .spec import DenseKernel

log = logging.getLogger("models.dense")

PACK_ROWS = 32  # oneDNN's batch-size hint when reordering; the result does not depend on it
PROBE_ROWS = (1, 8, 32)  # rows the choice is measured at: a decode step alone, a few rows, a batch
PROBE_CALLS = 15
STREAM_BYTES = 96 << 20  # more than a server CPU's last-level cache share
MAX_COPIES = 64


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


def _seconds(fn: Callable[[int], object], copies: int) -> float:
    """Median seconds of one call, the calls cycling through `copies` weight copies."""
    fn(0)
    times = []
    for i in range(max(PROBE_CALLS, copies)):
        start = time.perf_counter()
        fn(i % copies)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def measure(weight: Tensor, bias: Tensor | None, stream: bool = False) -> tuple[float, float]:
    """(aten seconds, oneDNN seconds): medians summed over PROBE_ROWS rows. `stream`: the model's
    weights do not fit in cache, so each call reads another copy of the weight (STREAM_BYTES in all),
    as a decode step reads every layer's weights from memory; else the weight stays cache-hot."""
    copies = max(1, min(MAX_COPIES, -(-STREAM_BYTES // (weight.numel() * 4)))) if stream else 1
    dense = [weight.detach().clone() for _ in range(copies)]
    packed = [PackedLinear(w, bias) for w in dense]
    aten = onednn = 0.0
    with torch.inference_mode():
        for rows in PROBE_ROWS:
            x = torch.randn(rows, weight.size(1))
            aten += _seconds(lambda i, x=x: F.linear(x, dense[i], bias), copies)
            onednn += _seconds(lambda i, x=x: packed[i](x), copies)
    return aten, onednn


def _float_linears(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    return [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
            if type(child) is nn.Linear and child.weight.dtype == torch.float32 and child.weight.device.type == "cpu"]


def pack_dense(model: nn.Module, kernel: DenseKernel = "auto",
               timer: Callable[[Tensor, Tensor | None, bool], tuple[float, float]] = measure) -> dict[str, str]:
    """Swap float32 CPU nn.Linear layers of `model` (in place) for PackedLinear where `kernel` says:
    "onednn" all, "auto" those whose shape `timer` measures faster packed, "aten" none. A tied head is
    packed as a copy. The timer streams the weights from memory when the model's float weights exceed
    STREAM_BYTES (a decoder's step), else keeps them cache-hot. Returns the choice per weight shape ("NxK" -> "onednn 1.9x" | "aten 1.1x")."""
    if kernel == "aten" or not onednn_available():
        return {}
    layers = _float_linears(model)
    tied = tied_embedding(model)
    if tied is not None and tied.dtype == torch.float32 and tied.device.type == "cpu":
        layers.append((model, "lm_head", None))  # type: ignore[arg-type]
    stream = sum((c.weight if c is not None else tied).numel() * 4 for _, _, c in layers) > STREAM_BYTES
    chosen: dict[tuple[int, int, bool], bool] = {}
    report: dict[str, str] = {}
    for parent, name, child in layers:
        weight, bias = (tied, None) if child is None else (child.weight, child.bias)
        key = (*weight.shape, bias is not None)
        if key not in chosen:
            if kernel == "onednn":
                chosen[key] = True
                report[f"{key[0]}x{key[1]}"] = "onednn"
            else:
                aten, onednn = timer(weight, bias, stream)
                chosen[key] = onednn < aten
                faster = aten / onednn if onednn < aten else onednn / aten
                report[f"{key[0]}x{key[1]}"] = f"{'onednn' if chosen[key] else 'aten'} {faster:.2f}x"
        if chosen[key]:
            setattr(parent, name, PackedLinear(weight, bias, copy=child is None))
    log.info("dense kernels (%s): %s", kernel, report)
    return report
