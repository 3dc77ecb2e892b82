"""Greedy and beam-search decoding for the encoder-decoder, with a beam size per request.

Each source runs its encoder once; its cross-attention keys/values are copied to its beams.
The rows of all live hypotheses share one KV cache and one decoder call per step; finished
requests leave the batch at once. Beam scoring follows `transformers` generate(num_beams=n):
top 2n candidates per request, a finished hypothesis scores sum(logprob) / length**length_penalty
(length counts generated tokens including the end token), and a request stops once its n finished
hypotheses cannot be beaten by its best running beam (early_stopping=False heuristic).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .inputs import PaddedBatch
from .kv_cache import KVCache
from .seq2seq import Seq2Seq

NEG = -1.0e9


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
    scores: Tensor  # (n,) running log-prob sums
    finished: list[tuple[float, list[int]]]  # (score, tokens incl. eos), best first, at most n
    done: bool = False
    result: list[int] | None = None
    cancelled: bool = False


def _step_request(req: _Request, logp: Tensor, eos: int, step: int) -> Tensor:
    """Advance one request by one token. logp: (rows, V) log-probs. Returns the source beam of each
    new running beam (n,) and updates req in place (its new last tokens are req.seqs[i][-1])."""
    n, vocab = req.params.beam_size, logp.size(-1)
    last_step = step + 1 >= req.params.max_new_tokens
    if n == 1:  # greedy
        tok = int(logp[0].argmax())
        req.seqs[0].append(tok)
        if tok == eos or last_step:
            req.done, req.result = True, req.seqs[0]
        return torch.zeros(1, dtype=torch.long)
    total = (logp + req.scores[:, None]).view(-1)  # (rows * V,)
    top_scores, top_idx = total.topk(2 * n)  # (2n,)
    src_beam, tokens = top_idx // vocab, top_idx % vocab  # (2n,) each
    gen_len = step + 1
    running: list[tuple[float, int, int]] = []
    for rank, (score, beam, tok) in enumerate(zip(top_scores.tolist(), src_beam.tolist(), tokens.tolist(),
                                                  strict=True)):
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
        return torch.zeros(0, dtype=torch.long)
    req.seqs = [req.seqs[beam] + [tok] for _, beam, tok in running]
    req.scores = torch.tensor([s for s, _, _ in running])
    return torch.tensor([beam for _, beam, _ in running], dtype=torch.long)


@torch.inference_mode()
def translate_ids(
    model: Seq2Seq,
    sources: Sequence[Sequence[int]],
    params: BeamParams | Sequence[BeamParams],
    banned_ids: Sequence[int] = (),
    cancelled: Callable[[int], bool] | None = None,
) -> list[list[int] | None]:
    """Decode every source (token ids ending with eos). Returns generated ids without start/eos.

    `cancelled(i)`, asked once per step for each source still decoding: True drops source i's rows
    from the next step on (its caller went away or its deadline passed); its result is None. The
    others' results are the same as without it (each request's beams are its own)."""
    if isinstance(params, BeamParams):
        params = [params] * len(sources)
    cfg = model.cfg
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    eos, start = cfg.eos_token_id, cfg.decoder_start_token_id
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else eos
    src = PaddedBatch.from_token_lists(sources, pad, device)  # (B, S)
    cross = model.cross_cache(model.encode(src.ids, src.keep), src.keep)  # (B, K, S, D) per layer
    requests = [_Request(p, 1, [[]], torch.zeros(1), []) for p in params]
    cross = cross.select(torch.arange(len(sources), device=device))
    max_new = max(p.max_new_tokens for p in params)
    rows_max = sum(p.beam_size for p in params)
    cache = KVCache.for_model(cfg, rows_max, max_new + 1, dtype=dtype, device=device)
    tokens = torch.full((len(sources), 1), start, dtype=torch.long, device=device)  # (R, 1)
    banned = torch.as_tensor(list(banned_ids), dtype=torch.long, device=device)
    live = list(range(len(requests)))  # requests with rows in the batch, in row order
    step = 0
    while live:
        n_rows = tokens.size(0)
        logits = model.decode(tokens, cross, cache=cache.view(0, n_rows))[:, -1].float()  # (R, V)
        cache.advance(1, 0, n_rows)
        logp = logits.log_softmax(-1)  # (R, V)
        if banned.numel():
            logp[:, banned] = float("-inf")
        gather: list[Tensor] = []
        new_tokens: list[int] = []
        still: list[int] = []
        offset = 0
        for r in live:
            req = requests[r]
            if cancelled is not None and cancelled(r):
                req.done, req.result, req.cancelled = True, None, True
                offset += req.rows
                req.rows = 0
                continue
            logp_r = logp[offset: offset + req.rows]  # (rows, V)
            if step + 1 >= req.params.max_new_tokens:  # force eos at the length limit
                logp_r = torch.full_like(logp_r, float("-inf"))
                logp_r[:, eos] = 0.0
            src_beams = _step_request(req, logp_r, eos, step)
            if not req.done:
                gather.append(src_beams + offset)
                new_tokens.extend(seq[-1] for seq in req.seqs)
                still.append(r)
            offset += req.rows
            req.rows = len(req.seqs) if not req.done else 0
        live = still
        step += 1
        if not live:
            break
        index = torch.cat(gather).to(device)  # (R',): source row of every new row
        cache.reorder(index)
        cross = cross.select(index)
        tokens = torch.tensor(new_tokens, dtype=torch.long, device=device)[:, None]  # (R', 1)
    out: list[list[int] | None] = []
    for req in requests:
        result = req.result or []
        out.append(None if req.cancelled else [t for t in result if t != eos])
    return out
