"""The engine on a paged KV cache (models/cache/paged.py): sequences bounded by the blocks they fill,
preemption when blocks run out (the same tokens as a run never preempted), prefix hits that share
blocks instead of copying them, and every block back in the pool when the engine is idle.

The reference is offline decoding (models.generate: one request, no cache shared with anyone), so a
wrong block, a lost seen-token mask or a resumed request that resamples shows up as other tokens.
"""

from __future__ import annotations

import dataclasses

import pytest
from torch import nn

from models.decoding import SamplingParams
from models.text import TextTokenizer
from models.tiny import tiny_model
from service.engine.prefix_cache import BLOCK

from .test_engine import FaultyLM, make, read, reference, run_until_idle

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny() -> tuple[nn.Module, TextTokenizer]:
    return tiny_model("decoder")


def mib_for_blocks(model: nn.Module, blocks: int) -> float:
    """kv_cache_mib holding exactly `blocks` blocks of 16 tokens (float32 keys and values)."""
    cfg = model.cfg
    return blocks * BLOCK * 2 * cfg.n_layers * cfg.kv_heads * cfg.head_dim * 4 / 2**20


# the newest requests (preempted first) have penalties: their seen tokens and counts must be rebuilt
PARAMS = [SamplingParams(max_new_tokens=60, ignore_eos=True),
          SamplingParams(max_new_tokens=60, ignore_eos=True, temperature=0.9, seed=7, top_k=20),
          SamplingParams(max_new_tokens=60, ignore_eos=True, repetition_penalty=1.5),
          SamplingParams(max_new_tokens=60, ignore_eos=True, temperature=1.1, seed=3, frequency_penalty=0.7)]


def test_short_sequences_run_beyond_the_rows_a_budget_of_full_rows_holds(tiny: tuple[nn.Module, TextTokenizer]) -> None:
    """A budget of 16 blocks holds two rows of max_total_tokens = 128; paged, 12 short requests (one
    block each) decode at once, with the tokens they get alone."""
    model, tok = tiny
    budget = mib_for_blocks(model, 16)
    assert make(model, tok, max_running=12, kv_cache_mib=budget, paged=False).limits.rows == 2
    engine = make(model, tok, max_running=12, kv_cache_mib=budget)
    prompts = [tok.encode(f"q{i}", add_special_tokens=False) for i in range(12)]
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    handles = [engine.submit(p, params) for p in prompts]
    history = run_until_idle(engine)
    assert max(s.running for s in history) == 12 and history[-1].preempted == 0
    outputs = [list(read(h)[1].token_ids) for h in handles]
    assert outputs == [reference(model, tok, p, params)[0] for p in prompts]
    assert len({tuple(o) for o in outputs}) >= 6
    assert engine.cache.blocks_free + len(engine._batch.prefix) == engine.cache.blocks_total


def run_four(model: nn.Module, tok: TextTokenizer, blocks: int, prefix_mib: float,
             graphs: bool = False) -> tuple[list, list]:
    """PARAMS' four requests on a pool of `blocks`: their Finished events and the stats of every step.
    `graphs`: decode steps padded to buckets over static buffers (models/execution/graphs.py; eager here)."""
    engine = make(model, tok, max_running=4, kv_cache_mib=mib_for_blocks(model, blocks), prefix_cache_mib=prefix_mib,
                  decode_graphs=graphs)
    assert (engine._batch.graphs is not None) == graphs
    handles = [engine.submit(p, q) for p, q in zip(PROMPTS(tok), PARAMS, strict=True)]
    history = run_until_idle(engine)
    held = len(engine._batch.prefix) if engine._batch.prefix is not None else 0
    assert engine.cache.blocks_free + held == engine.cache.blocks_total  # nothing leaked
    return [read(h)[1] for h in handles], history


def PROMPTS(tok: TextTokenizer) -> list[list[int]]:  # noqa: N802 - a constant of the tokenizer
    return [tok.encode(f"request number {i} says", add_special_tokens=False) for i in range(4)]


@pytest.mark.parametrize(("prefix_mib", "graphs"), [(0.0, False), (1.0, False), (1.0, True)])
def test_preempted_requests_give_the_tokens_of_an_uninterrupted_run(tiny: tuple[nn.Module, TextTokenizer],
                                                                   prefix_mib: float, graphs: bool) -> None:
    """Four requests growing to 5 blocks each on a pool of 10: the newest are preempted (blocks freed)
    and recomputed later, greedy, penalised and seeded alike; each gives the tokens it gets on a pool
    where nobody is preempted (and offline decoding's, where that has its parameters). With `graphs`
    the decode steps are padded to row and key-block buckets (what CUDA graphs replay)."""
    model, tok = tiny
    finals, history = run_four(model, tok, 10, prefix_mib, graphs)
    assert history[-1].preempted >= 2, [s.preempted for s in history]
    assert max(s.running for s in history) >= 2 and history[-1].kv_blocks == 10
    roomy, calm = run_four(model, tok, 100, prefix_mib)
    assert calm[-1].preempted == 0 and max(s.running for s in calm) == 4
    assert [f.finish_reason for f in finals] == ["length"] * 4
    outputs = [list(f.token_ids) for f in finals]
    assert outputs == [list(f.token_ids) for f in roomy]
    assert [f.text for f in finals] == [f.text for f in roomy]
    for i in (0, 1, 2):  # no presence / frequency penalty: models.generate has the same parameters
        assert outputs[i] == reference(model, tok, PROMPTS(tok)[i], PARAMS[i])[0]
    assert len({tuple(o) for o in outputs}) == 4
    assert [f.usage.prompt_tokens for f in finals] == [len(p) for p in PROMPTS(tok)]


def test_the_oldest_request_is_never_preempted(tiny: tuple[nn.Module, TextTokenizer]) -> None:
    model, tok = tiny
    engine = make(model, tok, max_running=4, kv_cache_mib=mib_for_blocks(model, 10), prefix_cache_mib=0)
    handles = [engine.submit(p, q) for p, q in zip(PROMPTS(tok), PARAMS, strict=True)]
    running = []  # per step: whether the first request holds a row
    while engine.stats().running or engine.stats().waiting or not running:
        engine.step()
        running.append(any(seq.request_id == handles[0].request_id for seq in engine._batch.rows))
    # its first step samples two tokens (prefill, decode), then one a step until its last, after which it
    # leaves: never stopped for a recomputation
    held = PARAMS[0].max_new_tokens - 2
    assert running == [True] * held + [False] * (len(running) - held)
    assert engine.stats().preempted >= 1


def test_a_prefix_hit_shares_the_blocks_it_reuses(tiny: tuple[nn.Module, TextTokenizer]) -> None:
    """Two requests with the same 3-block system prompt: the second row's first 3 blocks are the
    first row's (referenced, not copied), and both give their tokens alone."""
    model, tok = tiny
    engine = make(model, tok, max_running=4)
    system = list(range(20, 20 + 3 * BLOCK))
    prompts = [system + [70, 71], system + [80, 81, 82]]
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    first = engine.submit(prompts[0], params)
    engine.step()
    second = engine.submit(prompts[1], params)
    engine.step()
    tables = engine.cache.host_tables
    assert tables[1][:3] == tables[0][:3] and tables[1][3] != tables[0][3]
    assert all(engine.cache.refs(b) == 3 for b in tables[0][:3])  # two rows and the prefix cache
    assert engine.stats().cached_prompt_tokens == 3 * BLOCK
    run_until_idle(engine)
    assert [list(read(h)[1].token_ids) for h in (first, second)] == [reference(model, tok, p, params)[0]
                                                                     for p in prompts]


def test_admission_waits_for_blocks_instead_of_failing(tiny: tuple[nn.Module, TextTokenizer]) -> None:
    """A pool of 8 blocks and requests of 100 tokens (7 blocks with their output): one at a time,
    none refused, none failed."""
    model, tok = tiny
    engine = make(model, tok, max_running=4, kv_cache_mib=mib_for_blocks(model, 8), prefix_cache_mib=0)
    prompts = [[30 + i] * 90 for i in range(3)]
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    handles = [engine.submit(p, params) for p in prompts]
    history = run_until_idle(engine)
    assert max(s.running for s in history) == 1 and history[-1].preempted == 0
    assert [read(h)[1].finish_reason for h in handles] == ["length"] * 3


def test_a_chunked_prefill_is_preempted_first_and_then_completes(tiny: tuple[nn.Module, TextTokenizer]) -> None:
    """Two 40-token requests decoding on a pool of 8 blocks while a 70-token prompt is prefilled in
    chunks of 8 (theirs were chunked too): when the two need blocks, the newest (the prompt being
    chunked) gives its blocks back, starts over later, and every request gets its tokens alone."""
    model, tok = tiny
    engine = make(model, tok, max_running=4, kv_cache_mib=mib_for_blocks(model, 8), prefix_cache_mib=0,
                  prefill_chunk=8)
    params = [SamplingParams(max_new_tokens=30, ignore_eos=True)] * 2 + [SamplingParams(max_new_tokens=8,
                                                                                        ignore_eos=True)]
    prompts = [[60 + i] * 40 for i in range(2)] + [[40 + i % 50 for i in range(70)]]
    handles = [engine.submit(p, q) for p, q in zip(prompts[:2], params, strict=False)]
    engine.step()
    handles.append(engine.submit(prompts[2], params[2]))
    starts = []
    start_partial = engine._batch.start_partial
    engine._batch.start_partial = lambda seq: (starts.append(seq.request_id), start_partial(seq))[1]
    run_until_idle(engine)
    assert starts.count(handles[2].request_id) >= 2  # chunked, preempted, chunked again from the start
    assert engine.stats().preempted >= 1
    wants = [reference(model, tok, p, q)[0] for p, q in zip(prompts, params, strict=True)]
    assert [list(read(h)[1].token_ids) for h in handles] == wants
    assert engine.cache.blocks_free == engine.cache.blocks_total


def test_a_prefix_hit_counts_as_shared_blocks_at_admission(tiny: tuple[nn.Module, TextTokenizer]) -> None:
    """A pool of 16 blocks and requests sharing a 4-block system prompt: counted whole (5 blocks each)
    three would run at once; counted as the one block each adds to the shared prompt, all seven do,
    none preempted, each with its tokens alone."""
    model, tok = tiny
    engine = make(model, tok, max_running=8, kv_cache_mib=mib_for_blocks(model, 16), prefix_cache_mib=1.0)
    system = list(range(20, 20 + 4 * BLOCK))
    prompts = [system + [70 + i, 71, 72] for i in range(7)]
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    handles = [engine.submit(prompts[0], params)]
    engine.step()  # the first one computes the system prompt and leaves it in the prefix cache
    handles += [engine.submit(p, params) for p in prompts[1:]]
    history = run_until_idle(engine)
    assert max(s.running for s in history) == 7 and history[-1].preempted == 0
    assert history[-1].cached_prompt_tokens == 6 * len(system)
    assert [list(read(h)[1].token_ids) for h in handles] == [reference(model, tok, p, params)[0] for p in prompts]
    assert engine.cache.blocks_free + len(engine._batch.prefix) == engine.cache.blocks_total


def test_an_admitted_hit_is_pinned_until_its_prefill(tiny: tuple[nn.Module, TextTokenizer]) -> None:
    """The prefix cache holds a 3-block prompt no row uses (reclaimable) in a pool of 10. A request
    with that prefix (1 new block) is admitted on its hit; a 120-token one behind it (8 blocks) must
    wait for it: had its admission reclaimed the hit's blocks, the first one's prefill would need
    them back and one of the two would fail for lack of blocks. Both finish with their tokens alone."""
    model, tok = tiny
    engine = make(model, tok, max_running=4, kv_cache_mib=mib_for_blocks(model, 10), prefix_cache_mib=1.0)
    system = list(range(20, 20 + 3 * BLOCK))
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    warm = engine.submit(system + [90, 91], params)
    run_until_idle(engine)
    assert read(warm)[1].finish_reason == "length" and len(engine._batch.prefix) == 3
    prompts = [system + [70, 71], [30 + i % 40 for i in range(120)]]
    handles = [engine.submit(p, params) for p in prompts]
    history = run_until_idle(engine)
    assert max(s.running for s in history) == 1  # one after the other
    assert history[-1].cached_prompt_tokens == len(system)  # the first one reused warm's prompt
    finals = [read(h)[1] for h in handles]
    assert [f.finish_reason for f in finals] == ["length", "length"]
    assert [list(f.token_ids) for f in finals] == [reference(model, tok, p, params)[0] for p in prompts]
    assert engine.cache.blocks_free + len(engine._batch.prefix) == engine.cache.blocks_total


def test_steps_launched_ahead_give_every_request_its_tokens(tiny: tuple[nn.Module, TextTokenizer],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode graphs (padded steps, eager here) with each step launched before the previous one's
    tokens are handed out (engine/lookahead.py), on a pool small enough to preempt: greedy, seeded,
    penalised rows of different lengths, one cancelled mid-way, two admitted mid-way. Every request
    gets the tokens of the same run with no step ahead, and steps ahead were collected (the sampled
    rows' draws were given back when a step ahead was dropped or a row preempted)."""
    from service.engine import batch as batch_module

    model, tok = tiny
    collected = []
    real = batch_module.RunningBatch._collect

    def spy(self: batch_module.RunningBatch, ahead: bool) -> list:
        collected.append(len(self.rows))
        return real(self, ahead)

    monkeypatch.setattr(batch_module.RunningBatch, "_collect", spy)
    params = [dataclasses.replace(p, max_new_tokens=n) for p, n in zip(PARAMS, (60, 35, 47, 52), strict=True)]
    late = [tok.encode("a later request", add_special_tokens=False), tok.encode("and one more", add_special_tokens=False)]

    def run(ahead: bool) -> tuple[list[list[int]], list[str]]:
        engine = make(model, tok, max_running=6, kv_cache_mib=mib_for_blocks(model, 14), prefix_cache_mib=0,
                      decode_graphs=True, decode_ahead=ahead)
        handles = [engine.submit(p, q) for p, q in zip(PROMPTS(tok), params, strict=True)]
        for _ in range(8):
            engine.step()
        handles[1].cancel()
        for _ in range(4):
            engine.step()
        handles += [engine.submit(p, params[i % 2 + 1]) for i, p in enumerate(late)]
        history = run_until_idle(engine)
        assert history[-1].preempted >= 1
        finals = [read(h)[1] for h in handles]
        return [list(f.token_ids) for f in finals], [f.finish_reason for f in finals]

    plain = run(False)
    assert not collected
    assert run(True) == plain
    assert len(collected) > 40 and plain[1][1] == "cancelled"


def test_a_more_urgent_request_is_never_preempted_for_a_less_urgent_one(tiny: tuple[nn.Module, TextTokenizer]) -> None:
    """PARAMS' four requests on a pool of 10 blocks, the newest at priority -1 (vLLM's: lower is sooner),
    the others at 0: short of blocks, the engine preempts the priority-0 rows (the oldest included) and
    never the urgent one, which gives the tokens of an uninterrupted run."""
    from service.engine.core import Submission

    model, tok = tiny
    engine = make(model, tok, max_running=4, kv_cache_mib=mib_for_blocks(model, 10), prefix_cache_mib=0)
    subs = [Submission(p, q, priority=-1 if i == 3 else 0) for i, (p, q) in enumerate(zip(PROMPTS(tok), PARAMS,
                                                                                         strict=True))]
    handles = engine.submit_many(subs)
    held = []  # per step: whether the urgent request holds a row
    while engine.stats().running or engine.stats().waiting or not held:
        engine.step()
        held.append(any(seq.request_id == handles[3].request_id for seq in engine._batch.rows))
    first = held.index(True)
    assert all(held[first:first + PARAMS[3].max_new_tokens - 2]) and engine.stats().preempted >= 1
    roomy = make(model, tok, max_running=4, kv_cache_mib=mib_for_blocks(model, 100), prefix_cache_mib=0)
    alone = roomy.submit(PROMPTS(tok)[3], PARAMS[3])
    run_until_idle(roomy)
    assert list(read(handles[3])[1].token_ids) == list(read(alone)[1].token_ids)


def test_waiting_requests_are_admitted_by_priority_then_arrival(tiny: tuple[nn.Module, TextTokenizer]) -> None:
    """One row, six requests submitted together: they start one after another, the soonest priority
    first, in arrival order within a priority."""
    from service.engine.core import Submission

    model, tok = tiny
    engine = make(model, tok, max_running=1)
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    priorities = [0, 5, 0, -2, 5, -2]
    handles = engine.submit_many([Submission(tok.encode(f"p{i}", add_special_tokens=False), params, priority=p)
                                  for i, p in enumerate(priorities)])
    order = []
    while engine.stats().running or engine.stats().waiting or not order:
        engine.step()
        for seq in engine._batch.rows:
            if seq.request_id not in order:
                order.append(seq.request_id)
    ids = [h.request_id for h in handles]
    assert [ids.index(r) for r in order] == [3, 5, 0, 2, 1, 4]


def test_no_tenant_holds_more_than_its_share_of_the_queue(tiny: tuple[nn.Module, TextTokenizer]) -> None:
    """max_queued 6, max_queued_share 0.34: a tenant's waiting requests (each generation of a group
    counts) stop at 2, and the others are still admitted; requests of no tenant share only max_queued."""
    from service.engine.core import Submission
    from service.errors import EngineOverloaded

    model, tok = tiny
    engine = make(model, tok, max_running=1, max_queued=6, max_queued_share=0.34)
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)

    def sub(tenant: str | None) -> Submission:
        return Submission(tok.encode("hello", add_special_tokens=False), params, tenant=tenant)

    engine.submit_many([sub(None)])
    engine.step()  # it runs: the row is taken, the next ones wait
    engine.submit_many([sub("a")])
    engine.submit_many([sub("a")])
    with pytest.raises(EngineOverloaded, match="tenant 'a' has 2 generation requests waiting"):
        engine.submit_many([sub("a")])
    engine.submit_many([sub("b")])
    with pytest.raises(EngineOverloaded, match="tenant 'b'"):
        engine.submit_many([sub("b"), sub("b")])  # a group of two: 1 + 2 past the share
    engine.submit_many([sub(None)])
    assert engine.stats().waiting == 4
    run_until_idle(engine)


def test_an_urgent_request_takes_the_row_of_a_less_urgent_running_one(tiny: tuple[nn.Module, TextTokenizer]) -> None:
    """Two rows held by priority-0 requests: an urgent one (priority -1) is admitted at the next step,
    preempting the newest of them, which later resumes and gives the tokens of an uninterrupted run; a
    request of equal priority waits instead."""
    from service.engine.core import Submission

    model, tok = tiny
    engine = make(model, tok, max_running=2, prefix_cache_mib=0)
    long = SamplingParams(max_new_tokens=40, ignore_eos=True)
    prompts = PROMPTS(tok)
    low = engine.submit_many([Submission(p, long) for p in prompts[:2]])
    for _ in range(3):
        engine.step()
    same = engine.submit_many([Submission(prompts[2], long)])[0]
    engine.step()
    assert engine.stats().preempted == 0 and same.request_id not in {s.request_id for s in engine._batch.rows}
    urgent = engine.submit_many([Submission(prompts[3], SamplingParams(max_new_tokens=5, ignore_eos=True),
                                            priority=-1)])[0]
    engine.step()
    assert urgent.request_id in {s.request_id for s in engine._batch.rows} and engine.stats().preempted == 1
    assert low[1].request_id not in {s.request_id for s in engine._batch.rows}  # the newest of the two yielded
    run_until_idle(engine)
    roomy = make(model, tok, max_running=4, prefix_cache_mib=0)
    alone = [roomy.submit(p, long) for p in prompts[:2]]
    run_until_idle(roomy)
    assert [list(read(h)[1].token_ids) for h in low] == [list(read(h)[1].token_ids) for h in alone]


def test_a_preempted_request_comes_back_on_the_blocks_it_left(tiny: tuple[nn.Module, TextTokenizer]) -> None:
    """A request preempted for an urgent one leaves its full blocks in the prefix cache: back on a row
    while they are still there, it computes only the tokens after them (not its whole prompt and
    output again), and gives the tokens of an uninterrupted run; without a prefix cache it computes
    them all."""
    from service.engine.core import Submission

    model, tok = tiny
    long = SamplingParams(max_new_tokens=60, ignore_eos=True)
    prompt = list(range(3, 23))  # 20 tokens
    widths = {}
    for mib in (1.0, 0.0):
        spy = FaultyLM(model, lambda ids, cache: False)
        engine = make(spy, tok, max_running=1, prefix_cache_mib=mib)
        low = engine.submit_many([Submission(prompt, long)])[0]
        for _ in range(30):  # its prompt, then 29 decode steps: 20 + 29 tokens in its row
            engine.step()
        urgent = engine.submit_many([Submission([7, 8, 9], SamplingParams(max_new_tokens=3, ignore_eos=True),
                                                priority=-1)])[0]
        spy.calls.clear()
        history = run_until_idle(engine)
        assert history[-1].preempted == 1 and read(urgent)[1].finish_reason == "length"
        widths[mib] = [int(ids.size(1)) for ids in spy.calls if ids.size(1) > 1]  # prompt forwards
        assert list(read(low)[1].token_ids) == reference(model, tok, prompt, long)[0]
    # the urgent prompt (3 tokens, padded to 4), then the preempted row's 20 + 30 - 1 tokens: from the
    # cache all but the 1 after its 3 full blocks (padded to 2), or all 49 (padded to 50)
    assert widths == {1.0: [4, 2], 0.0: [4, 50]}
