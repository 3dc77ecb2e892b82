"""Marian (opus-mt) <-> our Seq2Seq: import from Hugging Face `MarianMTModel` weights, and export back.

Import: `model.shared` is our one token matrix (the encoder/decoder `embed_tokens` and a tied
`lm_head` are accepted as copies of it, and must equal it); sinusoidal `embed_positions` are not
stored by us (ours are computed by models/positions.py) but, when present, must match our table;
post-norm blocks; `final_logits_bias` (zeros when absent, as transformers does). Configs our
architecture cannot express (different encoder/decoder widths or head counts, separate decoder
vocabulary, pre-norm or embedding-norm variants of BART-style configs) raise naming the field.

Export (`to_hf_marian`) gives a MarianConfig dict and a state dict that MarianMTModel loads with
strict=True, so our own translators run side by side with transformers'.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..config import Seq2SeqConfig
from ..positions import sinusoidal_table
from ..projections.fuse import unfused_state_dict
from ..seq2seq import Seq2Seq
from .format import CheckpointError, build_model, load_state_strict
from .hf import activation, check_tied, make_config, need_field, rename_strict, require

SOURCE = "marian checkpoint"
MARIAN_LAYERNORM_EPS = 1e-5  # MarianMTModel's nn.LayerNorm default, not configurable
# Marian activations in both directions (our name -> theirs)
TO_HF_ACTIVATION = {"silu": "swish", "relu": "relu", "gelu": "gelu", "gelu_tanh": "gelu_new"}
FROM_HF_ACTIVATION = {"swish": "silu", "silu": "silu", "relu": "relu", "gelu": "gelu", "gelu_new": "gelu_tanh"}

# BART-family fields that old opus-mt config.json files carry; Marian needs exactly these values
_FIXED_FIELDS = {
    "normalize_before": False,
    "normalize_embedding": False,
    "layernorm_embedding": False,
    "add_final_layer_norm": False,
    "add_bias_logits": False,
    "static_position_embeddings": True,
    "share_encoder_decoder_embeddings": True,
}


def config_from_hf(hf_config: dict[str, Any]) -> Seq2SeqConfig:
    """Seq2SeqConfig for a MarianConfig dict; fields our architecture cannot express raise naming them."""
    for field, value in _FIXED_FIELDS.items():
        require(hf_config, field, lambda v, want=value: v is None or v == want,
                f"our Marian architecture needs {field}={value!r}", source=SOURCE)
    vocab = need_field(hf_config, "vocab_size", SOURCE)
    require(hf_config, "decoder_vocab_size", lambda v: v is None or v == vocab,
            f"a separate target vocabulary is not supported (vocab_size={vocab})", source=SOURCE)
    for enc, dec in (("encoder_ffn_dim", "decoder_ffn_dim"), ("encoder_attention_heads", "decoder_attention_heads")):
        if need_field(hf_config, enc, SOURCE) != need_field(hf_config, dec, SOURCE):
            raise CheckpointError(f"{SOURCE}: {dec}={hf_config[dec]!r} differs from {enc}={hf_config[enc]!r}; "
                                  "our encoder and decoder share one width and head count")
    eos = hf_config.get("eos_token_id", 0)
    if isinstance(eos, list):
        if len(eos) != 1:
            raise CheckpointError(f"{SOURCE}: eos_token_id={eos!r}: exactly one end-of-sequence id is supported")
        eos = eos[0]
    pad = need_field(hf_config, "pad_token_id", SOURCE)
    return make_config(
        Seq2SeqConfig, SOURCE,
        vocab_size=vocab,
        d_model=need_field(hf_config, "d_model", SOURCE),
        n_heads=hf_config["encoder_attention_heads"],
        d_ff=hf_config["encoder_ffn_dim"],
        n_layers=need_field(hf_config, "encoder_layers", SOURCE),
        decoder_layers=need_field(hf_config, "decoder_layers", SOURCE),
        max_positions=hf_config.get("max_position_embeddings", 512),
        position="sinusoidal",
        norm="layernorm",
        norm_eps=MARIAN_LAYERNORM_EPS,
        prenorm=False,
        final_norm=False,
        embed_norm=False,
        activation=activation(hf_config, "activation_function", FROM_HF_ACTIVATION, SOURCE),
        scale_embeddings=bool(hf_config.get("scale_embedding", False)),
        tie_embeddings=bool(hf_config.get("tie_word_embeddings", True)),
        final_logits_bias=True,
        pad_token_id=pad,
        eos_token_id=eos,
        decoder_start_token_id=hf_config.get("decoder_start_token_id", pad),
    )


def _layer_parts(cross: bool) -> dict[str, str]:
    """Their sub-module names -> ours, within one layer."""
    parts = {
        "self_attn.q_proj": "self_attn.q_proj",
        "self_attn.k_proj": "self_attn.k_proj",
        "self_attn.v_proj": "self_attn.v_proj",
        "self_attn.out_proj": "self_attn.o_proj",
        "self_attn_layer_norm": "self_norm",
        "fc1": "ff.up",
        "fc2": "ff.down",
        "final_layer_norm": "ff_norm",
    }
    if cross:
        parts.update({
            "encoder_attn.q_proj": "cross_attn.q_proj",
            "encoder_attn.k_proj": "cross_attn.k_proj",
            "encoder_attn.v_proj": "cross_attn.v_proj",
            "encoder_attn.out_proj": "cross_attn.o_proj",
            "encoder_attn_layer_norm": "cross_norm",
        })
    return parts


def _mapping(cfg: Seq2SeqConfig) -> dict[str, str]:
    """Their name (with the `model.` prefix) -> ours, for every tensor we store."""
    m = {"model.shared.weight": "encoder.embed.tokens.weight"}
    if not cfg.tie_embeddings:
        m["lm_head.weight"] = "lm_head.weight"
    for side, n_layers in (("encoder", cfg.n_layers), ("decoder", cfg.n_decoder_layers)):
        for i in range(n_layers):
            for theirs, ours in _layer_parts(side == "decoder").items():
                for p in ("weight", "bias"):
                    m[f"model.{side}.layers.{i}.{theirs}.{p}"] = f"{side}.blocks.{i}.{ours}.{p}"
    return m


def _check_positions(state: dict[str, Tensor], cfg: Seq2SeqConfig) -> None:
    """Stored sinusoidal tables (optional) must be the ones we compute."""
    table = None
    for side in ("encoder", "decoder"):
        stored = state.get(f"model.{side}.embed_positions.weight")
        if stored is None:
            continue
        if table is None:
            table = sinusoidal_table(cfg.max_positions, cfg.d_model)  # (P, C)
        if tuple(stored.shape) != tuple(table.shape) or not torch.allclose(stored.float(), table, atol=1e-4):
            raise CheckpointError(f"{SOURCE}: model.{side}.embed_positions.weight differs from the sinusoidal "
                                  f"table we compute (shape {tuple(stored.shape)}, ours {tuple(table.shape)})")


def from_hf(hf_config: dict[str, Any], state: dict[str, Tensor], dtype: torch.dtype | None = None) -> Seq2Seq:
    """Our Seq2Seq (eval mode) from a MarianConfig dict and a MarianMTModel (or MarianModel) state dict.

    dtype: cast floating weights to it; None keeps the stored dtype. The model may share storage
    with `state`.
    """
    cfg = config_from_hf(hf_config)
    if "shared.weight" in state:  # MarianModel: no `model.` prefix and no head
        state = {f"model.{k}": v for k, v in state.items()}
    _check_positions(state, cfg)
    copies = ["model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight"]
    if cfg.tie_embeddings:
        copies.append("lm_head.weight")
    for copy in copies:
        check_tied(state, copy, "model.shared.weight", SOURCE)
    optional = [*copies, "final_logits_bias", "model.encoder.embed_positions.weight",
                "model.decoder.embed_positions.weight"]
    ours = rename_strict(state, _mapping(cfg), optional=optional, source=SOURCE)
    bias = state.get("final_logits_bias")
    ours["final_logits_bias"] = bias.reshape(-1) if bias is not None else torch.zeros(cfg.vocab_size)  # (V,)
    return load_state_strict(build_model(cfg), ours, dtype, source=SOURCE)


def _export_checks(cfg: Seq2SeqConfig) -> None:
    """Fields of our config that MarianMTModel cannot express raise naming them."""
    fixed = {
        "position": "sinusoidal", "norm": "layernorm", "prenorm": False, "final_norm": False,
        "embed_norm": False, "attn_bias": True, "mlp_bias": True, "norm_bias": True,
        "norm_eps": MARIAN_LAYERNORM_EPS, "final_logits_bias": True,
    }
    for field, want in fixed.items():
        if getattr(cfg, field) != want:
            raise CheckpointError(f"to_hf_marian: {field}={getattr(cfg, field)!r} cannot be expressed in Marian "
                                  f"(needs {want!r})")
    if cfg.kv_heads != cfg.n_heads:
        raise CheckpointError(f"to_hf_marian: n_kv_heads={cfg.n_kv_heads} (grouped-query attention) cannot be "
                              "expressed in Marian")
    if cfg.activation not in TO_HF_ACTIVATION:
        raise CheckpointError(f"to_hf_marian: activation={cfg.activation!r} cannot be expressed in Marian; "
                              f"supported: {sorted(TO_HF_ACTIVATION)}")
    if cfg.pad_token_id is None:
        raise CheckpointError("to_hf_marian: pad_token_id must be set (Marian needs one)")


def hf_marian_config(cfg: Seq2SeqConfig) -> dict[str, Any]:
    """MarianConfig keyword arguments (inference settings: no dropout) for our Seq2SeqConfig."""
    _export_checks(cfg)
    return {
        "model_type": "marian",
        "vocab_size": cfg.vocab_size,
        "decoder_vocab_size": cfg.vocab_size,
        "d_model": cfg.d_model,
        "encoder_layers": cfg.n_layers,
        "decoder_layers": cfg.n_decoder_layers,
        "encoder_attention_heads": cfg.n_heads,
        "decoder_attention_heads": cfg.n_heads,
        "encoder_ffn_dim": cfg.d_ff,
        "decoder_ffn_dim": cfg.d_ff,
        "max_position_embeddings": cfg.max_positions,
        "activation_function": TO_HF_ACTIVATION[cfg.activation],
        "scale_embedding": cfg.scale_embeddings,
        "tie_word_embeddings": cfg.tie_embeddings,
        "share_encoder_decoder_embeddings": True,
        "pad_token_id": cfg.pad_token_id,
        "eos_token_id": cfg.eos_token_id,
        "forced_eos_token_id": cfg.eos_token_id,
        "decoder_start_token_id": cfg.decoder_start_token_id,
        "dropout": 0.0,
        "attention_dropout": 0.0,
        "activation_dropout": 0.0,
        "is_encoder_decoder": True,
    }


def to_hf_marian(model: Seq2Seq) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """(MarianConfig dict, MarianMTModel state dict) for our Seq2Seq.

    The state dict names every tensor MarianMTModel.load_state_dict(strict=True) expects, tied copies
    and sinusoidal tables included; tied names share one tensor, and tensors share storage with
    `model` (clone before changing them). Build the HF model with MarianConfig(**config).
    """
    cfg = model.cfg
    config = hf_marian_config(cfg)
    ours = unfused_state_dict(model)
    state: dict[str, Tensor] = {}
    for theirs, name in _mapping(cfg).items():
        state[theirs] = ours[name]
    shared = state["model.shared.weight"]  # (V, C)
    state["model.encoder.embed_tokens.weight"] = shared
    state["model.decoder.embed_tokens.weight"] = shared
    if cfg.tie_embeddings:
        state["lm_head.weight"] = shared
    table = sinusoidal_table(cfg.max_positions, cfg.d_model).to(shared.device)  # (P, C)
    state["model.encoder.embed_positions.weight"] = table
    state["model.decoder.embed_positions.weight"] = table
    state["final_logits_bias"] = ours["final_logits_bias"].reshape(1, -1)  # (1, V)
    return config, state
