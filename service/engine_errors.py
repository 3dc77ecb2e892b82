"""The errors a generation request meets at submit time, in a module without torch.

They cross from the generator replica to the ingress inside Ray's RayTaskError, and unpickling an
exception imports the module that defines it: defined next to the engine (which imports torch), the
first refusal under a burst made the ingress import torch and stall ~1.5 s (every request it held
waited, and 503s that should take milliseconds took seconds). tests/service/test_ingress_imports.py
keeps every error a replica raises importable without torch.

They subclass service.errors, so the HTTP layer answers 422 (a request over a limit) or 503 with
Retry-After (the queue is full, the engine is shut down) without knowing the engine.
"""

from __future__ import annotations

from .errors import InvalidRequest, NotReady, Overloaded


class EngineOverloaded(Overloaded):
    """The waiting queue holds max_queued requests: answer 503 + Retry-After, do not queue more."""


class EngineClosed(NotReady):
    """submit() after shutdown()."""


class RequestTooLarge(InvalidRequest):
    """A request over one of the engine's limits; `limit` names the EngineConfig field (-> 422)."""

    def __init__(self, message: str, param: str | None = None, limit: str | None = None) -> None:
        super().__init__(message, param)
        self.args = (message, param, limit)  # pickles whole across Ray
        self.limit = limit
