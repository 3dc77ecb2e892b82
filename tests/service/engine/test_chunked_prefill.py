"""Chunked prefill in the engine: a prompt longer than `prefill_chunk` is prefilled a chunk per step
on the cache's last row while the running requests keep decoding, then joins them.

Each claim is checked against offline decoding (models.generate, one whole prefill) on the tiny
decoder, whose answers depend on the prompt: the same tokens chunked or not, alone or among others.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from models.decoder import DecoderLM
from models.decoding import SamplingParams
from models.text import TextTokenizer
from models.tiny import tiny_model

from .test_engine import (
    POISON,
    FaultyLM,
    full_recomputation_greedy,
    make,
    only_the_poisoned_fails,
    read,
    reference,
    run_until_idle,
)

CHUNK = 8


@pytest.fixture(scope="module")
def tiny() -> tuple[nn.Module, TextTokenizer]:
    return tiny_model("decoder")


def long_prompt(n: int, base: int = 3) -> list[int]:
    return [base + (i * 7) % 90 for i in range(n)]


def test_a_long_prompt_is_prefilled_in_chunks_while_others_decode(tiny: tuple[nn.Module, TextTokenizer]) -> None:
    model, tok = tiny
    spy = FaultyLM(model, lambda ids, cache: False)
    engine = make(spy, tok, max_running=4, prefill_chunk=CHUNK, prefill_tokens=64)
    short = [5, 6, 7]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    running = engine.submit(short, params)
    engine.step()  # the short request runs
    prompt = long_prompt(30)  # 4 chunks: 8 + 8 + 8 + 6
    waiting = engine.submit(prompt, params)
    spy.calls.clear()
    for _ in range(3):
        engine.step()
        assert engine.stats().running == 2  # the chunked request holds its row
    shapes = [tuple(ids.shape) for ids in spy.calls]
    # each step: one chunk of the long prompt (one row of CHUNK tokens, float32 on CPU: padded to an even
    # width) and a decode step of the short one
    assert shapes == [(1, CHUNK), (1, 1)] * 3, shapes
    assert len(read_partial(engine)) == 0  # no token of the long request yet
    run_until_idle(engine)
    assert list(read(running)[1].token_ids) == reference(model, tok, short, params)[0]
    assert list(read(waiting)[1].token_ids) == reference(model, tok, prompt, params)[0]


def read_partial(engine) -> list[int]:
    partial = engine._batch.partial
    return [] if partial is None else partial.tokens


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_chunked_or_whole_alone_or_among_others_the_same_tokens(tiny: tuple[nn.Module, TextTokenizer],
                                                                sampled: bool) -> None:
    model, tok = tiny
    params = (SamplingParams(max_new_tokens=10, temperature=0.05, seed=3, ignore_eos=True) if sampled
              else SamplingParams(max_new_tokens=10, ignore_eos=True))
    prompts = [long_prompt(n, base) for n, base in ((27, 3), (19, 11), (40, 5), (4, 9), (33, 2))]
    want = [reference(model, tok, p, params)[0] for p in prompts]
    assert len({tuple(w) for w in want}) == len(prompts)  # the answers depend on the prompt
    alone = []
    for p in prompts:
        engine = make(model, tok, prefill_chunk=CHUNK)
        handle = engine.submit(p, params)
        run_until_idle(engine)
        alone.append(list(read(handle)[1].token_ids))
    engine = make(model, tok, max_running=3, prefill_chunk=CHUNK)  # rows free, move and refill
    handles = [engine.submit(p, params) for p in prompts]
    run_until_idle(engine)
    assert [list(read(h)[1].token_ids) for h in handles] == alone == want


def test_siblings_of_a_long_prompt_share_its_chunked_prefill(tiny: tuple[nn.Module, TextTokenizer]) -> None:
    model, tok = tiny
    spy = FaultyLM(model, lambda ids, cache: False)
    engine = make(spy, tok, max_running=8, prefill_chunk=CHUNK)
    prompt = long_prompt(20)
    params = [SamplingParams(max_new_tokens=8, temperature=0.9, seed=s, ignore_eos=True) for s in range(3)]
    handles = [engine.submit(prompt, p) for p in params]
    run_until_idle(engine)
    prefills = [tuple(ids.shape) for ids in spy.calls if ids.size(1) > 1]
    assert prefills == [(1, 8), (1, 8), (1, 4)]  # 8 + 8 + 4 tokens, once for the three
    outputs = [list(read(h)[1].token_ids) for h in handles]
    assert outputs == [reference(model, tok, prompt, p)[0] for p in params]
    assert len({tuple(o) for o in outputs}) == 3


def test_cancelling_a_chunked_prefill_frees_its_row(tiny: tuple[nn.Module, TextTokenizer]) -> None:
    model, tok = tiny
    engine = make(model, tok, max_running=2, prefill_chunk=CHUNK)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    handle = engine.submit(long_prompt(40), params)
    engine.step()
    assert engine._batch.partial is not None
    assert engine.cancel(handle.request_id)
    engine.step()
    assert engine._batch.partial is None and read(handle)[1].finish_reason == "cancelled"
    after = engine.submit(long_prompt(12, 4), params)  # the row serves the next long prompt
    run_until_idle(engine)
    assert list(read(after)[1].token_ids) == reference(model, tok, long_prompt(12, 4), params)[0]


def test_a_failing_chunk_fails_only_its_request(tiny: tuple[nn.Module, TextTokenizer]) -> None:
    model, tok = tiny
    engine = make(FaultyLM(model, lambda ids, cache: bool((ids == POISON).any())), tok, max_running=4,
                  prefill_chunk=CHUNK)
    poisoned = long_prompt(20)
    poisoned[13] = POISON  # in the second chunk
    only_the_poisoned_fails(engine, model, tok, [[30, 31, 32], poisoned, long_prompt(17, 6)])


def test_a_windowed_model_prefills_in_chunks_through_its_ring(tiny: tuple[nn.Module, TextTokenizer]) -> None:
    """Chunks after a past in a ring of 6 slots: read before written, the tokens of a recomputation."""
    base, tok = tiny
    windowed = DecoderLM(base.cfg.replace(sliding_window=6)).eval()
    windowed.load_state_dict(base.state_dict())
    prompts = [long_prompt(n, b) for n, b in ((23, 3), (9, 8), (30, 4))]
    engine = make(windowed, tok, max_running=2, prefill_chunk=CHUNK)
    assert engine.cache.ring and engine.cache.slots == 6
    handles = [engine.submit(p, SamplingParams(max_new_tokens=8, ignore_eos=True)) for p in prompts]
    run_until_idle(engine)
    with torch.no_grad():
        want = [full_recomputation_greedy(windowed, p, 8) for p in prompts]
    assert [list(read(h)[1].token_ids) for h in handles] == want


def test_an_urgent_prompt_is_prefilled_alone_and_before_a_chunk(tiny: tuple[nn.Module, TextTokenizer]) -> None:
    """A long prompt at priority 5 is in its chunks and three short ones of priority 5 wait when an
    urgent one (priority 0) arrives: the next step computes the urgent prompt in a forward of its own
    (not padded out by those behind it) and the chunk waits; the step after, the chunk goes on, the
    three are prefilled together and the four rows decode. Every answer is the one of a run alone."""
    from service.engine.core import Submission

    model, tok = tiny
    spy = FaultyLM(model, lambda ids, cache: False)
    engine = make(spy, tok, max_running=8, prefill_chunk=CHUNK, prefill_tokens=256)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    long = long_prompt(30)
    chunked = engine.submit_many([Submission(long, params, priority=5)])[0]
    engine.step()  # its first chunk
    shorts = [long_prompt(n, base) for n, base in ((6, 4), (7, 8), (5, 13))]
    low = engine.submit_many([Submission(p, params, priority=5) for p in shorts])
    urgent_prompt = [9, 8, 7]
    urgent = engine.submit_many([Submission(urgent_prompt, params, priority=0)])[0]
    spy.calls.clear()
    engine.step()
    # the urgent prompt alone (padded to an even width), then the decode step of its row
    assert [tuple(ids.shape) for ids in spy.calls] == [(1, 4), (1, 1)], spy.calls
    assert [seq.request_id for seq in engine._batch.rows] == [urgent.request_id]
    spy.calls.clear()
    engine.step()
    shapes = [tuple(ids.shape) for ids in spy.calls]
    assert shapes[0] == (1, CHUNK) and shapes[1][0] == 3 and shapes[2] == (4, 1), shapes  # chunk, the three, decode
    run_until_idle(engine)
    for handle, prompt in zip([chunked, *low, urgent], [long, *shorts, urgent_prompt], strict=True):
        assert list(read(handle)[1].token_ids) == reference(model, tok, prompt, params)[0]


@pytest.mark.parametrize("priority", [0, 5], ids=["urgent", "equal"])
def test_a_last_chunk_goes_on_when_the_next_prompt_waits_for_blocks_it_holds(tiny: tuple[nn.Module, TextTokenizer],
                                                                           priority: int) -> None:
    """A pool of 6 blocks of 16 tokens, nothing running, a 90-token prompt of priority 5 eleven chunks
    in (all 6 blocks held): a 5-token prompt of another text cannot be admitted until the chunked one
    is done, so its last chunk goes on (it used to wait for that prompt, or keep a block for it as for
    a sibling of its own text: forever); an urgent one then preempts it. Both give the answers of a
    run alone."""
    from service.engine.core import Submission

    from .test_paged_engine import mib_for_blocks

    model, tok = tiny
    engine = make(model, tok, max_running=4, prefill_chunk=CHUNK, kv_cache_mib=mib_for_blocks(model, 6),
                  max_total_tokens=96, prefix_cache_mib=0)
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    long, other_prompt = long_prompt(90), [9, 8, 7, 6, 5]
    chunked = engine.submit_many([Submission(long, params, priority=5)])[0]
    for _ in range(11):
        engine.step()
    assert engine._batch.partial_done == 88 and engine._batch.blocks_available() == 0
    other = engine.submit_many([Submission(other_prompt, params, priority=priority)])[0]
    run_until_idle(engine, max_steps=100)
    assert list(read(chunked)[1].token_ids) == reference(model, tok, long, params)[0]
    assert list(read(other)[1].token_ids) == reference(model, tok, other_prompt, params)[0]
