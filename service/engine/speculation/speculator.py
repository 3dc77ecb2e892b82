"""What the generation engine asks of speculative decoding each step (engine thread only): `propose` the
drafted tokens of the running rows (or none, when the policy finds that drafting does not pay), then,
after the verify step (engine/verify.py), `verified`; `timed` records every decode step's time, and
`release` forgets a request that left the batch. Counters for EngineStats."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import SpeculativeConfig
from ..sequence import SeqState
from .draft_model import DraftModel
from .ngram import PromptLookup
from .policy import Acceptance, Candidate, StepTimes, choose_drafts


@dataclass
class RowState:
    """A request's speculation: its n-gram index (prompt lookup) and its acceptance so far."""

    acceptance: Acceptance
    lookup: PromptLookup | None = None


@dataclass
class SpecCounts:
    drafted: int = 0  # tokens proposed and verified
    accepted: int = 0  # of them, kept
    steps: int = 0  # verify steps
    step_s: float = 0.0  # time in verify steps (and drafting)
    plain_s: float = 0.0  # the time plain steps would have taken for the same tokens (estimated)


class Speculator:
    """Proposes drafts for a RunningBatch's rows; owns the method's drafter and the step-time model."""

    def __init__(self, config: SpeculativeConfig, draft: DraftModel | None = None) -> None:
        """`draft`: method "draft"'s model (GenerationEngine checks that it is given exactly then)."""
        self.config, self.draft = config, draft
        self.times = StepTimes()  # decode and verify steps, by entries
        self.counts = SpecCounts()
        self._prior = config.prior_acceptance

    @property
    def method(self) -> str:
        return self.config.method

    def describe(self) -> dict[str, object]:
        """What /v1/models shows of it."""
        out: dict[str, object] = {"method": self.method, "max_draft_tokens": self.config.max_draft_tokens,
                                  "adaptive": self.config.adaptive}
        if self.method == "ngram" or self.config.draft_lookup:
            out |= {"ngram_min": self.config.ngram_min, "ngram_max": self.config.ngram_max}
        if self.method == "draft":
            out |= {"draft": dict(self.config.draft), "draft_lookup": self.config.draft_lookup,
                    "draft_cache": "shared" if self.draft.shared else "own"}
        return out

    def state(self, seq: SeqState) -> RowState:
        if seq.speculation is None:
            lookup = None
            if self.method == "ngram":
                lookup = PromptLookup(self.config.ngram_min, self.config.ngram_max)
            seq.speculation = RowState(Acceptance(self._prior), lookup)
        return seq.speculation

    def release(self, seq: SeqState) -> None:
        if self.draft is not None:
            self.draft.release(seq)

    def timed(self, entries: int, seconds: float) -> None:
        """A decode or verify step of `entries` entries took `seconds`."""
        self.times.record(entries, seconds)

    def propose(self, batch) -> dict[int, list[int]]:  # noqa: ANN001 - engine/batch.py's RunningBatch
        """Each drafting row's drafted tokens ({} for a plain step): only where the pool has free blocks
        for them and every row's next token."""
        rows, cache, most_k = batch.rows, batch.cache, self.config.max_draft_tokens
        candidates: list[Candidate] = []
        proposals: dict[int, list[int]] = {}
        for r, seq in enumerate(rows):
            if seq.matcher is not None or not seq.params.speculative or seq.done:
                continue
            most = min(most_k, seq.params.max_new_tokens - len(seq.tokens) - 1,
                       cache.max_len - cache.host_lengths[r] - 1)
            if most < 1:
                continue
            state = self.state(seq)
            if state.lookup is not None:
                known = len(state.lookup)
                tokens = seq.prompt + seq.tokens if known == 0 else seq.tokens[known - len(seq.prompt):]
                state.lookup.extend(tokens)
                proposals[r] = state.lookup.propose(most)
                most = len(proposals[r])
            candidates.append(Candidate(r, most, state.acceptance.rate))
        if self.config.adaptive:
            chosen = choose_drafts(len(rows), candidates, self.times,
                                   self.draft.draft_s if self.draft is not None else None)
        else:
            chosen = {c.row: c.most for c in candidates}
        for c in candidates:  # rows that could draft and did not: their acceptance drifts back to the prior
            if c.row not in chosen:
                rows[c.row].speculation.acceptance.forget()
        if not chosen:
            return {}
        # free blocks only: drafts never evict the prefix cache's blocks (nor preempt anyone)
        if sum(cache.blocks_needed(r, cache.host_lengths[r] + 1 + chosen.get(r, 0)) for r in range(len(rows))) > cache.blocks_free:
            return {}
        if self.draft is None:
            return {r: proposals[r][:k] for r, k in chosen.items()}
        drafted = self.draft.draft([rows[r] for r in chosen], list(chosen.values()), list(chosen))
        return {r: d for r, d in zip(chosen, drafted, strict=True) if d}

    def verified(self, batch, drafts: dict[int, list[int]], kept: dict[int, int],  # noqa: ANN001
                 emitted: int, seconds: float) -> None:
        """The verify step (`emitted` tokens kept in all, `seconds` with drafting) kept kept[r] of drafts[r]."""
        c = self.counts
        c.steps += 1
        for r, d in drafts.items():
            n = kept.get(r, 0)
            c.drafted += len(d)
            c.accepted += n
            seq = batch.rows[r]
            self.state(seq).acceptance.update(len(d), n)
            if self.draft is not None:
                self.draft.kept(seq, n)
        rows = len(batch.rows)
        c.step_s += seconds
        if self.times:
            c.plain_s += emitted / rows * self.times.estimate(rows)
