"""A cache of converted weights, so a GGUF model starts in seconds instead of being re-decoded each time.

A conversion is stored once under `<cache_dir>/converted/<key>/`, key = `<sha256 of the source
file>-f<FORMAT_VERSION>c<CONVERTER_VERSION>` (a new file, format or converter gives a new entry):

    config.json, model.safetensors   our checkpoint format (models.checkpoints.format)
    tokenizer/                       the transformers tokenizer
    chat_template.jinja              the GGUF's `tokenizer.chat_template` (absent if it had none)
    source.json                      what was converted: file name, sha256, versions, the HF config
An entry is built in a temporary folder and renamed into place: a reader sees no entry or a whole
one, and two processes converting at once both succeed.
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .. import zoo
from ..decoder import DecoderLM
from .format import FORMAT_VERSION, CheckpointError, load_checkpoint, save_checkpoint
from .gguf_import import import_gguf, load_gguf_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

CONVERTER_VERSION = 1  # bump when gguf_import's output changes for the same file
CONVERTED = "converted"
TOKENIZER_DIR = "tokenizer"
TEMPLATE_FILE = "chat_template.jinja"
SOURCE_FILE = "source.json"


@dataclass(frozen=True)
class LoadedLM:
    """A decoder ready to serve: model (eval mode), its tokenizer and chat template (None if none)."""

    model: DecoderLM
    tokenizer: PreTrainedTokenizerBase
    chat_template: str | None


def cache_key(source_sha256: str) -> str:
    return f"{source_sha256}-f{FORMAT_VERSION}c{CONVERTER_VERSION}"


def convert_gguf(gguf_path: Path, dest: Path, source_sha256: str) -> None:
    """Write the converted entry for `gguf_path` into the (new or empty) folder `dest`."""
    model, contents = import_gguf(gguf_path)
    save_checkpoint(model, dest)
    load_gguf_tokenizer(gguf_path).save_pretrained(str(dest / TOKENIZER_DIR))
    if contents.chat_template is not None:
        (dest / TEMPLATE_FILE).write_text(contents.chat_template)
    source: dict[str, Any] = {
        "file": gguf_path.name,
        "sha256": source_sha256,
        "format_version": FORMAT_VERSION,
        "converter_version": CONVERTER_VERSION,
        "hf_config": contents.hf_config,
    }
    (dest / SOURCE_FILE).write_text(json.dumps(source, indent=2, sort_keys=True) + "\n")


def load_converted(entry: Path, dtype: torch.dtype | None = None) -> LoadedLM:
    """Load a converted entry (see the module docstring). dtype: cast the float32 weights; None keeps them."""
    from transformers import AutoTokenizer  # heavy import, only needed here

    model = load_checkpoint(entry, dtype=dtype)
    if not isinstance(model, DecoderLM):
        raise CheckpointError(f"{entry} holds a {type(model).__name__}, not a decoder language model")
    tokenizer = AutoTokenizer.from_pretrained(str(entry / TOKENIZER_DIR))
    template_path = entry / TEMPLATE_FILE
    template = template_path.read_text() if template_path.is_file() else None
    return LoadedLM(model, tokenizer, template)


def load_gguf_cached(gguf_path: str | Path, cache_dir: Path, source_sha256: str | None = None,
                     dtype: torch.dtype | None = None) -> LoadedLM:
    """Model, tokenizer and chat template of a Llama GGUF, converting it on the first call only.

    source_sha256: the file's sha256 when already known (e.g. pinned by the zoo); None hashes the file.
    """
    gguf_path = Path(gguf_path)
    digest = source_sha256 or zoo.sha256_file(gguf_path)
    root = cache_dir / CONVERTED
    entry = root / cache_key(digest)
    if not (entry / SOURCE_FILE).is_file():
        root.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        with tempfile.TemporaryDirectory(dir=root, prefix=f".{entry.name}-") as tmp:
            staged = Path(tmp) / "entry"
            convert_gguf(gguf_path, staged, digest)
            try:
                staged.rename(entry)
            except OSError:
                if not (entry / SOURCE_FILE).is_file():
                    raise
                # another process finished first; its entry is equivalent and ours is dropped with tmp
        log.info("converted %s into %s in %.1f s", gguf_path.name, entry, time.perf_counter() - started)
    return load_converted(entry, dtype)


def load_smollm2(cache_dir: Path, dtype: torch.dtype | None = None) -> LoadedLM:
    """The default chat model (zoo entry `smollm2`), from the converted cache.

    Raises zoo.WeightsMissingError naming the fetch command when the GGUF has not been fetched.
    """
    folder = zoo.resolve("smollm2", cache_dir)
    (name, digest), = zoo.ZOO["smollm2"].files.items()
    return load_gguf_cached(folder / name, cache_dir, source_sha256=digest, dtype=dtype)


__all__ = [
    "CONVERTER_VERSION", "LoadedLM", "cache_key", "convert_gguf", "load_converted", "load_gguf_cached",
    "load_smollm2",
]
