"""Our encoder and decoder weights as transformers models (the inverse of models.checkpoints.bert/llama).

Only for the baseline systems on sources transformers cannot open by itself (the `tiny:` test models);
the default models are opened by transformers from their own files (see hf_models.py). The name
mappings are the importers' own (`body_mapping`, `_mapping`), read backwards, so the two directions cannot drift.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from models.checkpoints.bert import body_mapping as bert_mapping
from models.checkpoints.hf import HF_ACTIVATIONS
from models.checkpoints.llama import _mapping as llama_mapping
from models.decoder import DecoderLM
from models.encoder import EncoderModel
from models.projections.fuse import unfused_state_dict

# ours -> transformers' ACT2FN name (the first HF name that imports as ours)
TO_HF_ACTIVATION: dict[str, str] = {}
for _theirs, _ours in HF_ACTIVATIONS.items():
    TO_HF_ACTIVATION.setdefault(_ours, _theirs)


def _renamed(ours: dict[str, Tensor], mapping: dict[str, str], prefix: str = "") -> dict[str, Tensor]:
    return {prefix + theirs: ours[name] for theirs, name in mapping.items()}


def to_hf_bert(model: EncoderModel) -> nn.Module:
    """A transformers BertModel (no pooler) with our encoder's weights; the head is not part of it.

    Our config must be BERT's shape (learned positions, post-norm LayerNorm, embedding norm); a config
    without token types gets one all-zero type embedding (BERT always adds one).
    """
    from transformers import BertConfig, BertModel

    cfg = model.cfg
    wrong = {
        k: getattr(cfg, k)
        for k, want in (
            ("position", "learned"),
            ("norm", "layernorm"),
            ("prenorm", False),
            ("embed_norm", True),
            ("final_norm", False),
        )
        if getattr(cfg, k) != want
    }
    if wrong or cfg.activation not in TO_HF_ACTIVATION:
        raise ValueError(
            f"to_hf_bert: this encoder is not BERT-shaped: {wrong or {'activation': cfg.activation}}"
        )
    hf = BertModel(
        BertConfig(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.d_model,
            num_hidden_layers=cfg.n_layers,
            num_attention_heads=cfg.n_heads,
            intermediate_size=cfg.d_ff,
            hidden_act=TO_HF_ACTIVATION[cfg.activation],
            max_position_embeddings=cfg.max_positions,
            type_vocab_size=max(1, cfg.type_vocab_size),
            layer_norm_eps=cfg.norm_eps,
            pad_token_id=cfg.pad_token_id or 0,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        ),
        add_pooling_layer=False,
    )
    state = _renamed(unfused_state_dict(model), bert_mapping(cfg))
    if not cfg.type_vocab_size:
        state["embeddings.token_type_embeddings.weight"] = torch.zeros(1, cfg.d_model)  # (1, C)
    missing, unexpected = hf.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("position_ids")]
    if missing or unexpected:
        raise ValueError(f"to_hf_bert: missing {missing}, unexpected {unexpected}")
    return hf.eval()


def to_hf_llama(model: DecoderLM) -> nn.Module:
    """A transformers LlamaForCausalLM with our decoder's weights (rotary, RMSNorm, SwiGLU, GQA)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = model.cfg
    wrong = {
        k: getattr(cfg, k)
        for k, want in (
            ("position", "rotary"),
            ("norm", "rmsnorm"),
            ("prenorm", True),
            ("activation", "swiglu"),
            ("final_norm", True),
        )
        if getattr(cfg, k) != want
    }
    if wrong:
        raise ValueError(f"to_hf_llama: this decoder is not Llama-shaped: {wrong}")
    eos = list(cfg.eos_token_ids)
    hf = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.d_model,
            intermediate_size=cfg.d_ff,
            num_hidden_layers=cfg.n_layers,
            num_attention_heads=cfg.n_heads,
            num_key_value_heads=cfg.kv_heads,
            max_position_embeddings=cfg.max_positions,
            rms_norm_eps=cfg.norm_eps,
            rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
            attention_bias=cfg.attn_bias,
            mlp_bias=cfg.mlp_bias,
            tie_word_embeddings=cfg.tie_embeddings,
            bos_token_id=cfg.bos_token_id,
            eos_token_id=eos[0] if len(eos) == 1 else eos,
            pad_token_id=cfg.pad_token_id,
        )
    )
    state = _renamed(unfused_state_dict(model), llama_mapping(cfg), prefix="model.")
    if cfg.tie_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    else:
        state["lm_head.weight"] = state.pop("model.lm_head.weight")
    hf.load_state_dict(state, strict=True)
    return hf.eval()
