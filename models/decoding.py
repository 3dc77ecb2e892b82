"""Decoding strategies on batches where every row has its own parameters: pure functions from logits
(B, V) to next tokens. No model calls: the generation loops (generate.py, beam_search.py, the
service's engine) own the model and the cache.

Greedy, or temperature / top-k / top-p sampling with a per-row seeded generator; a logit bias;
repetition (over prompt and output, as `transformers`), presence and frequency penalties (over the
output, as OpenAI and vLLM); stop conditions. Per row, in order: bias, repetition, presence and
frequency, then (sampling rows) temperature and the top-k / top-p filter. Log-probabilities are those
of the distribution the token was drawn from (greedy: after bias and penalties); a token the filter
removed has -inf, sent as LOGPROB_FLOOR (JSON has no infinity; vLLM does the same).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch
from torch import Tensor

NEG_INF = float("-inf")
LOGPROB_FLOOR = -9999.0  # a filtered-out token's log-probability, as sent (vLLM's value)
MAX_TOP_LOGPROBS = 20  # OpenAI's bound for top_logprobs


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding parameters. temperature 0 means greedy."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0  # 0 = no top-k filter
    top_p: float = 1.0  # 1.0 = no nucleus filter
    repetition_penalty: float = 1.0  # 1.0 = none; > 1 discourages tokens already in the sequence
    presence_penalty: float = 0.0  # OpenAI's: minus this for every token already in the output
    frequency_penalty: float = 0.0  # OpenAI's: minus this times the token's count in the output
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), OpenAI's -100 .. 100
    logprobs: int | None = None  # None: none; k >= 0: the chosen token's and the k best tokens' log-probs
    seed: int | None = None  # None = a fresh random seed per request
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings; the returned text ends before the first one
    ignore_eos: bool = False  # benchmarks: always produce max_new_tokens
    speculative: bool = True  # False: the request never drafts where the engine speculates (its tokens are the same)

    def __post_init__(self) -> None:
        problems = []
        if self.max_new_tokens < 1:
            problems.append(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            problems.append(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            problems.append(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            problems.append(f"top_p must be in (0, 1], got {self.top_p}")
        if self.repetition_penalty <= 0:
            problems.append(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                problems.append(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if any(not -100.0 <= bias <= 100.0 or token < 0 for token, bias in self.logit_bias):
            problems.append("logit_bias maps token ids >= 0 to values in [-100, 100]")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            problems.append(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class RowSampler:
    """The sampling state of one sequence: its params and its own random generator."""

    params: SamplingParams
    generator: torch.Generator = field(init=False)

    def __post_init__(self) -> None:
        seed = self.params.seed if self.params.seed is not None else random.SystemRandom().randrange(2**63)
        self.generator = torch.Generator().manual_seed(seed)


@dataclass
class BatchParams:
    """Row parameters as tensors, rebuilt only when the batch's rows change."""

    temperature: Tensor  # (B,) float; 0 = greedy
    top_k: Tensor  # (B,) long; 0 = off
    top_p: Tensor  # (B,) float
    repetition_penalty: Tensor  # (B,) float
    any_sampling: bool
    any_penalty: bool
    any_filter: bool
    presence: Tensor | None = None  # (B,) float; None: no row has one
    frequency: Tensor | None = None  # (B,) float; None: no row has one
    bias: tuple[Tensor, Tensor, Tensor] | None = None  # (rows, token ids, values) (N,) each; None: no bias
    top_logprobs: int | None = None  # the most any row asks for; None: no row wants log-probabilities

    @classmethod
    def build(cls, params: list[SamplingParams], device: torch.device | str = "cpu") -> BatchParams:
        temp = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
        # a top_k past any vocabulary filters nothing; capped so that it fits int64 (found by fuzzing)
        top_k = torch.tensor([min(p.top_k, 2**31 - 1) for p in params], dtype=torch.long, device=device)
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
        rep = torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32, device=device)

        def per_row(name: str) -> Tensor | None:
            values = [getattr(p, name) for p in params]
            return torch.tensor(values, dtype=torch.float32, device=device) if any(values) else None

        entries = [(row, token, value) for row, p in enumerate(params) for token, value in p.logit_bias]
        bias = None
        if entries:
            rows, tokens, values = zip(*entries, strict=True)
            bias = (torch.tensor(rows, device=device), torch.tensor(tokens, device=device),
                    torch.tensor(values, dtype=torch.float32, device=device))
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        return cls(temp, top_k, top_p, rep, bool((temp > 0).any()), bool((rep != 1.0).any()),
                   bool(((top_k > 0) | (top_p < 1.0)).any()), per_row("presence_penalty"),
                   per_row("frequency_penalty"), bias, max(wanted) if wanted else None)


def apply_repetition_penalty(logits: Tensor, seen: Tensor, penalty: Tensor) -> Tensor:
    """CTRL-style penalty on tokens already in the sequence (as `transformers` applies it).

    logits: (B, V) float; seen: (B, V) bool; penalty: (B,). Returns (B, V).
    """
    p = penalty[:, None]  # (B, 1)
    penalised = torch.where(logits > 0, logits / p, logits * p)  # (B, V)
    return torch.where(seen, penalised, logits)  # (B, V)


# a nucleus is looked for among each row's best this many tokens before sorting its whole vocabulary
# (SmolLM2 at temperature 0.8, top_p 0.95: 95 % of its steps' nuclei are inside 128 tokens)
NUCLEUS_CANDIDATES = 128


def filter_top_k_top_p(logits: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Mask (to -inf) tokens outside each row's top-k and nucleus. (B, V) -> (B, V).

    Among each row's best NUCLEUS_CANDIDATES tokens first (a selection, not a sort of V): a row whose
    top-k is inside them and whose nucleus reaches top_p inside them (a language model's usually does)
    can keep nothing past them; only the other rows sort their whole vocabulary. Both keep the
    smallest set of best tokens whose mass reaches top_p, row by row."""
    if logits.size(-1) <= NUCLEUS_CANDIDATES:
        return _filter_sorted(logits, top_k, top_p)
    out, wide = _filter_among_candidates(logits, top_k, top_p, NUCLEUS_CANDIDATES)  # (B, V), (B,)
    if bool(wide.any()):
        rows = wide.nonzero().squeeze(1)  # (W,)
        out[rows] = _filter_sorted(logits[rows], top_k[rows], top_p[rows])  # (W, V)
    return out


def _filter_sorted(logits: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """filter_top_k_top_p by a sort of each row's whole vocabulary."""
    vocab = logits.size(-1)
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # (B, V) each
    rank = torch.arange(vocab, device=logits.device)[None, :]  # (1, V)
    k = torch.where(top_k > 0, top_k, vocab)[:, None]  # (B, 1)
    drop = rank >= k  # (B, V) outside top-k
    probs = sorted_logits.masked_fill(drop, NEG_INF).softmax(-1)  # (B, V)
    before = probs.cumsum(-1) - probs  # (B, V): mass of strictly better tokens
    # the best token always stays; top_p = 1 filters nothing (float cumsums can reach 1 early)
    # (rank > 0: a top_p that rounds to 0 in float32, e.g. 5e-324, must not drop the best token too)
    drop = drop | ((before >= top_p[:, None]) & (top_p[:, None] < 1.0) & (rank > 0))  # (B, V)
    drop = torch.zeros_like(drop).scatter(-1, order, drop)  # (B, V) back to vocabulary order
    return logits.masked_fill(drop, NEG_INF)


def _filter_among_candidates(logits: Tensor, top_k: Tensor, top_p: Tensor, m: int) -> tuple[Tensor, Tensor]:
    """filter_top_k_top_p over each row's best m tokens, and the rows (B,) bool whose top-k or nucleus
    may reach past them (their rows of the result are not to be used). Rows with no filter (top_k 0,
    top_p 1) are left whole."""
    values, index = logits.topk(m, dim=-1)  # (B, m) each, best first
    rank = torch.arange(m, device=logits.device)[None, :]  # (1, m)
    drop = rank >= torch.where(top_k > 0, top_k.clamp(max=m), m)[:, None]  # (B, m) outside top-k
    # the distribution the nucleus is measured in: over the top-k (inside the candidates), else all of V
    norm = torch.where(top_k > 0, values.masked_fill(drop, NEG_INF).logsumexp(-1), logits.logsumexp(-1))  # (B,)
    probs = (values - norm[:, None]).exp().masked_fill(drop, 0.0)  # (B, m)
    nucleus = top_p < 1.0  # (B,)
    wide = (top_k > m) | (nucleus & (probs.sum(-1) < top_p))  # (B,)
    before = probs.cumsum(-1) - probs  # (B, m): mass of strictly better tokens
    drop = drop | ((before >= top_p[:, None]) & nucleus[:, None] & (rank > 0))  # (B, m)
    kept = torch.full_like(logits, NEG_INF).scatter(-1, index, values.masked_fill(drop, NEG_INF))  # (B, V)
    whole = (top_k == 0) & ~nucleus  # (B,) rows with no filter
    return torch.where(whole[:, None], logits, kept), wide  # (B, V), (B,)


def apply_output_penalties(logits: Tensor, counts: Tensor, presence: Tensor | None,
                           frequency: Tensor | None) -> Tensor:
    """OpenAI's penalties: logits - presence * (count > 0) - frequency * count, per row.

    logits: (B, V) float; counts: (B, V) how often each token is in the row's output; presence,
    frequency: (B,) or None. Returns (B, V).
    """
    if frequency is not None:
        logits = logits - frequency[:, None] * counts  # (B, V)
    if presence is not None:
        logits = logits - presence[:, None] * (counts > 0)  # (B, V)
    return logits


def apply_logit_bias(logits: Tensor, bias: tuple[Tensor, Tensor, Tensor]) -> Tensor:
    """Add each (row, token, value) of `bias` to logits (B, V); token ids past V are ignored."""
    rows, tokens, values = bias
    inside = tokens < logits.size(-1)  # (N,)
    out = logits.clone()
    out.index_put_((rows[inside], tokens[inside]), values[inside], accumulate=True)  # (B, V)
    return out


@dataclass(frozen=True)
class Choice:
    """The chosen token of each row and, when a row asked for them, log-probabilities."""

    tokens: Tensor  # (B,) long
    logprobs: Tensor | None = None  # (B,) float: the chosen tokens'; None: no row asked
    top_ids: Tensor | None = None  # (B, k) long: each row's k most likely tokens, best first
    top_logprobs: Tensor | None = None  # (B, k) float


def next_tokens(
    logits: Tensor,
    params: BatchParams,
    samplers: list[RowSampler],
    seen: Tensor | None = None,
    counts: Tensor | None = None,
) -> Tensor:
    """Choose one token per row. logits: (B, V) float32; seen: (B, V) bool (prompt and output);
    counts: (B, V) output token counts (presence / frequency penalties). Returns (B,) long."""
    return choose(logits, params, samplers, seen, counts).tokens


def inverse_cdf(probs: Tensor, uniforms: Tensor) -> Tensor:
    """One draw per row: probs (S, V) (rows need not sum to 1), uniforms (S,) in [0, 1) -> token ids
    (S,): the first token whose cumulative probability passes u * the row's total. A token of zero
    probability is never drawn. Row by row, so a row's draw does not depend on the others."""
    cdf = probs.cumsum(-1)  # (S, V)
    target = uniforms.to(cdf.dtype)[:, None] * cdf[:, -1:]  # (S, 1)
    return torch.searchsorted(cdf, target, right=True)[:, 0].clamp(max=probs.size(-1) - 1)  # (S,)


def choose(
    logits: Tensor,
    params: BatchParams,
    samplers: list[RowSampler],
    seen: Tensor | None = None,
    counts: Tensor | None = None,
    allowed: Tensor | None = None,
) -> Choice:
    """next_tokens, with the log-probabilities of the distribution each row drew from when any row
    wants them (params.top_logprobs). allowed: (B, V) bool, True = the row may choose the token
    (structured outputs); applied first, so no bias or penalty brings a forbidden token back."""
    if allowed is not None:
        logits = logits.masked_fill(~allowed, NEG_INF)  # (B, V)
    if params.bias is not None:
        logits = apply_logit_bias(logits, params.bias)
    if params.any_penalty and seen is not None:
        logits = apply_repetition_penalty(logits, seen, params.repetition_penalty)
    if counts is not None and (params.presence is not None or params.frequency is not None):
        logits = apply_output_penalties(logits, counts, params.presence, params.frequency)
    choice = logits.argmax(-1)  # (B,): greedy rows keep this
    final = logits  # (B, V): what each row draws from (greedy rows: the argmax of it)
    if params.any_sampling:
        temp = params.temperature.clamp(min=1e-5)[:, None]  # (B, 1)
        scaled = logits / temp  # (B, V)
        if params.any_filter:
            scaled = filter_top_k_top_p(scaled, params.top_k, params.top_p)
        probs = scaled.float().softmax(-1)  # (B, V)
        rows = [row for row, sampler in enumerate(samplers) if not sampler.params.greedy]
        # one uniform per sampled row from the row's own generator (on the host: the same draws alone
        # or batched), then each row's token on the logits' device: no per-row copy or synchronisation
        uniforms = torch.tensor([float(torch.rand((), generator=samplers[row].generator)) for row in rows])  # (S,)
        index = torch.tensor(rows)  # (S,)
        if probs.is_cuda:
            uniforms = uniforms.pin_memory().to(probs.device, non_blocking=True)
            index = index.pin_memory().to(probs.device, non_blocking=True)
        choice = choice.index_copy(0, index, inverse_cdf(probs.index_select(0, index), uniforms))  # (B,)
        greedy = (params.temperature == 0)[:, None]  # (B, 1)
        final = torch.where(greedy, logits, scaled)  # (B, V)
    if params.top_logprobs is None:
        return Choice(choice)
    logp = final.float().log_softmax(-1).clamp(min=LOGPROB_FLOOR)  # (B, V): -inf (filtered) -> the floor
    chosen = logp.gather(-1, choice[:, None])[:, 0]  # (B,)
    top = logp.topk(params.top_logprobs, dim=-1) if params.top_logprobs else None  # (B, k) each
    return Choice(choice, chosen, top.indices if top else None, top.values if top else None)


def find_stop(text: str, stops: tuple[str, ...], start: int = 0) -> int:
    """Index in `text` of the earliest stop string beginning at or after `start`, or -1."""
    hits = [i for i in (text.find(s, start) for s in stops if s) if i >= 0]
    return min(hits) if hits else -1


def stop_holdback(text: str, stops: tuple[str, ...]) -> int:
    """Characters at the end of `text` that may begin a stop string (not yet safe to stream)."""
    hold = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:n]):
                hold = max(hold, n)
                break
    return hold
