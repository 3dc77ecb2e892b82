"""Norms shared by the blocks and by attention's per-head q/k norm."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import BlockConfig


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dim, computed in float32 like the Llama (and T5) reference."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        normed = F.rms_norm(x.float(), (x.size(-1),), eps=self.eps)  # (..., C) in float32
        return self.weight * normed.to(x.dtype)  # (..., C)


def make_norm(cfg: BlockConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.d_model, cfg.norm_eps)
    return nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.norm_bias)
