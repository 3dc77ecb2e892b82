"""A draft model (speculative decoding's second drafter): a smaller or cheaper model of the same tokenizer
proposes each drafting row's next k tokens, greedily, on a paged cache of its own.

A request holds a row of the draft's cache from its first draft until it leaves the batch (`release`).
Before drafting, the row catches up with the request's tokens it has not seen (its prompt the first
time: one prefill; later the one or two tokens the last verify step kept beyond its drafts); then k
one-token steps over all drafting rows at once. The keys of the drafts the target kept stay in the row
(`kept`); the others are past its length and overwritten. Engine thread only.

    R draft rows, B drafting requests
"""

from __future__ import annotations

import time

import torch

from models.cache.base import kv_dtype
from models.cache.paged import CacheFull, PagedKVCache
from models.execution.executors import DecoderExecutor

from ..sequence import SeqState
from .policy import StepTimes

PREFILL_FROM = 4  # a row this many tokens behind catches up with a prefill of its own, not as step entries


class DraftModel:
    """Owns the draft executor's cache and which request holds which of its rows."""

    def __init__(self, steps: DecoderExecutor, rows: int, blocks: int, max_len: int, kv_cache_dtype: str = "auto") -> None:
        """kv_cache_dtype: as the engine's (EngineConfig.kv_cache_dtype), for the draft's own cache."""
        self.steps = steps
        weight = next(steps.model.parameters())
        self.device = weight.device
        self.cache = PagedKVCache.for_model(steps.model.cfg, rows, blocks, max_len,
                                            kv_dtype(kv_cache_dtype, weight.dtype), self.device)
        self._free = list(range(rows - 1, -1, -1))
        self._row: dict[int, int] = {}  # id(seq) -> its draft row
        self._drafted: dict[int, int] = {}  # id(seq) -> tokens written past its length by the last draft
        self.times = StepTimes()  # one draft step, by rows

    def draft_s(self, k: int, rows: int) -> float:
        """Estimated seconds to draft k tokens for `rows` rows (k steps; catching up not counted)."""
        return k * self.times.estimate(rows) if self.times else 0.0

    def release(self, seq: SeqState) -> None:
        """The request left the batch (finished, failed, preempted): its row goes back."""
        row = self._row.pop(id(seq), None)
        self._drafted.pop(id(seq), None)
        if row is not None:
            self.cache.reset(row, row + 1)
            self._free.append(row)

    def kept(self, seq: SeqState, kept: int) -> None:
        """The verify step kept `kept` of seq's drafts: their keys (all but the last draft's, which was
        never an input) join its row."""
        row = self._row.get(id(seq))
        if row is not None:
            self.cache.advance(min(kept, self._drafted.pop(id(seq), 0)), row, row + 1)

    def draft(self, seqs: list[SeqState], k: int) -> list[list[int]]:
        """k greedy tokens for each of `seqs` after its tokens so far (prompt, output, pending token);
        [] for a request no row or block is free for."""
        rows, todo, out = [], [], [[] for _ in seqs]
        for i, seq in enumerate(seqs):
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
            return out
        with torch.inference_mode():
            # step 1: each row's tokens it has not seen as entries; its last entry proposes the first draft
            entries = [(row, self.cache.host_lengths[row] + j, t) for (_, row), ts in zip(rows, todo, strict=True)
                       for j, t in enumerate(ts)]
            last = [sum(len(ts) for ts in todo[:n + 1]) - 1 for n in range(len(todo))]
            nexts = self._step(entries, last)
            for (_, row), ts in zip(rows, todo, strict=True):
                self.cache.advance(len(ts), row, row + 1)
            for n, (i, _) in enumerate(rows):
                out[i].append(nexts[n])
            for j in range(1, k):  # then one entry a row per draft, past the rows' lengths
                entries = [(row, self.cache.host_lengths[row] + j - 1, out[i][-1]) for i, row in rows]
                nexts = self._step(entries, list(range(len(rows))), timed=True)
                for n, (i, _) in enumerate(rows):
                    out[i].append(nexts[n])
        for i, _ in rows:
            self._drafted[id(seqs[i])] = k - 1
        return out

    def _take(self, seq: SeqState) -> int | None:
        row = self._row.get(id(seq))
        if row is None and self._free:
            row = self._row[id(seq)] = self._free.pop()
        return row

    def _prefill(self, row: int, tokens: list[int]) -> None:
        """Row catches up with `tokens` in one forward (its first draft: the prompt)."""
        with torch.inference_mode():
            ids = torch.tensor([tokens], dtype=torch.long, device=self.device)  # (1, T)
            self.steps.prefill(ids, self.cache.view(row, row + 1), torch.tensor([len(tokens) - 1], device=self.device))
        self.cache.advance(len(tokens), row, row + 1)

    def _step(self, entries: list[tuple[int, int, int]], last: list[int], timed: bool = False) -> list[int]:
        """One step over (row, position, token) entries; the greedy next token after each entry in `last`."""
        started = time.perf_counter()
        ids = torch.tensor([[t] for _, _, t in entries], dtype=torch.long, device=self.device)  # (E, 1)
        view = self.cache.view_tokens([r for r, _, _ in entries], [p for _, p, _ in entries])
        logits = self.steps.decode(ids, view)[:, 0]  # (E, V)
        picked = logits.index_select(0, torch.tensor(last, device=self.device)).argmax(-1).tolist()
        if timed:
            self.times.record(len(entries), time.perf_counter() - started)
        return picked
