"""A classification adapter's own head: PEFT's `modules_to_save` on a sequence classifier (PEFT saves the
head of a SEQ_CLS adapter whole: `classifier` for BERT and DistilBERT, `classifier.dense` +
`classifier.out_proj` for RoBERTa, and the pooler or `pre_classifier` where they were trained too).

`adapter_head(adapter, model)` maps the saved tensors onto the encoder's head (EncoderModel.head_dense and
.head): what the adapter saves replaces the base's part, the rest stays the base's. Its labels and score
function come from a `config.json` beside the adapter (its `id2label` and `problem_type`, as
`save_pretrained` of the classifier writes them), else the base model's where the head has as many
outputs, else LABEL_i and the score function transformers infers from the output count. Anything else
an adapter saves (an LM head, embeddings) is refused by name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from .peft import AdapterError, LoraAdapter

if TYPE_CHECKING:  # models/attention.py imports this package: the encoder and the importers come later
    from ..encoder import HeadWeights

# a sequence classifier's head modules, as transformers names them (without the family's prefix) -> ours
_HEAD = {"classifier": "head", "classifier.out_proj": "head", "classifier.dense": "head_dense",
         "pooler.dense": "head_dense", "pre_classifier": "head_dense"}
_PREFIXES = ("bert.", "roberta.", "distilbert.")


@dataclass(frozen=True)
class AdapterHead:
    """The head a classification adapter's rows are labelled by."""

    weights: HeadWeights
    labels: tuple[str, ...]


def _parts(adapter: LoraAdapter) -> dict[str, dict[str, torch.Tensor]]:
    """Our head part ("head", "head_dense") -> {"weight": .., "bias": ..} from the adapter's saved modules."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in adapter.saved.items():
        module, _, kind = key.rpartition(".")
        for prefix in _PREFIXES:
            module = module.removeprefix(prefix)
        part = _HEAD.get(module)
        if part is None or kind not in ("weight", "bias"):
            raise AdapterError(f"adapter {adapter.name!r} saves {key.rpartition('.')[0]!r} (modules_to_save); only a "
                               "sequence classifier's head is served (classifier, its dense layer, the pooler)")
        parts.setdefault(part, {})[kind] = tensor
    return parts


def _labels(adapter: LoraAdapter, weight: torch.Tensor, base_labels: tuple[str, ...],
            base_scores: str) -> tuple[tuple[str, ...], str]:
    from ..checkpoints.format import CheckpointError
    from ..checkpoints.heads import head_fields

    config = Path(adapter.path) / "config.json"
    if config.is_file():
        try:
            fields = head_fields(json.loads(config.read_text()), {"w": weight}, "w", "tanh", str(config))
        except (OSError, ValueError, CheckpointError) as e:
            raise AdapterError(f"adapter {adapter.name!r}: {e}") from None
        return fields["labels"], fields["head_scores"]
    n = weight.size(0)
    if n == len(base_labels):
        return base_labels, base_scores
    return tuple(f"LABEL_{i}" for i in range(n)), "sigmoid" if n == 1 else "softmax"


def adapter_head(adapter: LoraAdapter, model: nn.Module) -> AdapterHead | None:
    """The head `adapter`'s rows of `model` (an EncoderModel) are labelled by; None when it saves none.
    AdapterError when it saves a module that is not a classifier's head, or one that does not fit."""
    from ..encoder import HeadWeights

    if not adapter.saved:
        return None
    parts = _parts(adapter)
    base_out, base_dense = getattr(model, "head", None), getattr(model, "head_dense", None)
    if base_out is None:
        raise AdapterError(f"adapter {adapter.name!r} saves a classification head, and this model has none to replace "
                           "(serve the adapter on a deployment of a sequence classifier)")
    if "head_dense" in parts and base_dense is None:
        raise AdapterError(f"adapter {adapter.name!r} saves a dense layer before its classifier, which this model's "
                           "head does not have")
    width, like = base_out.in_features, base_out.weight

    def take(part: str, base: nn.Linear, rows: int | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        saved = parts.get(part)
        if saved is None:
            return base.weight, base.bias
        w, b = saved.get("weight"), saved.get("bias")
        if w is None or w.dim() != 2 or w.size(1) != width or (rows is not None and w.size(0) != rows):
            raise AdapterError(f"adapter {adapter.name!r}: its {part.replace('_', ' ')} weight is "
                               f"{None if w is None else tuple(w.shape)}; this model's takes {width} inputs")
        if b is not None and b.shape != (w.size(0),):
            raise AdapterError(f"adapter {adapter.name!r}: its {part.replace('_', ' ')} bias is {tuple(b.shape)}, "
                               f"not ({w.size(0)},)")
        cast = {"dtype": like.dtype, "device": like.device}
        return w.to(**cast), None if b is None else b.to(**cast)

    dense_w, dense_b = take("head_dense", base_dense, width) if base_dense is not None else (None, None)
    out_w, out_b = take("head", base_out, None)
    labels, scores = _labels(adapter, out_w, tuple(model.cfg.labels), model.cfg.head_scores)
    return AdapterHead(HeadWeights(dense_w, dense_b, out_w, out_b, scores), labels)
