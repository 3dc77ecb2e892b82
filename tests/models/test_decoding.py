"""Decoding strategies (models/decoding.py) and offline generation (models/generate.py).

Dimension legend: B batch rows, V vocabulary. Sampling rows carry their own seeded generator,
so a row's tokens never depend on the rows it is batched with.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from models.config import DecoderConfig
from models.decoder import DecoderLM
from models.decoding import (
    LOGPROB_FLOOR,
    BatchParams,
    RowSampler,
    SamplingParams,
    apply_output_penalties,
    apply_repetition_penalty,
    choose,
    filter_top_k_top_p,
    find_stop,
    inverse_cdf,
    next_tokens,
    stop_holdback,
)
from models.generate import Generated, generate

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors: one thread is fastest


V = 50
NEG_INF = float("-inf")


def random_logits(b: int, spread: float = 3.0, seed: int = 0) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, V, generator=g) * spread  # (B, V)


def pick(logits: Tensor, params: list[SamplingParams], seen: Tensor | None = None) -> Tensor:
    return next_tokens(logits, BatchParams.build(params), [RowSampler(p) for p in params], seen)


# --- SamplingParams -------------------------------------------------------------------------------


@pytest.mark.parametrize(("fields", "message"), [
    (dict(max_new_tokens=0), "max_new_tokens must be >= 1, got 0"),
    (dict(temperature=-0.1), "temperature must be >= 0, got -0.1"),
    (dict(top_k=-1), "top_k must be >= 0, got -1"),
    (dict(top_p=0.0), "top_p must be in (0, 1], got 0.0"),
    (dict(top_p=1.5), "top_p must be in (0, 1], got 1.5"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be > 0, got 0.0"),
])
def test_sampling_params_validation_names_the_field(fields: dict, message: str) -> None:
    with pytest.raises(ValueError) as info:
        SamplingParams(**fields)
    assert message in str(info.value)


def test_sampling_params_reports_every_problem() -> None:
    with pytest.raises(ValueError, match="temperature must be >= 0.*; top_k must be >= 0"):
        SamplingParams(temperature=-1.0, top_k=-2)
    assert SamplingParams().greedy and not SamplingParams(temperature=0.5).greedy


# --- choosing tokens ------------------------------------------------------------------------------


def test_greedy_is_argmax() -> None:
    logits = random_logits(4)
    assert torch.equal(pick(logits, [SamplingParams()] * 4), logits.argmax(-1))


@pytest.mark.parametrize("filt", [dict(top_k=1), dict(top_p=1e-6), dict(top_k=3, top_p=1e-6)])
def test_filters_that_leave_one_token_equal_greedy(filt: dict) -> None:
    logits = random_logits(4, spread=0.5)  # flat: plain sampling would rarely pick the argmax
    for seed in range(5):
        params = [SamplingParams(temperature=1.5, seed=seed + 10 * row, **filt) for row in range(4)]
        assert torch.equal(pick(logits, params), logits.argmax(-1))


def test_top_k_keeps_exactly_k_per_row() -> None:
    logits = random_logits(3)
    top_k = torch.tensor([1, 5, 0])  # 0 = no filter
    out = filter_top_k_top_p(logits, top_k, torch.ones(3))
    assert (out > NEG_INF).sum(-1).tolist() == [1, 5, V]
    for row, k in enumerate((1, 5)):
        kept = set(torch.nonzero(out[row] > NEG_INF).flatten().tolist())
        assert kept == set(logits[row].topk(k).indices.tolist())
        assert torch.equal(out[row][out[row] > NEG_INF], logits[row][out[row] > NEG_INF])  # values untouched


def test_top_p_keeps_the_nucleus() -> None:
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])  # sorted: 0.5, 0.3, 0.15, 0.05
    logits = probs.log()[None, :].expand(4, 4)  # (B, 4)
    top_p = torch.tensor([0.4, 0.75, 0.85, 0.97])
    kept = filter_top_k_top_p(logits, torch.zeros(4, dtype=torch.long), top_p) > NEG_INF  # (B, 4)
    # the smallest set of best tokens whose mass reaches top_p
    assert kept.tolist() == [
        [False, True, False, False], [False, True, False, True], [False, True, True, True], [True] * 4,
    ]


def test_top_k_and_top_p_combine_per_row() -> None:
    """Row-wise parity with transformers' TopKLogitsWarper + TopPLogitsWarper, different params per row."""
    logits = random_logits(6, seed=3)
    settings = [(0, 0.9), (10, 1.0), (10, 0.5), (3, 0.99), (1, 1.0), (0, 0.3)]
    top_k = torch.tensor([k for k, _ in settings])
    top_p = torch.tensor([p for _, p in settings])
    out = filter_top_k_top_p(logits, top_k, top_p)
    for row, (k, p) in enumerate(settings):
        want = logits[row:row + 1]
        if k:
            want = TopKLogitsWarper(k)(None, want)
        if p < 1.0:
            want = TopPLogitsWarper(p)(None, want)
        assert torch.equal(out[row] > NEG_INF, want[0] > NEG_INF), (k, p)


def test_no_filter_row_is_left_alone_even_when_peaked() -> None:
    """top_k=0, top_p=1 changes nothing, however small the tail probabilities (a row batched with
    filtered rows must sample from the same distribution as alone)."""
    logits = random_logits(4, spread=20.0)  # float32 cumsums reach 1.0 well before the tail
    out = filter_top_k_top_p(logits, torch.zeros(4, dtype=torch.long), torch.ones(4))
    assert torch.equal(out, logits)


def test_repetition_penalty_matches_transformers() -> None:
    logits = random_logits(3, seed=4)
    history = torch.tensor([[3, 7, 7, 12], [0, 1, 2, 3], [40, 41, 5, 5]])  # (B, L) tokens so far
    seen = torch.zeros(3, V, dtype=torch.bool).scatter_(1, history, True)  # (B, V)
    penalty = torch.tensor([1.3, 0.7, 2.0])  # per row; < 1 encourages repeats
    got = apply_repetition_penalty(logits, seen, penalty)
    for row in range(3):
        proc = RepetitionPenaltyLogitsProcessor(float(penalty[row]))
        want = proc(history[row:row + 1], logits[row:row + 1].clone())
        torch.testing.assert_close(got[row], want[0], atol=0, rtol=0)
    assert torch.equal(got[~seen], logits[~seen])


def test_repetition_penalty_changes_the_greedy_choice() -> None:
    logits = torch.tensor([[2.0, 1.5, 0.0]])
    seen = torch.tensor([[True, False, False]])
    params = [SamplingParams(repetition_penalty=2.0)]
    assert pick(logits, params, seen).tolist() == [1]  # 2.0 / 2 < 1.5
    assert pick(logits, params, None).tolist() == [0]  # nothing seen, nothing penalised


def test_same_seed_same_samples_different_seed_different_samples() -> None:
    logits = random_logits(1, spread=0.5)

    def draws(seed: int) -> list[int]:
        params = [SamplingParams(temperature=1.0, seed=seed)]
        batch, samplers = BatchParams.build(params), [RowSampler(params[0])]
        return [int(next_tokens(logits, batch, samplers)[0]) for _ in range(30)]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)
    assert len(set(draws(7))) > 5  # really sampling, not argmax


# --- stop strings ---------------------------------------------------------------------------------


def test_find_stop() -> None:
    assert find_stop("abc STOP def END", ("END", "STOP")) == 4  # the earliest of several
    assert find_stop("abc STOP def END", ("END", "STOP"), start=5) == 13
    assert find_stop("abc", ("x", "")) == -1  # empty stop strings are ignored
    assert find_stop("abc", ()) == -1


def test_stop_holdback() -> None:
    assert stop_holdback("hello wor", ("world",)) == 3
    assert stop_holdback("hello w", ("xyz", "wo", "world")) == 1
    assert stop_holdback("hello ", ("world",)) == 0
    assert stop_holdback("ab", ("abcd",)) == 2  # the whole text may be a stop's beginning
    assert stop_holdback("x</s", ("</s>", "</stop>")) == 3


# --- generate() -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lm() -> DecoderLM:
    """A tiny LM with no eos, its weights spread so greedy output is varied."""
    torch.manual_seed(0)
    cfg = DecoderConfig(vocab_size=V, d_model=16, n_heads=4, n_kv_heads=2, d_ff=32, n_layers=2, max_positions=64,
                        position="rotary", norm="rmsnorm", activation="swiglu")
    model = DecoderLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.6)
    return model.eval()


PROMPTS = [[5, 9, 13], [7], [20, 21, 22, 23, 24, 25]]


def test_generate_greedy_batched_equals_alone(lm: DecoderLM) -> None:
    params = [SamplingParams(max_new_tokens=n) for n in (8, 12, 5)]
    batched = generate(lm, PROMPTS, params)
    for prompt, p, got in zip(PROMPTS, params, batched, strict=True):
        assert got == generate(lm, [prompt], p)[0]
        assert got.finish_reason == "length" and len(got.tokens) == p.max_new_tokens
    assert len(set(batched[1].tokens)) > 3  # non-trivial output


def test_generate_greedy_equals_argmax_of_full_recomputation(lm: DecoderLM) -> None:
    got = generate(lm, [PROMPTS[0]], SamplingParams(max_new_tokens=6))[0].tokens
    seq = list(PROMPTS[0])
    with torch.no_grad():
        for _ in range(6):
            seq.append(int(lm(torch.tensor([seq]))[0, -1].argmax()))
    assert got == seq[len(PROMPTS[0]):]


def test_seeded_sampled_row_alone_equals_batched(lm: DecoderLM) -> None:
    rows = [
        SamplingParams(max_new_tokens=10, temperature=0.9, seed=7),  # no filter
        SamplingParams(max_new_tokens=10),  # greedy
        SamplingParams(max_new_tokens=6, temperature=1.3, top_k=8, top_p=0.8, repetition_penalty=1.5, seed=3),
    ]
    batched = generate(lm, PROMPTS, rows)
    for prompt, p, got in zip(PROMPTS, rows, batched, strict=True):
        assert got == generate(lm, [prompt], p)[0]
    assert batched[0] == generate(lm, [PROMPTS[0]], rows[0])[0]  # and again: seeded = reproducible
    other_seed = SamplingParams(max_new_tokens=10, temperature=0.9, seed=8)
    assert generate(lm, [PROMPTS[0]], other_seed)[0].tokens != batched[0].tokens


def expected(free: list[int], stop: int) -> Generated:
    """What a row whose unstopped output is `free` gives with stop token `stop`."""
    return Generated(free[:free.index(stop)], "stop") if stop in free else Generated(free, "length")


def test_stop_token_ends_a_row_without_it(lm: DecoderLM) -> None:
    params = SamplingParams(max_new_tokens=12)
    free = [g.tokens for g in generate(lm, PROMPTS, params)]
    stop = free[1][4]
    assert stop in free[1] and stop not in free[2]  # one row stops, another runs to the limit
    got = generate(lm, PROMPTS, SamplingParams(max_new_tokens=12, stop_token_ids=(stop,)))
    assert got == [expected(row, stop) for row in free]
    assert got[1].finish_reason == "stop" and got[2].finish_reason == "length"
    ignored = generate(lm, PROMPTS, SamplingParams(max_new_tokens=12, stop_token_ids=(stop,), ignore_eos=True))
    assert ignored == [Generated(row, "length") for row in free]


def test_model_eos_stops_unless_ignored(lm: DecoderLM) -> None:
    free = generate(lm, [PROMPTS[2]], SamplingParams(max_new_tokens=12))[0].tokens
    eos = free[3]
    with_eos = DecoderLM(lm.cfg.replace(eos_token_ids=(eos,))).eval()
    with_eos.load_state_dict(lm.state_dict())
    got = generate(with_eos, [PROMPTS[2]], SamplingParams(max_new_tokens=12))[0]
    assert got == Generated(free[:free.index(eos)], "stop")
    ignored = generate(with_eos, [PROMPTS[2]], SamplingParams(max_new_tokens=12, ignore_eos=True))[0]
    assert ignored == Generated(free, "length")


def test_stop_string_ends_a_row(lm: DecoderLM) -> None:
    def decode(tokens: list[int]) -> str:
        return "".join(f"<{t}>" for t in tokens)

    free = generate(lm, [PROMPTS[0]], SamplingParams(max_new_tokens=12))[0].tokens
    stop = f"<{free[2]}><{free[3]}>"  # a stop string spanning two tokens
    end = decode(free).index(stop)
    got = generate(lm, [PROMPTS[0]], SamplingParams(max_new_tokens=12, stop=(stop,)), decode=decode)[0]
    assert got.finish_reason == "stop"
    text = decode(got.tokens)
    assert find_stop(text, (stop,)) == end and text.endswith(stop)  # stops on the token completing it
    no_decoder = generate(lm, [PROMPTS[0]], SamplingParams(max_new_tokens=12, stop=(stop,)))[0]
    assert no_decoder == Generated(free, "length")


def test_generate_rejects_bad_requests(lm: DecoderLM) -> None:
    with pytest.raises(ValueError, match="2 prompts but 1 parameter sets"):
        generate(lm, PROMPTS[:2], [SamplingParams()])
    with pytest.raises(ValueError, match="every prompt needs at least one token"):
        generate(lm, [[1], []], SamplingParams())
    with pytest.raises(ValueError, match="exceeds the model's 64"):
        generate(lm, [list(range(10))], SamplingParams(max_new_tokens=60))


# --- OpenAI's penalties, logit bias, log-probabilities ----------------------------------------------

def _rows(*params: SamplingParams) -> tuple[BatchParams, list[RowSampler]]:
    return BatchParams.build(list(params)), [RowSampler(p) for p in params]


def test_presence_and_frequency_penalties_follow_openais_formula() -> None:
    logits = torch.randn(2, 6, generator=torch.Generator().manual_seed(0))  # (B, V)
    counts = torch.tensor([[0, 3, 1, 0, 0, 0], [2, 0, 0, 0, 0, 1]])  # (B, V) output counts
    got = apply_output_penalties(logits, counts, torch.tensor([0.5, 0.0]), torch.tensor([0.25, -1.0]))
    want = logits - torch.tensor([[0.25], [-1.0]]) * counts - torch.tensor([[0.5], [0.0]]) * (counts > 0)
    torch.testing.assert_close(got, want)


def test_logit_bias_applies_to_its_own_row_only() -> None:
    logits = torch.zeros(2, 5)  # (B, V)
    params, samplers = _rows(SamplingParams(logit_bias=((3, 100.0),)), SamplingParams(logit_bias=((1, -100.0),)))
    choice = choose(logits, params, samplers)
    assert choice.tokens.tolist()[0] == 3 and choice.tokens.tolist()[1] != 1


def test_logprobs_are_those_of_the_distribution_drawn_from() -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 50, generator=g)  # (B, V)
    params, samplers = _rows(SamplingParams(logprobs=2), SamplingParams(temperature=0.5, seed=3, logprobs=0),
                             SamplingParams(temperature=1.0, top_k=4, seed=4, logprobs=5))
    choice = choose(logits, params, samplers)
    assert choice.logprobs is not None and choice.top_ids is not None and choice.top_logprobs is not None
    greedy, hot, filtered = logits[0].log_softmax(-1), (logits[1] / 0.5).log_softmax(-1), logits[2]
    keep = filtered.topk(4).indices
    filtered = torch.full_like(filtered, float("-inf")).scatter(0, keep, filtered[keep]).log_softmax(-1)
    for row, ref in enumerate((greedy, hot, filtered)):
        token = int(choice.tokens[row])
        assert float(choice.logprobs[row]) == pytest.approx(float(ref[token]), abs=1e-5)
    assert choice.top_ids[0, :2].tolist() == greedy.topk(2).indices.tolist()
    assert choice.top_logprobs[2, 4] == LOGPROB_FLOOR  # only 4 tokens survive top_k=4: the 5th is "-inf"
    # asking for log-probabilities never changes the tokens
    plain = choose(logits, *_rows(SamplingParams(), SamplingParams(temperature=0.5, seed=3),
                                  SamplingParams(temperature=1.0, top_k=4, seed=4)))
    assert plain.tokens.tolist() == choice.tokens.tolist() and plain.logprobs is None


@pytest.mark.parametrize("bad", [dict(presence_penalty=2.5), dict(frequency_penalty=-3.0),
                                 dict(logit_bias=((1, 101.0),)), dict(logit_bias=((-1, 1.0),)), dict(logprobs=21)])
def test_out_of_range_openai_parameters_are_refused(bad: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(**bad)


def test_inverse_cdf_draws_each_token_at_its_probability_and_never_a_filtered_one() -> None:
    """20,000 draws of one row (unnormalised, two tokens filtered to 0): frequencies within 0.01 of the
    probabilities; the same row among others draws the same tokens; u = 0 takes the first possible token."""
    probs = torch.tensor([0.0, 2.0, 1.0, 0.0, 4.0, 1.0])  # (V,) sums to 8
    u = torch.rand(20_000, generator=torch.Generator().manual_seed(0))  # (N,)
    alone = inverse_cdf(probs.expand(u.numel(), -1), u)  # (N,)
    freq = torch.bincount(alone, minlength=6).float() / u.numel()
    assert freq[0] == 0 and freq[3] == 0
    assert torch.allclose(freq, probs / probs.sum(), atol=0.01), freq
    others = torch.rand(u.numel(), 6, generator=torch.Generator().manual_seed(1))  # (N, V)
    batch = torch.stack([others, probs.expand_as(others)], 1).reshape(-1, 6)  # rows interleaved
    assert torch.equal(inverse_cdf(batch, u.repeat_interleave(2))[1::2], alone)
    assert inverse_cdf(probs[None], torch.zeros(1)).tolist() == [1]
    assert inverse_cdf(probs[None], torch.tensor([1 - 1e-7])).tolist() == [5]


def test_a_nucleus_among_the_best_candidates_keeps_what_the_full_sort_keeps(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows of a 2,000-token vocabulary with top-k and top-p mixed per row, most peaked as a language
    model's and a few flat: the filter keeps exactly the tokens and values the sort of every row's
    whole vocabulary keeps; the peaked rows never reach the sort (their nuclei are inside the best
    128), the flat ones do (a nucleus of ~1,800 tokens), row by row."""
    from models import decoding

    g = torch.Generator().manual_seed(0)
    spread = torch.cat([torch.linspace(4.0, 9.0, 44), torch.full((4,), 0.1)])  # (B,) peaked .. flat
    logits = torch.randn(48, 2000, generator=g) * spread[:, None]  # (B, V)
    top_k = torch.tensor([0, 5, 40, 0] * 12)
    top_p = torch.tensor([0.9, 1.0, 0.5, 0.95, 0.3, 0.99] * 8)
    _, wide = decoding._filter_among_candidates(logits, top_k, top_p, 128)
    flat = (top_k[44:] == 0) & (top_p[44:] < 1)
    assert not wide[:44].any() and torch.equal(wide[44:], flat) and flat.any()
    sorted_rows = []
    real = decoding._filter_sorted
    monkeypatch.setattr(decoding, "_filter_sorted", lambda x, k, p: sorted_rows.append(x.size(0)) or real(x, k, p))
    fast = decoding.filter_top_k_top_p(logits, top_k, top_p)  # (B, V)
    assert sorted_rows == [int(flat.sum())]
    assert torch.equal(fast, real(logits, top_k, top_p))
    assert 1 < int((fast[0] > NEG_INF).sum()) < 128 and int((fast[44] > NEG_INF).sum()) > 500
