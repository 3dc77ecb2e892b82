"""Hugging Face importers by `model_type`, and a one-call import of a local HF model directory."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from . import bert, distilbert, gpt2, llama, marian, roberta, t5
from .format import CheckpointError
from .hf import read_hf_dir

Importer = Callable[..., nn.Module]  # from_hf(hf_config, state, dtype=None) -> model in eval mode

# config.json "model_type" -> importer
IMPORTERS: dict[str, Importer] = {
    "bert": bert.from_hf,
    "distilbert": distilbert.from_hf,
    "roberta": roberta.from_hf,
    "xlm-roberta": roberta.from_hf,  # RoBERTa's architecture and tensor names, a larger vocabulary
    "gpt2": gpt2.from_hf,
    "llama": llama.from_hf,
    "marian": marian.from_hf,
    "t5": t5.from_hf,
    "mt5": t5.from_hf,  # T5 v1.1's layout and tensor names, a larger vocabulary
    "mistral": llama.from_hf,
    "qwen2": llama.from_hf,
    "qwen3": llama.from_hf,
}


def importer_for(hf_config: dict[str, Any]) -> Importer:
    """The importer for config.json's model_type; unknown types raise naming it."""
    model_type = hf_config.get("model_type")
    if model_type not in IMPORTERS:
        raise CheckpointError(f"config.json: model_type={model_type!r} is not supported; "
                              f"supported: {sorted(IMPORTERS)}")
    return IMPORTERS[model_type]


def import_hf(hf_config: dict[str, Any], state: dict[str, Tensor], dtype: torch.dtype | None = None) -> nn.Module:
    """Our model (eval mode) from an HF config dict and state dict, dispatched on model_type."""
    return importer_for(hf_config)(hf_config, state, dtype=dtype)


def import_hf_dir(path: str | Path, dtype: torch.dtype | None = None) -> nn.Module:
    """Our model (eval mode, on CPU) from a local Hugging Face model directory (never the Hub).

    dtype: cast floating weights to it; None keeps the stored dtype.
    """
    hf_config, state = read_hf_dir(path)
    importer = importer_for(hf_config)  # fail on the model type before anything else
    return importer(hf_config, state, dtype=dtype)
