"""Import BERT-family encoders (BERT, MiniLM / sentence-transformers) from Hugging Face `BertModel`
or `BertForSequenceClassification` weights.

Accepted names: a bare `BertModel` (`embeddings.…`, `encoder.layer.…`) or a model with a head
(`bert.embeddings.…`). A sequence classifier (models/checkpoints/heads.py decides) keeps its head:
the pooler (`pooler.dense`, tanh on the first token) and `classifier`, labels from `id2label`.
Otherwise the pooler and pre-training heads (`cls.*`) are ignored, since our encoder pools by mean
(or CLS) itself. Legacy `embeddings.position_ids` buffers are ignored.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..config import EncoderConfig
from ..encoder import EncoderModel
from .format import build_model, load_state_strict
from .heads import has_head, head_fields
from .hf import activation, make_config, need_field, per_layer, rename_strict, require, strip_prefix

SOURCE = "bert checkpoint"
IGNORE = (r"pooler\..*", r"cls\..*", r"embeddings\.position_ids")
HEAD = {"pooler.dense": "head_dense", "classifier": "head"}  # BertForSequenceClassification's head


def config_from_hf(hf_config: dict[str, Any], source: str = SOURCE, **fields: Any) -> EncoderConfig:
    """EncoderConfig for a BertConfig dict: learned positions, token types, embedding norm, post-norm.

    fields: EncoderConfig fields set by the caller (a head's; RoBERTa's position offset)."""
    require(hf_config, "position_embedding_type", lambda v: v in (None, "absolute"),
            "only absolute (learned) positions are supported", source=source)
    require(hf_config, "is_decoder", lambda v: not v, "an encoder as a decoder is not supported", source=source)
    require(hf_config, "add_cross_attention", lambda v: not v, "cross-attention is not supported",
            source=source)
    return post_norm_encoder(
        hf_config, source, BERT_SIZES,
        type_vocab_size=hf_config.get("type_vocab_size", 2),
        norm_eps=hf_config.get("layer_norm_eps", 1e-12),
        activation=activation(hf_config, "hidden_act", source=source),
        **fields,
    )


# our size fields -> BertConfig's names for them
BERT_SIZES = {"d_model": "hidden_size", "n_heads": "num_attention_heads", "d_ff": "intermediate_size",
              "n_layers": "num_hidden_layers"}


def post_norm_encoder(hf_config: dict[str, Any], source: str, sizes: dict[str, str], **fields: Any) -> EncoderConfig:
    """EncoderConfig of a BERT-style encoder (learned positions, an embedding norm, post-norm, mean
    pooling) whose sizes are under the names `sizes` gives (ours -> theirs); `fields` set the rest."""
    vocab = need_field(hf_config, "vocab_size", source)
    pad = hf_config.get("pad_token_id")
    return make_config(
        EncoderConfig, source,
        vocab_size=vocab,
        **{ours: need_field(hf_config, theirs, source) for ours, theirs in sizes.items()},
        max_positions=hf_config.get("max_position_embeddings", 512),
        position="learned", norm="layernorm", prenorm=False, final_norm=False, embed_norm=True, pooling="mean",
        pad_token_id=pad if pad is not None and 0 <= pad < vocab else None,
        **fields,
    )


def with_head(mapping: dict[str, str], head: dict[str, str], cfg: EncoderConfig) -> dict[str, str]:
    """`mapping` plus the head's weights and biases (their module -> ours) when cfg has a head."""
    if cfg.labels:
        mapping.update({f"{theirs}.{p}": f"{ours}.{p}" for theirs, ours in head.items() for p in ("weight", "bias")})
    return mapping


def body_mapping(cfg: EncoderConfig) -> dict[str, str]:
    """BertModel's embeddings and layers -> ours (RoBERTa's too)."""
    m = {
        "embeddings.word_embeddings.weight": "stack.embed.tokens.weight",
        "embeddings.position_embeddings.weight": "stack.embed.positions.weight",
        "embeddings.LayerNorm.weight": "stack.embed.norm.weight",
        "embeddings.LayerNorm.bias": "stack.embed.norm.bias",
    }
    if cfg.type_vocab_size:
        m["embeddings.token_type_embeddings.weight"] = "stack.embed.types.weight"
    parts = {
        "attention.self.query": "self_attn.q_proj",
        "attention.self.key": "self_attn.k_proj",
        "attention.self.value": "self_attn.v_proj",
        "attention.output.dense": "self_attn.o_proj",
        "attention.output.LayerNorm": "self_norm",
        "intermediate.dense": "ff.up",
        "output.dense": "ff.down",
        "output.LayerNorm": "ff_norm",
    }
    return {**m, **per_layer(cfg.n_layers, "encoder.layer", "stack.blocks", parts)}


def from_hf(hf_config: dict[str, Any], state: dict[str, Tensor], dtype: torch.dtype | None = None) -> EncoderModel:
    """Our EncoderModel (eval mode) from a BertConfig dict and a BertModel (or
    BertForSequenceClassification) state dict.

    dtype: cast floating weights to it; None keeps the stored dtype. The model may share storage
    with `state`.
    """
    state = strip_prefix(state, "bert.", "embeddings.word_embeddings.weight")
    head = head_fields(hf_config, state, "classifier.weight", "tanh", SOURCE) if has_head(
        hf_config, state, "classifier.weight", SOURCE) else {}
    cfg = config_from_hf(hf_config, **head)
    ours = rename_strict(state, with_head(body_mapping(cfg), HEAD, cfg), ignore=IGNORE, source=SOURCE)
    return load_state_strict(build_model(cfg), ours, dtype, source=SOURCE)
