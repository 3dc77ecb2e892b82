"""LoRA adapter directories of the tiny models, in PEFT's format, for tests over HTTP."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from models.adapters.peft import random_llama_factors, save_adapter
from models.tiny import tiny_model

# our encoder projection -> its BERT module name in an adapter
BERT_NAMES = {"q_proj": "attention.self.query", "v_proj": "attention.self.value", "o_proj": "attention.output.dense",
              "up_proj": "intermediate.dense", "down_proj": "output.dense"}


def encoder_adapter(where: Path, seed: int, labels: tuple[str, ...] | None) -> Path:
    """A rank-4 adapter of tiny:encoder named as a BERT adapter, with its own classification head of
    `labels` (and a config.json naming them) unless None."""
    model, _ = tiny_model("encoder")
    factors = {}
    for name, (a, b) in random_llama_factors(model, 4, seed=seed, std=0.3, modules=tuple(BERT_NAMES)).items():
        layer, proj = name.split(".")[2], name.rsplit(".", 1)[-1]
        factors[f"bert.encoder.layer.{layer}.{BERT_NAMES[proj]}"] = (a, b)
    saved = None
    if labels is not None:
        g = torch.Generator().manual_seed(seed)
        saved = {"classifier.weight": torch.randn(len(labels), model.cfg.d_model, generator=g),
                 "classifier.bias": torch.randn(len(labels), generator=g)}
    save_adapter(where, factors, 4, 8, "SEQ_CLS" if labels else "FEATURE_EXTRACTION", saved)
    if labels is not None:
        (where / "config.json").write_text(json.dumps({"id2label": dict(enumerate(labels))}))
    return where
