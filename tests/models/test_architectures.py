"""Tasks read from a checkpoint's config.json (a spec may leave `tasks` out), and HF tokenizer metadata."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers as hf

from models.architectures import infer_tasks
from models.spec import ModelSpec
from models.text import TextTokenizer
from models.tiny import byte_tokenizer


def hf_dir(tmp_path: Path, config: hf.PretrainedConfig) -> Path:
    config.save_pretrained(tmp_path)
    return tmp_path


@pytest.mark.parametrize(("config", "tasks"), [
    (hf.Qwen3Config(), ("generate",)),
    (hf.MistralConfig(), ("generate",)),
    (hf.LlamaConfig(), ("generate",)),
    (hf.MarianConfig(), ("translate",)),
    (hf.BertConfig(), ("embed",)),
    (hf.BertConfig(architectures=["BertForSequenceClassification"], id2label={0: "neg", 1: "pos"}), ("classify",)),
    (hf.BertConfig(architectures=["BertForSequenceClassification"], num_labels=1), ("rerank",)),
], ids=["qwen3", "mistral", "llama", "marian", "bert", "classifier", "cross-encoder"])
def test_hf_directory_tasks_follow_the_architecture(tmp_path: Path, config: hf.PretrainedConfig,
                                                     tasks: tuple[str, ...]) -> None:
    assert infer_tasks(f"hf:{hf_dir(tmp_path, config)}") == tasks


def test_our_checkpoints_gguf_and_tiny_models() -> None:
    assert infer_tasks("builtin:translator-en-es") == ("translate",)
    assert infer_tasks("gguf:/anywhere/model.gguf") == ("generate",)
    assert infer_tasks("tiny:encoder") == ("classify", "embed")
    assert infer_tasks("zoo:minilm") is None  # on disk only after `make weights`
    assert infer_tasks("hf:/no/such/dir") is None


def test_a_spec_without_tasks_takes_them_from_the_checkpoint(tmp_path: Path) -> None:
    spec = ModelSpec(name="qwen", source=f"hf:{hf_dir(tmp_path, hf.Qwen2Config())}")
    assert spec.tasks == ("generate",) and spec.kind == "generator"
    with pytest.raises(ValueError, match="cannot be read from 'zoo:minilm'"):
        ModelSpec(name="x", source="zoo:minilm")
    with pytest.raises(ValueError, match="names no languages"):  # inferred tasks are checked like given ones
        ModelSpec(name="mt", source="builtin:translator-en-es")


def test_hf_tokenizer_brings_its_chat_template_and_special_tokens(tmp_path: Path) -> None:
    byte_tokenizer().save(str(tmp_path / "tokenizer.json"))
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}{% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": template, "eos_token": {"content": "</s>"}, "bos_token": None}))
    tok = TextTokenizer.from_hf_dir(tmp_path)
    assert tok.special_tokens == {"eos_token": "</s>"}
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "[user] hi</s>"
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")  # the newer file wins
    assert TextTokenizer.from_hf_dir(tmp_path).apply_chat_template([{"role": "user", "content": "x"}]) == "x!"


def test_every_importer_has_its_tasks_and_no_more() -> None:
    from models.architectures import HF_TASKS
    from models.checkpoints.registry import IMPORTERS

    assert set(HF_TASKS) == set(IMPORTERS)


def test_a_decoder_classifier_is_not_taken_for_an_encoder(tmp_path: Path) -> None:
    config = hf.LlamaConfig(architectures=["LlamaForSequenceClassification"], num_labels=2)
    assert infer_tasks(f"hf:{hf_dir(tmp_path, config)}") is None
