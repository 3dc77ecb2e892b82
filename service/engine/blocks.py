"""The KV blocks of the running batch (a mixin of engine/batch.py's RunningBatch, which owns the state
it uses): what an admission or a decode step needs from the pool, prefix-cache hits loaded into a row
(engine/prefix_cache.py) and pinned while their request waits, and preemption: a request's row freed
when blocks run out, later `restore`d by recomputing its prompt and output in one forward without
sampling, so it decodes on as if never stopped. Engine thread only.
"""

from __future__ import annotations

import torch

from models.cache.paged import blocks_for
from models.inputs import PaddedBatch

from .prefix_cache import BLOCK, Pin
from .sequence import SeqState


class Blocks:
    """RunningBatch's block accounting, prefix hits and preemption."""

    def blocks_for(self, seq: SeqState, hit: int = 0) -> int:
        """New blocks a waiting request takes when admitted: its context and first new token, less
        the `hit` tokens' blocks it shares from the prefix cache (pinned by the admission)."""
        return blocks_for(len(seq.context) + 1, self.cache.block) - hit // self.cache.block

    def pin_prefix(self, seq: SeqState, hit: int) -> Pin | None:
        """Keep the prefix cache's first `hit` tokens of seq's context until unpin_prefix (None: no hit)."""
        return self.prefix.pin(seq.context, hit, seq.salt) if hit and self.prefix is not None else None

    def unpin_prefix(self, pin: Pin) -> None:
        if self.prefix is not None:
            self.prefix.unpin(pin)

    def blocks_available(self) -> int:
        """Free blocks, and blocks only the prefix cache holds (it gives them up on demand)."""
        return self.cache.blocks_free + (self.prefix.reclaimable() if self.prefix is not None else 0)

    def make_room(self, blocks: int) -> bool:
        """At least `blocks` free blocks, evicting prefix-cache blocks nobody else uses if needed."""
        short = blocks - self.cache.blocks_free
        if short > 0 and self.prefix is not None:
            self.prefix.reclaim(short)
        return self.cache.blocks_free >= blocks

    def decode_blocks(self) -> int:
        """New blocks the next decode step takes: rows whose next token starts a block."""
        cache = self.cache
        return sum(cache.blocks_needed(row, cache.host_lengths[row] + 1) for row in range(len(self.rows)))

    def preempt(self, row: int) -> SeqState:
        """Take a running request out: its full blocks go to the prefix cache (`remove`), which gives them
        up on demand, and `restore` recomputes, when it is admitted again, only what is gone."""
        seq = self.remove([row])[0]
        seq.resume = True
        return seq

    def restore(self, group: list[SeqState]) -> None:
        """Preempted requests back on fresh rows: one padded forward over each one's context (prompt
        and output but its pending token; cached prefix blocks reused), no sampling; their seen tokens
        and counts rebuilt. They decode on from their pending token as if never stopped."""
        with self._released_on_failure():
            self._restore_rows(group)

    def _restore_rows(self, group: list[SeqState]) -> None:
        start, stop = len(self.rows), len(self.rows) + len(group)
        if len(group) > self.free:
            raise ValueError(f"{len(group)} requests do not fit the {self.free} free cache rows")
        self.cache.reset(start, stop)
        contexts = [seq.context for seq in group]
        hits = [self.cached(seq) for seq in group]
        if not self.split and max(hits) + max(len(c) - h for c, h in zip(contexts, hits, strict=True)) > self.cache.max_len:
            hits = [0] * len(group)
        for row, (c, hit) in enumerate(zip(contexts, hits, strict=True), start):
            if hit:
                self.prefix.load(c, hit, row, group[row - start].salt)
                self.cache.set_lengths(hit, row, row + 1)
        if self.split:  # each part with the weights that first computed it, row by row (each fits alone)
            for row, (seq, hit) in enumerate(zip(group, hits, strict=True), start):
                self._recompute(row, seq, hit)
        else:
            padded = PaddedBatch.from_token_lists([c[h:] for c, h in zip(contexts, hits, strict=True)],
                                                  device=self.device, multiple=self._width_multiple(len(group)),
                                                  limit=self.cache.max_len - max(hits))  # (B, T)
            self.steps.prefill(padded.ids, self.cache.view(start, stop), padded.last_index(), self._slots(group))
            self.cache.advance(padded.lengths, start, stop)
        seen = self.seen[start:stop].zero_()  # (B, V) view
        counts = self.counts[start:stop].zero_()  # (B, V) view
        for i, seq in enumerate(group):
            seen[i, torch.tensor(seq.prompt + seq.tokens, device=self.device)] = True
            counts[i] = torch.bincount(torch.tensor(seq.tokens, device=self.device), minlength=counts.size(1))
            seq.resume = False
            if self.prefix is not None:  # with a prompt model, only blocks it computed: prompts' blocks
                self.prefix.store(seq.prompt if self.split else contexts[i], start + i, seq.salt)
        self.rows.extend(group)
        self._params = None

    def _recompute(self, row: int, seq: SeqState, done: int) -> None:
        """Row `row` holds seq.context[:done]: compute the rest of its prompt with the prompt model and
        the rest after it with the decode model, each padded as a prefill pads it."""
        context, prompt = seq.context, len(seq.prompt)
        for forward, end in ((self.steps.prefill, prompt), (self.steps.extend, len(context))):
            if done < end:
                padded = PaddedBatch.from_token_lists([context[done:end]], device=self.device,
                                                      multiple=self._width_multiple(1),
                                                      limit=self.cache.max_len - done)  # (1, T)
                forward(padded.ids, self.cache.view(row, row + 1), padded.last_index(), self._slots([seq]))
                self.cache.advance(padded.lengths, row, row + 1)
                done = end

    def keep_outputs(self, rows: list[int]) -> None:
        """Offer the prefix cache the full blocks of rows `rows`, about to be freed: their prompt and
        output as far as the row holds them (never the pending token, nor a stop token a step launched
        ahead fed), so that a request repeating them (a chat's next turn, whose history holds this
        answer; a preempted request coming back) prefills only what follows. Not a request that ended
        in an error (its step may have failed mid-way). With a prompt model the blocks hold the keys
        as first computed, the answer's by the decode weights (as a preempted request's recomputation
        computes them)."""
        if self.prefix is None:
            return
        for row in rows:
            seq = self.rows[row]
            if seq.reason == "error":
                continue
            held = min(self.cache.host_lengths[row], len(seq.prompt) + len(seq.tokens))
            if held // BLOCK > len(seq.context) // BLOCK:  # a full block its prompt's store did not cover
                self.prefix.store((seq.prompt + seq.tokens)[:held], row, seq.salt)

    def cached(self, seq: SeqState) -> int:
        """Tokens of seq's context (its prompt, unless preempted) the prefix cache holds now (0 without
        one); with a prompt model, of a preempted request's prompt only (its output is recomputed as
        decoded)."""
        if self.prefix is None:
            return 0
        hit = self.prefix.lookup(seq.context, seq.salt)
        if seq.resume and self.split:
            hit = min(hit, len(seq.prompt) // BLOCK * BLOCK)
        return hit

    def _load_prefix(self, seq: SeqState, row: int, hit: int | None = None) -> int:
        """Copy the cached keys/values of the first `hit` tokens (default: the longest cached prefix)
        of seq's prompt into `row` (just reset) and set its length; returns the tokens loaded (also
        kept as seq.cached_tokens)."""
        hit = self.cached(seq) if hit is None else hit
        if hit:
            self.prefix.load(seq.prompt, hit, row, seq.salt)
            self.cache.set_lengths(hit, row, row + 1)
        seq.cached_tokens = hit
        return hit
