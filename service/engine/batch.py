"""The running batch of the engine: live requests packed at the front of the KV cache.

Row r of the cache belongs to `rows[r]`, with its seen-token mask (repetition penalty) at
`seen[r]` and its output token counts (presence / frequency penalties) at `counts[r]`. `prefill` admits requests on fresh rows at the end, `decode` runs one step for a block
of rows, `remove` frees rows and moves the last live rows into the holes. A forward writes each
row's next cache slots before its length advances, and lengths advance only after sampling
succeeded, so a failed prefill or decode can be retried on the same rows.

Prefix caching (engine/prefix_cache.py): a prompt whose first blocks are cached gets their keys
and values copied into its row and prefills only the rest (rows of one forward may start at
different lengths); its full blocks are stored after its prefill.

Chunked prefill: a prompt longer than the engine's chunk is prefilled a chunk per step on the
cache's last row (`partial`, outside the decoding block), so the running rows keep decoding
between its chunks; after its last chunk it samples its first token and joins the block, with
the requests of the same prompt that wait right behind it (n > 1 siblings) on copies of its row.

A paged cache (models/paged_cache.py) gives each row the blocks its tokens fill. The engine
preempts a request when blocks run out (`preempt`: its row freed) and later `restore`s it: its
prompt and output so far are recomputed in one forward without sampling, and it goes on decoding
from its pending token.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

import torch
from torch import Tensor

from models.decoding import BatchParams, Choice, RowSampler, choose
from models.execution.executors import DecoderExecutor
from models.execution.graphs import DecodeGraphs
from models.inputs import PaddedBatch
from models.kv_cache import KVCache
from models.paged_cache import PagedKVCache, blocks_for
from models.projections.dense import kernels_per_shape

from .grammar import MaskBuilder
from .lookahead import Ahead, launch_states, read, to_host
from .prefix_cache import BLOCK, Pin, PrefixCache
from .sequence import SeqState

# A prefill pads its prompts (T) so that B x T, the rows its Linears see, is a multiple of
# prefill_multiple() (within the cache row). Where the Linears keep a oneDNN kernel per row count
# (bfloat16 on CPU: about 1.7 MiB each for SmolLM2's MLP), any B x T would make the replica's memory
# grow with the variety of prompt lengths (docs/reliability.md, Heap trimming); with 32, a prefill
# budget of 2048 tokens allows 64 distinct row counts, and decode steps add one per batch size.
# Elsewhere (float32 on our panel and block kernels or MKL, CUDA) nothing is kept per shape, and
# padding to 32 computed ~20 % of a closed loop's prompt tokens for nothing (prompts of 10-200
# tokens: 0.79 of the padded tokens real, 0.98 with 2; prefill 1.15x faster with 2:
# loadtests/experiments/prefill_padding.py, docs/benchmarks.md).
# There 2, which keeps a one-prompt prefill from being one token wide (the decode step's shape).
PREFILL_MULTIPLE = 32
SHAPE_FREE_MULTIPLE = 2


def prefill_multiple(*models: torch.nn.Module) -> int:
    """B x T of a prefill is a multiple of this: PREFILL_MULTIPLE where a model's projections keep
    kernels per shape (models.dense.kernels_per_shape), else SHAPE_FREE_MULTIPLE."""
    return PREFILL_MULTIPLE if any(kernels_per_shape(m) for m in models) else SHAPE_FREE_MULTIPLE


# a row's sampled token, and (its log-probability, ((token id, log-probability) of the best k, best
# first)) when the request asked for log-probabilities
Picked = tuple[int, tuple[float, tuple[tuple[int, float], ...]] | None]


class RunningBatch:
    """Owned by the engine thread."""

    def __init__(self, steps: DecoderExecutor, cache: KVCache | PagedKVCache, vocab_size: int,
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

    def _start_masks(self, seqs: list[SeqState]) -> Future[Tensor | None] | None:
        """Begin the allowed-token masks of the constrained rows among `seqs` on a worker thread, so
        they are computed while the forward pass runs; None when no row is constrained."""
        matchers = [s.matcher for s in seqs]
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
        logits = self.steps.prefill(padded.ids, self.cache.view(row, row + 1), padded.last_index())[:, 0]  # (1, V)
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
            self.prefix.store(seq.prompt, row)
        for sibling in siblings:
            sibling.cached_tokens = len(sibling.prompt)  # nothing computed for it
        for dst in range(start, stop):
            self.cache.move_row(row, dst)  # the prompt's keys and length
        if row >= stop:
            self.cache.reset(row, row + 1)
        self.partial, self.partial_done = None, 0
        self.rows.extend(group)
        self._params = None
        return self._took(choice, start, group)

    def usage(self) -> float:
        """The cache's use, 0..1: tokens held / rows' capacity, or blocks in use / the pool (paged)."""
        return self.cache.usage()

    # -- blocks (paged) --------------------------------------------------------------------------

    def blocks_for(self, seq: SeqState, hit: int = 0) -> int:
        """New blocks a waiting request takes when admitted: its context and first new token, less
        the `hit` tokens' blocks it shares from the prefix cache (pinned by the admission)."""
        return blocks_for(len(seq.context) + 1, self.cache.block) - hit // self.cache.block

    def pin_prefix(self, seq: SeqState, hit: int) -> Pin | None:
        """Keep the prefix cache's first `hit` tokens of seq's context until unpin_prefix (None: no hit)."""
        return self.prefix.pin(seq.context, hit) if hit and self.prefix is not None else None

    def unpin_prefix(self, pin: Pin) -> None:
        if self.prefix is not None:
            self.prefix.unpin(pin)

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
        """Take a running request out (its blocks freed): it is recomputed by `restore` when admitted again."""
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
                self.prefix.load(c, hit, row)
                self.cache.set_lengths(hit, row, row + 1)
        if self.split:  # each part with the weights that first computed it, row by row (each fits alone)
            for row, (seq, hit) in enumerate(zip(group, hits, strict=True), start):
                self._recompute(row, seq.context, hit, len(seq.prompt))
        else:
            padded = PaddedBatch.from_token_lists([c[h:] for c, h in zip(contexts, hits, strict=True)],
                                                  device=self.device, multiple=self._width_multiple(len(group)),
                                                  limit=self.cache.max_len - max(hits))  # (B, T)
            self.steps.prefill(padded.ids, self.cache.view(start, stop), padded.last_index())
            self.cache.advance(padded.lengths, start, stop)
        seen = self.seen[start:stop].zero_()  # (B, V) view
        counts = self.counts[start:stop].zero_()  # (B, V) view
        for i, seq in enumerate(group):
            seen[i, torch.tensor(seq.prompt + seq.tokens, device=self.device)] = True
            counts[i] = torch.bincount(torch.tensor(seq.tokens, device=self.device), minlength=counts.size(1))
            seq.resume = False
            if self.prefix is not None:  # with a prompt model, only blocks it computed: prompts' blocks
                self.prefix.store(seq.prompt if self.split else contexts[i], start + i)
        self.rows.extend(group)
        self._params = None

    def prefill(self, group: list[SeqState]) -> list[Picked]:
        """One forward over the right-padded prompts on rows [n, n + B), sampling each first token at
        its last prompt index; the group joins the batch only if all of this succeeds.

        Requests with the same prompt (n > 1 siblings, or the same prompt sent twice) are computed
        once: the group is reordered so each distinct prompt's first request comes first, the forward
        runs on those rows only, and the others get a copy of that row's cache and its logits (each
        still samples with its own generator)."""
        with self._released_on_failure():
            return self._prefill_rows(group)

    def _prefill_rows(self, group: list[SeqState]) -> list[Picked]:
        start, stop = len(self.rows), len(self.rows) + len(group)
        if len(group) > self.free:
            raise ValueError(f"{len(group)} requests do not fit the {self.free} free cache rows")
        firsts: dict[tuple[int, ...], int] = {}
        for i, seq in enumerate(group):
            firsts.setdefault(tuple(seq.prompt), i)
        group = [group[i] for i in firsts.values()] + [s for i, s in enumerate(group) if i not in firsts.values()]
        source = [list(firsts).index(tuple(seq.prompt)) for seq in group]  # (B,): the computed row of each
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
        logits = self.steps.prefill(padded.ids, self.cache.view(start, start + n_unique), last)[:, 0]  # (U, V)
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
                self.prefix.store(seq.prompt, start + i)
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

    def cached(self, seq: SeqState) -> int:
        """Tokens of seq's context (its prompt, unless preempted) the prefix cache holds now (0 without
        one); with a prompt model, of a preempted request's prompt only (its output is recomputed as
        decoded)."""
        if self.prefix is None:
            return 0
        hit = self.prefix.lookup(seq.context)
        if seq.resume and self.split:
            hit = min(hit, len(seq.prompt) // BLOCK * BLOCK)
        return hit

    def _recompute(self, row: int, context: list[int], done: int, prompt: int) -> None:
        """Row `row` holds context[:done]: compute the rest of its first `prompt` tokens with the prompt
        model and the rest after them with the decode model, each padded as a prefill pads it."""
        for forward, end in ((self.steps.prefill, prompt), (self.steps.extend, len(context))):
            if done < end:
                padded = PaddedBatch.from_token_lists([context[done:end]], device=self.device,
                                                      multiple=self._width_multiple(1),
                                                      limit=self.cache.max_len - done)  # (1, T)
                forward(padded.ids, self.cache.view(row, row + 1), padded.last_index())
                self.cache.advance(padded.lengths, row, row + 1)
                done = end

    def _load_prefix(self, seq: SeqState, row: int, hit: int | None = None) -> int:
        """Copy the cached keys/values of the first `hit` tokens (default: the longest cached prefix)
        of seq's prompt into `row` (just reset) and set its length; returns the tokens loaded (also
        kept as seq.cached_tokens)."""
        hit = self.cached(seq) if hit is None else hit
        if hit:
            self.prefix.load(seq.prompt, hit, row)
            self.cache.set_lengths(hit, row, row + 1)
        seq.cached_tokens = hit
        return hit

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
            logits = self.steps.decode(ids, self.cache.view(start, stop))[:, 0]  # (B, V)
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

    # -- one step ahead (engine/lookahead.py) ----------------------------------------------------

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

    def remove(self, dead: list[int]) -> list[SeqState]:
        """Free rows `dead` (ascending): the last live rows move into the holes, the tail is reset."""
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
        return removed

    def clear(self) -> list[SeqState]:
        """Drop every row and the chunked prefill in progress; returns their requests."""
        removed, self.rows, self._params, self._ahead = self.rows, [], None, None
        partial = self.drop_partial()
        self.cache.reset()
        return removed + ([partial] if partial is not None else [])

    def _took(self, choice: Choice, start: int, seqs: list[SeqState]) -> list[Picked]:
        """Mark the sampled tokens (B,) as seen (and counted) by their rows; each row's token and,
        when it asked for them, its log-probabilities."""
        tokens = choice.tokens  # (B,)
        self._mark(tokens, start)
        ids = tokens.tolist()
        if choice.logprobs is None:
            return [(t, None) for t in ids]
        chosen = choice.logprobs.tolist()
        top_ids = choice.top_ids.tolist() if choice.top_ids is not None else [[] for _ in ids]
        top_lp = choice.top_logprobs.tolist() if choice.top_logprobs is not None else [[] for _ in ids]
        picked: list[Picked] = []
        for i, (token, seq) in enumerate(zip(ids, seqs, strict=True)):
            k = seq.params.logprobs
            entry = None if k is None else (chosen[i], tuple(zip(top_ids[i][:k], top_lp[i][:k], strict=True)))
            picked.append((token, entry))
        return picked

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
