"""Import T5 / Flan-T5 (v1.0, v1.1) and mT5 from Hugging Face `T5ForConditionalGeneration` /
`MT5ForConditionalGeneration` weights into our Seq2Seq.

T5: pre-norm RMSNorm with a final norm per stack, no biases, unscaled attention scores, a bucketed
relative position bias (ours: one table per stack, `encoder.relative_bias` / `decoder.relative_bias`),
a ReLU (v1.0) or gated tanh-GELU (v1.1) feed-forward, start token = pad. The head's tying is read from
the weights (transformers 5 always writes `tie_word_embeddings: true`); the decoder output is scaled by
d_model**-0.5 before the head when `scale_decoder_outputs` says so, or in older configs when
`tie_word_embeddings` is not false (v1.0); mT5 never. Task prefixes (`task_specific_params`) go to
Seq2SeqConfig.translation_prefixes. A config our architecture cannot express raises, naming the field.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from ..config import Activation, Seq2SeqConfig
from ..seq2seq import Seq2Seq
from .format import CheckpointError, build_model, load_state_strict
from .hf import check_tied, make_config, need_field, rename_strict, require, token_ids

SOURCE = "t5 checkpoint"
# feed_forward_proj -> (our activation, the dense_act_fn / is_gated_act transformers derives from it)
FEED_FORWARD: dict[str, tuple[Activation, str, bool]] = {
    "relu": ("relu", "relu", False),
    "gated-gelu": ("geglu_tanh", "gelu_new", True),
    "gated-silu": ("swiglu", "silu", True),
}
# model_type -> whether the decoder output is scaled by d_model**-0.5 before the head, by config
SCALE_HEAD: dict[str, Callable[[Mapping[str, Any]], bool]] = {
    "t5": lambda c: bool(c["scale_decoder_outputs"]) if "scale_decoder_outputs" in c
    else c.get("tie_word_embeddings", True) is not False,
    "mt5": lambda c: bool(c.get("scale_decoder_outputs", False)),
}
# HF ignores a relative bias table in the first cross-attention layer (old checkpoints carry one)
IGNORE = (r"decoder\.block\.0\.layer\.1\.EncDecAttention\.relative_attention_bias\.weight",)
_TRANSLATION = re.compile(r"translation_(\w+?)_to_(\w+)")


def _feed_forward(hf_config: Mapping[str, Any]) -> Activation:
    proj = hf_config.get("feed_forward_proj", "relu")
    if proj not in FEED_FORWARD:
        raise CheckpointError(f"{SOURCE}: feed_forward_proj={proj!r} is not supported; supported: "
                              f"{sorted(FEED_FORWARD)}")
    ours, act_fn, gated = FEED_FORWARD[proj]
    # transformers reads these two over feed_forward_proj when stored: they must say the same
    require(hf_config, "dense_act_fn", lambda v: v is None or v == act_fn,
            f"feed_forward_proj={proj!r} needs dense_act_fn={act_fn!r}", source=SOURCE)
    require(hf_config, "is_gated_act", lambda v: v is None or v == gated,
            f"feed_forward_proj={proj!r} needs is_gated_act={gated!r}", source=SOURCE)
    return ours


def translation_prefixes(hf_config: Mapping[str, Any]) -> tuple[tuple[str, str, str], ...]:
    """(source, target, prefix) for every `translation_<src>_to_<tgt>` of task_specific_params."""
    params = hf_config.get("task_specific_params") or {}
    out = []
    for task, settings in sorted(params.items()):
        match = _TRANSLATION.fullmatch(task)
        if match and isinstance(settings, dict) and isinstance(settings.get("prefix"), str):
            out.append((match.group(1), match.group(2), settings["prefix"]))
    return tuple(out)


def config_from_hf(hf_config: dict[str, Any], tied: bool = True) -> Seq2SeqConfig:
    """Seq2SeqConfig for a T5Config / MT5Config dict. tied: whether the checkpoint's head is `shared`
    (the weights say; see the module docstring). Unsupported values raise naming the field."""
    model_type = hf_config.get("model_type", "t5")
    if model_type not in SCALE_HEAD:
        raise CheckpointError(f"{SOURCE}: model_type={model_type!r} is not supported; supported: "
                              f"{sorted(SCALE_HEAD)}")
    other = [a for a in hf_config.get("architectures") or []
             if not str(a).endswith(("ForConditionalGeneration", "Model")) or str(a).endswith("EncoderModel")]
    if other:
        raise CheckpointError(f"{SOURCE}: architectures={other} is not supported: only the encoder-decoder "
                              "(…ForConditionalGeneration) or the bare model")
    require(hf_config, "is_encoder_decoder", lambda v: v is True, "only the encoder-decoder is served",
            default=True, source=SOURCE)
    require(hf_config, "is_decoder", lambda v: not v, "a decoder-only T5 stack is not supported",
            default=False, source=SOURCE)
    d_model = need_field(hf_config, "d_model", SOURCE)
    n_heads = need_field(hf_config, "num_heads", SOURCE)
    d_kv = need_field(hf_config, "d_kv", SOURCE)
    n_layers = need_field(hf_config, "num_layers", SOURCE)
    pad = hf_config.get("pad_token_id", 0)
    if not isinstance(pad, int):
        raise CheckpointError(f"{SOURCE}: pad_token_id={pad!r} must be an id (T5 starts decoding from it)")
    eos = token_ids(hf_config.get("eos_token_id", 1), "eos_token_id", SOURCE)
    if len(eos) != 1:
        raise CheckpointError(f"{SOURCE}: eos_token_id={hf_config.get('eos_token_id')!r}: exactly one "
                              "end-of-sequence id is supported")
    start = hf_config.get("decoder_start_token_id")
    return make_config(
        Seq2SeqConfig, SOURCE,
        vocab_size=need_field(hf_config, "vocab_size", SOURCE),
        d_model=d_model,
        n_heads=n_heads,
        d_head=None if d_kv * n_heads == d_model else d_kv,
        d_ff=need_field(hf_config, "d_ff", SOURCE),
        n_layers=n_layers,
        decoder_layers=hf_config.get("num_decoder_layers") or n_layers,
        max_positions=hf_config.get("n_positions") or 512,  # relative positions: a serving limit, not a table
        position="relative",
        relative_buckets=hf_config.get("relative_attention_num_buckets", 32),
        relative_max_distance=hf_config.get("relative_attention_max_distance", 128),
        scale_attention=False,
        norm="rmsnorm",
        norm_eps=hf_config.get("layer_norm_epsilon", 1e-6),
        prenorm=True,
        final_norm=True,
        embed_norm=False,
        activation=_feed_forward(hf_config),
        attn_bias=False,
        mlp_bias=False,
        scale_embeddings=False,
        tie_embeddings=tied,
        scale_head=SCALE_HEAD[model_type](hf_config),
        final_logits_bias=False,
        pad_token_id=pad,
        eos_token_id=eos[0],
        decoder_start_token_id=start if start is not None else pad,
        translation_prefixes=translation_prefixes(hf_config),
    )


def _layer_parts(cfg: Seq2SeqConfig, cross: bool) -> dict[str, str]:
    """Their names within one block (`layer.N.…`) -> ours."""
    ff = "layer.2" if cross else "layer.1"
    parts = {"layer.0.layer_norm": "self_norm", f"{ff}.layer_norm": "ff_norm"}
    for p in "qkvo":
        parts[f"layer.0.SelfAttention.{p}"] = f"self_attn.{p}_proj"
        if cross:
            parts[f"layer.1.EncDecAttention.{p}"] = f"cross_attn.{p}_proj"
    if cross:
        parts["layer.1.layer_norm"] = "cross_norm"
    if cfg.activation == "relu":
        parts[f"{ff}.DenseReluDense.wi"] = "ff.up"
    else:  # gated: act(wi_0 x) * wi_1 x
        parts[f"{ff}.DenseReluDense.wi_0"] = "ff.gate"
        parts[f"{ff}.DenseReluDense.wi_1"] = "ff.up"
    parts[f"{ff}.DenseReluDense.wo"] = "ff.down"
    return parts


def _mapping(cfg: Seq2SeqConfig) -> dict[str, str]:
    """Their name -> ours, for every tensor we store."""
    m = {"shared.weight": "encoder.embed.tokens.weight"}
    if not cfg.tie_embeddings:
        m["lm_head.weight"] = "lm_head.weight"
    for side, n_layers in (("encoder", cfg.n_layers), ("decoder", cfg.n_decoder_layers)):
        m[f"{side}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"] = f"{side}.relative_bias.weight"
        m[f"{side}.final_layer_norm.weight"] = f"{side}.norm.weight"
        for i in range(n_layers):
            for theirs, ours in _layer_parts(cfg, side == "decoder").items():
                m[f"{side}.block.{i}.{theirs}.weight"] = f"{side}.blocks.{i}.{ours}.weight"
    return m


def from_hf(hf_config: dict[str, Any], state: dict[str, Tensor], dtype: torch.dtype | None = None) -> Seq2Seq:
    """Our Seq2Seq (eval mode) from a T5Config / MT5Config dict and a *ForConditionalGeneration state dict.

    dtype: cast floating weights to it; None keeps the stored dtype. The model may share storage
    with `state`.
    """
    head = state.get("lm_head.weight")
    tied = head is None or torch.equal(head, state.get("shared.weight", head))
    cfg = config_from_hf(hf_config, tied=tied)
    copies = ["encoder.embed_tokens.weight", "decoder.embed_tokens.weight"] + (["lm_head.weight"] if tied else [])
    for copy in copies:
        check_tied(state, copy, "shared.weight", SOURCE)
    ours = rename_strict(state, _mapping(cfg), optional=copies, ignore=IGNORE, source=SOURCE)
    return load_state_strict(build_model(cfg), ours, dtype, source=SOURCE)
