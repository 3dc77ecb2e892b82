"""The running batch of the engine: live requests packed at the front of the KV cache.

Row r of the cache belongs to `rows[r]`, with its seen-token mask (repetition penalty) at `seen[r]`
and its output token counts (presence / frequency penalties) at `counts[r]`. `decode` runs one step
for a block of rows on the plan's decode backend (the executor, or its captured graphs), `remove`
frees rows and moves the last live rows into the holes. A forward writes each row's next cache slots
before its length advances, and lengths advance only after sampling succeeded, so a failed prefill
or decode can be retried on the same rows. Admission is engine/prefill.py's, blocks and preemption
engine/blocks.py's, steps launched ahead engine/lookahead.py's. Engine thread only.

    B rows in a step, R cache rows, V vocabulary
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

import torch
from torch import Tensor

from models.cache.base import KeyValueCache
from models.decoding import BatchParams, Choice, RowSampler, choose
from models.execution.executors import DecoderExecutor
from models.execution.graphs import DecodeGraphs
from models.projections.dense import kernels_per_shape

from .blocks import Blocks
from .grammar import MaskBuilder
from .lookahead import Ahead, LookAhead, read, to_host
from .prefill import Prefill
from .prefix_cache import PrefixCache
from .sequence import Picked, SeqState, picked
from .verify import Verify

# A prefill pads its prompts (T) so that B x T, the rows its Linears see, is a multiple of
# prefill_multiple() (within the cache row). Where the Linears keep a oneDNN kernel per row count
# (bfloat16 on CPU: about 1.7 MiB each for SmolLM2's MLP), any B x T would make the replica's memory
# grow with the variety of prompt lengths (docs/reliability.md, Heap trimming); with 32, a prefill
# budget of 2048 tokens allows 64 distinct row counts, and decode steps add one per batch size.
# Elsewhere (float32 on our panel and block kernels or MKL, CUDA) nothing is kept per shape, and
# padding to 32 would compute many prompt tokens for nothing (docs/benchmarks.md, "Smaller figures":
# prefill padding). There 2, which keeps a one-prompt prefill from being one token wide (the decode
# step's shape).
PREFILL_MULTIPLE = 32
SHAPE_FREE_MULTIPLE = 2


def prefill_multiple(*models: torch.nn.Module) -> int:
    """B x T of a prefill is a multiple of this: PREFILL_MULTIPLE where a model's projections keep
    kernels per shape (models.projections.dense.kernels_per_shape), else SHAPE_FREE_MULTIPLE."""
    return PREFILL_MULTIPLE if any(kernels_per_shape(m) for m in models) else SHAPE_FREE_MULTIPLE


class RunningBatch(Prefill, Blocks, LookAhead, Verify):
    """Owned by the engine thread. Its admissions are Prefill's (engine/prefill.py), its KV blocks,
    prefix hits and preemptions Blocks' (engine/blocks.py), its steps launched ahead LookAhead's
    (engine/lookahead.py), speculative decoding's verify steps Verify's (engine/verify.py); the rows,
    decode steps and sampling are here."""

    def __init__(self, steps: DecoderExecutor, cache: KeyValueCache, vocab_size: int,
                 prefix: PrefixCache | None = None, graphs: DecodeGraphs | None = None) -> None:
        """`steps`: the model's executor, whose plan says what computes prompts (prefills, chunks, a
        preempted request's prompt: its prompt weights) and decode steps (and a preempted request's
        output when recomputed: the decode weights). `graphs`: decode steps through padded, captured
        steps of the model (models/execution/graphs.py), when the plan chose them."""
        self.steps, self.graphs = steps, graphs
        self._ahead: Ahead | None = None  # a decode step launched before its input tokens were handed out
        self.cache, self.prefix = cache, prefix
        self.split = steps.split  # prompts and decode steps on different weights
        self.paged = cache.paged
        self.device = cache.lengths.device
        self.multiple = prefill_multiple(steps.model, steps.prompt_model)  # of B x T in every prompt forward
        self.rows: list[SeqState] = []
        self.seen = torch.zeros(cache.rows, vocab_size, dtype=torch.bool, device=self.device)  # (R, V)
        self.counts = torch.zeros(cache.rows, vocab_size, dtype=torch.int32, device=self.device)  # (R, V)
        self._params: tuple[BatchParams, list[RowSampler]] | None = None
        self.partial: SeqState | None = None  # a long prompt prefilled chunk by chunk on the last row
        self.partial_done = 0  # its prompt tokens in the cache
        self._masks = MaskBuilder(vocab_size)
        self._mask_thread: ThreadPoolExecutor | None = None  # structured outputs: masks beside the forward
        self.on_leave: Callable[[SeqState], object] | None = None  # told of each request that leaves the rows

    def _width_multiple(self, rows: int) -> int:
        """What a prompt forward of `rows` rows pads its width T to a multiple of, so that B x T is a
        multiple of self.multiple."""
        return self.multiple // math.gcd(rows, self.multiple)

    def _to_device(self, rows: list[list[int]]) -> Tensor:
        """Token ids from the host on the engine's device; on CUDA through pinned memory without
        blocking the host (the copy is queued before the kernels that read it)."""
        if self.device.type != "cuda":
            return torch.tensor(rows, dtype=torch.long, device=self.device)
        return torch.tensor(rows, dtype=torch.long).pin_memory().to(self.device, non_blocking=True)

    def _slots(self, seqs: list[SeqState]) -> Tensor | None:
        """Each request's adapter slot (B,) on the engine's device (-1: the base model); None when none
        has an adapter (the forward adds nothing then)."""
        if all(s.adapter < 0 for s in seqs):
            return None
        return torch.tensor([s.adapter for s in seqs], dtype=torch.long, device=self.device)

    def _start_masks(self, seqs: list[SeqState | None]) -> Future[Tensor | None] | None:
        """Begin the allowed-token masks of the constrained rows among `seqs` (None: a row with no
        constraint) on a worker thread, so they are computed while the forward pass runs; None when no
        row is constrained."""
        matchers = [s.matcher if s is not None else None for s in seqs]
        if all(m is None for m in matchers):
            return None
        if self._mask_thread is None:
            self._mask_thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        return self._mask_thread.submit(self._masks.masks, matchers)

    def _allowed(self, pending: Future[Tensor | None] | None) -> Tensor | None:
        mask = pending.result() if pending is not None else None  # (B, V) bool on the CPU
        return mask.to(self.device) if mask is not None else None

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def held(self) -> int:
        """Requests holding a cache row: the decoding ones and the one prefilled in chunks."""
        return len(self.rows) + (self.partial is not None)

    @property
    def busy(self) -> bool:
        """Rows decode, or a prompt is being prefilled in chunks."""
        return bool(self.rows) or self.partial is not None

    @property
    def free(self) -> int:
        return self.cache.rows - len(self.rows) - (self.partial is not None)

    def usage(self) -> float:
        """The cache's use, 0..1: tokens held / rows' capacity, or blocks in use / the pool (paged)."""
        return self.cache.usage()

    def decode(self, start: int = 0, stop: int | None = None, ahead: bool = False) -> list[Picked]:
        """One step for rows [start, stop): each row's pending token in, one sampled token out.

        `ahead` (a step of every row; with decode graphs): launch the next step on this step's tokens
        before handing them out (engine/lookahead.py); a step already launched that way is collected
        here instead of computed."""
        stop = len(self.rows) if stop is None else stop
        whole = (start, stop) == (0, len(self.rows))
        if self._ahead is not None:
            if whole and self._ahead.covers(self.rows):
                return self._collect(ahead)
            self._drop_ahead()
        seqs = self.rows[start:stop]
        masks = self._start_masks(seqs)
        if self.graphs is not None:
            logits = self.graphs.step([s.pending for s in seqs], start, stop)  # (B, V)
        else:
            ids = self._to_device([[s.pending] for s in seqs])  # (B, 1)
            logits = self.steps.decode(ids, self.cache.view(start, stop), self._slots(seqs))[:, 0]  # (B, V)
        if whole:
            params, samplers = self._batch_params()
        else:
            params, samplers = BatchParams.build([s.params for s in seqs], self.device), [s.sampler for s in seqs]
        choice = choose(logits.float(), params, samplers, self.seen[start:stop], self.counts[start:stop],
                        self._allowed(masks))  # (B,)
        self.cache.advance(1, start, stop)
        if whole and ahead and self.can_look_ahead():
            host, ready = to_host(choice.tokens)  # queued before the next step: waits for this one only
            return self._hand_out(choice.tokens, lambda: read(host, ready), launch=True)
        return self._took(choice, start, seqs)

    @contextmanager
    def _released_on_failure(self) -> Iterator[None]:
        """Rows being filled hold no blocks if filling them fails: the retries of their requests (or
        the next admission) find the pool as it was."""
        start, free = len(self.rows), self.free
        try:
            yield
        except BaseException:
            self.cache.reset(start, start + free)
            raise

    def remove(self, dead: list[int]) -> list[SeqState]:
        """Free rows `dead` (ascending), their full blocks first offered to the prefix cache
        (`keep_outputs`): the last live rows move into the holes, the tail is reset."""
        self.keep_outputs(dead)
        gone, n = set(dead), len(self.rows)
        removed = [self.rows[i] for i in dead]
        keep_n = n - len(gone)
        movers = [i for i in range(keep_n, n) if i not in gone]
        holes = [i for i in dead if i < keep_n]
        for src, dst in zip(movers, holes, strict=True):
            self.cache.relocate(src, dst)
            self.seen[dst] = self.seen[src]
            self.counts[dst] = self.counts[src]
            self.rows[dst] = self.rows[src]
        del self.rows[keep_n:]
        self.cache.reset(keep_n, n)
        self._params = None
        self._left(removed)
        return removed

    def clear(self) -> list[SeqState]:
        """Drop every row and the chunked prefill in progress; returns their requests."""
        removed, self.rows, self._params, self._ahead = self.rows, [], None, None
        partial = self.drop_partial()
        self.cache.reset()
        self._left(removed)
        return removed + ([partial] if partial is not None else [])

    def _left(self, seqs: list[SeqState]) -> None:
        if self.on_leave is not None:
            for seq in seqs:
                self.on_leave(seq)

    def _took(self, choice: Choice, start: int, seqs: list[SeqState]) -> list[Picked]:
        """Mark the sampled tokens (B,) as seen (and counted) by their rows; each row's token and,
        when it asked for them, its log-probabilities."""
        self._mark(choice.tokens, start)  # (B,)
        return picked(choice, range(len(seqs)), [seq.params.logprobs for seq in seqs])

    def _mark(self, tokens: Tensor, start: int) -> None:
        """Rows start.. took `tokens` (B,): seen (repetition penalty) and counted (output penalties)."""
        rows = torch.arange(start, start + tokens.numel(), device=self.device)  # (B,)
        self.seen[rows, tokens] = True
        self.counts[rows, tokens] += 1

    def _batch_params(self) -> tuple[BatchParams, list[RowSampler]]:
        """The live rows' parameters, rebuilt only when the set (or order) of rows changed."""
        if self._params is None:
            self._params = (BatchParams.build([s.params for s in self.rows], self.device),
                            [s.sampler for s in self.rows])
        return self._params
