"""Our checkpoint format: a directory with `config.json` and `model.safetensors`.

    config.json        cfg.to_dict() (it names the family) plus "format_version"
    model.safetensors  every distinct tensor once: tensors shared between modules (Seq2Seq's
                       token matrix, reachable as encoder.embed.tokens.weight and
                       decoder.embed.tokens.weight) are stored under their first state-dict name

No pickle is read or written. Loading is strict: any missing, unexpected or misshapen tensor
raises CheckpointError naming it. `load_state_strict` is shared with the Hugging Face importers.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from ..config import BlockConfig, ConfigError
from ..decoder import DecoderLM
from ..encoder import EncoderModel
from ..projections.fuse import is_fused
from ..seq2seq import Seq2Seq

FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"

# family name (BlockConfig.family) -> model class built from that config
MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "encoder": EncoderModel,
    "decoder": DecoderLM,
    "seq2seq": Seq2Seq,
}


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model; the message names the tensors or fields at fault."""


def build_model(cfg: BlockConfig, device: torch.device | str = "cpu") -> nn.Module:
    """A randomly initialised model of cfg's family, built directly on `device`."""
    cls = MODEL_CLASSES.get(cfg.family)
    if cls is None:
        raise CheckpointError(f"no model class for family {cfg.family!r}; known: {sorted(MODEL_CLASSES)}")
    with torch.device(device):
        return cls(cfg)


def alias_groups(model: nn.Module) -> list[list[str]]:
    """State-dict names grouped by the tensor they refer to, in state-dict order.

    The first name of each group is the canonical one (the name our format stores).
    """
    groups: dict[int, list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(tensor), []).append(name)
    return list(groups.values())


def _describe(missing: list[str], unexpected: list[str], shapes: list[str], extra: list[str]) -> str:
    parts = []
    if missing:
        parts.append(f"missing tensors: {missing}")
    if unexpected:
        parts.append(f"unexpected tensors: {unexpected}")
    if shapes:
        parts.append(f"shape mismatches: {shapes}")
    return "; ".join(parts + extra)


def load_state_strict(model: nn.Module, state: dict[str, Tensor], dtype: torch.dtype | None = None,
                      source: str = "checkpoint") -> nn.Module:
    """Load `state` into `model` by assignment, after checking names and shapes strictly.

    Each group of aliased names (see alias_groups) needs exactly one of its names in `state`.
    Floating tensors are cast to `dtype` when given, else kept as stored. The model takes the
    tensors (it may share storage with `state`) and is returned in eval() mode.
    Raises CheckpointError naming every missing/unexpected tensor and every shape mismatch.
    """
    expected = model.state_dict()
    missing: list[str] = []
    shapes: list[str] = []
    doubled: list[str] = []
    unexpected = sorted(name for name in state if name not in expected)
    full: dict[str, Tensor] = {}
    for group in alias_groups(model):
        present = [name for name in group if name in state]
        if not present:
            missing.append(group[0])
            continue
        if len(present) > 1:
            doubled.append(f"{present} are one shared tensor but stored more than once")
        tensor = state[present[0]]
        want = tuple(expected[group[0]].shape)
        if tuple(tensor.shape) != want:
            shapes.append(f"{present[0]}: expected {want}, got {tuple(tensor.shape)}")
            continue
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        for name in group:
            full[name] = tensor.contiguous()
    if missing or unexpected or shapes or doubled:
        raise CheckpointError(f"{source} does not fit {type(model).__name__}: "
                              + _describe(missing, unexpected, shapes, doubled))
    device = next(iter(expected.values())).device
    model.load_state_dict({k: v.to(device) for k, v in full.items()}, strict=True, assign=True)
    return model.eval()


def _own_storage(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """Clone tensors whose storage another stored tensor also uses (e.g. q/k/v slices of one fused
    matrix after an import), so every stored tensor owns its bytes and loads back independently."""
    users = Counter(t.untyped_storage().data_ptr() for t in tensors.values())
    return {name: t.clone() if users[t.untyped_storage().data_ptr()] > 1 else t for name, t in tensors.items()}


def save_checkpoint(model: nn.Module, directory: str | Path) -> Path:
    """Write config.json and model.safetensors (each distinct tensor once) into `directory`.

    `model` must have a `cfg` of a registered family. Returns the directory.
    """
    cfg = getattr(model, "cfg", None)
    if not isinstance(cfg, BlockConfig) or cfg.family not in MODEL_CLASSES:
        raise CheckpointError(f"{type(model).__name__} has no config of a known family {sorted(MODEL_CLASSES)}")
    if is_fused(model):
        raise CheckpointError("save the model before fuse_projections (models/projections/fuse.py): checkpoints keep "
                              "q/k/v and gate/up separate")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    state = model.state_dict()
    tensors = {group[0]: state[group[0]].detach().contiguous().cpu() for group in alias_groups(model)}
    tensors = _own_storage(tensors)
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt", "format_version": str(FORMAT_VERSION)})
    config = {**cfg.to_dict(), "format_version": FORMAT_VERSION}
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


def read_config(directory: str | Path) -> BlockConfig:
    """The model config stored in `directory`/config.json."""
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"{path} not found: not a checkpoint directory")
    data = json.loads(path.read_text())
    version = data.pop("format_version", None)
    if version != FORMAT_VERSION:
        raise CheckpointError(f"{path}: format_version {version!r} is not supported (expected {FORMAT_VERSION})")
    try:  # from_dict gives JSON's lists back their tuple type
        return BlockConfig.from_dict(data)
    except ConfigError as exc:
        raise CheckpointError(f"{path}: {exc}") from exc


def load_checkpoint(directory: str | Path, device: torch.device | str = "cpu",
                    dtype: torch.dtype | None = None) -> nn.Module:
    """Rebuild the model saved by save_checkpoint, strictly, in eval() mode.

    dtype: cast floating weights to it; None keeps the stored dtype.
    """
    cfg = read_config(directory)
    weights = Path(directory) / WEIGHTS_FILE
    if not weights.is_file():
        raise CheckpointError(f"{weights} not found")
    model = build_model(cfg, device)
    state = load_file(str(weights), device=str(device))
    return load_state_strict(model, state, dtype, source=str(weights))


__all__ = [
    "CheckpointError", "FORMAT_VERSION", "MODEL_CLASSES", "alias_groups", "build_model", "load_checkpoint",
    "load_state_strict", "read_config", "save_checkpoint",
]
