"""Fine-tuned Hugging Face classifiers and cross-encoders end to end over real HTTP: a local Ray +
Serve whose deployments point at Hugging Face directories written here (`source: hf:PATH`, no code
for either model), each with its own labels and its own tokenizer.json.

- `classifier`: a tiny random BertForSequenceClassification with three labels of its own, through
  /v1/classify;
- `reranker`: a tiny random one-output BertForSequenceClassification (a cross-encoder), through
  /v1/rerank; pairs are tokenized as the HF tokenizer does (token type 1 on the text).

Both are compared with `transformers` on the same directories.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import transformers as hf
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

from service.testing.cluster import deploy, local_cluster, wait_for
from tests.models.test_parity import perturb
from tests.service.http_checks import assert_error

pytestmark = pytest.mark.e2e
MAX_INPUTS, LIMIT = 4, 24  # texts per request; the reranker's tokens per (query, text) pair
LABELS = ("sad", "calm", "joyful")
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
WORDS = ["the", "a", "cat", "dog", "sat", "ran", "on", "under", "mat", "tree", "what", "where", "is", "are", "red",
         "blue", "big", "small", "happy", "sad", "good", "bad", "very", "not", "quite", "sun", "rain"]
QUERY = "where is the cat"
TEXTS = ["the cat sat on the mat", "a dog ran under the tree", "red sun", "the cat is not sad"]


def wordpiece_tokenizer() -> Tokenizer:
    """A BERT-style tokenizer over WORDS: [CLS] A [SEP] (B [SEP], token type 1) like bert-base's."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS + WORDS)}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
    return tok


def hf_classifier_dir(path: Path, num_labels: int, seed: int) -> Path:
    """A tiny random BertForSequenceClassification (weights perturbed off their init) saved as a
    Hugging Face directory: config.json, model.safetensors, tokenizer.json."""
    torch.manual_seed(seed)
    id2label = dict(enumerate(LABELS)) if num_labels == 3 else None
    config = hf.BertConfig(vocab_size=len(SPECIALS) + len(WORDS), hidden_size=32, num_hidden_layers=2,
                           num_attention_heads=4, intermediate_size=64, max_position_embeddings=64,
                           type_vocab_size=2, pad_token_id=0, num_labels=num_labels,
                           **({"id2label": id2label} if id2label else {}))
    perturb(hf.BertForSequenceClassification(config)).save_pretrained(path, safe_serialization=True)
    wordpiece_tokenizer().save(str(path / "tokenizer.json"))
    return path


def app_args(classifier: Path, reranker: Path) -> dict[str, Any]:
    batching = {"max_batch_size": 8, "max_wait_ms": 10, "max_queued": 64}
    return {
        "device": "cpu", "max_inputs": MAX_INPUTS, "readiness_timeout_s": 2,
        "deployments": {
            "classifier": {"model": {"name": "tiny-hf-classifier", "tasks": ["classify"], "source": f"hf:{classifier}"},
                           "num_cpus": 0, "torch_threads": 1, "batching": batching},
            "reranker": {"model": {"name": "tiny-cross-encoder", "tasks": ["rerank"], "source": f"hf:{reranker}",
                                   "max_input_tokens": LIMIT},
                         "num_cpus": 0, "torch_threads": 1, "batching": batching},
        },
    }


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf-heads")
    return {"classifier": hf_classifier_dir(root / "classifier", 3, seed=0),
            "reranker": hf_classifier_dir(root / "reranker", 1, seed=1)}


@pytest.fixture(scope="module")
def url(dirs: dict[str, Path]) -> Iterator[str]:
    with local_cluster(keep=True) as base:
        deploy(app_args(dirs["classifier"], dirs["reranker"]), "heads", "/")
        wait_for(base, "/readyz", 200, timeout_s=120)
        yield base


def reference(path: Path, first: list[str], second: list[str] | None = None) -> torch.Tensor:
    """transformers' logits (B, L) for texts (or pairs), each alone, tokenized by the HF tokenizer
    (with token type ids, as BertTokenizerFast returns them)."""
    model = hf.AutoModelForSequenceClassification.from_pretrained(path).eval()
    tok = hf.PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"))
    rows = []
    with torch.no_grad():
        for i, text in enumerate(first):
            enc = tok(text, second[i] if second else None, return_token_type_ids=True, return_tensors="pt")
            rows.append(model(**enc).logits[0])
    return torch.stack(rows)


def test_a_classifier_directory_is_served_with_its_own_labels(url: str, dirs: dict[str, Path]) -> None:
    with httpx.Client(base_url=url, timeout=60) as c:
        cards = {m["id"]: m for m in c.get("/v1/models").json()["data"]}
        r = c.post("/v1/classify", json={"inputs": TEXTS})
    assert cards["tiny-hf-classifier"]["labels"] == list(LABELS) and cards["tiny-hf-classifier"]["tasks"] == ["classify"]
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    want = reference(dirs["classifier"], TEXTS).softmax(-1)  # (B, 3)
    for res, probs in zip(results, want.tolist(), strict=True):
        assert list(res["scores"]) == list(LABELS)
        assert [res["scores"][label] for label in LABELS] == pytest.approx(probs, abs=1e-4)
        assert res["label"] == LABELS[max(range(3), key=probs.__getitem__)]
    distinct = {tuple(round(v, 4) for v in res["scores"].values()) for res in results}
    assert len(distinct) == len(TEXTS)  # different inputs, different scores


def test_rerank_scores_are_the_cross_encoders_sigmoid_best_first(url: str, dirs: dict[str, Path]) -> None:
    logits = reference(dirs["reranker"], [QUERY] * len(TEXTS), TEXTS)[:, 0]  # (B,)
    with httpx.Client(base_url=url, timeout=60) as c:
        plain = c.post("/v1/rerank", json={"query": QUERY, "texts": TEXTS})
        raw = c.post("/v1/rerank", json={"query": QUERY, "texts": TEXTS, "raw_scores": True, "return_text": True})
        alone = [c.post("/v1/rerank", json={"query": QUERY, "texts": [t]}).json()[0]["score"] for t in TEXTS]
    assert plain.status_code == 200 and raw.status_code == 200, (plain.text, raw.text)
    ranks = plain.json()
    assert sorted(r["index"] for r in ranks) == list(range(len(TEXTS))) and all(set(r) == {"index", "score"}
                                                                                for r in ranks)
    assert [r["score"] for r in ranks] == sorted((r["score"] for r in ranks), reverse=True)
    for r in ranks:
        assert r["score"] == pytest.approx(torch.sigmoid(logits[r["index"]]).item(), abs=1e-4)
        assert r["score"] == pytest.approx(alone[r["index"]], abs=1e-5)  # batched = alone
    assert len({round(r["score"], 4) for r in ranks}) == len(TEXTS)
    for r in raw.json():
        assert r["text"] == TEXTS[r["index"]] and r["score"] == pytest.approx(logits[r["index"]].item(), abs=1e-4)
    assert [r["index"] for r in raw.json()] == [r["index"] for r in ranks]  # sigmoid keeps the order


def test_rerank_truncates_long_pairs_on_request(url: str) -> None:
    long = " ".join(["cat"] * (LIMIT + 5))
    with httpx.Client(base_url=url, timeout=60) as c:
        refused = c.post("/v1/rerank", json={"query": QUERY, "texts": ["red sun", long]})
        cut = c.post("/v1/rerank", json={"query": QUERY, "texts": [long], "truncate": True})
        exact = c.post("/v1/rerank", json={"query": QUERY, "texts": [" ".join(["cat"] * (LIMIT - 7))]})
    assert "at most 24" in assert_error(refused, 422, "invalid_request_error", "texts[1]")["message"]
    assert cut.status_code == 200 and cut.json()[0]["score"] == pytest.approx(exact.json()[0]["score"], abs=1e-5)


BAD_RERANK = [
    ({"query": QUERY, "texts": []}, "texts"),
    ({"query": QUERY, "texts": ["red sun"] * (MAX_INPUTS + 1)}, "texts"),
    ({"query": QUERY, "texts": ["red sun", ""]}, "texts[1]"),
    ({"query": "", "texts": ["red sun"]}, "query"),
    ({"query": " ".join(["cat"] * LIMIT), "texts": ["red sun"]}, "query"),
    ({"query": QUERY, "texts": "red sun"}, "texts"),
    ({"query": QUERY, "texts": ["red sun"], "raw_scores": "yes"}, "raw_scores"),
    ({"query": QUERY, "texts": ["red sun"], "model": "tiny-hf-classifier"}, "model"),  # 3 labels: no reranker
]


@pytest.mark.parametrize(("body", "param"), BAD_RERANK)
def test_bad_rerank_input_is_a_422_naming_the_field(url: str, body: dict[str, Any], param: str) -> None:
    with httpx.Client(base_url=url, timeout=60) as c:
        assert_error(c.post("/v1/rerank", json=body), 422, "invalid_request_error", param)
