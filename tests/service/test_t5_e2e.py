"""T5 served from a model spec alone: a tiny random T5 directory (transformers' save_pretrained, a
WordLevel tokenizer.json whose post-processor appends "</s>" as T5's tokenizer does, a translation
prefix in task_specific_params) behind /v1/translate.

Without Ray, the translator runner takes its prefix, ids and tokenizer from the checkpoint; end to
end, over real HTTP with a real Ray Serve, every translation equals our offline translate_ids on the
prefixed input decoded by the same tokenizer, for inputs and beam sizes whose outputs differ (asserted,
as is that the prefix changes them).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from tokenizers.processors import TemplateProcessing

from models.beam_search import BeamParams, translate_ids
from models.catalog import ModelSpec, load_model
from models.checkpoints.registry import import_hf_dir
from models.seq2seq import Seq2Seq
from models.text import TextTokenizer
from service.messages import TranslateOptions
from service.replica.config import BatchLimits
from service.replica.translator import TranslatorRunner
from service.testing.cluster import deploy, local_cluster, wait_for
from tests.models.test_t5 import EOS, PAD, VOCAB, hf_t5, spread

NAME, PREFIX, MAX_NEW = "tiny-t5-en-de", "translate English to German: ", 12
WORDS = ["translate", "English", "to", "German:", "the", "cat", "sat", "on", "mat", "a", "dog", "ran", "under",
         "tree", "big", "small", "red", "blue"]
TEXTS = ["the cat sat on the mat", "a big dog ran under the red tree"]


def tiny_t5_dir(path: Path) -> Path:
    """save_pretrained of a spread (varied-output) T5 v1.1 with an en->de prefix, and its tokenizer."""
    with torch.random.fork_rng():
        torch.manual_seed(4)
        model = spread(hf_t5("v1.1", num_decoder_layers=2), eos_boost=1.5)
    model.config.task_specific_params = {"translation_en_to_de": {"prefix": PREFIX, "num_beams": 4}}
    model.save_pretrained(path)
    vocab = {"<pad>": PAD, "</s>": EOS, "<unk>": 2} | {w: 3 + i for i, w in enumerate(WORDS)}
    vocab |= {f"w{i}": i for i in range(len(vocab), VOCAB)}  # every model id decodes to a word
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = WhitespaceSplit()
    tok.post_processor = TemplateProcessing(single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", EOS)])
    tok.add_special_tokens(["<pad>", "</s>", "<unk>"])
    tok.save(str(path / "tokenizer.json"))
    return path


@pytest.fixture(scope="module")
def t5_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_t5_dir(tmp_path_factory.mktemp("tiny-t5"))


@pytest.fixture(scope="module")
def offline(t5_dir: Path) -> tuple[Seq2Seq, TextTokenizer]:
    """The same checkpoint imported directly: no fusing, no packed kernels, no service."""
    return import_hf_dir(t5_dir), TextTokenizer.from_hf_dir(t5_dir)


def translate_offline(offline: tuple[Seq2Seq, TextTokenizer], text: str, beams: int, prefix: str = PREFIX) -> str:
    model, tok = offline
    ids = translate_ids(model, [tok.encode(prefix + text)], BeamParams(beams, MAX_NEW), banned_ids=[PAD])
    return tok.decode(ids[0])


def model_spec(t5_dir: Path, **changes: Any) -> dict[str, Any]:
    return {"name": NAME, "tasks": ["translate"], "source": f"hf:{t5_dir}", "languages": ["en", "de"],
            "defaults": {"beam_size": 4, "max_new_tokens": MAX_NEW}, **changes}


# -- the runner, without Ray ----------------------------------------------------------------------

def test_the_runner_takes_prefix_ids_and_tokenizer_from_the_checkpoint(t5_dir: Path, offline) -> None:
    spec = model_spec(t5_dir, dense_kernel="aten")
    loaded = load_model(ModelSpec(**{**spec, "tasks": ("translate",), "languages": ("en", "de")}), Path("/none"))
    runner = TranslatorRunner(loaded, "t5", BatchLimits(max_wait_ms=10))
    assert runner.prefix == PREFIX and runner.banned == [PAD]  # pad = T5's decoder start, never generated
    try:
        got = asyncio.run(runner.translate(TEXTS, TranslateOptions(beam_size=1), 10.0))
    finally:
        runner.close()
    assert got == [translate_offline(offline, t, beams=1) for t in TEXTS]
    assert got != [translate_offline(offline, t, beams=1, prefix="") for t in TEXTS]  # the prefix matters


def test_a_pair_the_model_has_no_prefix_for_fails_at_load_unless_the_spec_gives_one(t5_dir: Path) -> None:
    fields = {"name": NAME, "tasks": ("translate",), "source": f"hf:{t5_dir}", "languages": ("en", "fr"),
              "dense_kernel": "aten"}
    with pytest.raises(ValueError, match="en->de"):
        TranslatorRunner(load_model(ModelSpec(**fields), Path("/none")), "t5", BatchLimits())
    spec = ModelSpec(**fields, defaults={"prefix": "translate English to French: "})
    runner = TranslatorRunner(load_model(spec, Path("/none")), "t5", BatchLimits())
    assert runner.prefix == "translate English to French: "
    runner.close()


# -- over HTTP ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(t5_dir: Path) -> Iterator[str]:
    args = {"device": "cpu", "deployments": {"t5": {
        "model": model_spec(t5_dir), "num_cpus": 0,
        "batching": {"max_batch_size": 8, "max_wait_ms": 25, "max_queued": 64}}}}
    with local_cluster(keep=True) as url:
        deploy(args, "t5", "/")
        wait_for(url, "/readyz", 200, timeout_s=180)
        yield url


@pytest.mark.e2e
def test_t5_over_http_equals_offline_translation_of_the_prefixed_input(server: str, offline) -> None:
    got: dict[int, list[str]] = {}
    with httpx.Client(base_url=server, timeout=60) as c:
        for beams in (1, 4):
            r = c.post("/v1/translate", json={"inputs": TEXTS, "source_lang": "en", "target_lang": "de",
                                              "beam_size": beams})
            assert r.status_code == 200, r.text
            assert r.json() == {"model": NAME, "translations": [translate_offline(offline, t, beams) for t in TEXTS],
                                "sentences": [1] * len(TEXTS)}
            got[beams] = r.json()["translations"]
        card = next(m for m in c.get("/v1/models").json()["data"] if m["deployment"] == "t5")
    assert card["tasks"] == ["translate"] and card["languages"] == ["en", "de"]
    assert all(got[1]) and len(set(got[1])) == len(TEXTS)  # two inputs, two different translations
    assert got[1] != got[4]  # and beam search finds others than greedy
