"""GGUF import and the converted-weights cache, on tiny random Llama GGUFs written here.

A random transformers LlamaForCausalLM is written the way llama.cpp's convert_hf_to_gguf does
(its own names, q/k rows permuted, optional quantization); importing it must give the same logits.
The naming table and permutation below are written out independently of models.checkpoints.gguf_import,
so a mistake there cannot cancel out.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.convert_slow_tokenizer import bytes_to_unicode

from models.checkpoints import cache as converted
from models.checkpoints.format import CheckpointError
from models.checkpoints.gguf_import import (
    hf_name,
    import_gguf,
    load_gguf_tokenizer,
    read_gguf,
    unpermute_rotary,
)
from models.checkpoints.registry import import_hf_dir

Q = gguf.GGMLQuantizationType
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOKENS = SPECIALS + list(bytes_to_unicode().values()) + ["Ġt", "he", "Ġthe"]
MERGES = ["Ġ t", "h e", "Ġt he"]
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
N_LAYERS = 2

# llama.cpp tensor names for transformers' Llama / Qwen names (as convert_hf_to_gguf writes them)
TO_GGUF = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
for _i in range(N_LAYERS):
    for _theirs, _ours in [("self_attn.q_proj", "attn_q"), ("self_attn.k_proj", "attn_k"),
                           ("self_attn.v_proj", "attn_v"), ("self_attn.o_proj", "attn_output"),
                           ("mlp.gate_proj", "ffn_gate"), ("mlp.up_proj", "ffn_up"), ("mlp.down_proj", "ffn_down"),
                           ("input_layernorm", "attn_norm"), ("post_attention_layernorm", "ffn_norm"),
                           ("self_attn.q_norm", "attn_q_norm"), ("self_attn.k_norm", "attn_k_norm")]:
        for _p in ("weight", "bias"):
            TO_GGUF[f"model.layers.{_i}.{_theirs}.{_p}"] = f"blk.{_i}.{_ours}.{_p}"


def llamacpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """convert_hf_to_gguf.LlamaModel.permute, verbatim."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2)
            .reshape(weights.shape))


def tiny_llama(tie: bool, seed: int = 0, bias: bool = False) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(TOKENS), hidden_size=64, intermediate_size=128, num_hidden_layers=N_LAYERS,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5,
                      rope_theta=500.0, tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2, pad_token_id=2,
                      attention_bias=bias)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))  # not all ones, so norms must land in the right place
            elif name.endswith(".bias"):
                p.copy_(0.5 * torch.randn_like(p))  # biases away from 0, so their permutation matters
    return model


def write_gguf(path: Path, model: torch.nn.Module, qtype: gguf.GGMLQuantizationType, arch: str = "llama",
               rope_freqs: np.ndarray | None = None, metadata: dict[str, Any] | None = None) -> None:
    """Write `model` as llama.cpp would, and load the quantization round-trip back into `model`.

    Afterwards `model` holds exactly the weights the GGUF represents, so it is the reference. Only
    `llama` has its q/k rows permuted (llama.cpp rotates Qwen's heads the NEOX way, as HF does).
    """
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_rope_dimension_count(head_dim)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(TOKENS)
    w.add_token_types([3] * len(SPECIALS) + [1] * (len(TOKENS) - len(SPECIALS)))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(TEMPLATE)
    for key, value in (metadata or {}).items():  # "{arch}" in a key: the architecture
        key = key.format(arch=arch)
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        else:
            w.add_float32(key, value)
    state = model.state_dict()
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight")
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    for name, tensor in state.items():
        original = tensor.numpy()
        data = original
        if arch != "llama":
            pass
        elif name.endswith(("q_proj.weight", "q_proj.bias")):
            data = llamacpp_permute(data, cfg.num_attention_heads, cfg.num_attention_heads)
        elif name.endswith(("k_proj.weight", "k_proj.bias")):
            data = llamacpp_permute(data, cfg.num_attention_heads, cfg.num_key_value_heads)
        if data.ndim == 2 and qtype != Q.F32:
            w.add_tensor(TO_GGUF[name], gguf.quants.quantize(data, qtype), raw_dtype=qtype)
            # blocks run along rows, so quantizing commutes with the row permutation
            rounded = gguf.quants.dequantize(gguf.quants.quantize(original, qtype), qtype).reshape(original.shape)
            with torch.no_grad():
                model.get_parameter(name).copy_(torch.from_numpy(rounded))
        else:
            w.add_tensor(TO_GGUF[name], np.ascontiguousarray(data, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


@pytest.fixture
def ids() -> torch.Tensor:
    return torch.randint(0, len(TOKENS), (2, 11), generator=torch.Generator().manual_seed(1))  # (B, T)


@pytest.mark.parametrize(("qtype", "tie"), [(Q.F32, True), (Q.F32, False), (Q.Q8_0, True)],
                         ids=["f32-tied", "f32-untied", "q8_0-tied"])
def test_import_matches_transformers(tmp_path: Path, ids: torch.Tensor, qtype: Q, tie: bool) -> None:
    ref = tiny_llama(tie)
    write_gguf(tmp_path / "tiny.gguf", ref, qtype)
    model, contents = import_gguf(tmp_path / "tiny.gguf")
    assert model.cfg.tie_embeddings is tie and contents.hf_config["tie_word_embeddings"] is tie
    with torch.no_grad():
        expected = ref(ids).logits  # (B, T, V)
        got = model(ids)  # (B, T, V)
    assert got.shape == expected.shape == (2, 11, len(TOKENS))
    assert rel_err(got, expected) <= 1e-4


def tiny_qwen(arch: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    common = dict(vocab_size=len(TOKENS), hidden_size=64, intermediate_size=128, num_hidden_layers=N_LAYERS,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5,
                  rope_theta=500.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    if arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=32))  # 4 heads of 32 on a width of 64
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))  # biases and q/k norms away from 0 / 1
    return model.eval()


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_gguf_matches_the_same_weights_from_safetensors(tmp_path: Path, ids: torch.Tensor, arch: str) -> None:
    """A qwen2 / qwen3 GGUF (q/k/v biases, q/k norms, explicit head dim) loads to the same model as the
    Hugging Face directory of the same weights."""
    ref = tiny_qwen(arch)
    write_gguf(tmp_path / "tiny.gguf", ref, Q.F32, arch=arch)
    ref.save_pretrained(tmp_path / "hf")
    from_gguf, contents = import_gguf(tmp_path / "tiny.gguf")
    from_dir = import_hf_dir(tmp_path / "hf")
    assert contents.hf_config["model_type"] == arch
    assert from_gguf.cfg.replace(norm_eps=from_dir.cfg.norm_eps) == from_dir.cfg  # GGUF stores eps as float32
    with torch.no_grad():
        got, want, theirs = from_gguf(ids), from_dir(ids), ref(ids).logits  # (B, T, V) each
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    assert rel_err(got, theirs) <= 1e-4


def llama3_rope_factors(head_dim: int, theta: float, factor: float, low: float, high: float, old: int) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.generate_extra_tensors for rope_type llama3, restated."""
    out = []
    for freq in 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)):
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def test_llama3_rope_factors_from_a_gguf_match_transformers(tmp_path: Path, ids: torch.Tensor) -> None:
    """llama.cpp keeps Llama 3.1's RoPE scaling as a rope_freqs tensor of per-frequency divisors."""
    torch.manual_seed(0)
    rope = {"rope_type": "llama3", "rope_theta": 500.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    ref = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(TOKENS), hidden_size=64, intermediate_size=128, num_hidden_layers=N_LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5,
        rope_parameters=rope, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)).eval()
    factors = llama3_rope_factors(16, 500.0, 8.0, 1.0, 4.0, 32)
    assert len(set(factors.tolist())) > 2  # low, high and smoothed frequencies all present
    write_gguf(tmp_path / "tiny.gguf", ref, Q.F32, rope_freqs=factors)
    model, _ = import_gguf(tmp_path / "tiny.gguf")
    assert model.cfg.rope_scaling.type == "frequencies"
    with torch.no_grad():
        assert rel_err(model(ids), ref(ids).logits) <= 1e-4
        plain = LlamaForCausalLM(LlamaConfig(**{**ref.config.to_dict(), "rope_parameters": None,
                                                "rope_theta": 500.0})).eval()
        plain.load_state_dict(ref.state_dict())
        assert rel_err(model(ids), plain(ids).logits) > 1e-3  # the factors matter at these positions


def test_yarn_scaling_from_a_gguf_matches_transformers(tmp_path: Path, ids: torch.Tensor) -> None:
    """YaRN's factor, context and ramp ends (yarn_beta_fast / _slow) come from the metadata; an
    attention factor we would not apply is refused, naming the key."""
    rope = {"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0, "original_max_position_embeddings": 16,
            "beta_fast": 16.0, "beta_slow": 2.0}
    torch.manual_seed(0)
    ref = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(TOKENS), hidden_size=64, intermediate_size=128, num_hidden_layers=N_LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5,
        rope_parameters=rope, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)).eval()
    yarn = {"{arch}.rope.scaling.type": "yarn", "{arch}.rope.scaling.factor": 4.0,
            "{arch}.rope.scaling.original_context_length": 16, "{arch}.rope.scaling.yarn_beta_fast": 16.0,
            "{arch}.rope.scaling.yarn_beta_slow": 2.0}
    write_gguf(tmp_path / "tiny.gguf", ref, Q.F32, metadata=yarn)
    model, _ = import_gguf(tmp_path / "tiny.gguf")
    scaling = model.cfg.rope_scaling
    assert (scaling.type, scaling.factor, scaling.beta_fast, scaling.beta_slow) == ("yarn", 4.0, 16.0, 2.0)
    with torch.no_grad():
        assert rel_err(model(ids), ref(ids).logits) <= 1e-4
    write_gguf(tmp_path / "attn.gguf", ref, Q.F32, metadata={**yarn, "{arch}.rope.scaling.yarn_attn_factor": 0.8})
    with pytest.raises(CheckpointError, match="yarn_attn_factor=0.8"):
        import_gguf(tmp_path / "attn.gguf")


def test_llama_q_k_biases_are_unpermuted_like_the_weights(tmp_path: Path, ids: torch.Tensor) -> None:
    """llama.cpp permutes the q/k biases of a llama with attention_bias as it permutes their weights."""
    ref = tiny_llama(tie=True, bias=True)
    write_gguf(tmp_path / "tiny.gguf", ref, Q.F32)
    model, _ = import_gguf(tmp_path / "tiny.gguf")
    assert model.cfg.attn_bias
    with torch.no_grad():
        assert rel_err(model(ids), ref(ids).logits) <= 1e-4


def test_config_and_template_come_from_metadata(tmp_path: Path) -> None:
    write_gguf(tmp_path / "tiny.gguf", tiny_llama(tie=True), Q.F32)
    contents = read_gguf(tmp_path / "tiny.gguf")
    cfg = contents.hf_config
    assert (cfg["vocab_size"], cfg["hidden_size"], cfg["intermediate_size"]) == (len(TOKENS), 64, 128)
    assert (cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (N_LAYERS, 4, 2)
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["max_position_embeddings"]) == (1, 2, 64)
    assert cfg["rope_theta"] == 500.0 and cfg["rms_norm_eps"] == pytest.approx(1e-5)
    assert contents.chat_template == TEMPLATE
    assert "lm_head.weight" not in contents.state
    assert all(t.dtype == torch.float32 for t in contents.state.values())


def test_unpermute_inverts_llamacpp_permutation() -> None:
    w = torch.arange(8 * 2 * 3, dtype=torch.float32).reshape(16, 3)  # 2 heads of D=8, 3 inputs
    permuted = torch.from_numpy(llamacpp_permute(w.numpy(), 4, 2))
    assert not torch.equal(permuted, w)
    assert torch.equal(unpermute_rotary(permuted, 2), w)


def test_names_map_to_transformers_and_unknown_names_raise() -> None:
    assert hf_name("blk.3.ffn_gate.weight") == "model.layers.3.mlp.gate_proj.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    with pytest.raises(CheckpointError, match="blk.0.ssm_a"):
        hf_name("blk.0.ssm_a")


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    w = gguf.GGUFWriter(str(tmp_path / "other.gguf"), "falcon")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match="architecture 'falcon' is not supported"):
        read_gguf(tmp_path / "other.gguf")


def test_converted_cache_round_trip(tmp_path: Path, ids: torch.Tensor, monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "src" / "tiny.gguf"
    src.parent.mkdir()
    write_gguf(src, tiny_llama(tie=True), Q.Q8_0)
    direct, _ = import_gguf(src)
    cache_dir = tmp_path / "cache"

    first = converted.load_gguf_cached(src, cache_dir)
    entries = list((cache_dir / converted.CONVERTED).iterdir())
    assert [e.name for e in entries] == [converted.cache_key(converted.zoo.sha256_file(src))]  # no temp dirs

    def no_conversion(*args: object) -> None:
        raise AssertionError("a cached entry must not be converted again")

    monkeypatch.setattr(converted, "convert_gguf", no_conversion)
    second = converted.load_gguf_cached(src, cache_dir)
    with torch.no_grad():
        expected = direct(ids)  # (B, T, V)
        for loaded in (first, second):
            assert torch.equal(loaded.model(ids), expected)
    assert second.chat_template == TEMPLATE
    reference = load_gguf_tokenizer(src)
    text = "the cat sat on the mat"
    assert second.tokenizer(text).input_ids == reference(text).input_ids
    assert second.tokenizer.decode(second.tokenizer(text).input_ids) == text


def test_new_source_file_gets_a_new_cache_entry(tmp_path: Path) -> None:
    cache_dir = tmp_path / "cache"
    for seed in (0, 1):
        src = tmp_path / f"seed{seed}" / "tiny.gguf"
        src.parent.mkdir()
        write_gguf(src, tiny_llama(tie=True, seed=seed), Q.F32)
        converted.load_gguf_cached(src, cache_dir)
    assert len(list((cache_dir / converted.CONVERTED).iterdir())) == 2
