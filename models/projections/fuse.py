"""Serving-time fusion of projections that read the same input: each self-attention's q, k and v,
each gated MLP's gate and up, become one Linear (one matrix product, and for int8 one activation
quantization, instead of three or two). Applied after loading, before quantization; it changes no
weight, only how they are laid out (a checkpoint is always saved unfused)."""

from __future__ import annotations

from torch import Tensor, nn

from ..attention import MultiHeadAttention
from ..layers import Block, FeedForward


def fuse_projections(model: nn.Module) -> nn.Module:
    """Fuse every Block's self-attention q/k/v and gated feed-forward gate/up, in place. Returns `model`."""
    for module in model.modules():
        if isinstance(module, Block):
            module.self_attn.fuse_qkv()
            module.ff.fuse_gate_up()
    return model


def is_fused(model: nn.Module) -> bool:
    return any(getattr(m, "qkv", None) is not None or getattr(m, "gate_up", None) is not None
               for m in model.modules())


def unfused_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """`model.state_dict()` in the checkpoint layout: every fused projection split back into its
    q/k/v or gate/up tensors (views of the fused ones), so exporters see the names they map."""
    state = dict(model.state_dict())
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(module, MultiHeadAttention) and module.qkv is not None:
            qd, kd = module.n_heads * module.head_dim, module.n_kv_heads * module.head_dim
            _split_into(state, f"{prefix}qkv", [f"{prefix}q_proj", f"{prefix}k_proj", f"{prefix}v_proj"],
                        [qd, kd, kd])
        elif isinstance(module, FeedForward) and module.gate_up is not None:
            half = module.down.in_features
            _split_into(state, f"{prefix}gate_up", [f"{prefix}gate", f"{prefix}up"], [half, half])
    return state


def _split_into(state: dict[str, Tensor], fused: str, parts: list[str], sizes: list[int]) -> None:
    for kind in ("weight", "bias"):
        if f"{fused}.{kind}" in state:
            for part, tensor in zip(parts, state.pop(f"{fused}.{kind}").split(sizes), strict=True):
                state[f"{part}.{kind}"] = tensor
