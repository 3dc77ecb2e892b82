"""Which model serves each benchmark task: the default set (the service's DEFAULT_SPECS) or tiny
random models for development and smoke tests. Every system of one run serves the same specs.

Imports of models.* (torch) happen inside the functions, never at import time.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from models.catalog import ModelSpec

TASKS = ("classify", "embed", "translate", "generate")
# benchmark task -> the service's deployment name (= its DEFAULT_SPECS key)
DEPLOYMENT_FOR_TASK: dict[str, str] = {
    "classify": "encoder",
    "embed": "encoder",
    "translate": "translator",
    "generate": "generator",
}


def _default_set() -> dict[str, ModelSpec]:
    from models.catalog import DEFAULT_SPECS

    return {task: DEFAULT_SPECS[dep] for task, dep in DEPLOYMENT_FOR_TASK.items()}


def _tiny_set() -> dict[str, ModelSpec]:
    from models.catalog import ModelSpec

    encoder = ModelSpec(name="tiny-encoder", tasks=("classify", "embed"), source="tiny:encoder")
    return {
        "classify": encoder,
        "embed": encoder,
        "translate": ModelSpec(
            name="tiny-seq2seq",
            tasks=("translate",),
            source="tiny:seq2seq",
            languages=("en", "es"),
            defaults={"beam_size": 4, "max_new_tokens": 32},
        ),
        "generate": ModelSpec(
            name="tiny-decoder",
            tasks=("generate",),
            source="tiny:decoder",
            defaults={"max_new_tokens": 32, "temperature": 0.0},
        ),
    }


MODEL_SETS: dict[str, Callable[[], dict[str, ModelSpec]]] = {"default": _default_set, "tiny": _tiny_set}


def model_set(name: str) -> dict[str, ModelSpec]:
    """task -> ModelSpec for the named set."""
    if name not in MODEL_SETS:
        raise ValueError(f"unknown model set {name!r}; known: {sorted(MODEL_SETS)}")
    return MODEL_SETS[name]()


def spec_dict(spec: ModelSpec) -> dict[str, object]:
    """A ModelSpec as the service's settings spell it (its fields)."""
    return {
        "name": spec.name,
        "tasks": list(spec.tasks),
        "source": spec.source,
        "head": spec.head,
        "tokenizer": spec.tokenizer,
        "languages": list(spec.languages) if spec.languages else None,
        "max_input_tokens": spec.max_input_tokens,
        "defaults": dict(spec.defaults),
    }


def token_counter(spec: ModelSpec, cache_dir: Path) -> Callable[[str], int] | None:
    """Counts a text's tokens (without special tokens) with the model's tokenizer, loading only the
    tokenizer; None when it cannot be found without loading the model (e.g. a GGUF not converted yet)."""
    from models.text import TextTokenizer

    scheme, _, rest = spec.source.partition(":")
    tok: TextTokenizer | None = None
    if spec.tokenizer is not None:
        from models.catalog import resolve_dir

        tok = TextTokenizer.from_file(resolve_dir(spec.tokenizer, cache_dir))
    elif scheme == "tiny":
        from models.tiny import tiny_model

        tok = tiny_model(rest)[1]
    elif scheme == "gguf" and rest.startswith("zoo:"):
        from models import zoo
        from models.checkpoints.cache import CONVERTED, TOKENIZER_DIR, cache_key

        ((_, digest),) = zoo.ZOO[rest[len("zoo:") :]].files.items()
        path = cache_dir / CONVERTED / cache_key(digest) / TOKENIZER_DIR / "tokenizer.json"
        tok = TextTokenizer.from_file(path) if path.is_file() else None
    elif scheme in ("zoo", "builtin", "dir", "hf"):
        from models.catalog import resolve_dir

        path = resolve_dir(spec.source, cache_dir) / "tokenizer.json"
        tok = TextTokenizer.from_file(path) if path.is_file() else None
    if tok is None:
        return None
    found = tok
    return lambda text: len(found.encode(text, add_special_tokens=False))
