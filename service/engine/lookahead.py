"""A decode step launched one step ahead (a mixin of engine/batch.py's RunningBatch): the device computes
step k + 1 while the host hands out step k's tokens.

With CUDA graphs a step's remaining cost is the host's (reading tokens, detokenizing, events, the next
inputs; docs/benchmarks.md, "GPU"). So `RunningBatch.decode(ahead=True)` launches the next step on the
sampled tokens while they are still on the device, queuing their copy to the host first. `Ahead` is the
step in flight: its rows by identity (rows that finished, were cancelled or preempted meanwhile are
dropped, rows that moved are found), its tokens, and each sampled row's generator state before its
draw. A preempted row gets that state back (`give_back`), so its recomputation draws the same tokens;
a row that left wasted one token. A batch that gained a row drops the whole step and runs as usual;
the engine looks ahead only when no request waits. Engine thread only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

from models.decoding import choose

from .sequence import Picked, SeqState


def to_host(tokens: Tensor) -> tuple[Tensor, torch.cuda.Event | None]:
    """Queue a copy of tokens (B,) to the host: (pinned host tensor, event recorded after the copy);
    on the CPU the tensor itself and None."""
    if not tokens.is_cuda:
        return tokens, None
    host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
    host.copy_(tokens, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return host, ready


def read(host: Tensor, ready: torch.cuda.Event | None) -> list[int]:
    """The tokens of a `to_host` copy, once it landed (waits for that copy only)."""
    if ready is not None:
        ready.synchronize()
    return host.tolist()


@dataclass
class Ahead:
    """A decode step in flight, launched before its input tokens were handed out."""

    seqs: list[SeqState]  # its rows, in its order
    tokens: Tensor  # (B,) the tokens it sampled, on the device
    host: Tensor  # (B,) the same, being copied to the host
    ready: torch.cuda.Event | None
    states: dict[int, Tensor]  # id(seq) -> its generator's state before this step's draw (sampled rows)

    def __post_init__(self) -> None:
        self.index = {id(seq): i for i, seq in enumerate(self.seqs)}

    def covers(self, rows: Iterable[SeqState]) -> bool:
        """Whether it computed every one of `rows`."""
        return all(id(seq) in self.index for seq in rows)

    def order(self, rows: list[SeqState]) -> list[int]:
        """Its row index of each of `rows` (all covered)."""
        return [self.index[id(seq)] for seq in rows]

    def give_back(self, keep: Iterable[SeqState] = ()) -> None:
        """Undo its draws for every row but `keep`: a row that comes back later (preempted) draws again
        from where it was."""
        kept = {id(seq) for seq in keep}
        for seq in self.seqs:
            state = self.states.get(id(seq))
            if state is not None and id(seq) not in kept:
                seq.sampler.generator.set_state(state)

    def read(self, order: list[int]) -> list[int]:
        tokens = read(self.host, self.ready)
        return [tokens[i] for i in order]


def launch_states(seqs: list[SeqState]) -> dict[int, Tensor]:
    """The generator state of every sampled row, before a step ahead draws."""
    return {id(seq): seq.sampler.generator.get_state() for seq in seqs if not seq.sampler.params.greedy}


class LookAhead:
    """RunningBatch's steps launched ahead (a mixin: the batch owns `_ahead`, `graphs` and the rows)."""

    def can_look_ahead(self) -> bool:
        """Whether the next step may be launched before this one's tokens are handed out: decode
        graphs; no prompt in chunks (it joins the batch after its last chunk); no row whose next step
        needs its token on the host first (a structured output's mask) or that reads log-probabilities;
        room for one more token in every row, and the blocks for it."""
        if self.graphs is None or self.partial is not None:
            return False
        if any(s.matcher is not None or s.params.logprobs is not None for s in self.rows):
            return False
        c, n = self.cache, len(self.rows)
        if any(c.host_lengths[row] + 1 > c.max_len for row in range(n)):
            return False
        return self.make_room(sum(c.blocks_needed(row, c.host_lengths[row] + 1) for row in range(n)))

    def _hand_out(self, tokens: Tensor, read_tokens: Callable[[], list[int]], launch: bool) -> list[Picked]:
        """Every row's sampled token (B,) on the device: marked seen and counted, the next step
        launched on them when `launch` (can_look_ahead held), then read back."""
        self._mark(tokens, 0)
        if launch:
            self._launch(tokens)
        return [(t, None) for t in read_tokens()]

    def _launch(self, tokens: Tensor) -> None:
        """The next decode step of every row on `tokens` (B,), sampled, its tokens on their way to the host."""
        seqs, n = list(self.rows), len(self.rows)
        states = launch_states(seqs)
        logits = self.graphs.step([], 0, n, ids=tokens)  # (B, V)
        params, samplers = self._batch_params()
        choice = choose(logits.float(), params, samplers, self.seen[:n], self.counts[:n])  # (B,)
        host, ready = to_host(choice.tokens)
        self._ahead = Ahead(seqs, choice.tokens, host, ready, states)

    def _collect(self, ahead: bool) -> list[Picked]:
        """The step launched ahead, for the rows still here (some may have left, others moved)."""
        a, self._ahead = self._ahead, None
        assert a is not None
        a.give_back(keep=self.rows)  # a preempted row draws again when it comes back
        order = a.order(self.rows)
        tokens = a.tokens  # (B',)
        if order != list(range(len(a.seqs))):
            tokens = tokens.index_select(0, torch.tensor(order, device=self.device))  # (B,)
        self.cache.advance(1, 0, len(self.rows))
        return self._hand_out(tokens, lambda: a.read(order), launch=ahead and self.can_look_ahead())

    def _drop_ahead(self) -> None:
        """Forget the step launched ahead (the batch changed): its rows draw again from where they were;
        the keys it wrote past their lengths are overwritten by the step that runs instead."""
        if self._ahead is not None:
            self._ahead.give_back()
            self._ahead = None
