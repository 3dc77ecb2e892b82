"""Import Llama-architecture decoders from Hugging Face `LlamaForCausalLM` / `LlamaModel` weights.

Rotary positions (rope_theta; no RoPE scaling), RMSNorm, SwiGLU (gate_proj/up_proj/down_proj ->
ff.gate/ff.up/ff.down), grouped-query attention, optional attention/MLP biases, tied or untied
output head. Reads both config layouts: `rope_theta` / `rope_scaling` (transformers 4) and
`rope_parameters` (transformers 5). Rotary caches (`rotary_emb.inv_freq`) of older files are ignored.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..config import DecoderConfig
from ..decoder import DecoderLM
from .format import CheckpointError, build_model, load_state_strict
from .hf import check_tied, make_config, need_field, rename_strict, require, strip_prefix, token_ids

SOURCE = "llama checkpoint"
IGNORE = (r"layers\.\d+\.self_attn\.rotary_emb\.inv_freq",)


def _rope_theta(hf_config: dict[str, Any]) -> float:
    """rope_theta from either config layout; any RoPE scaling raises naming its field."""
    scaling = hf_config.get("rope_scaling")
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) != "default":
        raise CheckpointError(f"{SOURCE}: rope_scaling={scaling!r} is not supported (only plain RoPE)")
    params = hf_config.get("rope_parameters") or {}
    if params.get("rope_type", "default") != "default":
        raise CheckpointError(f"{SOURCE}: rope_parameters.rope_type={params['rope_type']!r} is not supported "
                              "(only 'default' RoPE)")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise CheckpointError(f"{SOURCE}: rope_parameters.partial_rotary_factor="
                              f"{params['partial_rotary_factor']!r} is not supported")
    theta = params.get("rope_theta", hf_config.get("rope_theta"))
    return float(theta) if theta is not None else 10000.0


def config_from_hf(hf_config: dict[str, Any]) -> DecoderConfig:
    """DecoderConfig for a LlamaConfig dict."""
    require(hf_config, "hidden_act", lambda v: v in ("silu", "swish"), "Llama's MLP must be SwiGLU (silu)",
            default="silu", source=SOURCE)
    d_model = need_field(hf_config, "hidden_size", SOURCE)
    n_heads = need_field(hf_config, "num_attention_heads", SOURCE)
    require(hf_config, "head_dim", lambda v: v is None or v * n_heads == d_model,
            f"head_dim must equal hidden_size / num_attention_heads = {d_model / n_heads:g}", source=SOURCE)
    vocab = need_field(hf_config, "vocab_size", SOURCE)
    pad, bos = hf_config.get("pad_token_id"), hf_config.get("bos_token_id")
    return make_config(
        DecoderConfig, SOURCE,
        vocab_size=vocab,
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=hf_config.get("num_key_value_heads") or n_heads,
        d_ff=need_field(hf_config, "intermediate_size", SOURCE),
        n_layers=need_field(hf_config, "num_hidden_layers", SOURCE),
        max_positions=hf_config.get("max_position_embeddings", 2048),
        position="rotary",
        rope_theta=_rope_theta(hf_config),
        norm="rmsnorm",
        norm_eps=hf_config.get("rms_norm_eps", 1e-6),
        prenorm=True,
        final_norm=True,
        embed_norm=False,
        activation="swiglu",
        attn_bias=bool(hf_config.get("attention_bias", False)),
        mlp_bias=bool(hf_config.get("mlp_bias", False)),
        tie_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
        pad_token_id=pad if isinstance(pad, int) and 0 <= pad < vocab else None,
        bos_token_id=bos if isinstance(bos, int) else None,
        eos_token_ids=token_ids(hf_config.get("eos_token_id"), "eos_token_id", SOURCE),
    )


def _mapping(cfg: DecoderConfig) -> dict[str, str]:
    m = {"embed_tokens.weight": "stack.embed.tokens.weight", "norm.weight": "stack.norm.weight"}
    if not cfg.tie_embeddings:
        m["lm_head.weight"] = "lm_head.weight"
    linears = {
        "self_attn.q_proj": ("self_attn.q_proj", cfg.attn_bias),
        "self_attn.k_proj": ("self_attn.k_proj", cfg.attn_bias),
        "self_attn.v_proj": ("self_attn.v_proj", cfg.attn_bias),
        "self_attn.o_proj": ("self_attn.o_proj", cfg.attn_bias),
        "mlp.gate_proj": ("ff.gate", cfg.mlp_bias),
        "mlp.up_proj": ("ff.up", cfg.mlp_bias),
        "mlp.down_proj": ("ff.down", cfg.mlp_bias),
    }
    for i in range(cfg.n_layers):
        theirs_block, ours_block = f"layers.{i}", f"stack.blocks.{i}"
        m[f"{theirs_block}.input_layernorm.weight"] = f"{ours_block}.self_norm.weight"
        m[f"{theirs_block}.post_attention_layernorm.weight"] = f"{ours_block}.ff_norm.weight"
        for theirs, (ours, bias) in linears.items():
            m[f"{theirs_block}.{theirs}.weight"] = f"{ours_block}.{ours}.weight"
            if bias:
                m[f"{theirs_block}.{theirs}.bias"] = f"{ours_block}.{ours}.bias"
    return m


def _strip_model_prefix(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """LlamaForCausalLM names its body `model.` and keeps `lm_head.` at the top; LlamaModel has neither."""
    return strip_prefix(state, "model.", "embed_tokens.weight")


def from_hf(hf_config: dict[str, Any], state: dict[str, Tensor], dtype: torch.dtype | None = None) -> DecoderLM:
    """Our DecoderLM (eval mode) from a LlamaConfig dict and a Llama state dict.

    dtype: cast floating weights to it; None keeps the stored dtype. The model may share storage
    with `state`.
    """
    cfg = config_from_hf(hf_config)
    state = _strip_model_prefix(state)
    if cfg.tie_embeddings:
        check_tied(state, "lm_head.weight", "embed_tokens.weight", SOURCE)
    optional = ("lm_head.weight",) if cfg.tie_embeddings else ()
    ours = rename_strict(state, _mapping(cfg), optional=optional, ignore=IGNORE, source=SOURCE)
    return load_state_strict(build_model(cfg), ours, dtype, source=SOURCE)
