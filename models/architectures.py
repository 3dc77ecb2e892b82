"""Which tasks a checkpoint can serve, read from its config.json alone (torch-free, for the settings).

A model spec in the Serve config may leave out `tasks`: the deployment kind then follows the
architecture. Hugging Face directories are read by `model_type` / `architectures`, our own
checkpoints by their family, GGUF files are decoders. Pinned `zoo:` weights are only on disk after
`make weights`, so their tasks are always written out.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

BUILTIN_DIR = Path(__file__).parent / "weights"

# Hugging Face model_type -> tasks (the importers of models/checkpoints/registry.py)
HF_TASKS: dict[str, tuple[str, ...]] = {
    "gpt2": ("generate",), "llama": ("generate",), "mistral": ("generate",), "qwen2": ("generate",),
    "qwen3": ("generate",),
    "marian": ("translate",), "t5": ("translate",), "mt5": ("translate",),
    "bert": ("embed",), "roberta": ("embed",), "xlm-roberta": ("embed",), "distilbert": ("embed",),
}
# our checkpoint format: family -> tasks
FAMILY_TASKS: dict[str, tuple[str, ...]] = {"decoder": ("generate",), "seq2seq": ("translate",),
                                            "encoder": ("embed",)}


def _config(path: Path) -> dict[str, Any] | None:
    file = path / "config.json"
    if not file.is_file():
        return None
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


ENCODER_TYPES = ("bert", "roberta", "xlm-roberta", "distilbert")  # those with classifier heads we import


def _hf_tasks(config: dict[str, Any]) -> tuple[str, ...] | None:
    heads = any(str(a).endswith("ForSequenceClassification") for a in config.get("architectures") or ())
    if heads and config.get("model_type") not in ENCODER_TYPES:
        return None  # e.g. LlamaForSequenceClassification: its importer refuses it, naming the architecture
    if heads:
        labels = config.get("id2label") or {}
        # one output: a cross-encoder's relevance score; several: labels to classify into
        return ("rerank",) if len(labels) == 1 or config.get("num_labels") == 1 else ("classify",)
    return HF_TASKS.get(config.get("model_type"))


def infer_tasks(source: str) -> tuple[str, ...] | None:
    """The tasks the checkpoint at `source` serves, or None when they cannot be read from it."""
    scheme, _, rest = source.partition(":")
    if scheme == "gguf":
        return ("generate",)
    if scheme == "tiny":
        return {"encoder": ("classify", "embed"), "decoder": ("generate",),
                "seq2seq": ("translate",)}.get(rest)
    if scheme not in ("hf", "dir", "builtin"):
        return None
    path = BUILTIN_DIR / rest if scheme == "builtin" else Path(rest).expanduser()
    config = _config(path)
    if config is None:
        return None
    if scheme == "hf":
        return _hf_tasks(config)
    family = config.get("family")
    if family == "encoder" and config.get("labels"):
        return ("classify", "embed")
    return FAMILY_TASKS.get(family)
