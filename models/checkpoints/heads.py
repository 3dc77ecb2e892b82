"""Hugging Face sequence-classification heads, shared by the encoder importers (bert, roberta,
distilbert): whether a checkpoint carries one, its labels (`id2label`, by id) and how its logits
become scores (`problem_type`).

A head is served by /v1/classify (labels and scores) and, with one output, by /v1/rerank (a
cross-encoder's relevance logit). Heads of other tasks (token classification, question answering,
multiple choice) are refused naming the architecture.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from torch import Tensor

from .format import CheckpointError

HEAD_SUFFIX = "ForSequenceClassification"
# architectures whose extra tensors (pooler, pre-training heads) the importers drop: a bare encoder
BARE_SUFFIXES = ("Model", "ForMaskedLM", "ForPreTraining")
# problem_type -> EncoderConfig.head_scores; regression only with one output (a cross-encoder's score)
PROBLEM_SCORES: dict[str, Literal["softmax", "sigmoid"]] = {
    "single_label_classification": "softmax",
    "multi_label_classification": "sigmoid",
    "regression": "sigmoid",
}


def has_head(hf_config: Mapping[str, Any], state: Mapping[str, Tensor], weight: str, source: str) -> bool:
    """Whether the checkpoint is a sequence classifier (its head's output weight is `weight`).

    config.json's `architectures` decides when present: `…ForSequenceClassification` has a head;
    `…Model`, `…ForMaskedLM`, `…ForPreTraining` are a bare encoder; any other is refused naming
    it. Without architectures (a config dict built in code) the head's tensor decides.
    """
    archs = list(hf_config.get("architectures") or [])
    if any(a.endswith(HEAD_SUFFIX) for a in archs):
        return True
    other = [a for a in archs if not a.endswith(BARE_SUFFIXES)]
    if other:
        raise CheckpointError(f"{source}: architectures={other} is not supported: we serve a bare encoder or "
                              f"a sequence-classification head (…{HEAD_SUFFIX})")
    return not archs and weight in state


def head_fields(hf_config: Mapping[str, Any], state: Mapping[str, Tensor], weight: str,
                dense: Literal["tanh", "relu"], source: str) -> dict[str, Any]:
    """EncoderConfig fields of a sequence-classification head on the first token: labels in id
    order (LABEL_i without id2label), the dense layer's activation and the score function."""
    if weight not in state:
        raise CheckpointError(f"{source}: missing tensors: [{weight!r}] (the classifier head)")
    n = state[weight].shape[0]
    id2label = hf_config.get("id2label") or {}
    try:
        by_id = {int(k): str(v) for k, v in id2label.items()}
    except (TypeError, ValueError):
        raise CheckpointError(f"{source}: id2label keys must be integer ids, got {sorted(id2label)}") from None
    if by_id and sorted(by_id) != list(range(n)):
        raise CheckpointError(f"{source}: id2label has ids {sorted(by_id)}, but the classifier has {n} outputs")
    labels = tuple(by_id[i] for i in range(n)) if by_id else tuple(f"LABEL_{i}" for i in range(n))
    problem = hf_config.get("problem_type")
    if problem is not None and problem not in PROBLEM_SCORES:
        raise CheckpointError(f"{source}: problem_type={problem!r} is not supported; "
                              f"supported: {sorted(PROBLEM_SCORES)}")
    if problem == "regression" and n != 1:
        raise CheckpointError(f"{source}: problem_type='regression' with {n} outputs is not supported "
                              "(one output is: a cross-encoder's score)")
    scores = PROBLEM_SCORES[problem] if problem is not None else ("sigmoid" if n == 1 else "softmax")
    return {"labels": labels, "head_pooling": "cls", "head_dense": dense, "head_scores": scores}
