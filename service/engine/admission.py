"""How long a new request would wait for a KV-cache row, from what the engine measures: its step time
and how many tokens its requests take. The engine refuses a request at once (503 + Retry-After)
when that wait alone outlasts the request's deadline, rather than queue it into a 504.

With every row busy, a row frees up every L x tau / rows seconds on average (L: tokens a request
takes, tau: one step's time, rows: rows decoding at once), so the k-th request past the free rows
starts after about k x L x tau / rows seconds. Until a step was measured the estimate is 0 (a cold
engine never refuses); until a request finished, L is the mean `max_new_tokens` of those asked for.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SMOOTHING = 0.2  # weight of the newest measurement in the moving averages


def ewma(old: float | None, new: float, weight: float = SMOOTHING) -> float:
    return new if old is None else (1 - weight) * old + weight * new


@dataclass
class WaitEstimator:
    """Moving averages of the step time and of the tokens per finished request. Not thread-safe: the
    engine updates it on its thread and reads it under its lock."""

    step_s: float | None = None
    tokens_per_request: float | None = None
    asked: list[int] = field(default_factory=list)  # max_new_tokens of recent requests (before any finished)

    def on_step(self, seconds: float) -> None:
        self.step_s = ewma(self.step_s, seconds)

    def on_finished(self, tokens: int) -> None:
        self.tokens_per_request = ewma(self.tokens_per_request, float(max(tokens, 1)))

    def on_asked(self, max_new_tokens: list[int]) -> None:
        """Requests arrived asking for these many tokens (L's stand-in until one finished)."""
        if self.tokens_per_request is None:
            self.asked = (self.asked + max_new_tokens)[-64:]

    def wait_s(self, ahead: int, free_rows: int, rows: int) -> float:
        """Seconds until the last of `ahead` queued requests (the new ones included) gets a row."""
        if ahead <= free_rows or self.step_s is None or rows <= 0:
            return 0.0
        tokens = self.tokens_per_request
        if tokens is None:
            tokens = sum(self.asked) / len(self.asked) if self.asked else 1.0
        return (ahead - free_rows) * tokens * self.step_s / rows
