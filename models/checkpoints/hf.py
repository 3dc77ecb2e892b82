"""Shared helpers for the Hugging Face importers: reading a model directory, renaming tensors strictly,
and checking config fields.

A Hugging Face directory holds `config.json` and the weights as `model.safetensors`, a sharded
`model.safetensors.index.json`, or (legacy) `pytorch_model.bin`, which is read with
torch.load(weights_only=True) so no arbitrary pickle code runs.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import Tensor

from ..config import Activation, BlockConfig, ConfigError
from .format import CheckpointError

# Hugging Face activation names (ACT2FN keys) -> ours
HF_ACTIVATIONS: dict[str, Activation] = {
    "gelu": "gelu",  # erf form
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "relu": "relu",
    "silu": "silu",
    "swish": "silu",
}


def read_hf_dir(path: str | Path) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """(config.json as a dict, state dict on CPU) from a Hugging Face model directory."""
    root = Path(path)
    config_path = root / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{config_path} not found: not a Hugging Face model directory")
    hf_config = json.loads(config_path.read_text())
    if (root / "model.safetensors").is_file():
        return hf_config, load_file(str(root / "model.safetensors"))
    index = root / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        state: dict[str, Tensor] = {}
        for shard in shards:
            state.update(load_file(str(root / shard)))
        return hf_config, state
    if (root / "pytorch_model.bin").is_file():
        state = torch.load(root / "pytorch_model.bin", map_location="cpu", weights_only=True)
        return hf_config, dict(state)
    raise CheckpointError(f"{root}: no model.safetensors, model.safetensors.index.json or pytorch_model.bin")


def strip_prefix(state: Mapping[str, Tensor], prefix: str, anchor: str) -> dict[str, Tensor]:
    """Drop `prefix` from every name if the checkpoint uses it (detected by `prefix + anchor`).

    Lets one importer read both the bare model (`embeddings.…`) and a model with a head
    (`bert.embeddings.…`). Names without the prefix (the head's own tensors) are kept as they are.
    """
    if prefix + anchor not in state:
        return dict(state)
    return {name.removeprefix(prefix): t for name, t in state.items()}


def rename_strict(
    state: Mapping[str, Tensor],
    mapping: Mapping[str, str],
    optional: Iterable[str] = (),
    ignore: Iterable[str] = (),
    source: str = "checkpoint",
) -> dict[str, Tensor]:
    """Rename `state` by `mapping` (their name -> ours), strictly.

    optional: their names that may be absent (tied copies, buffers); they are not renamed and
    should not appear in `mapping`. ignore: regular expressions (full match) for their names to drop
    (pooler/heads, legacy buffers). Any other name left over, or any name of `mapping` absent,
    raises CheckpointError naming them.
    """
    patterns = [re.compile(p) for p in ignore]
    optional = set(optional)
    missing = sorted(name for name in mapping if name not in state)
    unexpected = sorted(
        name for name in state
        if name not in mapping and name not in optional and not any(p.fullmatch(name) for p in patterns)
    )
    if missing or unexpected:
        parts = ([f"missing tensors: {missing}"] if missing else []) + (
            [f"unexpected tensors: {unexpected}"] if unexpected else [])
        raise CheckpointError(f"{source}: " + "; ".join(parts))
    return {ours: state[theirs] for theirs, ours in mapping.items()}


def per_layer(n_layers: int, theirs: str, ours: str, parts: Mapping[str, str],
              params: Iterable[str] = ("weight", "bias")) -> dict[str, str]:
    """`{theirs}.{i}.{their part}.{p}` -> `{ours}.{i}.{our part}.{p}` for every layer i, part and param."""
    params = tuple(params)
    return {f"{theirs}.{i}.{part}.{p}": f"{ours}.{i}.{mine}.{p}"
            for i in range(n_layers) for part, mine in parts.items() for p in params}


def check_tied(state: Mapping[str, Tensor], copy: str, original: str, source: str) -> None:
    """A stored copy of a tied tensor must equal the original (config and weights agree)."""
    if copy in state and original in state and not torch.equal(state[copy], state[original]):
        raise CheckpointError(f"{source}: {copy} should be tied to {original} but holds different values")


def activation(hf_config: Mapping[str, Any], field: str, table: Mapping[str, Activation] = HF_ACTIVATIONS,
               source: str = "config.json") -> Activation:
    """Our activation for the HF activation named in `field`; unsupported names raise naming the field."""
    name = hf_config.get(field)
    if name not in table:
        raise CheckpointError(f"{source}: {field}={name!r} is not supported; supported: {sorted(table)}")
    return table[name]


def require(hf_config: Mapping[str, Any], field: str, allowed: Callable[[Any], bool], why: str,
            default: Any = None, source: str = "config.json") -> None:
    """Raise CheckpointError naming `field` unless allowed(value) (value = default when absent)."""
    value = hf_config.get(field, default)
    if not allowed(value):
        raise CheckpointError(f"{source}: {field}={value!r} is not supported: {why}")


def need_field(hf_config: Mapping[str, Any], field: str, source: str = "config.json") -> Any:
    """A field the importer cannot guess."""
    if field not in hf_config or hf_config[field] is None:
        raise CheckpointError(f"{source}: required field {field!r} is missing")
    return hf_config[field]


def token_ids(value: Any, field: str, source: str = "config.json") -> tuple[int, ...]:
    """An id field that may be None, an int or a list of ints -> a tuple of ints."""
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    if isinstance(value, list | tuple) and all(isinstance(v, int) for v in value):
        return tuple(value)
    raise CheckpointError(f"{source}: {field}={value!r} must be an int or a list of ints")


def make_config(cls: type[BlockConfig], source: str, **fields: Any) -> BlockConfig:
    """cls(**fields), with a ConfigError re-raised as CheckpointError naming the source."""
    try:
        return cls(**fields)
    except ConfigError as exc:
        raise CheckpointError(f"{source}: {exc}") from exc
