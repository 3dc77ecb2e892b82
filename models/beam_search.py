"""Greedy and beam-search decoding for the encoder-decoder, with a beam size per request.

Each source runs its encoder once, and all its beams attend its one copy of the cross-attention
keys/values; every live hypothesis is a row of one KV cache, with one decoder call per step. Scoring
follows `transformers` generate(num_beams=n): top 2n candidates per request, a finished hypothesis
scores sum(logprob) / length**length_penalty (generated tokens, the end token included), and a
request stops once its best running beam cannot beat its n finished ones (early_stopping=False).
`BeamSearch` runs step by step over sources that join and leave between steps; `translate_ids` is
one such search over a fixed batch.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .cache.base import KeyValueCache
from .cache.cross import CrossCache, CrossSlots
from .cache.dense import KVCache
from .cache.paged import PagedKVCache, blocks_for, kernel_runs
from .execution.executors import Seq2SeqExecutor
from .execution.native import CrossRows
from .execution.planner import executor_for
from .inputs import PaddedBatch
from .kernels import native
from .seq2seq import Seq2Seq


@dataclass(frozen=True)
class BeamParams:
    beam_size: int = 4  # 1 = greedy
    max_new_tokens: int = 128
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        if self.beam_size < 1:
            raise ValueError(f"beam_size must be >= 1, got {self.beam_size}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass
class _Request:
    """Search state of one source sentence."""

    params: BeamParams
    rows: int  # live rows (beams) in the batch
    seqs: list[list[int]]  # generated tokens per running beam
    scores: list[float]  # running log-prob sums, one per running beam
    finished: list[tuple[float, list[int]]]  # (score, tokens incl. eos), best first, at most n
    done: bool = False
    result: list[int] | None = None
    key: Hashable = None  # the caller's name for it (BeamSearch)
    step: int = 0  # tokens generated so far (its own: sources join a running search at any step)
    slot: int = -1  # its cross keys/values' slot in BeamSearch._slots


def _step_request(req: _Request, top: tuple[list[float], list[int], list[int]], eos: int, step: int) -> list[int]:
    """Advance one request by one token. top: its 2n best (score, source beam, token) candidates, best
    first, as three lists (one candidate, the argmax, for greedy). Returns the source beam of each new
    running beam (n) and updates req in place (its new last tokens are req.seqs[i][-1])."""
    n = req.params.beam_size
    last_step = step + 1 >= req.params.max_new_tokens
    if n == 1:  # greedy
        tok = top[2][0]
        req.seqs[0].append(tok)
        if tok == eos or last_step:
            req.done, req.result = True, req.seqs[0]
        return [0]
    gen_len = step + 1
    running: list[tuple[float, int, int]] = []
    for rank, (score, beam, tok) in enumerate(zip(*top, strict=True)):
        hits_stop = tok == eos or last_step
        if hits_stop:
            if rank < n:  # only the top n candidates may finish (as transformers does)
                req.finished.append((score / gen_len**req.params.length_penalty, req.seqs[beam] + [tok]))
        elif len(running) < n:
            running.append((score, beam, tok))
    req.finished.sort(key=lambda f: -f[0])
    del req.finished[n:]
    if last_step or not running:
        req.done = True
    elif len(req.finished) == n:
        best_possible = running[0][0] / gen_len**req.params.length_penalty
        req.done = best_possible <= req.finished[-1][0]
    if req.done:
        req.result = req.finished[0][1] if req.finished else req.seqs[0]
        return []
    req.seqs = [req.seqs[beam] + [tok] for _, beam, tok in running]
    req.scores = [sc for sc, _, _ in running]
    return [beam for _, beam, _ in running]


def _select(live: Sequence[_Request], logits: Tensor, banned: list[int], eos: int, native_runs: bool,
            ) -> list[tuple[list[float], list[int], list[int]]]:
    """Every request's candidates (as _candidates) from the step's logits (R, V), rows in live's order:
    log-probs, the banned tokens at -inf, the rows of a request at its length limit forced to eos. One
    native call where `native_runs` (the plan's native decode step: float32 logits on a CPU whose
    kernels run; the same log-softmax, values and order), else torch ops."""
    forced = [req.step + 1 >= req.params.max_new_tokens for req in live]
    if native_runs:
        return native.module().search_select(logits, banned, eos, [req.rows for req in live],
                                             [req.params.beam_size for req in live], forced,
                                             [req.scores for req in live])
    logp = logits.float().log_softmax(-1)  # (R, V)
    if banned:
        logp.index_fill_(1, torch.tensor(banned, device=logp.device), float("-inf"))
    first = 0
    for req, force in zip(live, forced, strict=True):
        if force:  # only eos at the length limit
            logp[first: first + req.rows] = float("-inf")
            logp[first: first + req.rows, eos] = 0.0
        first += req.rows
    return _candidates(live, logp)


def _candidates(live: Sequence[_Request], logp: Tensor) -> list[tuple[list[float], list[int], list[int]]]:
    """Every request's best candidates from the step's log-probs logp (R, V), rows in live's order:
    the argmax of a greedy row; for a beam search of n, the top 2n of its rows' (running score +
    logp) over all (beam, token) pairs. One argmax for all greedy rows and one topk per group of
    requests with the same rows and beam size, not one per request."""
    vocab = logp.size(-1)
    out: list[tuple[list[float], list[int], list[int]]] = [([], [], [])] * len(live)
    groups: dict[tuple[int, int], list[tuple[int, int]]] = {}  # (rows, n) -> (request, first row)
    offset, greedy = 0, []
    for i, req in enumerate(live):
        if req.params.beam_size == 1:
            greedy.append((i, offset))
        else:
            groups.setdefault((req.rows, req.params.beam_size), []).append((i, offset))
        offset += req.rows
    if greedy:
        best = logp.argmax(-1).tolist()  # (R,)
        for i, row in greedy:
            out[i] = ([0.0], [0], [best[row]])
    for (rows, n), members in groups.items():
        index = [first + r for _, first in members for r in range(rows)]
        sub = logp if index == list(range(logp.size(0))) else logp[torch.tensor(index, device=logp.device)]  # (G*rows, V)
        scores = torch.tensor([live[i].scores for i, _ in members], device=logp.device)  # (G, rows)
        top_scores, top_idx = _top(sub, scores, 2 * n)  # (G, 2n) each
        for (i, _), sc, flat in zip(members, top_scores.tolist(), top_idx.tolist(), strict=True):
            out[i] = (sc, [f // vocab for f in flat], [f % vocab for f in flat])
    return out


def _top(logp: Tensor, scores: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The k best of (scores[g, r] + logp[g * rows + r, v]) over each group g's rows * V candidates,
    best first: values (G, k) and flat indices r * V + v (G, k). One pass of the native kernel on a
    CPU with float32 log-probs (equal values lowest index first), else torch's add and topk."""
    groups, rows = scores.shape
    if scores.dtype == torch.float32 and kernel_runs(logp.dtype, logp.device):
        return native.module().beam_top(logp.contiguous(), scores.contiguous(), k)
    total = (logp.view(groups, rows, -1) + scores[:, :, None]).view(groups, -1)  # (G, rows*V)
    return total.topk(k, dim=-1)  # (G, k) each


@dataclass(frozen=True)
class Translated:
    """What a step says about one source: its new greedy token (`token`, streamed; None for a beam
    search or an end token), or its end (`done`: `ids` without start/eos, None when cancelled or
    failed; `error`: why its decoder rows failed)."""

    key: Hashable
    token: int | None = None
    done: bool = False
    ids: list[int] | None = None
    error: BaseException | None = None


class BeamSearch:
    """Greedy and beam search as a sequence of steps over a set of sources that may change between
    steps (continuous batching for the encoder-decoder): `add` encodes new sources once (one padded
    encoder pass) and gives them fresh rows after the live ones; every `step` advances all rows of
    all sources by one token, in one decoder call; a source leaves as soon as its search ends or it is
    cancelled, and its rows go to the next sources added. Each source's beams are its own rows, so
    its result is the same whether it runs alone, among others, or joins later.

    Cross-attention keys/values are kept one slot per source (`_slots`, cache.cross.CrossSlots: a join
    writes its slot, a leave frees it, nothing else moves), never copied to the beams: each source's
    beams attend them together (cache.cross.CrossCache.grouped); the map from rows to slots is rebuilt
    only when the row layout changes (a source joins, widens from 1 row to its beams, or leaves). Rows
    are reserved for a source's full beam size when it is added."""

    def __init__(self, model: Seq2Seq | Seq2SeqExecutor, rows: int, max_new_tokens: int,
                 banned_ids: Sequence[int] = ()) -> None:
        """`model`: its executor (a bare model is planned with execution "auto")."""
        self.steps = executor_for(model)
        model = self.steps.model
        cfg = model.cfg
        weight = next(model.parameters())
        self.model, self.rows, self.max_new_tokens = model, rows, max_new_tokens
        self.device = weight.device
        self.eos, self.start = cfg.eos_token_id, cfg.decoder_start_token_id
        self.pad = cfg.pad_token_id if cfg.pad_token_id is not None else cfg.eos_token_id
        self.cache: KeyValueCache
        if kernel_runs(weight.dtype, self.device):  # each row attends its own keys; reorders share blocks
            blocks = rows * blocks_for(max_new_tokens + 1) + 1
            # blocks zeroed as rows take them: a search touches only the pages it uses
            self.cache = PagedKVCache.for_model(cfg, rows, blocks, max_new_tokens + 1, weight.dtype, self.device,
                                                zeroed=False)
        else:
            self.cache = KVCache.for_model(cfg, rows, max_new_tokens + 1, dtype=weight.dtype, device=self.device)
        self.banned = list(banned_ids)
        self._native = self.steps.native_select  # the step's selection in one native call
        self._live: list[_Request] = []  # sources with rows, in row order
        self._slots = CrossSlots(rows)  # each live source's cross keys/values at its own slot
        self._cross: CrossCache | None = None  # _slots grouped for the rows as they are; None: rebuild
        self._cross_rows: list[tuple[int, int]] = []  # (slot, rows) per live source when _cross was built
        self._rows: CrossRows | None = None  # the native step's cross-attention inputs for _cross
        self._tokens: list[int] = []  # every row's next input token

    def __len__(self) -> int:
        """Sources still searching."""
        return len(self._live)

    @property
    def free(self) -> int:
        """Rows not reserved by a live source (each reserves its beam size)."""
        return self.rows - sum(req.params.beam_size for req in self._live)

    @property
    def busy_rows(self) -> int:
        """Decoder rows the next step computes."""
        return len(self._tokens)

    def clear(self) -> None:
        """Drop every source (a failed step: their state cannot be trusted)."""
        self._live, self._slots, self._cross, self._rows, self._tokens = [], CrossSlots(self.rows), None, None, []

    @torch.inference_mode()
    def add(self, sources: Sequence[Sequence[int]], params: Sequence[BeamParams], keys: Sequence[Hashable]) -> None:
        """Encode `sources` (token ids ending with eos) in one padded pass; they decode from the next
        step on. ValueError when their beams do not fit the free rows or a limit exceeds the cache."""
        if not sources:
            return
        if sum(p.beam_size for p in params) > self.free:
            raise ValueError(f"{sum(p.beam_size for p in params)} beams do not fit {self.free} free rows")
        longest = max(p.max_new_tokens for p in params)
        if longest > self.max_new_tokens:
            raise ValueError(f"max_new_tokens {longest} is over this search's {self.max_new_tokens}")
        src = PaddedBatch.from_token_lists(sources, self.pad, self.device)  # (B, S)
        cross = self.steps.encode(src.ids, src.keep)  # (B, K, S, D) per layer
        n = len(self._tokens)
        self.cache.reset(n, n + len(sources))
        slots = self._slots.put(cross)
        self._live += [_Request(p, 1, [[]], [0.0], [], key=k, slot=slot)
                       for p, k, slot in zip(params, keys, slots, strict=True)]
        self._tokens += [self.start] * len(sources)
        self._cross = None

    def step(self, cancelled: Callable[[Hashable], bool] | None = None) -> list[Translated]:
        """One token for every row. `cancelled(key)`, asked once per step for each live source: True
        drops its rows from this step on (its result is None). Returns what happened to each source:
        its greedy token, or its end."""
        if torch.is_inference_mode_enabled():  # (translate_ids) already inside: no second entry
            return self._step(cancelled)
        with torch.inference_mode():
            return self._step(cancelled)

    def _step(self, cancelled: Callable[[Hashable], bool] | None) -> list[Translated]:
        if not self._live:
            return []
        out: list[Translated] = []
        gone = [i for i, req in enumerate(self._live) if cancelled(req.key)] if cancelled is not None else []
        if gone:
            out += self._drop(gone)
            if not self._live:
                return out
        n_rows = len(self._tokens)
        rows = [(req.slot, req.rows) for req in self._live]
        view = self.cache.view(0, n_rows)
        if self._cross is None or rows != self._cross_rows:  # a source joined, left or widened to its beams
            self._cross, self._cross_rows = self._grouped(), rows
            self._rows = self.steps.rows(self._cross)  # the steps' native cross-attention inputs
        tokens = torch.tensor(self._tokens, dtype=torch.long, device=self.device)[:, None]  # (R, 1)
        failed: dict[int, BaseException] = {}
        try:
            logits = self.steps.decode(tokens, self._cross, view, self._rows)[:, -1]  # (R, V)
        except Exception:
            if len(self._live) == 1:
                raise
            logits, failed = self._decode_alone(tokens)
        self.cache.advance(1, 0, n_rows)
        if failed:  # those sources leave with their errors; the others go on with their own rows' logits
            keep = [r for i, (req, first) in enumerate(self._offsets()) if i not in failed
                    for r in range(first, first + req.rows)]
            logits = logits[torch.tensor(keep, device=self.device)]  # (R', V)
            out += self._drop(list(failed), failed)
            if not self._live:
                return out
        tops = _select(self._live, logits, self.banned, self.eos, self._native)
        offsets = self._offsets()
        gather: list[int] = []
        new_tokens: list[int] = []
        still: list[int] = []
        for i, (req, first) in enumerate(offsets):
            src_beams = _step_request(req, tops[i], self.eos, req.step)
            req.step += 1
            if req.done:
                req.rows = 0
                out.append(Translated(req.key, done=True, ids=[t for t in req.result or [] if t != self.eos]))
                continue
            if req.params.beam_size == 1:
                out.append(Translated(req.key, token=req.seqs[0][-1]))
            gather += [first + b for b in src_beams]
            new_tokens += [seq[-1] for seq in req.seqs]
            still.append(i)
            req.rows = len(req.seqs)
        self._keep(still, gather, new_tokens)
        return out

    def _decode_alone(self, tokens: Tensor) -> tuple[Tensor, dict[int, BaseException]]:
        """The step's decoder call again, one source's rows at a time (the call over all rows failed):
        the rows' logits (R, V), zero for the sources whose own call fails too, and those sources
        (indices into _live) with their errors. A failed call wrote its rows' keys/values at the
        position the retry writes again, so the others' caches come out as a whole step leaves them."""
        parts: list[Tensor | None] = []
        failed: dict[int, BaseException] = {}
        for i, (req, first) in enumerate(self._offsets()):
            slots = torch.arange(req.rows, device=self.device)  # its rows' places in its own grid
            try:
                cross = self._slots.cache.select(torch.tensor([req.slot], device=self.device)).grouped(
                    slots, req.params.beam_size)
                parts.append(self.steps.decode(tokens[first: first + req.rows], cross,
                                               self.cache.view(first, first + req.rows))[:, -1])  # (n, V)
            except Exception as exc:
                failed[i] = exc
                parts.append(None)
        good = next((p for p in parts if p is not None), None)
        if good is None:  # every source failed alone: the search's state is not to be trusted
            raise next(iter(failed.values()))
        return torch.cat([p if p is not None else good.new_zeros(req.rows, good.size(-1))
                          for p, req in zip(parts, self._live, strict=True)]), failed  # (R, V)

    def _grouped(self) -> CrossCache:
        """The sources' cross keys/values for the rows as they are: row r is slot (its source's slot,
        its place among that source's rows) of a grid as wide as the widest beam."""
        width = max(req.params.beam_size for req in self._live)
        slots = [req.slot * width + r for req in self._live for r in range(req.rows)]
        return self._slots.cache.grouped(torch.tensor(slots, device=self.device), width)  # rows (R,)

    def _offsets(self) -> list[tuple[_Request, int]]:
        """Every live source with its first row."""
        out, offset = [], 0
        for req in self._live:
            out.append((req, offset))
            offset += req.rows
        return out

    def _drop(self, gone: list[int], errors: dict[int, BaseException] | None = None) -> list[Translated]:
        """Remove live sources `gone` (indices into _live): cancelled, or failed with `errors[i]`."""
        still, gather, tokens = [], [], []
        for i, (req, first) in enumerate(self._offsets()):
            if i not in gone:
                gather += range(first, first + req.rows)
                tokens += self._tokens[first: first + req.rows]
                still.append(i)
        dropped = [(i, self._live[i]) for i in gone]
        self._keep(still, gather, tokens)
        return [Translated(req.key, done=True, ids=None, error=(errors or {}).get(i)) for i, req in dropped]

    def _keep(self, still: list[int], gather: list[int], tokens: list[int]) -> None:
        """The new row layout: live sources `still` (indices into _live, in order), row i holding old
        row gather[i] (beams reordered) with next input tokens[i]."""
        if len(still) < len(self._live):
            kept = set(still)
            self._slots.release([req.slot for i, req in enumerate(self._live) if i not in kept])
            self._live = [self._live[i] for i in still]
            self._cross = None
        n_rows, self._tokens = len(self._tokens), tokens
        if gather != list(range(len(gather))):
            self.cache.reorder(gather)
        if len(gather) < n_rows:
            self.cache.reset(len(gather), n_rows)  # rows left behind (a paged cache frees their blocks)


@torch.inference_mode()
def translate_ids(
    model: Seq2Seq | Seq2SeqExecutor,
    sources: Sequence[Sequence[int]],
    params: BeamParams | Sequence[BeamParams],
    banned_ids: Sequence[int] = (),
    cancelled: Callable[[int], bool] | None = None,
) -> list[list[int] | None]:
    """Decode every source (token ids ending with eos). Returns generated ids without start/eos.

    `cancelled(i)`, asked once per step for each source still decoding: True drops source i's rows
    from the next step on (its caller went away or its deadline passed); its result is None. The
    others' results are the same as without it (each request's beams are its own). A source whose
    decoder rows fail even alone (BeamSearch.step retries a failed call source by source) fails the
    call with its error."""
    if isinstance(params, BeamParams):
        params = [params] * len(sources)
    search = BeamSearch(model, sum(p.beam_size for p in params), max(p.max_new_tokens for p in params), banned_ids)
    search.add(sources, params, keys=range(len(sources)))
    out: list[list[int] | None] = [None] * len(sources)
    while search:
        for event in search.step(cancelled):
            if event.error is not None:  # a source's decoder rows failed alone too: the call fails
                raise event.error
            if event.done:
                out[event.key] = event.ids
    return out
