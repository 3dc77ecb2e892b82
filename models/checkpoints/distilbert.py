"""Import DistilBERT encoders from Hugging Face `DistilBertModel` or
`DistilBertForSequenceClassification` weights.

DistilBERT is a post-norm BERT without token types and with its own tensor names (`q_lin`,
`k_lin`, `v_lin`, `out_lin`, `sa_layer_norm`, `ffn.lin1`/`lin2`, `output_layer_norm`, under
`distilbert.`), LayerNorm eps 1e-12 (fixed in its code). Sinusoidal positions
(`sinusoidal_pos_embds`) are a fixed table that the checkpoint stores as its position embedding
weight, so they load as our learned positions, unchanged. The head reads the first token:
`pre_classifier` + ReLU, then `classifier`. Masked-LM tensors (`vocab_*`) are ignored.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..config import EncoderConfig
from ..encoder import EncoderModel
from .bert import post_norm_encoder, with_head
from .format import build_model, load_state_strict
from .heads import has_head, head_fields
from .hf import activation, per_layer, rename_strict, strip_prefix

SOURCE = "distilbert checkpoint"
IGNORE = (r"vocab_transform\..*", r"vocab_layer_norm\..*", r"vocab_projector\..*", r"embeddings\.position_ids")
HEAD = {"pre_classifier": "head_dense", "classifier": "head"}
LAYER_NORM_EPS = 1e-12  # DistilBERT's nn.LayerNorm(eps=1e-12), not configurable
PARTS = {
    "attention.q_lin": "self_attn.q_proj",
    "attention.k_lin": "self_attn.k_proj",
    "attention.v_lin": "self_attn.v_proj",
    "attention.out_lin": "self_attn.o_proj",
    "sa_layer_norm": "self_norm",
    "ffn.lin1": "ff.up",
    "ffn.lin2": "ff.down",
    "output_layer_norm": "ff_norm",
}


def config_from_hf(hf_config: dict[str, Any], **fields: Any) -> EncoderConfig:
    """EncoderConfig for a DistilBertConfig dict: learned positions (the sinusoidal table is stored),
    no token types, embedding norm, post-norm."""
    return post_norm_encoder(
        hf_config, SOURCE, {"d_model": "dim", "n_heads": "n_heads", "d_ff": "hidden_dim", "n_layers": "n_layers"},
        type_vocab_size=0,
        norm_eps=LAYER_NORM_EPS,
        activation=activation(hf_config, "activation", source=SOURCE),
        **fields,
    )


def _mapping(cfg: EncoderConfig) -> dict[str, str]:
    m = {
        "embeddings.word_embeddings.weight": "stack.embed.tokens.weight",
        "embeddings.position_embeddings.weight": "stack.embed.positions.weight",
        "embeddings.LayerNorm.weight": "stack.embed.norm.weight",
        "embeddings.LayerNorm.bias": "stack.embed.norm.bias",
    }
    return with_head({**m, **per_layer(cfg.n_layers, "transformer.layer", "stack.blocks", PARTS)}, HEAD, cfg)


def from_hf(hf_config: dict[str, Any], state: dict[str, Tensor], dtype: torch.dtype | None = None) -> EncoderModel:
    """Our EncoderModel (eval mode) from a DistilBertConfig dict and a DistilBertModel (or
    DistilBertForSequenceClassification) state dict. dtype: as bert.from_hf."""
    state = strip_prefix(state, "distilbert.", "embeddings.word_embeddings.weight")
    head = head_fields(hf_config, state, "classifier.weight", "relu", SOURCE) if has_head(
        hf_config, state, "classifier.weight", SOURCE) else {}
    cfg = config_from_hf(hf_config, **head)
    ours = rename_strict(state, _mapping(cfg), ignore=IGNORE, source=SOURCE)
    return load_state_strict(build_model(cfg), ours, dtype, source=SOURCE)
