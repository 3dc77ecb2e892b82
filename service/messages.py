"""The plain dataclasses that cross between the ingress and the model replicas (pickled by Ray).

No torch here, so the ingress replica never imports it. The HTTP layer converts these to and from
the pydantic models in service/schemas.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Classification:
    label: str
    score: float
    scores: dict[str, float]


@dataclass(frozen=True)
class Embeddings:
    vectors: list[list[float]]
    prompt_tokens: int


@dataclass(frozen=True)
class ModelInfo:
    """What /v1/models and /readyz report about a loaded model (one replica's view)."""

    name: str
    deployment: str
    tasks: tuple[str, ...]
    device: str
    dtype: str
    max_input_tokens: int
    labels: tuple[str, ...] = ()
    languages: tuple[str, str] | None = None
    defaults: dict[str, Any] = field(default_factory=dict)
    loaded_at: float = 0.0  # unix time
    load_seconds: float = 0.0
    stats: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TranslateOptions:
    beam_size: int | None = None  # None: the model's default
    max_new_tokens: int | None = None
    truncate: bool = False
