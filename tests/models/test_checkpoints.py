"""Our checkpoint format (round trips, strict errors) and the HF importers' error handling and directory reading.

Dimension legend: B batch rows, T length, V vocabulary.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers as hf
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from models.checkpoints import bert, gpt2, llama, marian
from models.checkpoints.format import CheckpointError, load_checkpoint, save_checkpoint
from models.checkpoints.registry import IMPORTERS, import_hf_dir, importer_for
from models.config import PRESETS, DecoderConfig
from models.decoder import DecoderLM
from models.encoder import EncoderModel
from models.seq2seq import Seq2Seq

FAMILIES = {
    "encoder": lambda: EncoderModel(PRESETS["tiny-encoder"]),
    "gpt": lambda: DecoderLM(PRESETS["tiny-gpt"]),
    "llama": lambda: DecoderLM(PRESETS["tiny-llama"].replace(tie_embeddings=False)),
    "seq2seq": lambda: Seq2Seq(PRESETS["tiny-seq2seq"]),
}


@torch.no_grad()
def perturb(model: nn.Module) -> nn.Module:
    for p in model.parameters():
        p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def run(model: nn.Module) -> Tensor:
    """The model's main output on a fixed right-padded batch (B=2, T=5)."""
    ids = torch.tensor([[5, 6, 7, 8, 9], [10, 11, 12, 0, 0]])  # (B, T)
    keep = ids != 0  # (B, T)
    with torch.no_grad():
        if isinstance(model, Seq2Seq):
            return model(ids, keep, ids[:, :3], keep[:, :3])
        return model(ids, keep)


# --- our format -----------------------------------------------------------------------------------


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_round_trip_gives_identical_outputs(family: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = perturb(FAMILIES[family]())
    save_checkpoint(model, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    loaded = load_checkpoint(tmp_path)
    assert type(loaded) is type(model) and loaded.cfg == model.cfg and not loaded.training
    assert torch.equal(run(loaded), run(model))


def test_seq2seq_stores_shared_tokens_once_and_stays_tied(tmp_path: Path) -> None:
    model = perturb(Seq2Seq(PRESETS["tiny-seq2seq"]))
    save_checkpoint(model, tmp_path)
    names = set(load_file(str(tmp_path / "model.safetensors")))
    assert "encoder.embed.tokens.weight" in names and "decoder.embed.tokens.weight" not in names
    loaded = load_checkpoint(tmp_path)
    assert loaded.encoder.embed.tokens.weight is loaded.decoder.embed.tokens.weight


def test_load_casts_to_dtype(tmp_path: Path) -> None:
    save_checkpoint(perturb(DecoderLM(PRESETS["tiny-llama"])), tmp_path)
    loaded = load_checkpoint(tmp_path, dtype=torch.bfloat16)
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}


def _corrupt(directory: Path, edit) -> None:
    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


CORRUPTIONS = {
    "missing": (lambda t: t.pop("stack.blocks.1.ff.up.weight"), "stack.blocks.1.ff.up.weight"),
    "extra": (lambda t: t.update({"stack.blocks.9.extra.weight": torch.zeros(3)}), "stack.blocks.9.extra.weight"),
    "shape": (lambda t: t.update({"stack.norm.weight": torch.ones(17)}), "stack.norm.weight: expected (16,), got (17,)"),
}


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_corrupt_checkpoint_names_the_tensor(kind: str, tmp_path: Path) -> None:
    save_checkpoint(DecoderLM(PRESETS["tiny-gpt"]), tmp_path)
    edit, expected = CORRUPTIONS[kind]
    _corrupt(tmp_path, edit)
    with pytest.raises(CheckpointError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        load_checkpoint(tmp_path)


def test_imported_model_round_trips(tmp_path: Path) -> None:
    config, model = tiny_hf("gpt2")  # q/k/v biases are slices of one fused tensor after the import
    ours = gpt2.from_hf(config.to_dict(), model.state_dict())
    save_checkpoint(ours, tmp_path)
    assert torch.equal(run(load_checkpoint(tmp_path)), run(ours))


def test_unknown_format_version_is_rejected(tmp_path: Path) -> None:
    save_checkpoint(DecoderLM(PRESETS["tiny-gpt"]), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "format_version": 99}))
    with pytest.raises(CheckpointError, match="format_version"):
        load_checkpoint(tmp_path)


# --- Hugging Face importers: errors ---------------------------------------------------------------


def tiny_hf(kind: str) -> tuple[hf.PreTrainedConfig, nn.Module]:
    torch.manual_seed(0)
    if kind == "bert":
        config = hf.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                               intermediate_size=32, max_position_embeddings=16)
        return config, hf.BertModel(config).eval()
    if kind == "gpt2":
        config = hf.GPT2Config(vocab_size=50, n_embd=16, n_layer=1, n_head=2, n_positions=16,
                               bos_token_id=1, eos_token_id=1)
        return config, hf.GPT2LMHeadModel(config).eval()
    config = hf.MarianConfig(vocab_size=50, d_model=16, encoder_layers=1, decoder_layers=1,
                             encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                             decoder_ffn_dim=32, max_position_embeddings=16, pad_token_id=0,
                             decoder_start_token_id=0, eos_token_id=1)
    return config, hf.MarianMTModel(config).eval()


IMPORTER_OF = {"bert": bert.from_hf, "gpt2": gpt2.from_hf, "marian": marian.from_hf}
DROP = {
    "bert": "encoder.layer.0.attention.self.key.bias",
    "gpt2": "transformer.h.0.attn.c_attn.weight",
    "marian": "model.decoder.layers.0.encoder_attn.out_proj.weight",
}


@pytest.mark.parametrize("kind", sorted(DROP))
def test_hf_state_missing_tensor_is_named(kind: str) -> None:
    config, model = tiny_hf(kind)
    state = model.state_dict()
    del state[DROP[kind]]
    name = DROP[kind].removeprefix("transformer.")
    with pytest.raises(CheckpointError, match=f"missing tensors: .*{name}"):
        IMPORTER_OF[kind](config.to_dict(), state)


def test_hf_state_unexpected_tensor_is_named() -> None:
    config, model = tiny_hf("bert")
    state = {**model.state_dict(), "qa_outputs.weight": torch.zeros(2, 16)}  # a head we do not serve
    with pytest.raises(CheckpointError, match=r"unexpected tensors: \['qa_outputs.weight'\]"):
        bert.from_hf(config.to_dict(), state)


def test_bert_prefixed_names_and_heads_are_accepted() -> None:
    config, model = tiny_hf("bert")
    state = {f"bert.{k}": v for k, v in model.state_dict().items()}
    state["cls.predictions.bias"] = torch.zeros(50)
    ours = bert.from_hf(config.to_dict(), state)
    assert torch.equal(ours.stack.embed.tokens.weight, model.embeddings.word_embeddings.weight)


def test_hf_tied_copy_that_differs_is_rejected() -> None:
    config, model = tiny_hf("gpt2")
    state = dict(model.state_dict())
    state["lm_head.weight"] = state["lm_head.weight"] + 1.0
    with pytest.raises(CheckpointError, match="lm_head.weight should be tied"):
        gpt2.from_hf(config.to_dict(), state)


def _llama_config(**changes) -> dict:
    return {**hf.LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                             num_attention_heads=2).to_dict(), **changes}


UNSUPPORTED = {
    "llama rope_scaling": (llama.config_from_hf, _llama_config(rope_scaling={"rope_type": "llama3", "factor": 8.0}),
                           "original_max_position_embeddings"),
    "llama rope_type": (llama.config_from_hf,
                        _llama_config(rope_parameters={"rope_type": "longrope", "factor": 2.0, "rope_theta": 1e4}),
                        "rope_type='longrope'"),
    "llama partial rotary": (llama.config_from_hf,
                             _llama_config(rope_parameters={"rope_theta": 1e4, "partial_rotary_factor": 0.5}),
                             "partial_rotary_factor"),
    "llama classifier": (llama.config_from_hf, _llama_config(architectures=["LlamaForSequenceClassification"]),
                         "LlamaForSequenceClassification"),
    "qwen2 mixed windows": (llama.config_from_hf,
                            {**hf.Qwen2Config(num_hidden_layers=2, use_sliding_window=True, max_window_layers=1,
                                              sliding_window=8).to_dict()}, "layer_types"),
    "llama hidden_act": (llama.config_from_hf, _llama_config(hidden_act="gelu"), "hidden_act"),
    "bert positions": (bert.config_from_hf, {**hf.BertConfig().to_dict(), "position_embedding_type": "relative_key"},
                       "position_embedding_type"),
    "bert activation": (bert.config_from_hf, {**hf.BertConfig().to_dict(), "hidden_act": "tanh"}, "hidden_act"),
    "gpt2 layer scaling": (gpt2.config_from_hf, {**hf.GPT2Config().to_dict(), "scale_attn_by_inverse_layer_idx": True},
                           "scale_attn_by_inverse_layer_idx"),
    "marian ffn dims": (marian.config_from_hf, {**hf.MarianConfig().to_dict(), "decoder_ffn_dim": 8},
                        "decoder_ffn_dim"),
    "marian heads": (marian.config_from_hf, {**hf.MarianConfig().to_dict(), "decoder_attention_heads": 4},
                     "decoder_attention_heads"),
    "marian unshared": (marian.config_from_hf,
                        {**hf.MarianConfig().to_dict(), "share_encoder_decoder_embeddings": False},
                        "share_encoder_decoder_embeddings"),
    "marian prenorm": (marian.config_from_hf, {**hf.MarianConfig().to_dict(), "normalize_before": True},
                       "normalize_before"),
    "marian embedding norm": (marian.config_from_hf, {**hf.MarianConfig().to_dict(), "layernorm_embedding": True},
                              "layernorm_embedding"),
    "marian activation": (marian.config_from_hf, {**hf.MarianConfig().to_dict(), "activation_function": "tanh"},
                          "activation_function"),
    "model type": (importer_for, {"model_type": "bart"}, "model_type='bart'"),
}


@pytest.mark.parametrize("case", sorted(UNSUPPORTED))
def test_unsupported_config_field_is_named(case: str) -> None:
    fn, config, field = UNSUPPORTED[case]
    with pytest.raises(CheckpointError, match=field.replace(".", r"\.").replace("(", r"\(")):
        fn(config)


def test_llama_config_fields_are_read() -> None:
    legacy = {**_llama_config(), "rope_parameters": None, "rope_theta": 5e5, "rope_scaling": None,
              "eos_token_id": 7, "tie_word_embeddings": True, "num_key_value_heads": 1}
    cfg = llama.config_from_hf(legacy)
    assert isinstance(cfg, DecoderConfig)
    assert (cfg.rope_theta, cfg.eos_token_ids, cfg.tie_embeddings, cfg.kv_heads) == (5e5, (7,), True, 1)


def test_importers_are_keyed_by_model_type() -> None:
    assert {"bert", "gpt2", "llama", "marian", "mistral", "qwen2", "qwen3"} <= set(IMPORTERS)


# --- Hugging Face directories ---------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["gpt2", "marian"])
def test_import_hf_dir_reads_save_pretrained_output(kind: str, tmp_path: Path) -> None:
    config, model = tiny_hf(kind)
    model.save_pretrained(tmp_path)  # safetensors, tied copies and Marian's position tables left out
    ours = import_hf_dir(tmp_path)
    ids = torch.tensor([[5, 6, 7, 8]])  # (B, T)
    with torch.no_grad():
        if kind == "gpt2":
            got, ref = ours(ids), model(input_ids=ids).logits
        else:
            got, ref = ours(ids, ids > 0, ids[:, :2]), model(input_ids=ids, decoder_input_ids=ids[:, :2]).logits
    assert torch.allclose(got, ref, atol=1e-5)


def test_import_hf_dir_reads_pytorch_bin(tmp_path: Path) -> None:
    config, model = tiny_hf("bert")
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    ours = import_hf_dir(tmp_path)
    assert isinstance(ours, EncoderModel)
    assert torch.equal(ours.stack.blocks[0].ff.down.weight, model.encoder.layer[0].output.dense.weight)
