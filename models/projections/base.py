"""Stacking Linears that read the same input into one (models/projections/fuse.py fuses q/k/v and gate/up),
finding the embedding matrix a tied output head reuses (models/projections/quant.py, models/projections/dense.py), and the
base of the float layers whose weight lives in another layout (models/projections/dense.py, models/projections/panels.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn


def stack_linears(*linears: nn.Linear) -> nn.Linear:
    """One Linear whose output is the outputs of `linears` concatenated, in order: (C -> sum N_i).
    Same device and dtype; biases stacked too (all or none have one)."""
    weight = torch.cat([lin.weight for lin in linears])  # (sum N_i, C)
    has_bias = linears[0].bias is not None
    out = nn.Linear(weight.size(1), weight.size(0), bias=has_bias, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        out.weight.copy_(weight)
        if has_bias:
            out.bias.copy_(torch.cat([lin.bias for lin in linears]))  # (sum N_i,)
    return out


def swap_linears(model: nn.Module, replace: Callable[[str, nn.Module], nn.Module | None]) -> int:
    """The one place a model's projections change format: every submodule for which `replace(its
    qualified name, it)` returns a module is replaced by it, in place (None keeps it). Returns how many."""
    swapped = 0
    for name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            new = replace(f"{name}.{child_name}" if name else child_name, child)
            if new is not None:
                setattr(parent, child_name, new)
                swapped += 1
    return swapped


def tied_embedding(model: nn.Module) -> Tensor | None:
    """The embedding matrix a DecoderLM or Seq2Seq uses as its head (lm_head None), else None."""
    if getattr(model, "lm_head", False) is not None:
        return None
    stack = getattr(model, "stack", None) or getattr(model, "decoder", None)  # DecoderLM, Seq2Seq
    return stack.embed.tokens.weight if stack is not None else None


class RepackedLinear(nn.Module):
    """A float Linear whose weight is held in a kernel's own layout. state_dict() gives the dense
    `weight` back (subclasses define the property), so exporters and checkpoints see an ordinary
    Linear; a `copy` (a tied head's packed copy of the embedding matrix) adds nothing to it."""

    def __init__(self, weight: Tensor, bias: Tensor | None, copy: bool = False) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.copy = copy
        self.bias = None if bias is None else nn.Parameter(bias.detach().float().contiguous(), requires_grad=False)

    @property
    def weight(self) -> Tensor:
        raise NotImplementedError

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:  # noqa: ANN001
        if self.copy:
            return
        destination[prefix + "weight"] = self.weight
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
