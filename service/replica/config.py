"""What an operator sets for the dynamic batcher of an encoder or translator replica, free of torch:
the settings embed it as a deployment's `batching` (service/settings.py), the batcher
(service/replica/batcher.py) reads it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BatchLimits:
    __pydantic_config__ = {"extra": "forbid"}  # in a config file (pydantic reads it), a misspelt field is an error

    max_batch_size: int = 32  # inputs per batch
    max_wait_ms: float = 5.0  # the oldest input waits at most this long for company
    max_batch_tokens: int = 16384  # rows * longest row (padded tokens) per batch (a longer single input runs alone)
    max_queued: int = 1024  # inputs waiting per replica; past it: 503 + Retry-After
    overhead_tokens: int = 32  # a batch's fixed cost in padded tokens (length grouping, select_batch; MiniLM: ~30)
    # a translator's decoding work per batch: the sum over its inputs of beam_size x max_new_tokens (decoder
    # rows x steps); an input over it alone runs alone. None: no bound (encoders: their cost is the tokens)
    max_batch_work: int | None = None

    def __post_init__(self) -> None:
        problems = [f"{name} must be >= 1, got {getattr(self, name)}"
                    for name in ("max_batch_size", "max_batch_tokens", "max_queued") if getattr(self, name) < 1]
        if self.max_batch_work is not None and self.max_batch_work < 1:
            problems.append(f"max_batch_work must be >= 1, got {self.max_batch_work}")
        problems += [f"{name} must be >= 0, got {getattr(self, name)}"
                     for name in ("max_wait_ms", "overhead_tokens") if not getattr(self, name) >= 0]
        if problems:
            raise ValueError("BatchLimits: " + "; ".join(problems))

    @property
    def max_wait_s(self) -> float:
        return self.max_wait_ms / 1000.0
