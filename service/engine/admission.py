"""How long a new request would wait for a KV-cache row, and take once it has one, from what the engine
measures (`WaitEstimator`): the engine refuses a request at once (503 + Retry-After) when it could not
make its deadline, rather than queue it into a 504. A stream's deadline covers its first token, a
whole answer's its wait and its decoding.

    L tokens a request takes, tau a step's time (prefills included), tau_d a step without prefill
The k-th request past the free rows waits about k x L x tau / rows, and decodes in about
min(max_new_tokens, L) x tau_d (all of it when it ignores eos). Each estimate is 0 until measured (a
cold engine never refuses); L is the mean of what requests expect (`Ask.expected`) until one finished.
Warm-up steps are forgotten (StepLoop.forget_timings). Not thread-safe: the engine's lock guards it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

SMOOTHING = 0.2  # weight of the newest measurement in the moving averages


def ewma(old: float | None, new: float, weight: float = SMOOTHING) -> float:
    return new if old is None else (1 - weight) * old + weight * new


@dataclass(frozen=True)
class Ask:
    """What admission knows of a request: the most tokens it takes (`exact`: surely all of them, it
    ignores eos) and its deadline (time.perf_counter() seconds; None: none), by which it must have
    started (a stream) or, `whole`, answered (its caller waits for the whole answer)."""

    max_tokens: int
    exact: bool = False
    deadline: float | None = None
    whole: bool = False
    expected: int | None = None  # the tokens it likely takes, L's stand-in until one finished (None: max_tokens)

    @property
    def prior(self) -> int:
        return self.max_tokens if self.expected is None else min(self.expected, self.max_tokens)


@dataclass
class WaitEstimator:
    """Moving averages of the step time and of the tokens per finished request. Not thread-safe: the
    engine updates it on its thread and reads it under its lock."""

    step_s: float | None = None  # tau
    decode_s: float | None = None  # tau_d
    tokens_per_request: float | None = None
    asked: list[int] = field(default_factory=list)  # Ask.prior of recent requests (before any finished)

    def on_step(self, seconds: float, prefilled: bool = False) -> None:
        """A step that generated tokens took `seconds` (`prefilled`: it also computed prompt tokens)."""
        self.step_s = ewma(self.step_s, seconds)
        if not prefilled:
            self.decode_s = ewma(self.decode_s, seconds)

    def on_finished(self, tokens: int) -> None:
        self.tokens_per_request = ewma(self.tokens_per_request, float(max(tokens, 1)))

    def on_asked(self, expected: list[int]) -> None:
        """Requests arrived that are expected to take these many tokens (L's stand-in until one finished)."""
        if self.tokens_per_request is None:
            self.asked = (self.asked + expected)[-64:]

    def typical_tokens(self) -> float:
        """L: the tokens a request takes (measured, else the mean asked for, else 1)."""
        if self.tokens_per_request is not None:
            return self.tokens_per_request
        return sum(self.asked) / len(self.asked) if self.asked else 1.0

    def wait_s(self, ahead: int, free_rows: int, rows: int) -> float:
        """Seconds until the last of `ahead` queued requests (the new ones included) gets a row."""
        if ahead <= free_rows or self.step_s is None or rows <= 0:
            return 0.0
        return (ahead - free_rows) * self.typical_tokens() * self.step_s / rows

    def run_s(self, ask: Ask) -> float:
        """Seconds the request decodes once it has a row (0 until a step without prefill was measured)."""
        if self.decode_s is None:
            return 0.0
        tokens = ask.max_tokens if ask.exact else min(float(ask.max_tokens), self.typical_tokens())
        return tokens * self.decode_s

    def late_s(self, asks: Sequence[Ask], wait: float, now: float) -> float | None:
        """The seconds the first request that would miss its deadline needs (the wait, and its own
        decoding when it is `whole`); None when each can make it."""
        for ask in asks:
            if ask.deadline is not None:
                need = wait + (self.run_s(ask) if ask.whole else 0.0)
                if need > ask.deadline - now:
                    return need
        return None
