"""Reading a LoRA adapter in PEFT's format: `adapter_config.json` + `adapter_model.safetensors`.

`read_adapter(path)` returns a `LoraAdapter`: each of our projections' factors (A (r, I), B (O, r)) with
its scale (lora_alpha / r, or / sqrt(r) with rsLoRA; rank_pattern and alpha_pattern per module), and the
weights of `modules_to_save` (a new classification head). What we do not compute as PEFT does is refused
with `AdapterError` naming it (DoRA, other PEFT types, trained biases, embedding adapters, a module no
family table maps): an adapter is served exactly or not at all.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import Tensor

from .targets import Target, targets

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."
# LoraConfig fields whose non-default values change the arithmetic in ways we do not implement
_REFUSED = {"use_dora": (False, None), "layer_replication": (None,), "use_qalora": (False, None),
            "lora_bias": (False, None)}


class AdapterError(ValueError):
    """An adapter that cannot be served as PEFT computes it; str(e) names the problem."""


@dataclass(frozen=True)
class Factors:
    """One adapter module's update of one of our projections: y += scale * (x a^T) b^T over its outputs."""

    target: Target
    a: Tensor  # (r, I)
    b: Tensor  # (O_target, r)
    scale: float


@dataclass
class LoraAdapter:
    """A LoRA adapter read from disk, as our projections see it."""

    name: str
    path: str
    rank: int  # the largest rank of any module
    factors: list[Factors]
    saved: dict[str, Tensor] = field(default_factory=dict)  # modules_to_save: their weights by HF name
    task: str | None = None  # PEFT's task_type (CAUSAL_LM, SEQ_CLS, FEATURE_EXTRACTION, ...)

    @property
    def nbytes(self) -> int:
        return sum(f.a.nbytes + f.b.nbytes for f in self.factors) + sum(t.nbytes for t in self.saved.values())


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's rank_pattern / alpha_pattern lookup: the first key that matches the end of the module's name."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _is_saved(key: str, saved_modules: list[str]) -> bool:
    """Whether tensor `key` belongs to a module of modules_to_save (or one inside it), matched as PEFT
    matches them: a module whose name ends with an entry (DistilBERT's `pre_classifier` for `classifier`)."""
    parts = key.replace(".modules_to_save", "").split(".")[:-1]
    return any(".".join(parts[:i]).endswith(s) for s in saved_modules for i in range(1, len(parts) + 1))


def _config(directory: Path) -> dict[str, Any]:
    try:
        cfg = json.loads((directory / CONFIG).read_text())
    except FileNotFoundError as e:
        raise AdapterError(f"{directory}: no {CONFIG} (a PEFT adapter directory has one)") from e
    except (OSError, json.JSONDecodeError) as e:
        raise AdapterError(f"{directory / CONFIG}: not readable JSON ({e})") from e
    if not isinstance(cfg, dict):
        raise AdapterError(f"{directory / CONFIG}: expected a JSON object")
    kind = cfg.get("peft_type")
    if kind != "LORA":
        raise AdapterError(f"{directory / CONFIG}: peft_type {kind!r} is not served; only LORA adapters are")
    for name, allowed in _REFUSED.items():
        if cfg.get(name) not in allowed:
            what = "DoRA (use_dora)" if name == "use_dora" else name
            raise AdapterError(f"{directory / CONFIG}: {what}={cfg.get(name)!r} is not served")
    if cfg.get("bias", "none") != "none":
        raise AdapterError(f"{directory / CONFIG}: bias={cfg['bias']!r} (trained biases) is not served; only 'none'")
    for name in ("r", "lora_alpha"):
        if not isinstance(cfg.get(name), (int, float)) or cfg[name] <= 0:
            raise AdapterError(f"{directory / CONFIG}: {name} must be a positive number, got {cfg.get(name)!r}")
    return cfg


def _weights(directory: Path) -> dict[str, Tensor]:
    path = directory / WEIGHTS
    if not path.exists():
        found = "adapter_model.bin (a pickle; save with safe_serialization=True)" if (
            directory / "adapter_model.bin").exists() else "nothing"
        raise AdapterError(f"{directory}: no {WEIGHTS}, found {found}")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise AdapterError(f"{path}: not a readable safetensors file ({e})") from e


def read_adapter(path: str | Path, name: str | None = None) -> LoraAdapter:
    """The LoRA adapter in PEFT directory `path`, named `name` (default: the directory's name)."""
    directory = Path(path)
    if not directory.is_dir():
        raise AdapterError(f"{directory}: not a directory")
    cfg = _config(directory)
    state = _weights(directory)
    saved_modules = cfg.get("modules_to_save") or []
    pairs: dict[str, dict[str, Tensor]] = {}
    saved: dict[str, Tensor] = {}
    for key, tensor in state.items():
        key = key.removeprefix(PREFIX)
        m = re.fullmatch(r"(.+)\.(lora_A|lora_B)(?:\.\w+)?\.weight", key)
        if m is not None:
            pairs.setdefault(m.group(1), {})[m.group(2)] = tensor
        elif _is_saved(key, saved_modules):
            saved[key.replace(".modules_to_save", "")] = tensor
        elif re.search(r"lora_(embedding_[AB]|magnitude_vector)", key):
            raise AdapterError(f"{directory / WEIGHTS}: {key}: "
                               + ("DoRA is" if "magnitude" in key else "adapters on embeddings are") + " not served")
        else:
            raise AdapterError(f"{directory / WEIGHTS}: unexpected tensor {key!r}")
    if not pairs:
        raise AdapterError(f"{directory / WEIGHTS}: no lora_A / lora_B weights")
    rank_pattern, alpha_pattern = cfg.get("rank_pattern") or {}, cfg.get("alpha_pattern") or {}
    factors: list[Factors] = []
    rank = 0
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"lora_A", "lora_B"}:
            raise AdapterError(f"{directory / WEIGHTS}: {module} has {sorted(ab)}; a LoRA module needs lora_A and lora_B")
        a, b = ab["lora_A"], ab["lora_B"]
        r = int(_pattern_value(rank_pattern, module, cfg["r"]))
        if a.dim() != 2 or b.dim() != 2 or a.size(0) != r or b.size(1) != r or not a.is_floating_point():
            raise AdapterError(f"{directory / WEIGHTS}: {module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} "
                               f"are not rank-{r} factors")
        alpha = float(_pattern_value(alpha_pattern, module, cfg["lora_alpha"]))
        scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
        found = targets(module)
        if found is None:
            raise AdapterError(f"{directory / WEIGHTS}: module {module!r} is not one of the projections we serve "
                               f"adapters on (attention and feed-forward projections of a block)")
        rows = b.size(0) // found[0].of
        if rows * found[0].of != b.size(0):
            raise AdapterError(f"{directory / WEIGHTS}: {module}: lora_B's {b.size(0)} outputs do not split in "
                               f"{found[0].of}")
        for t in found:
            factors.append(Factors(t, a.float(), b[t.part * rows:(t.part + 1) * rows].float(), scale))
        rank = max(rank, r)
    return LoraAdapter(name or directory.name, str(directory), rank, factors, saved, cfg.get("task_type"))


def save_adapter(path: str | Path, factors: dict[str, tuple[Tensor, Tensor]], rank: int, alpha: float,
                 task_type: str = "CAUSAL_LM", saved: dict[str, Tensor] | None = None) -> Path:
    """Write a LoRA adapter in PEFT's format: `factors` maps a Hugging Face module name
    (`model.layers.0.self_attn.q_proj`) to its (A (r, I), B (O, r)); `saved`: whole tensors of
    modules_to_save by name (`classifier.weight`); read_adapter reads it back."""
    from safetensors.torch import save_file

    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    modules = sorted({name.rsplit(".", 1)[-1] for name in factors})
    cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": modules, "bias": "none",
           "use_dora": False, "use_rslora": False, "task_type": task_type, "lora_dropout": 0.0,
           "modules_to_save": sorted({k.rsplit(".", 1)[0] for k in saved}) if saved else None,
           "rank_pattern": {}, "alpha_pattern": {}}
    (directory / CONFIG).write_text(json.dumps(cfg, indent=2))
    tensors = {}
    for name, (a, b) in factors.items():
        tensors[f"{PREFIX}{name}.lora_A.weight"] = a.contiguous()
        tensors[f"{PREFIX}{name}.lora_B.weight"] = b.contiguous()
    for name, t in (saved or {}).items():
        tensors[f"{PREFIX}{name}"] = t.contiguous()
    save_file(tensors, str(directory / WEIGHTS))
    return directory


def random_llama_factors(model, rank: int, seed: int, std: float = 0.05,  # noqa: ANN001 - a DecoderLM
                         modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                     "down_proj")) -> dict[str, tuple[Tensor, Tensor]]:
    """Random rank-`rank` factors, named as a Llama-family adapter's, for every `modules` projection of a
    model of ours (its config's shapes; no gate_proj without a gated feed-forward): test and benchmark
    adapters."""
    import torch

    cfg = model.cfg
    q, kv = cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    shapes = {"q_proj": (cfg.d_model, q), "k_proj": (cfg.d_model, kv), "v_proj": (cfg.d_model, kv),
              "o_proj": (q, cfg.d_model), "gate_proj": (cfg.d_model, cfg.d_ff), "up_proj": (cfg.d_model, cfg.d_ff),
              "down_proj": (cfg.d_ff, cfg.d_model)}
    g = torch.Generator().manual_seed(seed)
    gated = model.stack.blocks[0].ff.gated
    out = {}
    for layer in range(cfg.n_layers):
        for name in (m for m in modules if gated or m != "gate_proj"):
            i, o = shapes[name]
            where = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            a = torch.randn(rank, i, generator=g) * std
            b = torch.randn(o, rank, generator=g) * std
            out[f"model.layers.{layer}.{where}.{name}"] = (a, b)
    return out
