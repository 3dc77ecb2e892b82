"""The default sentiment classifier: the committed head files, the helpers that trained it, and (slow)
the real encoder + head labelling obvious sentences.

The slow test fails, rather than skips, when the weights are missing: `make weights` fetches them.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from models import zoo
from models.catalog import BUILTIN_DIR, DEFAULT_SPECS, _attach_head, load_model
from models.config import EncoderConfig
from models.encoder import EncoderModel
from models.train.sentiment import LABELS, clean_text, fit_linear, scores, stratified_split

HEAD_DIR = BUILTIN_DIR / "sentiment-head"
D_MODEL = 384  # MiniLM-L6 width: the head's input


def test_head_files_have_the_shapes_and_labels_the_catalog_expects() -> None:
    meta = json.loads((HEAD_DIR / "head.json").read_text())
    tensors = load_file(HEAD_DIR / "head.safetensors")
    assert tuple(meta["labels"]) == LABELS == ("negative", "neutral", "positive")
    assert meta["base_model"] == DEFAULT_SPECS["encoder"].source
    assert (meta["pooling"], meta["normalized"]) == ("mean", True)
    assert set(tensors) == {"weight", "bias"}
    assert tensors["weight"].shape == (len(LABELS), D_MODEL) and tensors["bias"].shape == (len(LABELS),)
    assert tensors["weight"].dtype == tensors["bias"].dtype == torch.float32
    assert torch.isfinite(tensors["weight"]).all() and torch.isfinite(tensors["bias"]).all()


def test_head_attaches_to_an_encoder_and_classify_is_the_linear_map(tmp_path: Path) -> None:
    torch.manual_seed(0)
    cfg = EncoderConfig(vocab_size=50, d_model=D_MODEL, n_heads=4, d_ff=32, n_layers=1, max_positions=16,
                        prenorm=False, final_norm=False, embed_norm=True, pad_token_id=0)
    model, labels = _attach_head(EncoderModel(cfg).eval(), "builtin:sentiment-head", tmp_path)
    tensors = load_file(HEAD_DIR / "head.safetensors")
    ids = torch.randint(1, 50, (2, 7))  # (B, T)
    keep = torch.tensor([[True] * 7, [True] * 4 + [False] * 3])  # (B, T)
    with torch.no_grad():
        got = model.classify(ids, keep)  # (B, n_labels)
        expected = model.embed(ids, keep) @ tensors["weight"].T + tensors["bias"]  # (B, n_labels)
    assert labels == LABELS
    torch.testing.assert_close(got, expected)


def test_metrics_beat_the_majority_baseline() -> None:
    metrics = json.loads((HEAD_DIR / "metrics.json").read_text())
    test, baseline = metrics["test"], metrics["test_majority_baseline"]
    assert metrics["labels"] == list(LABELS)
    assert sum(map(sum, test["confusion"])) == test["n"] == metrics["split_sizes"]["test"]
    assert test["macro_f1"] > baseline["macro_f1"] + 0.3 and test["accuracy"] > baseline["accuracy"] + 0.2


def test_stratified_split_is_disjoint_complete_stratified_and_seeded() -> None:
    labels = np.repeat([0, 1, 2], [500, 300, 200])
    split = stratified_split(labels, seed=3)
    joined = np.concatenate(list(split.values()))
    assert np.array_equal(np.sort(joined), np.arange(len(labels)))  # every row exactly once
    assert [len(split[k]) for k in ("train", "validation", "test")] == [800, 100, 100]
    assert np.bincount(labels[split["test"]]).tolist() == [50, 30, 20]
    again = stratified_split(labels, seed=3)
    assert all(np.array_equal(split[k], again[k]) for k in split)
    assert not np.array_equal(split["test"], stratified_split(labels, seed=4)["test"])


def test_scores_on_a_known_confusion_matrix() -> None:
    y_true = torch.tensor([0, 0, 0, 1, 1, 2])
    y_pred = torch.tensor([0, 0, 1, 1, 2, 2])
    got = scores(y_true, y_pred)
    assert got["confusion"] == [[2, 1, 0], [0, 1, 1], [0, 0, 1]]
    assert got["accuracy"] == round(4 / 6, 4)
    f1 = {"negative": 0.8, "neutral": 0.5, "positive": 2 / 3}  # 2PR/(P+R) per class
    assert got["f1"] == pytest.approx(f1, abs=1e-4)
    assert got["macro_f1"] == pytest.approx(sum(f1.values()) / 3, abs=1e-4)


def test_fit_linear_separates_separable_classes() -> None:
    gen = torch.Generator().manual_seed(0)
    centres = torch.eye(3, 8) * 4  # (k, C)
    y = torch.arange(3).repeat_interleave(40)  # (N,)
    x = centres[y] + torch.randn(len(y), 8, generator=gen)  # (N, C)
    head = fit_linear(x, y, weight_decay=1e-4, weights=None)
    assert head.weight.shape == (3, 8) and head.bias.shape == (3,)
    assert (head(x).argmax(-1) == y).float().mean() > 0.97


def test_clean_text_drops_mojibake_and_unescapes_html() -> None:
    assert clean_text("cars\u00d1 are   great &amp; fast\r\n") == "cars are great & fast"


@pytest.mark.slow
def test_default_classifier_labels_obvious_sentences() -> None:
    cache_dir = zoo.default_cache_dir()
    try:
        loaded = load_model(DEFAULT_SPECS["encoder"], cache_dir)
    except zoo.WeightsMissingError as e:
        pytest.fail(str(e))
    texts = ["I absolutely love this!", "This is terrible, I hate it."]
    ids = loaded.tokenizer.encode_batch(texts)
    width = max(map(len, ids))
    batch = torch.tensor([seq + [0] * (width - len(seq)) for seq in ids])  # (B, T)
    keep = torch.tensor([[True] * len(seq) + [False] * (width - len(seq)) for seq in ids])  # (B, T)
    with torch.inference_mode():
        probs = loaded.model.classify(batch, keep).softmax(-1)  # (B, n_labels)
    assert loaded.labels == LABELS
    assert [loaded.labels[i] for i in probs.argmax(-1).tolist()] == ["positive", "negative"]
    assert probs.max(-1).values.min() > 0.5


@pytest.mark.parametrize(("labels", "scores", "want"), [(["relevant"], None, "sigmoid"), (["a", "b"], None, "softmax"),
                                                        (["a", "b"], "sigmoid", "sigmoid")])
def test_a_head_checkpoint_says_how_its_logits_become_scores(tmp_path: Path, labels: list[str],
                                                             scores: str | None, want: str) -> None:
    """One output scores by sigmoid (a reranker's relevance, as Hugging Face's one-label heads), several
    by softmax, unless head.json says otherwise ("scores")."""
    from safetensors.torch import save_file

    head = tmp_path / "head"
    head.mkdir()
    meta = {"labels": labels} | ({"scores": scores} if scores else {})
    (head / "head.json").write_text(json.dumps(meta))
    save_file({"weight": torch.randn(len(labels), 8), "bias": torch.randn(len(labels))}, head / "head.safetensors")
    cfg = EncoderConfig(vocab_size=50, d_model=8, n_heads=2, d_ff=16, n_layers=1, max_positions=16,
                        prenorm=False, final_norm=False, embed_norm=True, pad_token_id=0)
    model, _ = _attach_head(EncoderModel(cfg).eval(), f"dir:{head}", tmp_path)
    assert model.cfg.head_scores == want
    logits = torch.tensor([[0.5, -1.0][:len(labels)]])
    expected = torch.sigmoid(logits) if want == "sigmoid" else logits.softmax(-1)
    torch.testing.assert_close(model.scores(logits), expected)
