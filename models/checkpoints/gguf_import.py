"""Import Llama-family GGUF files (llama.cpp's `llama`, `qwen2`, `qwen3`) as a Hugging Face-style config
and state, then our DecoderLM through `models.checkpoints.llama.from_hf`.

- metadata `<arch>.*` / `tokenizer.ggml.*` -> a transformers config dict (`hf_config_from_gguf`;
  `tie_word_embeddings` when the file has no `output.weight`);
- tensors, quantized or not, are dequantized to float32, reshaped to the reversed GGUF shape
  (`(out, in)`, as nn.Linear) and renamed (`blk.N.attn_q.weight` -> `model.layers.N.self_attn.q_proj...`);
- for `llama` only, `unpermute_rotary` undoes llama.cpp's row permutation of q and k (as transformers'
  GGUF loader does); Qwen files keep HF's rotate-half order.
The chat template is `tokenizer.chat_template`; `load_gguf_tokenizer` rebuilds the tokenizer (slow:
cache it with models.checkpoints.cache).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from torch import Tensor

from ..decoder import DecoderLM
from .format import CheckpointError
from .llama import from_hf

log = logging.getLogger(__name__)

# GGUF names outside the blocks -> transformers names (suffix .weight/.bias kept)
GLOBAL_TENSORS: dict[str, str] = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# GGUF names inside block N (`blk.N.<name>`) -> transformers names inside `model.layers.N.`
BLOCK_TENSORS: dict[str, str] = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",  # qwen3
    "attn_k_norm": "self_attn.k_norm",  # qwen3
}


@dataclass(frozen=True)
class GGUFModel:
    """The decoded contents of a GGUF: transformers config dict, float32 state with transformers names."""

    hf_config: dict[str, Any]
    state: dict[str, Tensor]
    chat_template: str | None


def unpermute_rotary(w: Tensor, n_heads: int) -> Tensor:
    """Undo llama.cpp's q/k row permutation (GGUF -> HF): w (n_heads * D, ...), n_heads = kv heads for k.

    convert_hf_to_gguf reorders each head's rows [x0 .. x_{D/2-1}, y0 .. y_{D/2-1}] (HF rotates halves)
    into [x0, y0, x1, y1, ...] (llama.cpp rotates adjacent pairs); this restores the HF order.
    """
    d = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, d, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)  # (H * D, ...)


def hf_name(name: str) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; unknown names raise."""
    stem, _, suffix = name.rpartition(".")
    parts = stem.split(".")
    if len(parts) == 1 and stem in GLOBAL_TENSORS:
        return f"{GLOBAL_TENSORS[stem]}.{suffix}"
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in BLOCK_TENSORS:
        return f"model.layers.{parts[1]}.{BLOCK_TENSORS[parts[2]]}.{suffix}"
    raise CheckpointError(f"GGUF tensor {name!r} has no Llama-family counterpart "
                          f"(supported: {sorted(GLOBAL_TENSORS)}, "
                          f"blk.N.{{{', '.join(sorted(BLOCK_TENSORS))}}})")


_MISSING = object()


def field(reader: gguf.GGUFReader, key: str, default: Any = _MISSING) -> Any:
    """A metadata value (scalars as Python values, strings decoded, arrays as lists)."""
    f = reader.get_field(key)
    if f is None:
        if default is _MISSING:
            raise CheckpointError(f"GGUF metadata {key!r} is missing")
        return default
    return f.contents()


@dataclass(frozen=True)
class Architecture:
    """A GGUF architecture of the Llama family: the transformers model it is, and its tensor layout."""

    model_type: str
    hf_class: str
    permuted_qk: bool  # llama.cpp permuted q/k rows for its adjacent-pair rotation (llama only)


ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture("llama", "LlamaForCausalLM", permuted_qk=True),
    "qwen2": Architecture("qwen2", "Qwen2ForCausalLM", permuted_qk=False),
    "qwen3": Architecture("qwen3", "Qwen3ForCausalLM", permuted_qk=False),
}
ROPE_FREQS = "rope_freqs.weight"  # not a weight: RoPE frequency factors, read into the config
# GGUF rope.scaling.type -> transformers rope_type
_ROPE_SCALING = {"linear": "linear", "yarn": "yarn"}
# YaRN's ramp ends in GGUF metadata -> transformers' rope_parameters names
_YARN_BETAS = {"yarn_beta_fast": "beta_fast", "yarn_beta_slow": "beta_slow"}
# YaRN attention-factor metadata llama.cpp may write, and the value that leaves the derived factor as is
_YARN_ATTENTION = {"attn_factor": 1.0, "yarn_attn_factor": 1.0, "yarn_log_multiplier": 0.0}


def _rope_parameters(reader: gguf.GGUFReader, arch: str, theta: float) -> dict[str, Any]:
    scaling = field(reader, f"{arch}.rope.scaling.type", "none")
    freqs = [t for t in reader.tensors if t.name == ROPE_FREQS]
    if freqs:  # Llama 3.1's scaling, as llama.cpp stores it: one divisor per rotary frequency
        if scaling != "none":
            raise CheckpointError(f"GGUF: both {ROPE_FREQS} and rope scaling {scaling!r}: not supported together")
        return {"rope_type": "frequencies", "rope_theta": theta, "freq_factors": dequantized(freqs[0]).tolist()}
    if scaling == "none":
        return {"rope_type": "default", "rope_theta": theta}
    if scaling not in _ROPE_SCALING:
        raise CheckpointError(f"GGUF: rope scaling {scaling!r} is not supported; supported: "
                              f"{['none', *sorted(_ROPE_SCALING)]}")
    params = {"rope_type": _ROPE_SCALING[scaling], "rope_theta": theta,
              "factor": float(field(reader, f"{arch}.rope.scaling.factor"))}
    if scaling == "yarn":
        params["original_max_position_embeddings"] = int(field(reader, f"{arch}.rope.scaling.original_context_length"))
        for key, name in _YARN_BETAS.items():
            value = field(reader, f"{arch}.rope.scaling.{key}", None)
            if value is not None:
                params[name] = float(value)
        for key, neutral in _YARN_ATTENTION.items():  # we derive YaRN's attention factor from the scaling
            value = field(reader, f"{arch}.rope.scaling.{key}", None)
            if value is not None and float(value) != neutral:
                raise CheckpointError(f"GGUF: {arch}.rope.scaling.{key}={value} is not supported (YaRN's attention "
                                      f"factor is derived from the scaling factor, as transformers does by default)")
    return params


def _family_config(reader: gguf.GGUFReader, arch: str) -> dict[str, Any]:
    n_embd = int(field(reader, f"{arch}.embedding_length"))
    n_heads = int(field(reader, f"{arch}.attention.head_count"))
    head_dim = int(field(reader, f"{arch}.attention.key_length", n_embd // n_heads))
    rope_dims = int(field(reader, f"{arch}.rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise CheckpointError(f"GGUF: partial rotary (rope.dimension_count={rope_dims}, head dim {head_dim}) "
                              "is not supported")
    tokens = reader.get_field("tokenizer.ggml.tokens")
    if tokens is None:
        raise CheckpointError("GGUF metadata 'tokenizer.ggml.tokens' is missing: cannot size the vocabulary")
    theta = float(field(reader, f"{arch}.rope.freq_base", 10000.0))
    eos = field(reader, "tokenizer.ggml.eos_token_id", None)
    names = {t.name for t in reader.tensors}
    return {
        "architectures": [ARCHITECTURES[arch].hf_class],
        "model_type": ARCHITECTURES[arch].model_type,
        "vocab_size": len(tokens.data),
        "hidden_size": n_embd,
        "intermediate_size": int(field(reader, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(field(reader, f"{arch}.block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(field(reader, f"{arch}.attention.head_count_kv", n_heads)),
        "head_dim": head_dim,
        "max_position_embeddings": int(field(reader, f"{arch}.context_length")),
        "rms_norm_eps": float(field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": theta,
        "rope_parameters": _rope_parameters(reader, arch, theta),
        "hidden_act": "silu",
        "attention_bias": "blk.0.attn_output.bias" in names if arch != "qwen2" else None,
        "mlp_bias": False,
        "use_sliding_window": False,
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": field(reader, "tokenizer.ggml.bos_token_id", None),
        "eos_token_id": eos,
        "pad_token_id": field(reader, "tokenizer.ggml.padding_token_id", None),
    }


def hf_config_from_gguf(reader: gguf.GGUFReader) -> dict[str, Any]:
    """A transformers config dict (Llama, Qwen2 or Qwen3) from the GGUF metadata."""
    arch = field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise CheckpointError(f"GGUF architecture {arch!r} is not supported; "
                              f"supported: {sorted(ARCHITECTURES)}")
    return _family_config(reader, arch)


def dequantized(tensor: gguf.ReaderTensor) -> Tensor:
    """float32 tensor in transformers layout (reversed GGUF shape), owning its memory (not the mmap)."""
    arr = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    if not arr.flags.writeable or arr.dtype != np.float32:  # F32 tensors come back as views of the file
        arr = np.array(arr, dtype=np.float32)
    shape = [int(n) for n in reversed(tensor.shape)]
    return torch.from_numpy(arr).reshape(shape)


def read_gguf(path: str | Path) -> GGUFModel:
    """Config, float32 transformers-named state (q/k un-permuted) and chat template of a Llama-family GGUF."""
    reader = gguf.GGUFReader(str(path))
    hf_config = hf_config_from_gguf(reader)
    heads = {"attn_q": hf_config["num_attention_heads"], "attn_k": hf_config["num_key_value_heads"]}
    if not ARCHITECTURES[hf_config["model_type"]].permuted_qk:
        heads = {}
    state: dict[str, Tensor] = {}
    for tensor in reader.tensors:
        if tensor.name == ROPE_FREQS:
            continue
        name = hf_name(tensor.name)
        w = dequantized(tensor)  # (out, in) or (C,)
        kind = tensor.name.split(".")[-2]
        if kind in heads:  # weights and biases: llama.cpp permuted both
            w = unpermute_rotary(w, heads[kind])  # (H * D, C)
        state[name] = w
    template = field(reader, "tokenizer.chat_template", None)
    log.info("read %s: %d tensors (%s)", path, len(state),
             ", ".join(sorted({t.tensor_type.name for t in reader.tensors})))
    return GGUFModel(hf_config, state, template)


def import_gguf(path: str | Path, dtype: torch.dtype | None = None) -> tuple[DecoderLM, GGUFModel]:
    """Our DecoderLM (eval mode) from a Llama-family GGUF, and the decoded contents it was built from.

    dtype: cast the (dequantized, float32) weights to it; None keeps float32.
    """
    contents = read_gguf(path)
    return from_hf(contents.hf_config, contents.state, dtype=dtype), contents


def load_gguf_tokenizer(path: str | Path) -> Any:
    """The transformers (fast) tokenizer rebuilt from the GGUF's tokenizer.ggml.* metadata (takes seconds)."""
    from transformers import AutoTokenizer  # heavy import, only needed here

    p = Path(path)
    return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)


__all__ = [
    "ARCHITECTURES", "Architecture", "BLOCK_TENSORS", "GGUFModel", "GLOBAL_TENSORS", "dequantized", "field",
    "hf_config_from_gguf",
    "hf_name", "import_gguf", "load_gguf_tokenizer", "read_gguf", "unpermute_rotary",
]
