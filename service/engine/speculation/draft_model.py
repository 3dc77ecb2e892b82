"""A draft model (speculative decoding's second drafter): a smaller or cheaper model of the same tokenizer
proposes each drafting row's next k tokens, greedily.

Where it keeps its keys and values (fixed when it is built, shown as `cache`):
- "shared": a draft of the model's own architecture (its config equals the model's, e.g. the same
  weights as 4-bit blocks) reads the model's paged cache, whose rows hold every token of a request but
  its pending one, and writes its drafts' keys past a row's length, where the verify step then writes
  the model's own for the same positions. No catching up: the draft's first entry is the pending token.
- "own": a paged cache of the draft's own. A request holds a row of it from its first draft until it
  leaves the batch (`release`); before drafting, the row catches up with the request's tokens it has
  not seen (its prompt the first time: one prefill; later the one or two tokens the last verify step
  kept beyond its drafts). The keys of the drafts the model kept stay in the row (`kept`); the others
  are past its length and overwritten.
Then steps over all drafting rows at once until each row has k drafts.

With `lookup` (n_min, n_max), the draft speculates its own steps by prompt lookup (ngram.py, a request's
index kept while it is in the batch): a row's step takes its last token and the tokens the lookup
guesses after it as entries, and keeps the guesses that equal the draft's own greedy choices (plus the
choice after the last of them), so k drafts take fewer draft steps; the drafts are the tokens the draft
would have chosen one step at a time. How many guesses a row sends is chosen as the engine chooses its
drafts (policy.choose_drafts): from the draft's step times by entries and the row's acceptance so far.
Engine thread only.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from models.cache.paged import CacheFull, PagedKVCache
from models.execution.executors import DecoderExecutor

from ..sequence import SeqState
from .ngram import PromptLookup
from .policy import Acceptance, Candidate, StepTimes, choose_drafts

PREFILL_FROM = 4  # own cache: a row this many tokens behind catches up with a prefill, not as step entries
GUESS_PRIOR = 0.5  # a row's acceptance of the lookup's guesses before any was checked

Drafting = tuple[int, int, int, int]  # (index in the call's seqs, cache row, its pending token's position, that token)


class DraftModel:
    """Owns the draft's rows (own cache) or writes past the model's (shared), and the lookups' state."""

    def __init__(self, steps: DecoderExecutor, cache: PagedKVCache, shared: bool,
                 lookup: tuple[int, int] | None = None) -> None:
        """`cache`: the model's own (shared: True; GenerationEngine checks the draft's config is the
        model's) or one for the draft; lookup: (ngram_min, ngram_max) of the prompt lookup that
        speculates the draft's steps (None: one token a step)."""
        self.steps, self.cache, self.shared, self.lookup = steps, cache, shared, lookup
        self.device = next(steps.model.parameters()).device
        self._free = [] if shared else list(range(cache.rows - 1, -1, -1))
        self._row: dict[int, int] = {}  # own cache: id(seq) -> its draft row
        self._drafted: dict[int, int] = {}  # own cache: id(seq) -> tokens written past its length by the last draft
        self._guesses: dict[int, tuple[PromptLookup, Acceptance]] = {}  # id(seq) -> its index and acceptance
        self.times = StepTimes()  # seconds a drafted token (catching up not counted), by rows
        self.step_times = StepTimes()  # one draft step, by entries (how many guesses pay)
        self.step_count = 0  # draft steps run (catching-up prefills not counted)

    def draft_s(self, k: int, rows: int) -> float:
        """Estimated seconds to draft k tokens for `rows` rows (catching up not counted)."""
        return k * self.times.estimate(rows) if self.times else 0.0

    def release(self, seq: SeqState) -> None:
        """The request left the batch (finished, failed, preempted): its row goes back."""
        self._guesses.pop(id(seq), None)
        self._drafted.pop(id(seq), None)
        row = self._row.pop(id(seq), None)
        if row is not None:
            self.cache.reset(row, row + 1)
            self._free.append(row)

    def kept(self, seq: SeqState, kept: int) -> None:
        """The verify step kept `kept` of seq's drafts: in an own cache their keys (all but the last
        draft's, which was never an input) join its row."""
        row = self._row.get(id(seq))
        if row is not None:
            self.cache.advance(min(kept, self._drafted.pop(id(seq), 0)), row, row + 1)

    def draft(self, seqs: list[SeqState], ks: Sequence[int], rows: Sequence[int]) -> list[list[int]]:
        """ks[i] greedy tokens for seqs[i] (in the model's batch row rows[i]) after its tokens so far
        (prompt, output, pending token); [] for a request no row or block is free for."""
        out: list[list[int]] = [[] for _ in seqs]
        with torch.inference_mode():
            drafting = self._shared_rows(seqs, ks, rows) if self.shared else self._own_rows(seqs, ks, out)
            if not drafting:
                return out
            started, before = time.perf_counter(), sum(len(out[i]) for i, *_ in drafting)
            guessing = [self._guessing(seqs[i]) for i, *_ in drafting] if self.lookup else None
            self._extend(drafting, guessing, out, ks)
            drafted = sum(len(out[i]) for i, *_ in drafting) - before
            if drafted:
                self.times.record(len(drafting), (time.perf_counter() - started) * len(drafting) / drafted)
        if not self.shared:
            for i, *_ in drafting:
                self._drafted[id(seqs[i])] = ks[i] - 1
        return out

    def _shared_rows(self, seqs: list[SeqState], ks: Sequence[int], rows: Sequence[int]) -> list[Drafting]:
        """(i, row, its pending token's position, that token) for each request the model's cache has
        room for k entries past its length: the pending token and k - 1 drafts, as the verify step
        will write them."""
        drafting = []
        for i, (seq, k, row) in enumerate(zip(seqs, ks, rows, strict=True)):
            at = self.cache.host_lengths[row]
            if at + k > self.cache.max_len:
                continue
            try:
                self.cache.ensure(row, at + k)
            except CacheFull:
                continue
            drafting.append((i, row, at, seq.tokens[-1]))
        return drafting

    def _own_rows(self, seqs: list[SeqState], ks: Sequence[int], out: list[list[int]]) -> list[Drafting]:
        """Each request's own row caught up with its tokens (the last of them as the entries of one
        step, whose last entry proposes the first draft, in out): (i, row, its pending token's position,
        that token) for those a row and blocks were free for."""
        rows, todo = [], []
        for i, (seq, k) in enumerate(zip(seqs, ks, strict=True)):
            row = self._take(seq)
            tokens = seq.prompt + seq.tokens  # its whole sequence: the pending token last
            known = self.cache.host_lengths[row] if row is not None else 0
            if row is None or len(tokens) + k > self.cache.max_len or known >= len(tokens):
                continue
            try:
                self.cache.ensure(row, len(tokens) + k)
            except CacheFull:
                continue
            if len(tokens) - known > PREFILL_FROM:
                self._prefill(row, tokens[known:-1])
                known = len(tokens) - 1
            rows.append((i, row))
            todo.append(tokens[known:])
        if not rows:
            return []
        entries = [(row, self.cache.host_lengths[row] + j, t) for (_, row), ts in zip(rows, todo, strict=True)
                   for j, t in enumerate(ts)]
        last = [sum(len(ts) for ts in todo[:n + 1]) - 1 for n in range(len(todo))]
        nexts = self._step(entries, last)
        for n, ((i, row), ts) in enumerate(zip(rows, todo, strict=True)):
            self.cache.advance(len(ts), row, row + 1)
            out[i].append(nexts[n])
        return [(i, row, self.cache.host_lengths[row] - 1, seqs[i].tokens[-1]) for i, row in rows]

    def _extend(self, drafting: list[Drafting], guessing: list[tuple[PromptLookup, Acceptance]] | None,
                out: list[list[int]], ks: Sequence[int]) -> None:
        """Steps until each drafting (i, row, at, pending) has ks[i] drafts in out[i]: a row's entries are its
        last token (its last draft, or `pending` at position `at`) and, with `guessing`, the lookup's
        guesses after it."""
        while True:
            active = [n for n, (i, *_) in enumerate(drafting) if len(out[i]) < ks[i]]
            if not active:
                return
            guesses: dict[int, list[int]] = {n: [] for n in active}
            if guessing is not None:
                for n in active:
                    i = drafting[n][0]
                    guesses[n] = guessing[n][0].propose(ks[i] - len(out[i]) - 1, out[i])
                chosen = choose_drafts(len(active), [Candidate(n, len(guesses[n]), guessing[n][1].rate)
                                                     for n in active], self.step_times)
                guesses = {n: g[:chosen.get(n, 0)] for n, g in guesses.items()}
            entries, last = [], []
            for n in active:
                i, row, at, pending = drafting[n]
                token = out[i][-1] if out[i] else pending
                last += range(len(entries), len(entries) + 1 + len(guesses[n]))
                entries += [(row, at + len(out[i]) + j, t) for j, t in enumerate([token, *guesses[n]])]
            picked = self._step(entries, last)
            for n in active:
                i, guess = drafting[n][0], guesses[n]
                choices, picked = picked[:1 + len(guess)], picked[1 + len(guess):]
                out[i].append(choices[0])
                kept = 0
                while kept < len(guess) and guess[kept] == choices[kept]:
                    kept += 1
                    out[i].append(choices[kept])
                if guess:
                    guessing[n][1].update(len(guess), kept)

    def _guessing(self, seq: SeqState) -> tuple[PromptLookup, Acceptance]:
        """seq's lookup (indexed up to its pending token) and how often its guesses were kept."""
        state = self._guesses.get(id(seq))
        if state is None:
            state = self._guesses[id(seq)] = (PromptLookup(*self.lookup), Acceptance(GUESS_PRIOR))
        tokens = seq.prompt + seq.tokens
        state[0].extend(tokens[len(state[0]):])
        return state

    def _take(self, seq: SeqState) -> int | None:
        row = self._row.get(id(seq))
        if row is None and self._free:
            row = self._row[id(seq)] = self._free.pop()
        return row

    def _prefill(self, row: int, tokens: list[int]) -> None:
        """Row catches up with `tokens` in one forward (its first draft: the prompt)."""
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)  # (1, T)
        self.steps.prefill(ids, self.cache.view(row, row + 1), torch.tensor([len(tokens) - 1], device=self.device))
        self.cache.advance(len(tokens), row, row + 1)

    def _step(self, entries: list[tuple[int, int, int]], last: list[int]) -> list[int]:
        """One step over (row, position, token) entries; the greedy next token after each entry in `last`."""
        started = time.perf_counter()
        ids = torch.tensor([[t] for _, _, t in entries], dtype=torch.long, device=self.device)  # (E, 1)
        view = self.cache.view_tokens([r for r, _, _ in entries], [p for _, p, _ in entries])
        logits = self.steps.decode(ids, view)[:, 0]  # (E, V)
        picked = logits.index_select(0, torch.tensor(last, device=self.device)).argmax(-1).tolist()
        self.step_times.record(len(entries), time.perf_counter() - started)
        self.step_count += 1
        return picked
