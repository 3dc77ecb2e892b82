"""Admission of the running batch (a mixin of engine/batch.py's RunningBatch, which owns the state it
uses: rows, cache, seen, counts, partial): waiting requests prefilled on fresh rows at the end of the
live block, and a prompt longer than the engine's chunk prefilled a chunk per step on the cache's
last row (`partial`), joining the block after its last chunk with the requests of the same prompt
that wait behind it (n > 1 siblings) on copies of its row. Requests with the same prompt are computed
once. A prefill samples each request's first token; its rows join only if all of it succeeded.
Engine thread only.

    B requests, U distinct prompts, T padded prompt tokens, V vocabulary
"""

from __future__ import annotations

import torch
from torch import Tensor

from models.decoding import BatchParams, choose
from models.inputs import PaddedBatch

from .sequence import Picked, SeqState


class Prefill:
    """RunningBatch's admissions: prefill, the chunked prefill of one long prompt."""

    @property
    def partial_row(self) -> int:
        return self.cache.rows - 1

    def start_partial(self, seq: SeqState) -> None:
        """Take `seq` (a prompt longer than a chunk) for chunked prefill on the last row."""
        if self.partial is not None or self.free < 1:
            raise ValueError("no free row for a chunked prefill")
        row = self.partial_row
        self.cache.reset(row, row + 1)
        self.partial, self.partial_done = seq, self._load_prefix(seq, row)

    def drop_partial(self) -> SeqState | None:
        """Forget the chunked prefill in progress (its request failed or was cancelled)."""
        seq, self.partial, self.partial_done = self.partial, None, 0
        self.cache.reset(self.partial_row, self.partial_row + 1)
        return seq

    def prefill_chunk(self, chunk: int, siblings: list[SeqState]) -> list[Picked]:
        """The partial request's next chunk of at most `chunk` prompt tokens. After its last chunk it
        samples its first token and joins the decoding rows, followed by `siblings` (waiting requests
        with the same prompt, as many as rows allow) on copies of its row, each sampling its own
        first token from the same logits. Returns their tokens ([] while chunks remain)."""
        seq = self.partial
        if seq is None:
            raise RuntimeError("prefill_chunk() without a partial request")
        row, done = self.partial_row, self.partial_done
        piece = seq.prompt[done:done + chunk]
        last = done + len(piece) == len(seq.prompt)
        group = [seq, *siblings] if last else [seq]
        masks = self._start_masks(group) if last else None
        padded = PaddedBatch.from_token_lists([piece], device=self.device, multiple=self._width_multiple(1),
                                              limit=self.cache.max_len - done)  # (1, T): padded as prefill pads
        logits = self.steps.prefill(padded.ids, self.cache.view(row, row + 1), padded.last_index(),
                                    self._slots([seq]))[:, 0]  # (1, V)
        if not last:
            self.cache.advance(len(piece), row, row + 1)
            self.partial_done += len(piece)
            return []
        start, stop = len(self.rows), len(self.rows) + len(group)
        if stop > self.cache.rows:  # the partial's own row is free once it joins (the last to fill)
            raise ValueError(f"{len(group)} requests do not fit the free cache rows")
        self._mark_prompts(start, group)
        counts = self.counts[start:stop].zero_()  # (B, V) view: no output yet
        params = BatchParams.build([s.params for s in group], self.device)
        choice = choose(logits.float().repeat(len(group), 1), params, [s.sampler for s in group],
                        self.seen[start:stop], counts, self._allowed(masks))  # (B,)
        self.cache.advance(len(piece), row, row + 1)
        if self.prefix is not None:
            self.prefix.store(seq.prompt, row, seq.salt)
        for sibling in siblings:
            sibling.cached_tokens = len(sibling.prompt)  # nothing computed for it
        for dst in range(start + 1, stop):
            self.cache.move_row(row, dst)  # the siblings: copies of the prompt's keys and length
        if row >= stop:  # its own row is nobody's: its blocks move (no copy, no block more)
            self.cache.relocate(row, start)
        else:
            self.cache.move_row(row, start)
        self.partial, self.partial_done = None, 0
        self.rows.extend(group)
        self._params = None
        return self._took(choice, start, group)

    def prefill(self, group: list[SeqState]) -> list[Picked]:
        """One forward over the right-padded prompts on rows [n, n + B), sampling each first token at
        its last prompt index; the group joins the batch only if all of this succeeds.

        Requests with the same prompt and adapter (n > 1 siblings, or the same prompt sent twice) are
        computed once: the group is reordered so each distinct prompt's first request comes first, the forward
        runs on those rows only, and the others get a copy of that row's cache and its logits (each
        still samples with its own generator)."""
        with self._released_on_failure():
            return self._prefill_rows(group)

    def _prefill_rows(self, group: list[SeqState]) -> list[Picked]:
        start, stop = len(self.rows), len(self.rows) + len(group)
        if len(group) > self.free:
            raise ValueError(f"{len(group)} requests do not fit the {self.free} free cache rows")
        firsts: dict[tuple[str, tuple[int, ...]], int] = {}
        for i, seq in enumerate(group):
            firsts.setdefault((seq.salt, tuple(seq.prompt)), i)
        group = [group[i] for i in firsts.values()] + [s for i, s in enumerate(group) if i not in firsts.values()]
        source = [list(firsts).index((seq.salt, tuple(seq.prompt))) for seq in group]  # (B,): the computed row of each
        n_unique = len(firsts)
        masks = self._start_masks(group)
        self.cache.reset(start, stop)
        uniques = group[:n_unique]
        hits = [self.cached(seq) for seq in uniques]
        if max(hits) + max(len(seq.prompt) - hit for seq, hit in zip(uniques, hits, strict=True)) > self.cache.max_len:
            hits = [0] * n_unique  # one padded forward must fit every row: prefill these whole
        hits = [self._load_prefix(seq, start + i, hit) for i, (seq, hit) in enumerate(zip(uniques, hits, strict=True))]
        padded = PaddedBatch.from_token_lists([seq.prompt[hit:] for seq, hit in zip(uniques, hits, strict=True)],
                                              device=self.device, multiple=self._width_multiple(n_unique),
                                              limit=self.cache.max_len - max(hits))  # (U, T): what is left
        last = padded.last_index()  # (U,)
        logits = self.steps.prefill(padded.ids, self.cache.view(start, start + n_unique), last,
                                    self._slots(uniques))[:, 0]  # (U, V)
        seen = self._mark_prompts(start, uniques)  # (U, V) view
        index = torch.tensor(source, device=self.device)  # (B,)
        if n_unique < len(group):
            logits = logits.index_select(0, index)  # (B, V)
            self.seen[start:stop] = seen.index_select(0, index)  # (B, V)
            seen = self.seen[start:stop]  # (B, V) view
        counts = self.counts[start:stop].zero_()  # (B, V) view: no output yet
        params = BatchParams.build([s.params for s in group], self.device)
        choice = choose(logits.float(), params, [s.sampler for s in group], seen, counts,
                        self._allowed(masks))  # (B,)
        self.cache.advance(padded.lengths, start, start + n_unique)  # the real tokens, known on the host
        for i, seq in enumerate(uniques):
            if self.prefix is not None:
                self.prefix.store(seq.prompt, start + i, seq.salt)
        for row in range(n_unique, len(group)):
            self.cache.move_row(start + source[row], start + row)  # the shared prompt's keys and length
            group[row].cached_tokens = len(group[row].prompt)  # nothing computed for it
        self.rows.extend(group)
        self._params = None
        return self._took(choice, start, group)

    def _mark_prompts(self, start: int, seqs: list[SeqState]) -> Tensor:
        """Rows [start, start + len(seqs)) of the seen-token mask: exactly their prompts' tokens (the
        cached ones too, which no padded batch of this step holds). Returns the (B, V) view."""
        seen = self.seen[start:start + len(seqs)].zero_()  # (B, V) view
        for i, seq in enumerate(seqs):
            seen[i, torch.tensor(seq.prompt, device=self.device)] = True
        return seen
