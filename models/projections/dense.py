"""Float32 projections on the CPU: MKL (F.linear), oneDNN with prepacked weights, or our panel kernels
(panels.py), chosen per weight shape at load: `pack_dense(model, kernel)` swaps layers in place.

"auto" times every candidate on every projection at load, in sweeps over the layers in model order
(so caches hold what a forward pass leaves), and keeps the fastest per shape, except that block and
encoder-decoder head projections take the panels where they run (the native backend needs them);
"panels" / "onednn" pack every float layer, "bf16" every one on our bfloat16 panels (rounding the
weights: only where a spec names it), "aten" none. Which kernel wins depends on the CPU and
shape (docs/benchmarks-history.md, "Float projections through oneDNN"). Only float32 CPU weights are
packed; results differ from F.linear's in the last bits (summation order). A tied head gets a packed
copy (one more head-sized matrix); while timing, candidates hold up to 3x the projections' memory.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..kernels import native
from ..spec import DenseKernel
from .base import RepackedLinear, swap_linears, tied_embedding
from .panels import Bf16PanelLinear, PanelLinear

log = logging.getLogger("models.projections.dense")

PACK_ROWS = 32  # oneDNN's batch-size hint when reordering; the result does not depend on it
PROBE_ROWS = (1, 8, 32)  # rows the choice is measured at: a decode step alone, a few rows, a batch
PROBE_SWEEPS = 3


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class PackedLinear(RepackedLinear):
    """nn.Linear with its weight held in oneDNN's blocked layout (CPU, float32); see RepackedLinear."""

    def __init__(self, weight: Tensor, bias: Tensor | None, copy: bool = False) -> None:
        super().__init__(weight, bias, copy)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().float().contiguous(), PACK_ROWS)

    def forward(self, x: Tensor) -> Tensor:
        """x: (..., K) -> (..., N)."""
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")  # (..., N)

    @property
    def weight(self) -> Tensor:
        """The dense (N, K) weight (a copy)."""
        return self.packed.to_dense()


Shape = tuple[int, int]  # (N, K)


def kernels_per_shape(model: nn.Module) -> bool:
    """Whether `model`'s projections keep a compiled kernel per input shape: oneDNN does (about 1.7 MiB
    per row count for SmolLM2's MLP in bfloat16; docs/reliability.md, Heap trimming), for 16-bit float
    weights on CPU (F.linear goes to oneDNN) and for PackedLinear; MKL, our panel and block kernels
    (models/projections/panels.py) and CUDA keep none. Callers that pick input shapes (a prefill's padding) bound
    the variety of row counts where this is True."""
    for m in model.modules():
        if isinstance(m, PackedLinear):
            return True
        if isinstance(m, nn.Linear) and m.weight.device.type == "cpu" and m.weight.dtype in (torch.bfloat16,
                                                                                             torch.float16):
            return True
    return False


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


class AtenLinear(nn.Module):
    """F.linear on a slot's dense weight, as the model computes it unpacked (a timing candidate)."""

    def __init__(self, weight: Tensor, bias: Tensor | None, copy: bool = False) -> None:
        super().__init__()
        self.w, self.b = weight, bias

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.w, self.b)


# kernel name -> a module built from (weight, bias, copy); "aten" leaves the slot as it is
BUILDERS: dict[str, Callable[..., nn.Module]] = {"aten": AtenLinear, "onednn": PackedLinear, "panels": PanelLinear,
                                                 "bf16": Bf16PanelLinear}
Candidates = dict[str, list[nn.Module]]  # kernel -> one module per slot
Timer = Callable[[list[Slot], Candidates], dict[Shape, dict[str, float]]]


def kernels_here() -> list[str]:
    """The float32 kernels this process can run: aten always, oneDNN and our panels where available
    ("auto" chooses among these; "bf16" rounds the weights, so only a spec that names it gets it)."""
    return ["aten"] + (["onednn"] if onednn_available() else []) + (["panels"] if native.available() else [])


class KernelUnavailable(ValueError):
    """A dense kernel named by the spec that this CPU cannot run (raised at load)."""


def check_bf16() -> None:
    """Raise KernelUnavailable unless our bfloat16 panels run here (AVX512-BF16 and the native kernels)."""
    if not native.has_bf16():
        why = native.unavailable_reason() or f"the kernels here are the {native.isa()} build"
        raise KernelUnavailable(f"bfloat16 panels need a CPU with AVX512-BF16 and our native kernels ({why})")


def measure(slots: list[Slot], candidates: Candidates) -> dict[Shape, dict[str, float]]:
    """Seconds per weight shape and kernel, from sweeps over all the model's projections in model
    order at PROBE_ROWS rows, one kernel at a time: each layer is timed where the model would run
    it, after the others, and each timed sweep right after an untimed sweep of the same kernel, so
    the caches hold what a forward pass after another leaves there (a decoder's weights stream from
    memory; a small translator's stay in cache, except what its head evicts). Timed after another
    kernel's sweep instead, a translator ran every candidate from memory (the candidates' copies
    together outgrow the cache) and the choice flipped between loads (docs/benchmarks-history.md,
    "Translator after the beam step changes")."""
    totals: dict[Shape, dict[str, float]] = {slot.shape: dict.fromkeys(candidates, 0.0) for slot in slots}
    with torch.inference_mode():
        for rows in PROBE_ROWS:
            xs = {k: torch.randn(rows, k) for k in {slot.shape[1] for slot in slots}}
            for _ in range(PROBE_SWEEPS):  # kernels take turns, so a slow moment of the machine hits all
                for kernel, modules in candidates.items():
                    for timed in (False, True):
                        for slot, module in zip(slots, modules, strict=True):
                            start = time.perf_counter()
                            module(xs[slot.shape[1]])
                            if timed:
                                totals[slot.shape][kernel] += time.perf_counter() - start
    return totals


def _slots(model: nn.Module) -> list[Slot]:
    slots = [Slot(parent, name, child.weight, child.bias) for parent in model.modules()
             for name, child in parent.named_children()
             if type(child) is nn.Linear and child.weight.dtype == torch.float32 and child.weight.device.type == "cpu"]
    tied = tied_embedding(model)
    if tied is not None and tied.dtype == torch.float32 and tied.device.type == "cpu":
        slots.append(Slot(model, "lm_head", tied, None, copy=True))
    return slots


def pack_dense(model: nn.Module, kernel: DenseKernel = "auto", timer: Timer = measure) -> dict[str, str]:
    """Swap float32 CPU nn.Linear layers of `model` (in place) for packed ones where `kernel` says:
    "panels" or "onednn" all (with that kernel), "auto" the projections of transformer blocks with
    the panels where they exist (models/execution/native.py runs a whole stack of such blocks in one
    call) and every other weight shape with the kernel `timer` measures fastest, "aten" none; "bf16"
    all with our bfloat16 panels (the weights rounded; KernelUnavailable without AVX512-BF16). A tied
    head is packed as a copy. For inference only (a packed copy does not follow training updates). A
    float32 kernel this process cannot run falls back to "auto".
    Returns the choice per weight shape: "NxK" -> "panels 1.9x" (the winner and how much faster it
    ran than the next best kernel) or just the kernel's name when it was not measured."""
    slots = _slots(model)
    if kernel == "aten" or not slots:  # nothing to pack (a model on a GPU): no kernel is built or timed
        return {}
    if kernel == "bf16":
        check_bf16()
    here = kernels_here() + (["bf16"] if kernel == "bf16" else [])
    if here == ["aten"]:
        return {}
    if kernel != "auto" and kernel not in here:
        log.warning("dense kernel %r is not available here (%s); measuring the others", kernel, here)
        kernel = "auto"
    build = lambda name, slot: BUILDERS[name](slot.weight, slot.bias, copy=slot.copy)  # noqa: E731
    if kernel != "auto":
        modules = {id(slot): build(kernel, slot) for slot in slots}
        report = {_shape_name(slot.shape): kernel for slot in slots}
    else:
        # a block's projections go to the panels where they exist: the native backend, which runs a whole
        # stack in one call, takes only panels and beats every per-projection choice, while timed one
        # projection at a time they tie with oneDNN within the machine's noise, so a load could lose the
        # native backend to a coin toss. An encoder-decoder's head too: the native decode step applies it
        # in the same call (models/execution/native.py's NativeDecoder). Every projection is still timed, in
        # model order, so the others (a decoder-only model's head) are measured with the caches as a
        # forward pass leaves them.
        blocks = _block_parts(model) | _fused_heads(model) if "panels" in here else set()
        candidates = {name: [build(name, s) for s in slots] for name in here}
        use, report = {}, {}
        for shape, seconds in timer(slots, candidates).items():
            ranked = sorted(seconds, key=seconds.__getitem__)
            use[shape] = ranked[0]
            report[_shape_name(shape)] = f"{ranked[0]} {seconds[ranked[1]] / seconds[ranked[0]]:.2f}x"
        pinned = [id(slot.parent) in blocks for slot in slots]
        modules = {id(slot): candidates["panels" if pin else use[slot.shape]][i]
                   for i, (slot, pin) in enumerate(zip(slots, pinned, strict=True))}
        measured = {slot.shape for slot, pin in zip(slots, pinned, strict=True) if not pin}
        report.update({_shape_name(slot.shape): "panels (blocks)"
                       for slot, pin in zip(slots, pinned, strict=True) if pin and slot.shape not in measured})
    chosen = {id(slot.weight): modules[id(slot)] for slot in slots if not slot.copy}
    swap_linears(model, lambda _, child: None if type(child) is not nn.Linear or isinstance(
        chosen.get(id(child.weight)), AtenLinear) else chosen.get(id(child.weight)))
    for slot in slots:  # a tied head's packed copy: the model has no module there to swap
        if slot.copy and not isinstance(modules[id(slot)], AtenLinear):
            setattr(slot.parent, slot.name, modules[id(slot)])
    log.info("dense kernels (%s): %s", kernel, report)
    return report


def _shape_name(shape: Shape) -> str:
    return f"{shape[0]}x{shape[1]}"


def _fused_heads(model: nn.Module) -> set[int]:
    """id of `model` when its head is applied inside the decoder's native step (an encoder-decoder's
    lm_head: its slot's parent is the model)."""
    from ..seq2seq import Seq2Seq

    return {id(model)} if isinstance(model, Seq2Seq) else set()


def _block_parts(model: nn.Module) -> set[int]:
    """ids of the attention and feed-forward modules of `model`'s transformer blocks."""
    from ..layers import Block

    return {id(part) for block in model.modules() if isinstance(block, Block)
            for part in (block.self_attn, block.cross_attn, block.ff) if part is not None}
