"""A Hugging Face Qwen3 directory served with no code and no `tasks`: the kind follows the architecture.

A tiny random `Qwen3ForCausalLM` (per-head q/k norms, an explicit head dim, a sliding window of 6
on every layer, so the engine's cached steps must apply it) saved with save_pretrained, a byte-level
tokenizer.json and a tokenizer_config.json with a chat template. Over real HTTP, /v1/generate and
/v1/chat/completions give exactly the tokens `transformers` generates greedily from the same weights.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
import transformers as hf

from models.text import TextTokenizer
from models.tiny import EOS, PAD, VOCAB, byte_tokenizer
from service.testing.cluster import deploy, local_cluster, wait_for

pytestmark = pytest.mark.e2e
NAME = "tiny-qwen3"
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
N_NEW = 24


def qwen3_dir(path: Path) -> tuple[Path, hf.Qwen3ForCausalLM]:
    config = hf.Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                            use_sliding_window=True, sliding_window=6, max_window_layers=0,
                            tie_word_embeddings=False, bos_token_id=None, eos_token_id=EOS, pad_token_id=PAD)
    torch.manual_seed(4)
    model = hf.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)  # varied, far-from-tied logits
    model.save_pretrained(path)
    byte_tokenizer().save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "eos_token": "</s>"}))
    return path, model


def hf_greedy(model: hf.Qwen3ForCausalLM, ids: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=N_NEW, eos_token_id=EOS,
                             pad_token_id=PAD)[0, len(ids):].tolist()
    return out[:out.index(EOS)] if EOS in out else out


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, hf.Qwen3ForCausalLM, TextTokenizer]]:
    path, model = qwen3_dir(tmp_path_factory.mktemp("qwen3"))
    args = {"device": "cpu", "deployments": {"qwen": {
        "model": {"name": NAME, "source": f"hf:{path}", "defaults": {"max_new_tokens": N_NEW}},
        "num_cpus": 0, "torch_threads": 1, "engine": {"max_running": 4, "max_queued": 8}}}}
    with local_cluster(keep=True) as url:
        deploy(args, "family", "/")
        wait_for(url, "/readyz", 200, timeout_s=120)
        yield url, model, TextTokenizer.from_hf_dir(path)


def test_the_directory_is_served_as_a_generator(served) -> None:
    url, _, _ = served
    cards = {m["id"]: m for m in httpx.get(f"{url}/v1/models", timeout=30).json()["data"]}
    assert cards[NAME]["tasks"] == ["generate"]


def test_generate_gives_the_tokens_transformers_generates(served) -> None:
    url, model, tok = served
    texts = []
    for prompt in ("the sliding window covers six tokens", "¿otra cosa?"):
        want = tok.decode(hf_greedy(model, tok.encode(prompt)))
        body = httpx.post(f"{url}/v1/generate", json={"prompt": prompt, "max_new_tokens": N_NEW}, timeout=60).json()
        assert body["text"] == want
        texts.append(body["text"])
    assert len(set(texts)) == 2 and all(texts)  # different prompts, different (non-empty) answers


def test_chat_uses_the_directory_template(served) -> None:
    url, model, tok = served
    messages = [{"role": "user", "content": "hola"}]
    prompt_ids = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
    body = httpx.post(f"{url}/v1/chat/completions", json={"model": NAME, "messages": messages,
                                                          "max_tokens": N_NEW}, timeout=60).json()
    assert body["usage"]["prompt_tokens"] == len(prompt_ids)
    assert body["choices"][0]["message"]["content"] == tok.decode(hf_greedy(model, prompt_ids))
