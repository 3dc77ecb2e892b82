"""Speculative decoding in the engine (service/engine/speculation/, engine/verify.py): the same tokens as
decoding without drafts (greedy, penalties, seeded sampling), alone and among others, with prefix hits,
chunked prefill and preemption; sampling keeps the model's distribution (a chi-square test a wrong
acceptance rule fails); rejected drafts leave the cache as a run that never drafted; the adaptive rule
stops drafting where it does not pay, and without it every step drafts; a request may opt out.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from torch import nn

from models.decoder import DecoderLM
from models.decoding import SamplingParams
from models.execution.planner import Runtime, plan_model
from models.text import TextTokenizer
from models.tiny import tiny_model
from service.engine.config import SpeculativeConfig
from service.engine.core import GenerationEngine
from service.engine.speculation.ngram import PromptLookup
from service.engine.speculation.policy import Candidate, StepTimes, choose_drafts
from service.engine.verify import kept_tokens

from .test_engine import make, read, run_until_idle
from .test_paged_engine import mib_for_blocks

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NGRAM = SpeculativeConfig(method="ngram", max_draft_tokens=6)
# a GPT-2-like block: post-norm LayerNorm with biases, learned positions, a plain GELU MLP
POST_NORM = {"prenorm": False, "norm": "layernorm", "position": "learned", "activation": "gelu",
             "attn_bias": True, "mlp_bias": True}


def native_model() -> DecoderLM:
    """SmolLM2's shape in small as the shipped generator holds it (q4_1 blocks): decode steps on the
    native step, where an entry's bits do not depend on the entries beside it."""
    from tests.models.execution.test_native import fast_model

    return fast_model("q4_1")


@pytest.fixture(scope="module", params=["llama", "gpt2", "native"])
def family(request: pytest.FixtureRequest) -> tuple[nn.Module, TextTokenizer]:
    model, tok = tiny_model("decoder")
    if request.param == "gpt2":
        torch.manual_seed(0)
        model = DecoderLM(model.cfg.replace(**POST_NORM)).eval()
    elif request.param == "native":
        model = native_model()
    return model, tok


def prompts_of(tok: TextTokenizer, n: int) -> list[list[int]]:
    """Prompts that repeat themselves (prompt lookup finds its n-grams) and ones that do not."""
    return [tok.encode(f"item {i}: " + "the cat sat on the mat, " * (i % 3), add_special_tokens=False)
            for i in range(n)]


PARAMS = [SamplingParams(max_new_tokens=40, ignore_eos=True),
          SamplingParams(max_new_tokens=33, ignore_eos=True, repetition_penalty=1.3, frequency_penalty=0.4),
          SamplingParams(max_new_tokens=40, ignore_eos=True, temperature=0.9, seed=7, top_k=20),
          SamplingParams(max_new_tokens=25, ignore_eos=True, temperature=1.2, seed=3, top_p=0.8, presence_penalty=0.5),
          SamplingParams(max_new_tokens=40, ignore_eos=True, logprobs=2)]


def run(model: nn.Module, tok: TextTokenizer, prompts: list[list[int]], params: list[SamplingParams],
        draft: nn.Module | None = None, **config: object) -> tuple[list, list]:
    """Every request at once; their Finished events and the stats of every step."""
    engine = make(model, tok, **config) if draft is None else make(
        model, tok, draft=plan_model(draft, "auto", Runtime(paged=True, graphs=False)), **config)
    handles = [engine.submit(p, q) for p, q in zip(prompts, params, strict=True)]
    history = run_until_idle(engine)
    held = len(engine._batch.prefix) if engine._batch.prefix is not None else 0
    assert engine.cache.blocks_free + held == engine.cache.blocks_total  # no block leaked by drafts
    return [read(h)[1] for h in handles], history


def same(a: list, b: list) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids and x.text == y.text and x.finish_reason == y.finish_reason
        assert (x.logprobs is None) == (y.logprobs is None)
        if x.logprobs is not None:
            assert [(e.token, [t for t, _ in e.top]) for e in x.logprobs] == [(e.token, [t for t, _ in e.top])
                                                                              for e in y.logprobs]
            values = [v for e in x.logprobs for v in (e.logprob, *(v for _, v in e.top))]
            assert values == pytest.approx([v for e in y.logprobs for v in (e.logprob, *(v for _, v in e.top))], abs=1e-4)


def test_prompt_lookup_gives_the_tokens_of_plain_decoding(family: tuple[nn.Module, TextTokenizer]) -> None:
    """Greedy, penalised, seeded sampled and log-probability rows among each other: the tokens (and
    text, log-probabilities) of decoding without drafts; drafts were verified and most kept."""
    model, tok = family
    prompts, params = prompts_of(tok, 10), (PARAMS * 2)[:10]
    plain, _ = run(model, tok, prompts, params)
    spec, history = run(model, tok, prompts, params, speculative=NGRAM)
    same(spec, plain)
    last = history[-1]
    assert last.spec_steps > 0 and last.spec_accepted > 0 and last.spec_drafted >= last.spec_accepted
    assert last.generated_tokens == sum(len(f.token_ids) for f in plain)


def test_alone_equals_among_others() -> None:
    model, tok = native_model(), tiny_model("decoder")[1]
    prompts = prompts_of(tok, 6)
    params = (PARAMS * 2)[:6]
    together, _ = run(model, tok, prompts, params, speculative=NGRAM)
    for i in range(6):
        alone, _ = run(model, tok, [prompts[i]], [params[i]], speculative=NGRAM)
        same(alone, [together[i]])


@pytest.mark.parametrize("lookup", [False, True])
def test_a_draft_model_gives_the_tokens_of_plain_decoding(lookup: bool) -> None:
    """A draft of other weights (a second random model: its drafts are mostly rejected; one of the
    model's architecture, whose keys share the model's cache, and a wider one with a cache of its
    own) and of the same weights (all kept): the target's tokens either way."""
    model, tok = tiny_model("decoder")
    prompts, params = prompts_of(tok, 5), PARAMS
    plain, _ = run(model, tok, prompts, params)
    draft = SpeculativeConfig(method="draft", max_draft_tokens=4, draft={"source": "tiny"}, draft_lookup=lookup)
    drafters = {"shared": tiny_model("decoder", seed=1)[0], "own": tiny_model("decoder-wide", seed=1)[0]}
    for cache, drafter in (*drafters.items(), ("shared", model)):
        spec, history = run(model, tok, prompts, params, draft=drafter, speculative=draft)
        same(spec, plain)
        assert history[-1].spec_steps > 0 and history[-1].spec_draft_steps > 0
        assert make(model, tok, draft=plan_model(drafter, "auto", Runtime(paged=True, graphs=False)),
                    speculative=draft).speculator.describe()["draft_cache"] == cache
    greedy = [SamplingParams(max_new_tokens=30, ignore_eos=True)] * 3
    _, history = run(model, tok, prompts[:3], greedy, draft=model, speculative=draft)
    assert 0 < history[-1].spec_accepted == history[-1].spec_drafted  # the same weights, greedy: every draft kept


def test_without_the_adaptive_rule_every_step_drafts_the_most() -> None:
    """`adaptive: false`: a draft as dear as the model itself (the same weights) still drafts
    max_draft_tokens every step, fewer only where max_new_tokens leaves fewer, and all are kept."""
    model, tok = tiny_model("decoder")
    fixed = SpeculativeConfig(method="draft", max_draft_tokens=4, draft={"source": "tiny"}, adaptive=False)
    plain, _ = run(model, tok, prompts_of(tok, 1), [SamplingParams(max_new_tokens=30, ignore_eos=True)])
    spec, history = run(model, tok, prompts_of(tok, 1), [SamplingParams(max_new_tokens=30, ignore_eos=True)],
                        draft=model, speculative=fixed)
    same(spec, plain)
    # the prefill's token, then 5 verify steps of 4 drafts + 1 and a last one of 3 + 1
    assert (history[-1].spec_steps, history[-1].spec_drafted, history[-1].spec_accepted) == (6, 23, 23)


def test_a_draft_that_looks_up_its_own_steps_drafts_the_same_tokens_in_fewer_steps() -> None:
    """`draft_lookup` on the native step (an entry's bits do not depend on the entries beside it): the
    draft's tokens are the ones it drafts one step at a time (the same weights, greedy: every draft kept
    either way, the same counts), in fewer of its steps on prompts that repeat themselves."""
    model, tok = native_model(), tiny_model("decoder")[1]
    prompts = [tok.encode("the cat sat on the mat, " * 2, add_special_tokens=False),
               tok.encode("one two three four " * 2, add_special_tokens=False)]
    greedy = [SamplingParams(max_new_tokens=60, ignore_eos=True)] * 2
    plain, _ = run(model, tok, prompts, greedy)
    counts = {}
    for lookup in (False, True):
        config = SpeculativeConfig(method="draft", max_draft_tokens=6, draft={"source": "tiny"}, adaptive=False,
                                   draft_lookup=lookup)
        spec, history = run(model, tok, prompts, greedy, draft=model, speculative=config)
        same(spec, plain)
        last = history[-1]
        counts[lookup] = (last.spec_steps, last.spec_drafted, last.spec_accepted), last.spec_draft_steps
    assert counts[True][0] == counts[False][0] and counts[True][0][1] == counts[True][0][2] > 0
    assert 0 < counts[True][1] < 0.75 * counts[False][1]  # the text repeats (here 27 steps against 50)


@pytest.mark.parametrize("drafter", ["ngram", "draft", "wide draft"])
@pytest.mark.parametrize("prefix_mib", [0.0, 1.0])
def test_preemption_chunked_prefill_and_prefix_hits_keep_the_tokens(prefix_mib: float, drafter: str) -> None:
    """A pool too small for every request (preemption and recomputation), prompts longer than a chunk,
    and prompts sharing their beginning (prefix hits): the tokens of the same run without drafts, by
    prompt lookup and by a draft model (one writing the model's cache, and one with a cache of its own)."""
    model, tok = tiny_model("decoder")
    shared = "the cat sat on the mat, " * 2
    prompts = [tok.encode(shared + f"request {i} " + "and so on, " * (i % 3), add_special_tokens=False) for i in range(4)]
    params = [SamplingParams(max_new_tokens=40, ignore_eos=True),
              SamplingParams(max_new_tokens=40, ignore_eos=True, temperature=0.9, seed=7, top_k=20),
              SamplingParams(max_new_tokens=40, ignore_eos=True, repetition_penalty=1.5),
              SamplingParams(max_new_tokens=40, ignore_eos=True, temperature=1.1, seed=3, frequency_penalty=0.7)]
    config = dict(max_running=4, kv_cache_mib=mib_for_blocks(model, 12), prefix_cache_mib=prefix_mib, prefill_chunk=40)
    plain, plain_history = run(model, tok, prompts, params, **config)
    if drafter == "ngram":
        spec, history = run(model, tok, prompts, params, **config,  # fixed k: no step timing decides the steps
                            speculative=SpeculativeConfig(method="ngram", max_draft_tokens=6, adaptive=False))
    else:
        draft = tiny_model("decoder" if drafter == "draft" else "decoder-wide")[0]  # seed 0: "draft" is the model
        spec, history = run(model, tok, prompts, params, draft=draft, **config,
                            speculative=SpeculativeConfig(method="draft", max_draft_tokens=4, draft={"source": "tiny"},
                                                          adaptive=False))
    same(spec, plain)
    last = history[-1]
    assert last.preempted > 0 and last.spec_steps > 10
    assert last.spec_accepted > 0 or drafter == "wide draft"  # another random model's drafts: mostly rejected
    if prefix_mib:
        assert history[-1].cached_prompt_tokens > 0


def row_keys(engine: GenerationEngine, row: int) -> torch.Tensor:
    """Row `row`'s keys and values in every layer, position by position, up to its length: (2L, K, N, D)."""
    c = engine.cache
    n = c.host_lengths[row]
    slots = torch.tensor([c.key_slots(row, p) for p in range(n)]).T  # (K, N)
    return torch.stack([buf[slots] for buf in c._flat_k + c._flat_v])


def test_rejected_drafts_leave_the_cache_as_a_run_that_never_drafted() -> None:
    """After drafts were rejected, every key and value up to the row's length is the plain run's (the
    native step: the same bits)."""
    model, tok = native_model(), tiny_model("decoder")[1]
    prompt = prompts_of(tok, 3)[2]
    params = SamplingParams(max_new_tokens=70, ignore_eos=True, temperature=1.0, seed=11)
    eager = SpeculativeConfig(method="ngram", max_draft_tokens=4, ngram_min=1)  # proposes at almost every step
    engines = [make(model, tok), make(model, tok, speculative=eager)]
    for e in engines:
        e.submit(prompt, params)
    spec = engines[1]
    for _ in range(100):
        if spec.stats().spec_drafted > spec.stats().spec_accepted and spec.cache.host_lengths[0] >= 90:
            break
        spec.step()
    assert spec.stats().spec_drafted > spec.stats().spec_accepted  # some drafts were rejected
    while engines[0].cache.host_lengths[0] < spec.cache.host_lengths[0]:
        engines[0].step()
    n = spec.cache.host_lengths[0]
    assert torch.equal(row_keys(spec, 0), row_keys(engines[0], 0)[:, :, :n])


def chi_square(counts: Counter, probs: dict[int, float], n: int) -> float:
    return sum((counts.get(t, 0) - n * p) ** 2 / (n * p) for t, p in probs.items())


def test_sampling_with_drafts_keeps_the_models_distribution() -> None:
    """Rows with one context and many seeds, each verifying the same draft d: the first token's
    frequencies match the model's distribution p (chi-square, 7 degrees of freedom, p = 0.001 bound),
    and d is kept as often as p(d). A rule that kept d with probability p(d) and otherwise drew from p
    (d not removed) would put p(d) (2 - p(d)) on d: the test's sample is large enough to fail it."""
    model, tok = tiny_model("decoder")
    prompt = prompts_of(tok, 1)[0]
    params = [SamplingParams(max_new_tokens=8, temperature=1.0, top_k=8, seed=s, ignore_eos=True) for s in range(1200)]
    engine = make(model, tok, max_running=1200, kv_cache_mib=64, max_total_tokens=64, prefill_tokens=50_000,
                  max_queued=2000, speculative=NGRAM)
    for p in params:
        engine.submit(prompt, p)
    with torch.inference_mode():
        engine._admit()
    batch = engine._batch
    pending = 65  # every row's next input: one context for all
    for seq in batch.rows:
        seq.pending = pending
    with torch.inference_mode():
        ids = torch.tensor([prompt + [pending]])
        logits = model(ids)[0, -1].float()  # (V,)
    top = logits.topk(8)
    probs = dict(zip(top.indices.tolist(), top.values.softmax(-1).tolist(), strict=True))
    d = top.indices[1].item()  # a likely token, not the likeliest
    with torch.inference_mode():
        results, kept = batch.verify({r: [d] for r in range(len(batch.rows))})
    firsts: Counter = Counter()
    row_seen = set()
    for row, (token, _) in results:
        if row not in row_seen:
            firsts[token] += 1
            row_seen.add(row)
    n = len(batch.rows)
    bound = 24.32  # chi-square, 7 degrees of freedom, p = 0.001
    assert chi_square(firsts, probs, n) < bound
    assert sum(kept.values()) == firsts[d]
    broken = {t: (p * (1 - probs[d]) if t != d else probs[d] * (2 - probs[d])) for t, p in probs.items()}
    expected_broken = sum((n * broken[t] - n * p) ** 2 / (n * p) for t, p in probs.items())
    assert expected_broken > 2 * bound


def test_a_request_may_opt_out_and_grammar_rows_do_not_draft() -> None:
    """Opted-out rows and rows under a grammar (a regex of repeats, which prompt lookup would propose)
    never draft, beside a row that does; every row's tokens are those without drafts."""
    from service.messages import GrammarSpec

    model, tok = tiny_model("decoder")
    prompts = prompts_of(tok, 3)
    params = [SamplingParams(max_new_tokens=40, ignore_eos=True, speculative=False)] * 3
    plain, _ = run(model, tok, prompts, params)
    spec, history = run(model, tok, prompts, params, speculative=NGRAM)
    same(spec, plain)
    assert history[-1].spec_drafted == 0

    drafted_under_grammar = []

    def with_grammar(**config: object) -> tuple[list, GenerationEngine]:
        engine = make(model, tok, **config)
        verify = engine._batch.verify

        def watched(drafts: dict[int, list[int]]) -> object:
            drafted_under_grammar.extend(r for r in drafts if engine._batch.rows[r].matcher is not None)
            return verify(drafts)

        engine._batch.verify = watched
        grammar = engine.grammars.compile(GrammarSpec("regex", "(ab ){8}"))
        free = engine.submit(prompts[2], SamplingParams(max_new_tokens=40, ignore_eos=True))
        ruled = engine.submit(prompts[2], SamplingParams(max_new_tokens=30), grammar=grammar)
        run_until_idle(engine)
        return [read(free)[1], read(ruled)[1]], engine

    plain, _ = with_grammar()
    spec, engine = with_grammar(speculative=NGRAM)
    same(spec, plain)
    assert set(spec[1].text.split()) == {"ab"} and engine.stats().spec_drafted > 0
    assert drafted_under_grammar == []


def test_prompt_lookup_proposes_what_followed_the_longest_latest_match() -> None:
    lookup = PromptLookup(2, 3, [1, 2, 3, 4, 9, 2, 3, 5, 6, 1, 2, 3])
    assert lookup.propose(3) == [4, 9, 2]  # the longest suffix (1, 2, 3) wins over (2, 3)
    latest = PromptLookup(2, 3, [2, 3, 4, 9, 2, 3, 5, 6, 7, 2, 3])
    assert latest.propose(3) == [5, 6, 7]  # (2, 3): its latest earlier occurrence
    lookup = PromptLookup(2, 3, [1, 2, 3, 4, 7, 1, 2, 3])
    assert lookup.propose(2) == [4, 7]  # the longest suffix (1, 2, 3) wins
    lookup.extend([8])
    assert lookup.propose(4) == []  # (2, 3, 8) and (3, 8) never occurred before
    loop = PromptLookup(2, 2, [5, 7, 7, 7, 7])
    assert loop.propose(4) == [7, 7, 7, 7]  # a loop goes on as a loop
    cycle = PromptLookup(2, 2, [1, 2, 1, 2])
    assert cycle.propose(5) == [1, 2, 1, 2, 1]
    guesses = PromptLookup(2, 3, [1, 2, 3, 4, 9])
    assert guesses.propose(2, after=[1, 2]) == [3, 4]  # the sequence continued by unverified tokens
    assert guesses.propose(2, after=[7]) == []
    assert PromptLookup(2, 2, [5, 7, 1]).propose(3, after=[5, 7]) == [1, 5, 7]  # a loop runs into `after`


def test_kept_tokens_stop_at_the_first_difference() -> None:
    assert kept_tokens([4, 5, 6], [4, 5]) == 3  # both drafts kept, and the token after them
    assert kept_tokens([4, 9, 6], [4, 5]) == 2  # the second draft rejected: the model's token instead
    assert kept_tokens([7, 5, 6], [4, 5]) == 1
    assert kept_tokens([7], []) == 1


def test_large_batches_stop_drafting_by_themselves() -> None:
    """Where an entry costs little beside the step (weights read once), rows draft; where each entry
    costs as much as a row's share of the step, the expected gain does not pay and no row drafts."""
    cheap, dear = StepTimes(), StepTimes()
    for e in (1, 4, 8, 32, 64):
        cheap.record(e, 0.010 + 0.0002 * e)  # batch 1 on a CPU: the weights dominate
        dear.record(e, 0.002 + 0.004 * e)  # compute-bound: t(E) proportional to E
    candidates = [Candidate(r, 6, 0.7) for r in range(32)]
    assert choose_drafts(1, candidates[:1], cheap) == {0: 6}
    assert choose_drafts(32, candidates, dear) == {}
    # a low acceptance does not draft even when entries are cheap; a draft model's cost counts
    assert choose_drafts(1, [Candidate(0, 6, 0.01)], cheap) == {}
    assert choose_drafts(1, candidates[:1], cheap, draft_s=lambda k, n: 0.05 * k) == {}
    assert math.isclose(cheap.estimate(8), 0.0116, rel_tol=1e-6)


def test_bad_speculative_settings_are_refused_with_their_reason() -> None:
    from models.spec import ModelSpec
    from service.engine.config import EngineConfig
    from service.replica.loading import draft_spec

    with pytest.raises(ValueError, match="max_draft_tokens must be in"):
        SpeculativeConfig(max_draft_tokens=0)
    with pytest.raises(ValueError, match="method 'draft' needs `draft`"):
        SpeculativeConfig(method="draft")
    with pytest.raises(ValueError, match="needs paged: true"):
        EngineConfig(paged=False, speculative=NGRAM)
    model, tok = tiny_model("decoder")
    with pytest.raises(ValueError, match="needs the draft model"):
        make(model, tok, speculative=SpeculativeConfig(method="draft", draft={"quantize": "q4_1"}))
    other = DecoderLM(model.cfg.replace(vocab_size=model.cfg.vocab_size + 1)).eval()
    with pytest.raises(ValueError, match="a draft needs the same tokenizer"):
        make(model, tok, draft=plan_model(other, "auto", Runtime(paged=True, graphs=False)),
             speculative=SpeculativeConfig(method="draft", draft={"source": "other"}))
    spec = ModelSpec(name="m", source="tiny:decoder")
    assert draft_spec(spec, {"quantize": "q4_1"}).name == "m-draft"
    with pytest.raises(ValueError, match=r"\['quantise'\] are not model spec fields"):
        draft_spec(spec, {"quantise": "q4_1"})
