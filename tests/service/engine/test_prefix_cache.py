"""Automatic prefix caching (service/engine/prefix_cache.py) and the engine on it.

The unit tests fill cache rows with recognisable keys, so every test checks exactly which slots a
hit copies. The engine tests check that a request whose prompt begins like an earlier one
computes only the rest of its prompt (the forwards the model sees) and still gives the tokens of
offline decoding (models.generate: no cache shared with anyone), greedy and seeded.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from models.cache.dense import KVCache
from models.decoding import SamplingParams
from models.text import TextTokenizer
from models.tiny import tiny_model
from service.engine.prefix_cache import BLOCK, PrefixCache

from .test_engine import FaultyLM, make, read, reference, run_until_idle

LAYERS, K, D = 2, 2, 3


def filled(rows: int = 3, max_len: int = 64) -> KVCache:
    """Slot s of row r, layer l holds 1000 l + 100 r + s in keys and its negative in values."""
    cache = KVCache(LAYERS, rows, K, max_len, D)
    for layer in range(LAYERS):
        value = 1000 * layer + 100 * torch.arange(rows)[:, None] + torch.arange(max_len)[None, :]  # (R, L)
        cache.k[layer].copy_(value[:, None, :, None].float().expand(rows, K, max_len, D))
        cache.v[layer].copy_(-cache.k[layer])
    return cache


def test_a_stored_prefix_is_found_block_by_block_and_loaded_into_another_row() -> None:
    cache = filled()
    prefix = PrefixCache(cache, budget_bytes=2**20)
    prompt = list(range(50, 50 + 3 * BLOCK + 5))  # 3 full blocks and 5 tokens
    assert prefix.lookup(prompt) == 0
    assert prefix.store(prompt, row=0) == 3 and len(prefix) == 3
    assert prefix.store(prompt, row=0) == 0  # already there
    other = prompt[:2 * BLOCK] + [7] * 30  # the same first two blocks, then something else
    assert prefix.lookup(other) == 2 * BLOCK
    assert prefix.lookup(prompt) == 3 * BLOCK
    assert prefix.lookup(prompt[:3 * BLOCK]) == 2 * BLOCK  # its last token is always computed
    assert prefix.lookup([7] * BLOCK + prompt[BLOCK:]) == 0  # a block only counts after the same prefix
    prefix.load(other, 2 * BLOCK, row=2)
    for layer in range(LAYERS):
        want = 1000 * layer + torch.arange(2 * BLOCK).float()  # row 0's slots
        assert torch.equal(cache.k[layer][2, 1, :2 * BLOCK, 0], want)
        assert torch.equal(cache.v[layer][2, 0, :2 * BLOCK, 2], -want)
        assert cache.k[layer][2, 0, 2 * BLOCK, 0] == 1000 * layer + 200 + 2 * BLOCK  # the rest untouched


def test_eviction_takes_the_least_recent_prefix_tail_first() -> None:
    cache = filled()
    prefix = PrefixCache(cache, budget_bytes=0)
    assert prefix.capacity == 0 and prefix.store(list(range(40)), 0) == 0 and prefix.lookup(list(range(40))) == 0
    prefix = PrefixCache(cache, budget_bytes=3 * PrefixCache(cache, 0).block_bytes)
    shared = list(range(100, 100 + BLOCK))
    a, b = shared + list(range(BLOCK)) + [1], shared + list(range(50, 50 + BLOCK)) + [1]
    prefix.store(a, 0)
    prefix.store(b, 1)  # 3 blocks: the shared one, a's and b's second
    assert (prefix.lookup(a), prefix.lookup(b)) == (2 * BLOCK, 2 * BLOCK)
    c = list(range(200, 200 + BLOCK)) + [1]
    prefix.store(c, 2)  # over the budget: a's tail (least recent) goes, not the shared first block
    assert len(prefix) == 3 and prefix.nbytes == 3 * prefix.block_bytes
    assert (prefix.lookup(a), prefix.lookup(b), prefix.lookup(c)) == (BLOCK, 2 * BLOCK, BLOCK)


def test_a_pinned_prefix_outlives_the_budget_until_unpinned() -> None:
    """An admission pins the hit it counted on: storing past the budget evicts other entries, then,
    with every entry pinned, none; unpinning evicts back to the budget, least recent first."""
    cache = filled()
    prefix = PrefixCache(cache, budget_bytes=2 * PrefixCache(cache, 0).block_bytes)
    a = list(range(100, 100 + 2 * BLOCK)) + [1]
    prefix.store(a, 0)
    pin = prefix.pin(a, prefix.lookup(a))
    assert pin.taken == 0  # copies: no pool block is held back
    b = list(range(300, 300 + 2 * BLOCK)) + [1]
    prefix.store(b, 1)  # over the budget with a pinned: b's own blocks cannot stay
    assert prefix.lookup(a) == 2 * BLOCK and len(prefix) == 2
    prefix.pin(a, 2 * BLOCK)
    prefix.unpin(pin)
    prefix.store(b, 1)
    assert prefix.lookup(a) == 2 * BLOCK and prefix.lookup(b) == 0  # still pinned once
    prefix.unpin(pin)
    prefix.store(b, 1)
    assert (prefix.lookup(a), prefix.lookup(b), len(prefix)) == (0, 2 * BLOCK, 2)


@pytest.fixture(scope="module")
def tiny() -> tuple[nn.Module, TextTokenizer]:
    """The tiny decoder with its weights spread x3: attention then depends on which keys sit where,
    so a prefix loaded into the wrong slots changes the tokens (at the default init it barely does)."""
    model, tok = tiny_model("decoder")
    with torch.no_grad():
        for weight in model.parameters():
            if weight.dim() >= 2:
                weight.mul_(3.0)
    return model, tok


SYSTEM = list(range(3, 3 + 40))  # a 40-token "system prompt": 2 full blocks, 8 tokens more


@pytest.mark.parametrize("chunk", [None, 8], ids=["whole", "chunked"])
def test_a_shared_system_prompt_is_computed_once_and_the_tokens_do_not_change(
        tiny: tuple[nn.Module, TextTokenizer], chunk: int | None) -> None:
    model, tok = tiny
    spy = FaultyLM(model, lambda ids, cache: False)
    engine = make(spy, tok, max_running=4, prefill_chunk=chunk)
    params = [SamplingParams(max_new_tokens=8, ignore_eos=True, logprobs=0),
              SamplingParams(max_new_tokens=8, temperature=0.05, seed=1, ignore_eos=True)]
    prompts = [SYSTEM + [60 + 7 * i, 90 - 3 * i, 62 + 5 * i] for i in range(4)]
    handles = []
    computed = []
    for i, prompt in enumerate(prompts):  # one after another: each finds the blocks the first stored
        handles.append(engine.submit(prompt, params[i % 2]))
        spy.calls.clear()
        run_until_idle(engine)
        computed.append(sum(int(ids.size(1)) for ids in spy.calls if ids.size(1) > 1))
    stats = engine.stats()
    assert stats.prompt_tokens == sum(len(p) for p in prompts)
    assert stats.cached_prompt_tokens == 3 * 2 * BLOCK and stats.prefix_cache_bytes > 0
    # prefill widths (float32 on CPU: each forward padded to an even width): the first computes its 43
    # tokens, in one forward (44) or in chunks of 8 (5 x 8 + 4); the others only the 11 after the 32
    # cached, in one forward (12) or in 2 chunks (8 + 4)
    assert computed == [44, 12, 12, 12], computed
    finals = [read(h)[1] for h in handles]
    outputs = [list(f.token_ids) for f in finals]
    assert outputs == [reference(model, tok, p, params[i % 2])[0] for i, p in enumerate(prompts)]
    assert len({tuple(o) for o in outputs}) >= 3  # the answers depend on the prompt
    for prompt, final in zip(prompts[::2], finals[::2], strict=True):  # greedy, with log-probabilities
        want = teacher_forced_logprobs(model, prompt, list(final.token_ids))
        got = torch.tensor([entry.logprob for entry in final.logprobs])
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)  # a prefix in the wrong slots moves these


def teacher_forced_logprobs(model: nn.Module, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """log p(token i | prompt + tokens[:i]) from one forward over the whole sequence, no cache: (n,)"""
    ids = torch.tensor([prompt + tokens])  # (1, T)
    with torch.no_grad():
        logp = torch.log_softmax(model(ids)[0].float(), dim=-1)  # (T, V)
    rows = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(tokens))  # (n,)
    return logp[rows, torch.tensor(tokens)]  # (n,)


def test_requests_with_and_without_a_hit_in_one_prefill(tiny: tuple[nn.Module, TextTokenizer]) -> None:
    """Rows of one padded forward starting at different lengths: a hit, a miss and siblings."""
    model, tok = tiny
    engine = make(model, tok, max_running=8)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    warm = engine.submit(SYSTEM + [90], params)
    run_until_idle(engine)
    prompts = [SYSTEM + [70, 71], list(range(120, 150)), SYSTEM + [70, 71], SYSTEM[:20] + [5, 6, 7]]
    handles = [engine.submit(p, params) for p in prompts]
    run_until_idle(engine)
    assert read(warm)[1].finish_reason == "length"
    assert [list(read(h)[1].token_ids) for h in handles] == [reference(model, tok, p, params)[0] for p in prompts]
    # the first: 32 from the cache; the third: its sibling's row (43); the last: one block (16)
    assert engine.stats().cached_prompt_tokens == 2 * BLOCK + len(prompts[2]) + BLOCK


def test_a_windowed_model_has_no_prefix_cache(tiny: tuple[nn.Module, TextTokenizer]) -> None:
    from models.decoder import DecoderLM

    base, tok = tiny
    windowed = DecoderLM(base.cfg.replace(sliding_window=4)).eval()
    windowed.load_state_dict(base.state_dict())
    assert make(windowed, tok)._batch.prefix is None
    assert make(base, tok, prefix_cache_mib=0)._batch.prefix is None
    assert make(base, tok)._batch.prefix is not None


def test_a_hit_that_would_not_fit_beside_a_long_prompt_is_prefilled_whole(
        tiny: tuple[nn.Module, TextTokenizer]) -> None:
    """One padded forward puts every row's rest at the longest cached length: a 32-token hit beside a
    50-token miss needs 82 slots of a 64-token row, so both are computed whole, with the right tokens."""
    model, tok = tiny
    spy = FaultyLM(model, lambda ids, cache: False)
    engine = make(spy, tok, max_running=4, max_total_tokens=64, prefill_chunk=None)
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    warm = engine.submit(SYSTEM + [90], params)  # stores SYSTEM's two full blocks
    run_until_idle(engine)
    assert read(warm)[1].finish_reason == "length"
    prompts = [SYSTEM + [70, 71], list(range(120, 170))]  # a 32-token hit, a 50-token miss
    spy.calls.clear()
    handles = [engine.submit(p, params) for p in prompts]
    engine.step()
    assert [tuple(ids.shape) for ids in spy.calls[:-1]] == [(2, 50)]  # whole prompts, no hit loaded
    assert engine.stats().cached_prompt_tokens == 0
    run_until_idle(engine)
    assert [list(read(h)[1].token_ids) for h in handles] == [reference(model, tok, p, params)[0] for p in prompts]


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "dense"])
def test_a_next_turn_reuses_the_previous_answer_and_gives_the_same_tokens(
        tiny: tuple[nn.Module, TextTokenizer], paged: bool) -> None:
    """A finished request leaves its prompt and output blocks in the cache: a chat's next turn (the
    earlier prompt, its answer, a new question) computes only the blocks after them, and still gives
    the tokens of offline decoding."""
    model, tok = tiny
    spy = FaultyLM(model, lambda ids, cache: False)
    engine = make(spy, tok, max_running=4, paged=paged)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    first = engine.submit(SYSTEM + [60, 61, 62], params)  # 43 tokens: 2 full prompt blocks
    run_until_idle(engine)
    answer = list(read(first)[1].token_ids)
    assert len(answer) == 40  # the row held 43 + 39 tokens: 5 full blocks, 3 of them output
    assert engine.stats().cached_prompt_tokens == 0
    turn = SYSTEM + [60, 61, 62] + answer + [70, 71, 72, 73]  # 87 tokens
    spy.calls.clear()
    second = engine.submit(turn, params)
    run_until_idle(engine)
    assert engine.stats().cached_prompt_tokens == 5 * BLOCK
    assert [int(ids.size(1)) for ids in spy.calls if ids.size(1) > 1] == [8]  # its last 7 tokens (padded to 8)
    assert list(read(second)[1].token_ids) == reference(model, tok, turn, params)[0]


def test_a_failed_request_leaves_only_its_prompt_blocks(tiny: tuple[nn.Module, TextTokenizer]) -> None:
    """A request its decode step failed (after 34 tokens: 16 + 34 fed, 3 full blocks) keeps no output
    block in the cache; the same request finished keeps them."""
    model, tok = tiny
    decodes: list[int] = []

    def fails(ids: torch.Tensor, cache: object) -> bool:
        decodes.extend([1] if ids.size(1) == 1 else [])
        return len(decodes) == 35

    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    for spy, kept in ((FaultyLM(model, fails), 1), (model, 3)):
        engine = make(spy, tok, max_running=4)
        handle = engine.submit(SYSTEM[:16] + [60], params)
        run_until_idle(engine)
        assert read(handle)[1].finish_reason == ("error" if kept == 1 else "length")
        assert len(engine._batch.prefix) == kept  # the prompt's block (and the output's two)
