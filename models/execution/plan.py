"""An execution plan: which backend computes each phase of a model, and why not the others.

Owns the plan's types only (the choice is planner.py's). A plan is fixed when a model is loaded and
never changes while it serves: a phase runs on its backend or fails loudly. It is plain data, so it
crosses to the ingress (the `/v1/models` card), into the log and into an info metric unchanged.

    phase    encode (an encoder's pass, a translator's source), prefill (a generator's prompts),
             decode (one token per row: a generator's steps, a translator's beam steps)
    backend  torch (the model's own forward, the readable reference), compiled (its blocks through
             torch.compile), native (our C++ stack step, models/kernels/), cuda_graphs (captured steps)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..spec import BACKENDS, PHASES, Backend, Phase


class PlanError(ValueError):
    """A backend was asked for that this model or machine cannot run (raised at load, never per step)."""


@dataclass(frozen=True)
class PhasePlan:
    """One phase: its backend, what it runs on (ISA, formats, weights), and each other backend's reason."""

    phase: Phase
    backend: Backend
    detail: str = ""
    not_taken: Mapping[str, str] = field(default_factory=dict)  # backend -> why it does not run this phase

    def to_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, "detail": self.detail, "not_taken": dict(self.not_taken)}


@dataclass(frozen=True)
class ExecutionPlan:
    """The phases of one model, in the order a request meets them."""

    phases: tuple[PhasePlan, ...]

    def __post_init__(self) -> None:
        names = [p.phase for p in self.phases]
        if len(set(names)) != len(names) or not set(names) <= set(PHASES):
            raise ValueError(f"an execution plan names each of {PHASES} at most once, got {names}")

    def __getitem__(self, phase: str) -> PhasePlan:
        for p in self.phases:
            if p.phase == phase:
                return p
        raise KeyError(f"this plan has no {phase!r} phase; it has {[p.phase for p in self.phases]}")

    def backend(self, phase: str) -> Backend:
        return self[phase].backend

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """{phase: {backend, detail, not_taken}}: the `/v1/models` card's `plan`."""
        return {p.phase: p.to_dict() for p in self.phases}

    def summary(self) -> str:
        """One line for the log: `prefill=compiled decode=native (avx512_vnni, q4_1 blocks)`."""
        return " ".join(f"{p.phase}={p.backend}" + (f" ({p.detail})" if p.detail else "") for p in self.phases)

    def reasons(self) -> str:
        """The backends not taken, phase by phase, for the log."""
        return "; ".join(f"{p.phase}: " + ", ".join(f"not {b}: {why}" for b, why in p.not_taken.items())
                         for p in self.phases if p.not_taken)


__all__ = ["BACKENDS", "PHASES", "Backend", "ExecutionPlan", "Phase", "PhasePlan", "PlanError"]
