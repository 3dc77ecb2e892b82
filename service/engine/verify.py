"""Speculative decoding's verify step (a mixin of engine/batch.py's RunningBatch, which owns the rows, the
cache, `seen` and `counts`): every row's pending token and the tokens drafted for it go through one
decode step as entries of their own (models.cache.paged.PagedKVCache.view_tokens), entry j of a row
at the row's length + j, so each entry is computed exactly as the plain decode step at that position
would compute it (on the native step: the same bits). Each entry samples as that plain step would
(its row's parameters, penalties counting the drafts before it, the row's own generator); a row keeps
its entries' tokens while each equals the draft that follows, and the first token that differs.

With deterministic drafts (prompt lookup, a draft model's greedy tokens) this is Leviathan et al.'s
rule for a proposal that puts all its mass on the draft d: d is kept with probability p(d), and
otherwise the token comes from p without d, renormalised; drawing from p and keeping d when the draw
is d has that law. Each row's generator is left as if it had drawn once per kept token, so a seeded
request gives the tokens it gives without drafts. Rejected entries' keys stay past the row's length
and are overwritten by its next tokens: nothing is copied back. Engine thread only.

    B rows, E entries (B + drafted tokens), V vocabulary
"""

from __future__ import annotations

import torch
from torch import Tensor

from models.decoding import BatchParams, choose

from .sequence import Picked, picked


def kept_tokens(chosen: list[int], drafts: list[int]) -> int:
    """How many of a row's entries' tokens `chosen` (len(drafts) + 1) it keeps: while each equals the
    draft that follows, then the first that differs (or the one after the last draft)."""
    kept = 1
    while kept <= len(drafts) and chosen[kept - 1] == drafts[kept - 1]:
        kept += 1
    return kept


class Verify:
    """RunningBatch's verify step."""

    def verify(self, drafts: dict[int, list[int]]) -> tuple[list[tuple[int, Picked]], dict[int, int]]:
        """One step over every row, row r with its pending token then drafts[r] (absent: none). Returns
        each row's kept tokens in order, (row, Picked) pairs, and how many drafted tokens each drafting
        row kept. Rows' lengths advance by the tokens they keep; a failure leaves the rows as they were
        (lengths, generators)."""
        n, c = len(self.rows), self.cache
        rows: list[int] = []
        past: list[int] = []
        ids: list[int] = []
        for r, seq in enumerate(self.rows):
            d = drafts.get(r, [])
            for j, token in enumerate([seq.pending, *d]):
                rows.append(r)
                past.append(c.host_lengths[r] + j)
                ids.append(token)
        states = {r: self.rows[r].sampler.generator.get_state() for r in drafts
                  if not self.rows[r].params.greedy}
        try:
            masks = self._start_masks([self.rows[r] if past[e] == c.host_lengths[r] else None
                                       for e, r in enumerate(rows)])
            logits = self.steps.decode(self._to_device([[t] for t in ids]), c.view_tokens(rows, past),
                                       self._slots([self.rows[r] for r in rows]))[:, 0]  # (E, V)
            params = BatchParams.build([self.rows[r].params for r in rows], self.device)
            seen, counts = self._entry_history(rows, ids, params)
            choice = choose(logits.float(), params, [self.rows[r].sampler for r in rows], seen, counts,
                            self._allowed(masks))  # (E,)
        except BaseException:
            for r, state in states.items():
                self.rows[r].sampler.generator.set_state(state)
            raise
        chosen = choice.tokens.tolist()
        first = 0
        kept_drafts: dict[int, int] = {}
        lengths = []
        entries: list[int] = []  # the kept entries, in order
        for r in range(n):
            d = drafts.get(r, [])
            kept = kept_tokens(chosen[first:first + len(d) + 1], d)
            if r in drafts:
                kept_drafts[r] = kept - 1
            if r in states:  # as if the row had drawn once per kept token
                gen = self.rows[r].sampler.generator
                gen.set_state(states[r])
                for _ in range(kept):
                    torch.rand((), generator=gen)
            entries.extend(range(first, first + kept))
            lengths.append(kept)
            first += len(d) + 1
        c.advance(lengths, 0, n)
        index = torch.tensor(entries, device=self.device)  # (K,)
        kept_rows = torch.tensor([rows[e] for e in entries], device=self.device)  # (K,)
        tokens = choice.tokens.index_select(0, index)  # (K,)
        self.seen[kept_rows, tokens] = True
        self.counts.index_put_((kept_rows, tokens), torch.ones_like(tokens, dtype=self.counts.dtype), accumulate=True)
        entry_tokens = picked(choice, entries, [self.rows[rows[e]].params.logprobs for e in entries])
        return [(rows[e], p) for e, p in zip(entries, entry_tokens, strict=True)], kept_drafts

    def _entry_history(self, rows: list[int], ids: list[int], params: BatchParams) -> tuple[Tensor | None, Tensor | None]:
        """Each entry's seen tokens and output counts (E, V): its row's, plus the drafts before it
        (entry j of a row has drafts 1..j in its history); None where no row has a penalty."""
        output = params.presence is not None or params.frequency is not None
        if not params.any_penalty and not output:
            return None, None
        index = torch.tensor(rows, device=self.device)  # (E,)
        seen = self.seen.index_select(0, index) if params.any_penalty else None  # (E, V)
        counts = self.counts.index_select(0, index) if output else None  # (E, V)
        for e in range(1, len(rows)):
            if rows[e] != rows[e - 1]:
                continue
            earlier = torch.tensor(ids[_first_entry(rows, e) + 1:e + 1], device=self.device)  # (j,): drafts 1..j
            if seen is not None:
                seen[e, earlier] = True
            if counts is not None:
                counts[e].index_add_(0, earlier, torch.ones_like(earlier, dtype=counts.dtype))
        return seen, counts


def _first_entry(rows: list[int], e: int) -> int:
    """The index of the first entry of entry e's row."""
    while e > 0 and rows[e - 1] == rows[e]:
        e -= 1
    return e
