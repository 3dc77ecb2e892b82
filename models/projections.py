"""Stacking Linears that read the same input into one (models/fuse.py fuses q/k/v and gate/up)."""

from __future__ import annotations

import torch
from torch import nn


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
