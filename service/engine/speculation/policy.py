"""When speculation pays, decided per step (engine thread only).

A decode step's time is measured by its entries E (rows plus drafted tokens): `StepTimes` keeps a moving
average per E and estimates t(E) on a line through them (before two counts were measured, a prior
slope). A row whose acceptance rate is a (`Acceptance`: kept / verified drafted tokens, with a prior)
gains a^i expected tokens from its i-th drafted token. `choose_drafts` adds drafted tokens, likeliest
first, while each raises the step's expected tokens per second: at a few rows on a CPU an entry costs
little beside the weights every step reads, so rows draft; at many rows t(E) grows with E and the
expected gain no longer pays, so large batches stop drafting by themselves. A draft model's own steps
are a cost of their own (`draft_s(k, rows)`), and it drafts the same k for every row it drafts for.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

ALPHA = 0.2  # weight of a new measurement in a moving average
PRIOR_SLOPE = 0.02  # before two entry counts were measured: each entry costs this fraction of the step


class StepTimes:
    """Measured seconds of a step by its entry count."""

    def __init__(self) -> None:
        self._by_entries: dict[int, float] = {}
        self._line: tuple[float, float] | None = None  # (intercept, slope), refit after each record

    def record(self, entries: int, seconds: float) -> None:
        old = self._by_entries.get(entries)
        self._by_entries[entries] = seconds if old is None else old + ALPHA * (seconds - old)
        self._line = None

    def __bool__(self) -> bool:
        return bool(self._by_entries)

    def estimate(self, entries: int) -> float:
        """t(entries) in seconds (a measured step must exist: check bool(self))."""
        if entries in self._by_entries and len(self._by_entries) == 1:
            return self._by_entries[entries]
        a, b = self._fit()
        return max(a + b * entries, 1e-6)

    def _fit(self) -> tuple[float, float]:
        if self._line is None:
            points = list(self._by_entries.items())
            if len(points) == 1:
                (e, t), = points
                slope = PRIOR_SLOPE * t
                self._line = (t - slope * e, slope)
            else:
                n = len(points)
                mx = sum(e for e, _ in points) / n
                my = sum(t for _, t in points) / n
                var = sum((e - mx) ** 2 for e, _ in points)
                slope = max(sum((e - mx) * (t - my) for e, t in points) / var, 0.0)
                self._line = (my - slope * mx, slope)
        return self._line


@dataclass
class Acceptance:
    """A request's drafted tokens kept / verified, with `prior` counted as PRIOR_WEIGHT tokens."""

    prior: float
    kept: float = 0.0
    verified: float = 0.0

    PRIOR_WEIGHT = 4.0
    DECAY = 0.9  # older steps weigh less: a request's text changes character as it goes

    @property
    def rate(self) -> float:
        return (self.kept + self.prior * self.PRIOR_WEIGHT) / (self.verified + self.PRIOR_WEIGHT)

    def update(self, drafted: int, kept: int) -> None:
        """A step verified `drafted` tokens of the row and kept `kept`: the first kept + 1 were judged
        (the ones after the first rejection were not)."""
        if drafted:
            self.kept = self.kept * self.DECAY + kept
            self.verified = self.verified * self.DECAY + min(kept + 1, drafted)

    def forget(self) -> None:
        """A step the row could have drafted in and did not: what it measured weighs less, so a row
        the policy stopped drafting for tries again once its rate has drifted back toward the prior."""
        self.kept *= self.DECAY
        self.verified *= self.DECAY


@dataclass(frozen=True)
class Candidate:
    """A row that may draft: up to `most` tokens, accepted with probability `rate` each."""

    row: int
    most: int
    rate: float


def choose_drafts(rows: int, candidates: list[Candidate], times: StepTimes,
                  draft_s: Callable[[int, int], float] | None = None) -> dict[int, int]:
    """Drafted tokens per row ({row: k}, rows that draft only) for a step of `rows` rows, maximising the
    expected tokens per second; {} when drafting is not expected to pay. With no step measured yet,
    every candidate drafts (the first steps measure). `draft_s(k, n)`: seconds a draft model takes to
    draft k tokens for n rows (None: drafting is free, as prompt lookup)."""
    candidates = [c for c in candidates if c.most > 0]
    if not candidates:
        return {}
    if not times:
        return {c.row: c.most for c in candidates}
    plain = rows / times.estimate(rows)
    if draft_s is not None:
        return _uniform(rows, candidates, times, draft_s, plain)
    # marginal: each drafted token (row r's i-th: gains rate^i) while the expected rate rises
    options = sorted(((c.rate ** i, c.row, i) for c in candidates for i in range(1, c.most + 1)),
                     key=lambda o: (-o[0], o[1], o[2]))
    chosen: dict[int, int] = {}
    tokens, entries, best = float(rows), rows, plain
    for gain, row, i in options:
        if chosen.get(row, 0) != i - 1:
            continue
        rate = (tokens + gain) / times.estimate(entries + 1)
        if rate <= best:
            continue
        tokens, entries, best = tokens + gain, entries + 1, rate
        chosen[row] = i
    return chosen


def _uniform(rows: int, candidates: list[Candidate], times: StepTimes, draft_s: Callable[[int, int], float],
             plain: float) -> dict[int, int]:
    """The same k for every candidate row (a draft model drafts k steps for all of them)."""
    best, best_k = plain, 0
    for k in range(1, max(c.most for c in candidates) + 1):
        ks = [min(k, c.most) for c in candidates]
        tokens = rows + sum(sum(c.rate ** i for i in range(1, n + 1)) for c, n in zip(candidates, ks, strict=True))
        seconds = times.estimate(rows + sum(ks)) + draft_s(k, len(candidates))
        if tokens / seconds > best:
            best, best_k = tokens / seconds, k
    return {c.row: min(best_k, c.most) for c in candidates} if best_k else {}
