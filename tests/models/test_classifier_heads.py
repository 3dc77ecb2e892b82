"""Hugging Face sequence-classification heads (BERT, RoBERTa / XLM-RoBERTa, DistilBERT) imported
into our EncoderModel: logits equal transformers' on padded batches, padded = alone, labels from
id2label, scores by problem_type, our checkpoint format round trip, and clear refusals.

Dimension legend: B batch rows (3, of different lengths), T padded length, C width, L labels.
Every HF parameter is perturbed away from its init, so a wrongly mapped norm, bias or head layer
cannot hide.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as hf
from torch import Tensor

from models.checkpoints import bert, distilbert, roberta
from models.checkpoints.format import CheckpointError, load_checkpoint, save_checkpoint
from models.checkpoints.registry import import_hf, import_hf_dir
from models.config import EncoderConfig
from models.encoder import EncoderModel
from tests.models.test_parity import assert_close_rel, perturb

pytestmark = pytest.mark.usefixtures("one_torch_thread")
VOCAB = 100
LENGTHS = (7, 4, 2)  # three rows, T = 7
LABELS = {"2": "positive", "0": "negative", "1": "neutral"}  # as in a config.json: string ids, any order
SMALL = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
             max_position_embeddings=40, attn_implementation="eager")


def padded(side: str, pad: int, seed: int = 1) -> tuple[Tensor, Tensor]:
    """ids (B, T) with `pad` at padding (never inside a row) and keep (B, T) bool."""
    g = torch.Generator().manual_seed(seed)
    t = max(LENGTHS)
    slots = torch.arange(t)[None, :]  # (1, T)
    lengths = torch.tensor(LENGTHS)[:, None]  # (B, 1)
    keep = slots < lengths if side == "right" else slots >= t - lengths  # (B, T)
    ids = torch.randint(3, VOCAB, (len(LENGTHS), t), generator=g).masked_fill(~keep, pad)  # (B, T)
    return ids, keep


def _bert(**extra: Any) -> hf.PreTrainedModel:
    return hf.BertForSequenceClassification(hf.BertConfig(**SMALL, type_vocab_size=2, pad_token_id=0, **extra))


def _roberta(**extra: Any) -> hf.PreTrainedModel:
    return hf.RobertaForSequenceClassification(hf.RobertaConfig(**SMALL, type_vocab_size=1, pad_token_id=1, **extra))


def _xlm_roberta(**extra: Any) -> hf.PreTrainedModel:
    return hf.XLMRobertaForSequenceClassification(hf.XLMRobertaConfig(**SMALL, type_vocab_size=1, pad_token_id=1,
                                                                      **extra))


def _distilbert(**extra: Any) -> hf.PreTrainedModel:
    return hf.DistilBertForSequenceClassification(hf.DistilBertConfig(
        vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, hidden_dim=64, max_position_embeddings=40, pad_token_id=0,
        attn_implementation="eager", **extra))


# name -> (builder, importer, pad id). HF's heads read slot 0, so their logits are compared on
# right-padded rows; RoBERTa's offset positions also on left-padded ones (its hidden states).
HEADS: dict[str, tuple[Callable[..., hf.PreTrainedModel], Callable[..., EncoderModel], int]] = {
    "bert": (_bert, bert.from_hf, 0),
    "roberta": (_roberta, roberta.from_hf, 1),
    "xlm-roberta": (_xlm_roberta, roberta.from_hf, 1),
    "distilbert": (_distilbert, distilbert.from_hf, 0),
}


def imported(name: str, seed: int = 0, **extra: Any) -> tuple[hf.PreTrainedModel, EncoderModel]:
    build, importer, _ = HEADS[name]
    torch.manual_seed(seed)
    ref = perturb(build(num_labels=3, id2label=LABELS, **extra), skip=("position_embeddings",)
                  if extra.get("sinusoidal_pos_embds") else ())
    return ref, importer(ref.config.to_dict(), ref.state_dict())


def reference_logits(ref: hf.PreTrainedModel, ids: Tensor, keep: Tensor, types: Tensor | None = None) -> Tensor:
    kwargs = {} if types is None else {"token_type_ids": types}
    with torch.no_grad():
        return ref(input_ids=ids, attention_mask=keep.long(), **kwargs).logits  # (B, L)


@pytest.mark.parametrize("name", sorted(HEADS))
def test_logits_match_transformers_on_a_padded_batch(name: str) -> None:
    ref, ours = imported(name)
    ids, keep = padded("right", HEADS[name][2])
    with torch.no_grad():
        got = ours.classify(ids, keep)  # (B, L)
    assert_close_rel(got, reference_logits(ref, ids, keep))
    assert ours.cfg.labels == ("negative", "neutral", "positive")  # id2label by id, not by key order


@pytest.mark.parametrize("side", ["right", "left"])
def test_roberta_offset_positions_match_on_either_padding(side: str) -> None:
    """RoBERTa counts positions from padding_idx + 1 over non-pad tokens, so left padding works too."""
    ref, ours = imported("roberta")
    ids, keep = padded(side, HEADS["roberta"][2])
    with torch.no_grad():
        want = ref.roberta(input_ids=ids, attention_mask=keep.long()).last_hidden_state  # (B, T, C)
        got = ours(ids, keep)  # (B, T, C)
    assert_close_rel(got[keep], want[keep])


def test_bert_token_types_reach_the_classifier() -> None:
    ref, ours = imported("bert")
    ids, keep = padded("right", 0)
    types = torch.zeros_like(ids)
    types[:, 3:] = 1  # (B, T): a second segment, as a pair encoding gives
    with torch.no_grad():
        got, plain = ours.classify(ids, keep, types), ours.classify(ids, keep)
    assert_close_rel(got, reference_logits(ref, ids, keep, types))
    assert not torch.allclose(got, plain, atol=1e-4)  # the types change the logits


def test_distilbert_sinusoidal_positions_load_from_the_stored_table() -> None:
    ref, ours = imported("distilbert", sinusoidal_pos_embds=True)
    table = ref.distilbert.embeddings.position_embeddings.weight
    assert torch.allclose(table[1, 0::2][:1], torch.sin(torch.ones(1)))  # HF's sinusoidal table (pos 1, dim 0)
    assert torch.equal(ours.stack.embed.positions.weight, table)
    ids, keep = padded("right", 0)
    with torch.no_grad():
        assert_close_rel(ours.classify(ids, keep), reference_logits(ref, ids, keep))


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("name", sorted(HEADS))
def test_a_padded_row_equals_the_row_alone(name: str, side: str) -> None:
    _, ours = imported(name)
    ids, keep = padded(side, HEADS[name][2])
    with torch.no_grad():
        batched = ours.classify(ids, keep)  # (B, L)
        for row in range(ids.size(0)):
            alone = ours.classify(ids[row][keep[row]][None])  # (1, L)
            torch.testing.assert_close(batched[row], alone[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", sorted(HEADS))
def test_our_checkpoint_format_round_trips_the_head(name: str, tmp_path: Path) -> None:
    _, ours = imported(name)
    back = load_checkpoint(save_checkpoint(ours, tmp_path / name))
    assert back.cfg == ours.cfg and EncoderConfig.from_dict(ours.cfg.to_dict()) == ours.cfg
    ids, keep = padded("right", HEADS[name][2])
    with torch.no_grad():
        assert torch.equal(back.classify(ids, keep), ours.classify(ids, keep))


def test_roberta_positions_are_offset_in_the_config() -> None:
    _, ours = imported("roberta")
    assert ours.cfg.position_offset == 2 and ours.cfg.max_tokens == 38  # 40 rows, the first two padding's
    assert ours.cfg.type_vocab_size == 1 and ours.cfg.head_dense == "tanh" and ours.cfg.head_pooling == "cls"


@pytest.mark.parametrize(("extra", "num_labels", "scores"), [
    ({}, 3, "softmax"),
    ({"problem_type": "single_label_classification"}, 3, "softmax"),
    ({"problem_type": "multi_label_classification"}, 3, "sigmoid"),
    ({}, 1, "sigmoid"),  # a cross-encoder: one relevance logit
    ({"problem_type": "regression"}, 1, "sigmoid"),
])
def test_problem_type_chooses_the_score_function(extra: dict[str, Any], num_labels: int, scores: str) -> None:
    torch.manual_seed(0)
    ref = perturb(_bert(num_labels=num_labels, **extra))
    ours = bert.from_hf(ref.config.to_dict(), ref.state_dict())
    assert ours.cfg.head_scores == scores and len(ours.cfg.labels) == num_labels
    logits = torch.tensor([[0.5, -1.0, 2.0][:num_labels]])  # (1, L)
    want = logits.softmax(-1) if scores == "softmax" else logits.sigmoid()
    assert torch.equal(ours.scores(logits), want)


def test_hf_directories_import_by_model_type_with_their_architecture(tmp_path: Path) -> None:
    for name in ("bert", "xlm-roberta", "distilbert"):
        ref, ours = imported(name)
        ref.save_pretrained(tmp_path / name, safe_serialization=True)
        loaded = import_hf_dir(tmp_path / name)
        assert loaded.cfg == ours.cfg, name
        ids, keep = padded("right", HEADS[name][2])
        with torch.no_grad():
            assert_close_rel(loaded.classify(ids, keep), reference_logits(ref, ids, keep))


def test_a_bare_encoder_still_ignores_the_pooler() -> None:
    torch.manual_seed(0)
    ref = perturb(hf.BertModel(hf.BertConfig(**SMALL, pad_token_id=0)))
    ours = bert.from_hf({**ref.config.to_dict(), "architectures": ["BertModel"]}, ref.state_dict())
    assert ours.head is None and ours.head_dense is None and ours.cfg.labels == ()


def _config(name: str, **changes: Any) -> tuple[dict[str, Any], dict[str, Tensor]]:
    ref, _ = imported(name)
    return {**ref.config.to_dict(), **changes}, ref.state_dict()


REFUSED = {
    "token classification": ("bert", {"architectures": ["BertForTokenClassification"]}, "BertForTokenClassification"),
    "question answering": ("distilbert", {"architectures": ["DistilBertForQuestionAnswering"]},
                           "DistilBertForQuestionAnswering"),
    "problem type": ("roberta", {"problem_type": "ordinal"}, "problem_type='ordinal'"),
    "regression with labels": ("bert", {"problem_type": "regression"}, "regression' with 3 outputs"),
    "id2label ids": ("bert", {"id2label": {"0": "a", "1": "b", "5": "c"}}, r"id2label has ids \[0, 1, 5\]"),
    "duplicate labels": ("distilbert", {"id2label": {"0": "a", "1": "a", "2": "b"}}, "duplicate labels"),
    "relative positions": ("roberta", {"position_embedding_type": "relative_key"}, "position_embedding_type"),
    "activation": ("distilbert", {"activation": "tanh"}, "activation='tanh'"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_what_we_cannot_serve_is_refused_naming_it(case: str) -> None:
    name, changes, message = REFUSED[case]
    config, state = _config(name, **changes)
    with pytest.raises(CheckpointError, match=message):
        import_hf(config, state)


def test_a_classifier_without_its_head_tensors_names_them() -> None:
    config, state = _config("roberta", architectures=["RobertaForSequenceClassification"])
    del state["classifier.dense.bias"]
    with pytest.raises(CheckpointError, match=r"missing tensors: \['classifier.dense.bias'\]"):
        roberta.from_hf(config, state)
