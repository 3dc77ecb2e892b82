"""oneDNN-packed projections against torch's own F.linear on the real default models: the
translator's beam-4 and greedy strings, SmolLM2's greedy tokens and logits, MiniLM's embeddings and
labels. Every float layer is packed (`dense_kernel: onednn`), so the check does not depend on what
the shipped default `auto` measures on this CPU: `auto` packs a subset of these layers."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from models import zoo
from models.catalog import BUILTIN_DIR, DEFAULT_SPECS, load_model
from models.decoding import SamplingParams
from models.generate import generate
from models.inputs import PaddedBatch
from models.projections.dense import onednn_available
from models.train.eval_translator import read_test, translate_all

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN")]
SOURCES = read_test(BUILTIN_DIR / "translator-en-es" / "test.tsv")[0][:64]


def _pair(kind: str):  # noqa: ANN202
    cache = zoo.default_cache_dir()
    plain = load_model(dataclasses.replace(DEFAULT_SPECS[kind], dense_kernel="aten"), cache)
    packed = load_model(dataclasses.replace(DEFAULT_SPECS[kind], dense_kernel="onednn"), cache)
    assert plain.kernels == {} and packed.kernels and set(packed.kernels.values()) == {"onednn"}
    return plain, packed


@torch.inference_mode()
def test_translator_strings_are_those_of_plain_linear() -> None:
    plain, packed = _pair("translator")
    for beam in (4, 1):
        assert translate_all(packed.model, packed.tokenizer, SOURCES, beam=beam) == \
            translate_all(plain.model, plain.tokenizer, SOURCES, beam=beam)


@torch.inference_mode()
def test_generator_greedy_tokens_and_logits_match_plain_linear() -> None:
    plain, packed = _pair("generator")
    tok = plain.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]), add_special_tokens=False)
               for q in ("What is the capital of France?", "List three fruits.")]
    params = SamplingParams(max_new_tokens=24)
    assert [g.tokens for g in generate(packed.model, prompts, params)] == \
        [g.tokens for g in generate(plain.model, prompts, params)]
    x = torch.tensor([prompts[0]])
    want = plain.model(x)  # (1, T, V)
    torch.testing.assert_close(packed.model(x), want, atol=5e-4, rtol=1e-5)


@torch.inference_mode()
def test_encoder_embeddings_and_labels_match_plain_linear() -> None:
    plain, packed = _pair("encoder")
    batch = PaddedBatch.from_token_lists(plain.tokenizer.encode_batch(SOURCES), 0)
    want, got = plain.model.embed(batch.ids, batch.keep), packed.model.embed(batch.ids, batch.keep)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(packed.model.head(got).argmax(-1), plain.model.head(want).argmax(-1))
