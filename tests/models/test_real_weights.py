"""Parity with transformers on the real default weights (fetched once by `make weights`).

These tests fail, rather than skip, when the weights are missing: the Makefile fetches them first.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel, AutoTokenizer

from models import zoo
from models.checkpoints.cache import load_smollm2
from models.checkpoints.registry import import_hf_dir
from models.reference import transformers_from_gguf

pytestmark = pytest.mark.slow

SENTENCES = [
    "Hi.",
    "The quick brown fox jumps over the lazy dog.",
    "Sentence embeddings map text of any length to one unit vector, which makes padding a good test.",
]


@pytest.fixture(scope="session")
def weights_cache() -> Path:
    """The zoo cache root, with every default model present and verified (else fail with the fix)."""
    cache_dir = zoo.default_cache_dir()
    try:
        for name in zoo.ZOO:
            zoo.resolve(name, cache_dir)
    except zoo.WeightsMissingError as e:
        pytest.fail(str(e))
    return cache_dir


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


def test_minilm_embeddings_match_transformers(weights_cache: Path) -> None:
    folder = zoo.resolve("minilm", weights_cache)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    keep = batch["attention_mask"].bool()  # (B, T)
    assert keep.sum(1).unique().numel() == len(SENTENCES)  # really different lengths in one padded batch
    ref_model = AutoModel.from_pretrained(str(folder), dtype=torch.float32).eval()
    ours = import_hf_dir(folder)
    with torch.no_grad():
        hidden = ref_model(**batch).last_hidden_state  # (B, T, C)
        w = batch["attention_mask"].unsqueeze(-1).float()  # (B, T, 1)
        expected = F.normalize((hidden * w).sum(1) / w.sum(1).clamp(min=1e-9), dim=-1)  # (B, C)
        got = ours.embed(batch["input_ids"], keep)  # (B, C)
    assert got.shape == expected.shape == (len(SENTENCES), 384)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(got.norm(dim=-1), torch.ones(len(SENTENCES)))


def test_smollm2_logits_match_transformers_gguf_loader(weights_cache: Path) -> None:
    folder = zoo.resolve("smollm2", weights_cache)
    (gguf_name,) = zoo.ZOO["smollm2"].files
    lm = load_smollm2(weights_cache)  # converts once, then loads from the converted cache
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = lm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>assistant" in prompt
    ids = torch.tensor([lm.tokenizer(prompt).input_ids])  # (1, T)
    ref_tok = AutoTokenizer.from_pretrained(str(folder), gguf_file=gguf_name)
    assert ids[0].tolist() == ref_tok(prompt).input_ids
    ref = transformers_from_gguf(folder, gguf_name)
    with torch.no_grad():
        expected = ref(ids).logits  # (1, T, V)
        got = lm.model(ids)  # (1, T, V)
    assert got.shape == expected.shape == (1, ids.shape[1], 49152)
    assert rel_err(got, expected) <= 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_smollm2_greedy_answer_names_paris(weights_cache: Path, dtype: torch.dtype) -> None:
    """In bfloat16: on our bfloat16 panels where they run (the parameters around them float32), else cast."""
    from models.catalog import DEFAULT_SPECS, load_model
    from models.decoding import SamplingParams
    from models.generate import generate
    from models.kernels import native
    from models.projections.panels import Bf16PanelLinear

    lm = load_model(DEFAULT_SPECS["generator"], weights_cache, dtype=dtype)
    assert lm.dtype == dtype
    panels = dtype == torch.bfloat16 and native.has_bf16()
    assert {p.dtype for p in lm.model.parameters()} == {torch.float32 if panels else dtype}
    assert any(isinstance(m, Bf16PanelLinear) for m in lm.model.modules()) is panels
    prompt = lm.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    ids = lm.tokenizer.encode(prompt, add_special_tokens=False)
    (out,) = generate(lm.model, [ids], SamplingParams(max_new_tokens=24))
    assert "Paris" in lm.tokenizer.decode(out.tokens)
