"""Import the Llama family of decoders from Hugging Face `*ForCausalLM` / `*Model` weights:
Llama (1-3.x), Mistral, Qwen2 and Qwen3, which share one layout of tensor names.

Rotary positions with RoPE scaling (linear, dynamic NTK, YaRN, llama3), RMSNorm, SwiGLU
(gate_proj/up_proj/down_proj -> ff.gate/ff.up/ff.down), grouped-query attention, an explicit head
dim, tied or untied output head. What differs by `model_type` is in TRAITS: Qwen2's biases on q/k/v
only, Qwen3's per-head q/k RMSNorm, Mistral's (and Qwen's) sliding window. Reads both config layouts:
`rope_theta` / `rope_scaling` (transformers 4) and `rope_parameters` (transformers 5). Rotary caches
(`rotary_emb.inv_freq`) of older files are ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..config import ConfigError, DecoderConfig, RopeScaling
from ..decoder import DecoderLM
from .format import CheckpointError, build_model, load_state_strict
from .hf import check_tied, make_config, need_field, rename_strict, require, strip_prefix, token_ids

SOURCE = "llama checkpoint"
IGNORE = (r"layers\.\d+\.self_attn\.rotary_emb\.inv_freq",)


@dataclass(frozen=True)
class Traits:
    """What a model_type of the family fixes, where the config does not say."""

    qkv_bias: bool | None = None  # None: config's attention_bias (on q, k, v and o)
    qk_norm: bool = False  # q_norm / k_norm over each head (Qwen3)
    windowed: bool = False  # the config's sliding_window (or layer_types) applies
    # Qwen: the window is off unless use_sliding_window, and then only on layers >= max_window_layers
    window_by_layer: bool = False


TRAITS: dict[str, Traits] = {
    "llama": Traits(),
    "mistral": Traits(windowed=True),
    "qwen2": Traits(qkv_bias=True, windowed=True, window_by_layer=True),
    "qwen3": Traits(qk_norm=True, windowed=True, window_by_layer=True),
}

# rope_type -> the RopeScaling fields its parameters map to (their name -> ours)
_ROPE_FIELDS: dict[str, dict[str, str]] = {
    "linear": {"factor": "factor"},
    "dynamic": {"factor": "factor", "original_max_position_embeddings": "original_max_positions"},
    "llama3": {"factor": "factor", "original_max_position_embeddings": "original_max_positions",
               "low_freq_factor": "low_freq_factor", "high_freq_factor": "high_freq_factor"},
    # not a transformers type: llama.cpp's per-frequency divisors (a GGUF's rope_freqs tensor)
    "frequencies": {"freq_factors": "freq_factors"},
    "yarn": {"factor": "factor", "original_max_position_embeddings": "original_max_positions",
             "beta_fast": "beta_fast", "beta_slow": "beta_slow", "attention_factor": "attention_factor",
             "mscale": "mscale", "mscale_all_dim": "mscale_all_dim", "truncate": "truncate"},
}


_ROPE_REQUIRED: dict[str, tuple[str, ...]] = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
    "yarn": ("factor", "original_max_position_embeddings"),
    "frequencies": ("freq_factors",),
}


def _rope(hf_config: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """rope_theta and the RoPE scaling from either config layout; unsupported types raise naming them."""
    params = dict(hf_config.get("rope_parameters") or {})
    legacy = hf_config.get("rope_scaling") or {}
    for key, value in legacy.items():  # transformers 4: rope_scaling {"type"/"rope_type", "factor", ...}
        params["rope_type" if key == "type" else key] = value
    kind = params.get("rope_type", "default")
    theta = params.get("rope_theta", hf_config.get("rope_theta"))
    theta = float(theta) if theta is not None else 10000.0
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise CheckpointError(f"{SOURCE}: rope partial_rotary_factor={params['partial_rotary_factor']!r} "
                              "is not supported")
    if kind == "default":
        return theta, None
    if kind not in _ROPE_FIELDS:
        raise CheckpointError(f"{SOURCE}: rope_type={kind!r} is not supported; supported: "
                              f"{['default', *sorted(_ROPE_FIELDS)]}")
    fields = {ours: params[theirs] for theirs, ours in _ROPE_FIELDS[kind].items() if params.get(theirs) is not None}
    if kind == "dynamic":  # its base grows past the context the model was trained for
        fields.setdefault("original_max_positions", hf_config.get("max_position_embeddings", 2048))
    missing = [theirs for theirs in _ROPE_REQUIRED[kind] if params.get(theirs) is None]
    if missing:
        raise CheckpointError(f"{SOURCE}: rope_type {kind!r} needs {missing} in rope_parameters")
    if kind == "frequencies":
        fields = {"freq_factors": tuple(float(f) for f in fields["freq_factors"]), "factor": 1.0}
    try:
        return theta, RopeScaling(type=kind, **fields)
    except ConfigError as exc:
        raise CheckpointError(f"{SOURCE}: {exc}") from exc


def _layer_types(hf_config: dict[str, Any], traits: Traits, n_layers: int) -> list[str]:
    """Each layer's attention, as transformers 5 writes `layer_types` (and derives it for older files)."""
    given = hf_config.get("layer_types")
    if given is not None:
        return list(given)
    window = hf_config.get("sliding_window")
    if not isinstance(window, int) or window <= 0:
        return ["full_attention"] * n_layers
    if not traits.window_by_layer:
        return ["sliding_attention"] * n_layers
    if not hf_config.get("use_sliding_window", False):
        return ["full_attention"] * n_layers
    first = hf_config.get("max_window_layers", 28)
    return ["sliding_attention" if i >= first else "full_attention" for i in range(n_layers)]


def _window(hf_config: dict[str, Any], traits: Traits, n_layers: int) -> int | None:
    """The sliding window of every layer, or None; a mix of windowed and full layers raises."""
    if not traits.windowed:
        return None
    layer_types = _layer_types(hf_config, traits, n_layers)
    kinds = set(layer_types)
    if kinds == {"full_attention"}:
        return None
    if kinds != {"sliding_attention"} or len(layer_types) != n_layers:
        raise CheckpointError(f"{SOURCE}: layer_types mixes {sorted(kinds)}: sliding-window attention "
                              "on some layers only is not supported")
    window = hf_config.get("sliding_window")
    if not isinstance(window, int) or window <= 0:
        raise CheckpointError(f"{SOURCE}: layer_types asks for sliding attention but sliding_window={window!r}")
    return window


def config_from_hf(hf_config: dict[str, Any]) -> DecoderConfig:
    """DecoderConfig for a LlamaConfig / MistralConfig / Qwen2Config / Qwen3Config dict."""
    model_type = hf_config.get("model_type", "llama")
    if model_type not in TRAITS:
        raise CheckpointError(f"{SOURCE}: model_type={model_type!r} is not in the Llama family "
                              f"({sorted(TRAITS)})")
    traits = TRAITS[model_type]
    heads = [a for a in hf_config.get("architectures") or [] if not str(a).endswith(("ForCausalLM", "Model"))]
    if heads:
        raise CheckpointError(f"{SOURCE}: architectures={heads} is not supported: only the causal LM "
                              "(…ForCausalLM) or the bare model")
    require(hf_config, "hidden_act", lambda v: v in ("silu", "swish"), "the MLP must be SwiGLU (silu)",
            default="silu", source=SOURCE)
    d_model = need_field(hf_config, "hidden_size", SOURCE)
    n_heads = need_field(hf_config, "num_attention_heads", SOURCE)
    n_layers = need_field(hf_config, "num_hidden_layers", SOURCE)
    head_dim = hf_config.get("head_dim") or d_model // n_heads
    vocab = need_field(hf_config, "vocab_size", SOURCE)
    pad, bos = hf_config.get("pad_token_id"), hf_config.get("bos_token_id")
    theta, scaling = _rope(hf_config)
    max_positions = hf_config.get("max_position_embeddings", 2048)
    if scaling is not None and scaling.type == "dynamic":  # positions past the trained context are its purpose
        max_positions = int(max_positions * scaling.factor)
    bias = bool(hf_config.get("attention_bias") or False)
    return make_config(
        DecoderConfig, SOURCE,
        vocab_size=vocab,
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=hf_config.get("num_key_value_heads") or n_heads,
        d_head=None if head_dim * n_heads == d_model else head_dim,
        d_ff=need_field(hf_config, "intermediate_size", SOURCE),
        n_layers=n_layers,
        max_positions=max_positions,
        position="rotary",
        rope_theta=theta,
        rope_scaling=scaling,
        sliding_window=_window(hf_config, traits, n_layers),
        norm="rmsnorm",
        norm_eps=hf_config.get("rms_norm_eps", 1e-6),
        prenorm=True,
        final_norm=True,
        embed_norm=False,
        activation="swiglu",
        attn_bias=bias if traits.qkv_bias is None else traits.qkv_bias,
        attn_out_bias=None if traits.qkv_bias is None else bias,
        qk_norm=traits.qk_norm,
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
        "self_attn.o_proj": ("self_attn.o_proj", cfg.out_bias),
        "mlp.gate_proj": ("ff.gate", cfg.mlp_bias),
        "mlp.up_proj": ("ff.up", cfg.mlp_bias),
        "mlp.down_proj": ("ff.down", cfg.mlp_bias),
    }
    for i in range(cfg.n_layers):
        theirs_block, ours_block = f"layers.{i}", f"stack.blocks.{i}"
        m[f"{theirs_block}.input_layernorm.weight"] = f"{ours_block}.self_norm.weight"
        m[f"{theirs_block}.post_attention_layernorm.weight"] = f"{ours_block}.ff_norm.weight"
        if cfg.qk_norm:
            m[f"{theirs_block}.self_attn.q_norm.weight"] = f"{ours_block}.self_attn.q_norm.weight"
            m[f"{theirs_block}.self_attn.k_norm.weight"] = f"{ours_block}.self_attn.k_norm.weight"
        for theirs, (ours, bias) in linears.items():
            m[f"{theirs_block}.{theirs}.weight"] = f"{ours_block}.{ours}.weight"
            if bias:
                m[f"{theirs_block}.{theirs}.bias"] = f"{ours_block}.{ours}.bias"
    return m


def _strip_model_prefix(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """LlamaForCausalLM names its body `model.` and keeps `lm_head.` at the top; LlamaModel has neither."""
    return strip_prefix(state, "model.", "embed_tokens.weight")


def from_hf(hf_config: dict[str, Any], state: dict[str, Tensor], dtype: torch.dtype | None = None) -> DecoderLM:
    """Our DecoderLM (eval mode) from a Llama-family config dict (TRAITS) and its state dict.

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
