"""The baselines' transformers models on our weights (tiny models): the same numbers as ours, and
padded batches that give each row what it gets alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loadtests.systems.export import to_hf_bert, to_hf_llama
from loadtests.systems.hf_models import build_classifier, build_generator, build_translator
from loadtests.systems.modelsets import model_set
from models.tiny import tiny_model

NOWHERE = Path("/nonexistent")  # tiny models need no cache


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def test_exported_bert_matches_our_encoder() -> None:
    ours, tok = tiny_model("encoder")
    ids = torch.tensor([tok.encode("hello world"), tok.encode("padding test")[:11]])  # (2, 11)
    keep = torch.ones_like(ids, dtype=torch.bool)
    keep[1, 8:] = False
    with torch.inference_mode():
        theirs = to_hf_bert(ours)(input_ids=ids, attention_mask=keep.long()).last_hidden_state  # (2, 11, C)
        mine = ours(ids, keep)  # (2, 11, C)
    torch.testing.assert_close(theirs[0], mine[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(theirs[1, :8], mine[1, :8], atol=1e-5, rtol=1e-5)


def test_exported_llama_matches_our_decoder() -> None:
    ours, tok = tiny_model("decoder")
    ids = torch.tensor([tok.encode("a prompt for the tiny decoder")])  # (1, T)
    with torch.inference_mode():
        torch.testing.assert_close(to_hf_llama(ours)(input_ids=ids).logits, ours(ids), atol=1e-5, rtol=1e-5)


def test_builders_report_parity_and_batches_match_single_rows() -> None:
    specs = model_set("tiny")
    clf = build_classifier(specs["classify"], NOWHERE, "cpu")
    assert clf.info["parity_max_abs_diff"] < 1e-5
    texts = ["short", "a considerably longer text that forces padding of the short one"]
    batch, cost = clf.model(texts)
    assert (
        cost.computed_tokens == 2 * max(len(clf.model.tokenizer.encode(t)) for t in texts) > cost.real_tokens
    )
    for text, row in zip(texts, batch, strict=True):
        alone, _ = clf.model([text])
        assert alone[0]["label"] == row["label"]
        assert alone[0]["scores"] == pytest.approx(row["scores"], abs=1e-5)

    tr = build_translator(specs["translate"], NOWHERE, "cpu")
    assert tr.info["parity_max_abs_diff"] < 1e-4
    out, _ = tr.model(["one", "two words"], beam_size=2, max_new_tokens=4)
    assert len(out) == 2 and all(isinstance(t, str) for t in out)

    gen = build_generator(specs["generate"], NOWHERE, "cpu")
    assert gen.info["parity_max_abs_diff"] < 1e-4
    results, cost = gen.model(["hi", "a longer prompt"], [3, 6], ignore_eos=True, temperature=0.0)
    assert [r.completion_tokens for r in results] == [3, 6]
    assert all(r.finish_reason == "length" for r in results)
    assert cost.real_tokens < cost.computed_tokens  # static batching runs both rows to the longest
