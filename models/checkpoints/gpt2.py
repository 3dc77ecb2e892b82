"""Import GPT-2 from Hugging Face `GPT2LMHeadModel` / `GPT2Model` weights.

GPT-2 stores its projections as Conv1D with (in, out) weights, so each is transposed, and the
fused `c_attn` is split into q/k/v. gelu_new is our "gelu_tanh". Names may carry the
`transformer.` prefix (GPT2LMHeadModel) or not (GPT2Model, the original hub files). The causal-mask
buffers `attn.bias` / `attn.masked_bias` of older files are ignored; `lm_head.weight` is accepted as
a copy of the tied token matrix (or loaded as our lm_head when tie_word_embeddings is false).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..config import DecoderConfig
from ..decoder import DecoderLM
from .format import CheckpointError, build_model, load_state_strict
from .hf import (
    activation,
    check_tied,
    make_config,
    need_field,
    rename_strict,
    require,
    strip_prefix,
    token_ids,
)

SOURCE = "gpt2 checkpoint"
IGNORE = (r"h\.\d+\.attn\.bias", r"h\.\d+\.attn\.masked_bias")


def config_from_hf(hf_config: dict[str, Any]) -> DecoderConfig:
    """DecoderConfig for a GPT2Config dict: learned positions, pre-norm + ln_f, tied head by default."""
    require(hf_config, "scale_attn_weights", lambda v: v, "attention is always scaled by 1/sqrt(D)",
            default=True, source=SOURCE)
    require(hf_config, "scale_attn_by_inverse_layer_idx", lambda v: not v,
            "per-layer attention scaling is not supported", default=False, source=SOURCE)
    require(hf_config, "add_cross_attention", lambda v: not v, "cross-attention is not supported",
            default=False, source=SOURCE)
    d_model = need_field(hf_config, "n_embd", SOURCE)
    vocab = need_field(hf_config, "vocab_size", SOURCE)
    pad = hf_config.get("pad_token_id")
    bos = hf_config.get("bos_token_id")
    return make_config(
        DecoderConfig, SOURCE,
        vocab_size=vocab,
        d_model=d_model,
        n_heads=need_field(hf_config, "n_head", SOURCE),
        d_ff=hf_config.get("n_inner") or 4 * d_model,
        n_layers=need_field(hf_config, "n_layer", SOURCE),
        max_positions=hf_config.get("n_positions", 1024),
        position="learned",
        norm="layernorm",
        norm_eps=hf_config.get("layer_norm_epsilon", 1e-5),
        prenorm=True,
        final_norm=True,
        embed_norm=False,
        activation=activation(hf_config, "activation_function", source=SOURCE),
        tie_embeddings=hf_config.get("tie_word_embeddings", True),
        pad_token_id=pad if pad is not None and 0 <= pad < vocab else None,
        bos_token_id=bos if isinstance(bos, int) else None,
        eos_token_ids=token_ids(hf_config.get("eos_token_id"), "eos_token_id", SOURCE),
    )


def _mapping(cfg: DecoderConfig) -> dict[str, str]:
    """Their name -> ours, for the tensors that need no reshaping."""
    m = {
        "wte.weight": "stack.embed.tokens.weight",
        "wpe.weight": "stack.embed.positions.weight",
        "ln_f.weight": "stack.norm.weight",
        "ln_f.bias": "stack.norm.bias",
    }
    if not cfg.tie_embeddings:
        m["lm_head.weight"] = "lm_head.weight"
    for i in range(cfg.n_layers):
        for theirs, ours in (("ln_1", "self_norm"), ("ln_2", "ff_norm")):
            for p in ("weight", "bias"):
                m[f"h.{i}.{theirs}.{p}"] = f"stack.blocks.{i}.{ours}.{p}"
        # Conv1D weights are transposed below; biases only renamed
        for theirs in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
            for p in ("weight", "bias"):
                m[f"h.{i}.{theirs}.{p}"] = f"h.{i}.{theirs}.{p}"
    return m


def _unfuse(state: dict[str, Tensor], cfg: DecoderConfig) -> dict[str, Tensor]:
    """Transpose Conv1D weights (in, out) -> (out, in) and split c_attn into q/k/v."""
    out = {k: v for k, v in state.items() if not k.startswith("h.")}
    c = cfg.d_model
    for i in range(cfg.n_layers):
        block = f"stack.blocks.{i}"
        w = state[f"h.{i}.attn.c_attn.weight"]  # (C, 3C)
        b = state[f"h.{i}.attn.c_attn.bias"]  # (3C,)
        if tuple(w.shape) != (c, 3 * c) or tuple(b.shape) != (3 * c,):
            raise CheckpointError(f"{SOURCE}: h.{i}.attn.c_attn: expected weight ({c}, {3 * c}) and bias "
                                  f"({3 * c},), got {tuple(w.shape)} and {tuple(b.shape)}")
        for j, name in enumerate(("q_proj", "k_proj", "v_proj")):
            out[f"{block}.self_attn.{name}.weight"] = w[:, j * c:(j + 1) * c].t()  # (C, C)
            out[f"{block}.self_attn.{name}.bias"] = b[j * c:(j + 1) * c]  # (C,)
        for theirs, ours in (("attn.c_proj", "self_attn.o_proj"), ("mlp.c_fc", "ff.up"), ("mlp.c_proj", "ff.down")):
            out[f"{block}.{ours}.weight"] = state[f"h.{i}.{theirs}.weight"].t()  # (out, in)
            out[f"{block}.{ours}.bias"] = state[f"h.{i}.{theirs}.bias"]
    return out


def from_hf(hf_config: dict[str, Any], state: dict[str, Tensor], dtype: torch.dtype | None = None) -> DecoderLM:
    """Our DecoderLM (eval mode) from a GPT2Config dict and a GPT-2 state dict.

    dtype: cast floating weights to it; None keeps the stored dtype. The model may share storage
    with `state`.
    """
    cfg = config_from_hf(hf_config)
    state = strip_prefix(state, "transformer.", "wte.weight")
    if cfg.tie_embeddings:
        check_tied(state, "lm_head.weight", "wte.weight", SOURCE)
    optional = ("lm_head.weight",) if cfg.tie_embeddings else ()
    renamed = rename_strict(state, _mapping(cfg), optional=optional, ignore=IGNORE, source=SOURCE)
    return load_state_strict(build_model(cfg), _unfuse(renamed, cfg), dtype, source=SOURCE)
