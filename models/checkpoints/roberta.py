"""Import RoBERTa-family encoders (RoBERTa, XLM-RoBERTa) from Hugging Face `RobertaModel` or
`RobertaForSequenceClassification` weights.

The body is BERT's (same tensor names under `roberta.`, see bert.py) with two differences our
config expresses: positions count from `padding_idx + 1` (`position_offset`: the first token sits
at row pad + 1 of the table, so a 514-row table holds 512 tokens), and one token type. The head
reads the first token: `classifier.dense` + tanh, then `classifier.out_proj`; there is no pooler
(a bare RobertaModel's `pooler.*` and a masked-LM `lm_head.*` are ignored).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..config import EncoderConfig
from ..encoder import EncoderModel
from . import bert
from .format import build_model, load_state_strict
from .heads import has_head, head_fields
from .hf import need_field, rename_strict, strip_prefix

SOURCE = "roberta checkpoint"
IGNORE = (r"pooler\..*", r"lm_head\..*", r"embeddings\.position_ids")
HEAD = {"classifier.dense": "head_dense", "classifier.out_proj": "head"}
HEAD_WEIGHT = "classifier.out_proj.weight"


def config_from_hf(hf_config: dict[str, Any], **fields: Any) -> EncoderConfig:
    """EncoderConfig for a RobertaConfig (or XLMRobertaConfig) dict: BERT's, with positions offset
    past the padding index and RoBERTa's defaults (one token type, LayerNorm eps 1e-5)."""
    pad = need_field(hf_config, "pad_token_id", SOURCE)  # the position table's padding row
    defaults = {"type_vocab_size": 1, "layer_norm_eps": 1e-5}
    return bert.config_from_hf({**defaults, **hf_config}, SOURCE, position_offset=pad + 1, **fields)


def from_hf(hf_config: dict[str, Any], state: dict[str, Tensor], dtype: torch.dtype | None = None) -> EncoderModel:
    """Our EncoderModel (eval mode) from a RobertaConfig dict and a RobertaModel (or
    RobertaForSequenceClassification) state dict. dtype: as bert.from_hf."""
    state = strip_prefix(state, "roberta.", "embeddings.word_embeddings.weight")
    head = head_fields(hf_config, state, HEAD_WEIGHT, "tanh", SOURCE) if has_head(
        hf_config, state, HEAD_WEIGHT, SOURCE) else {}
    cfg = config_from_hf(hf_config, **head)
    mapping = bert.with_head(bert.body_mapping(cfg), HEAD, cfg)
    ours = rename_strict(state, mapping, ignore=IGNORE, source=SOURCE)
    return load_state_strict(build_model(cfg), ours, dtype, source=SOURCE)
