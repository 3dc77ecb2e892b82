"""The continuous-batching engine on the tiny decoder: admission and eviction, cancellation, limits,
determinism (alone = among others = models.generate), finish reasons, streamed text, failures.

Most tests drive the scheduler by hand (`engine.step()` on an engine never started) so that what
happens at each step is exact; a few run the engine thread and the asyncio front.
"""

from __future__ import annotations

import asyncio
import copy
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from models.cache.dense import CacheView
from models.decoder import DecoderLM
from models.decoding import SamplingParams
from models.generate import generate
from models.projections.quant import quantize_int8
from models.text import TextTokenizer
from models.tiny import EOS, tiny_model
from service.engine.admission import Ask
from service.engine.batch import PREFILL_MULTIPLE, SHAPE_FREE_MULTIPLE
from service.engine.config import EngineConfig
from service.engine.core import GenerationEngine
from service.engine.events import Delta, Finished, RequestHandle
from service.errors import EngineClosed, EngineOverloaded, InvalidRequest, Overloaded, RequestTooLarge
from service.telemetry.hooks import EngineObserver, EngineStats

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors: one thread is fastest

TEXT = "héllo ¿qué? 日本"


@pytest.fixture(scope="module")
def tiny() -> tuple[nn.Module, TextTokenizer]:
    return tiny_model("decoder")


def make(model: nn.Module, tok: TextTokenizer, observer: EngineObserver | None = None, draft: Any = None,
         **config: Any) -> GenerationEngine:
    # roomy limits unless a test sets its own (the operator defaults suit SmolLM2, not these tests)
    config = {"max_total_tokens": 128, "max_running": 32, "kv_cache_mib": 256, "max_new_tokens": None,
              "max_queued": 256, "prefill_tokens": 4096, **config}
    return GenerationEngine(model, tok, EngineConfig(**config), observer, draft=draft)


def run_until_idle(engine: GenerationEngine, max_steps: int = 1000) -> list[EngineStats]:
    """Step by hand until nothing runs or waits; the stats after each step."""
    seen = []
    for _ in range(max_steps):
        engine.step()
        seen.append(engine.stats())
        if seen[-1].running == 0 and seen[-1].waiting == 0:
            return seen
    raise AssertionError(f"not idle after {max_steps} steps")


def read(handle: RequestHandle) -> tuple[list[Delta], Finished]:
    """All events of a finished request (sync handle): its deltas and its Finished."""
    events = list(handle.events(timeout=5))
    assert isinstance(events[-1], Finished) and all(isinstance(e, Delta) for e in events[:-1])
    return events[:-1], events[-1]  # type: ignore[return-value]


def prompts_of(tok: TextTokenizer, n: int) -> list[list[int]]:
    return [tok.encode(f"request {i}: " + "abc" * (i % 5), add_special_tokens=False) for i in range(n)]


def mixed_params(n: int) -> list[SamplingParams]:
    """Greedy, penalised and seeded sampled rows, each with its own length."""
    kinds = [dict(), dict(repetition_penalty=1.3), dict(temperature=0.9, seed=7, top_k=20),
             dict(temperature=1.2, seed=3, top_p=0.8, repetition_penalty=1.1)]
    return [SamplingParams(max_new_tokens=3 + (5 * i) % 13, **kinds[i % len(kinds)]) for i in range(n)]


class ScriptedLM(nn.Module):
    """The tiny decoder (it still fills the KV cache) whose logits choose script[i] as the i-th new
    token after a prompt of `prompt_len` tokens, then EOS."""

    def __init__(self, base: nn.Module, script: Sequence[int], prompt_len: int) -> None:
        super().__init__()
        self.base, self.cfg, self.prompt_len = base, base.cfg, prompt_len
        self.script = torch.tensor([*script, EOS])

    def forward(self, ids: Tensor, keep: Tensor | None = None, cache: CacheView | None = None,
                last: Tensor | None = None) -> Tensor:
        assert cache is not None
        past = cache.lengths.clone()  # (B,)
        logits = self.base(ids, keep, cache, last)[:, -1:]  # (B, 1, V)
        index = last if last is not None else torch.full_like(past, ids.size(1) - 1)  # (B,)
        step = (past + index + 1 - self.prompt_len).clamp(0, len(self.script) - 1)  # (B,)
        forced = torch.full_like(logits, -1e4)  # (B, 1, V)
        forced[torch.arange(ids.size(0)), 0, self.script[step]] = 0.0
        return forced


class FaultyLM(nn.Module):
    """The tiny decoder, raising when `fails(ids, cache)` says so; records every ids it is given."""

    def __init__(self, base: nn.Module, fails: Callable[[Tensor, CacheView], bool]) -> None:
        super().__init__()
        self.base, self.cfg, self.fails = base, base.cfg, fails
        self.calls: list[Tensor] = []

    def forward(self, ids: Tensor, keep: Tensor | None = None, cache: CacheView | None = None,
                last: Tensor | None = None) -> Tensor:
        assert cache is not None
        self.calls.append(ids.clone())
        if self.fails(ids, cache):
            raise RuntimeError("injected failure")
        return self.base(ids, keep, cache, last)


def reference(model: nn.Module, tok: TextTokenizer, prompt: list[int], params: SamplingParams) -> tuple[list[int], str]:
    out = generate(model, [prompt], params, decode=tok.decode)[0]
    return out.tokens, out.finish_reason


# -- admission, eviction, determinism ------------------------------------------------------------

def test_more_requests_than_rows_all_complete_as_offline_generate(tiny: tuple[nn.Module, TextTokenizer]) -> None:
    model, tok = tiny
    engine = make(model, tok, max_running=3)
    prompts, params = prompts_of(tok, 8), mixed_params(8)
    handles = [engine.submit(p, q) for p, q in zip(prompts, params, strict=True)]
    history = run_until_idle(engine)
    assert (history[0].running, history[0].waiting) == (3, 5)
    assert max(s.running for s in history) == 3
    waiting = [s.waiting for s in history]
    assert waiting == sorted(waiting, reverse=True) and waiting[-1] == 0  # admitted as rows free
    for prompt, p, handle in zip(prompts, params, handles, strict=True):
        _, final = read(handle)
        tokens, reason = reference(model, tok, prompt, p)
        assert list(final.token_ids) == tokens and final.finish_reason == reason
        assert final.usage.prompt_tokens == len(prompt)
        assert final.usage.completion_tokens == len(tokens) + (reason == "stop")
    assert sum(history[-1].finished.values()) == 8


def test_evicted_rows_are_packed_and_reused(tiny: tuple[nn.Module, TextTokenizer]) -> None:
    model, tok = tiny
    engine = make(model, tok, max_running=4)
    prompts = [list(range(3 + 25 * i, 3 + 25 * i + 4 + i)) for i in range(10)]  # disjoint token sets
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True, repetition_penalty=(1.0, 3.0)[n % 2])
              for n in (2, 9, 3, 7, 1, 5, 4, 8, 2, 6)]  # a moved row takes its seen-token mask along
    handles = [engine.submit(p, q) for p, q in zip(prompts, params, strict=True)]
    for _ in range(200):
        engine.step()
        running = engine.stats().running
        lengths = engine.cache.lengths
        assert (lengths[:running] > 0).all() and (lengths[running:] == 0).all()  # live rows packed in front
        if running == 0 and engine.stats().waiting == 0:
            break
    for prompt, p, handle in zip(prompts, params, handles, strict=True):
        final = read(handle)[1]
        assert list(final.token_ids) == reference(model, tok, prompt, p)[0]
        assert final.finish_reason == "length" and len(final.token_ids) == p.max_new_tokens
    assert engine.stats().cache_usage == 0.0


def test_prompts_of_very_different_lengths_are_prefilled_in_separate_forwards(
        tiny: tuple[nn.Module, TextTokenizer]) -> None:
    model, tok = tiny
    spy = FaultyLM(model, lambda ids, cache: False)
    engine = make(spy, tok, max_running=8)
    prompts = [list(range(3 + i, 3 + i + n)) for i, n in enumerate((90, 2, 3, 88, 2))]  # all different
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    handles = [engine.submit(p, params) for p in prompts]
    engine.step()  # all five admitted in one step
    prefills = sorted(tuple(ids.shape) for ids in spy.calls[:-1])  # the last call is the decode step
    # not one (5, 90) forward, 85 % padding; in float32 on CPU each B x T padded only to a multiple of
    # 2 (SHAPE_FREE_MULTIPLE): (3, 3) would be 9 rows
    assert prefills == [(2, 90), (3, 4)], prefills
    assert tuple(spy.calls[-1].shape) == (5, 1)
    run_until_idle(engine)
    for prompt, handle in zip(prompts, handles, strict=True):
        assert list(read(handle)[1].token_ids) == reference(model, tok, prompt, params)[0]


def test_requests_with_the_same_prompt_share_one_prefill(tiny: tuple[nn.Module, TextTokenizer]) -> None:
    """n > 1 siblings (and any identical prompts admitted together) are prefilled once and copied;
    each still samples on its own generator, as it would alone."""
    model, tok = tiny
    spy = FaultyLM(model, lambda ids, cache: False)
    engine = make(spy, tok, max_running=8)
    shared, other = tok.encode("a shared system prompt", add_special_tokens=False), [5, 6, 7]
    params = [SamplingParams(max_new_tokens=12, temperature=0.9, seed=s, ignore_eos=True) for s in range(4)]
    handles = [engine.submit(shared, p) for p in params] + [engine.submit(other, params[0])]
    engine.step()
    prefill_rows = sum(ids.size(0) for ids in spy.calls[:-1])
    assert prefill_rows == 2  # one row for the four siblings, one for the other prompt
    run_until_idle(engine)
    outputs = [list(read(h)[1].token_ids) for h in handles]
    assert outputs[:4] == [reference(model, tok, shared, p)[0] for p in params]
    assert outputs[4] == reference(model, tok, other, params[0])[0]
    assert len({tuple(o) for o in outputs[:4]}) == 4  # four seeds, four different continuations


@pytest.mark.parametrize(("dtype", "multiple"), [(torch.bfloat16, PREFILL_MULTIPLE), (torch.float32, SHAPE_FREE_MULTIPLE)],
                         ids=["bfloat16", "float32"])
def test_prefill_row_counts_are_multiples_within_the_cache_row(tiny: tuple[nn.Module, TextTokenizer],
                                                               dtype: torch.dtype, multiple: int) -> None:
    """B x T of every prefill is a multiple of 32 in 16-bit floats (a bounded set of oneDNN Linear
    shapes) and of 2 in float32 on CPU (little padding), except where the cache row ends first; the
    answers are those of unpadded offline decoding."""
    model, tok = tiny
    model = model if dtype == torch.float32 else copy.deepcopy(model).to(dtype)
    spy = FaultyLM(model, lambda ids, cache: False)
    engine = make(spy, tok, max_running=8, max_total_tokens=40, prefill_tokens=64, prefix_cache_mib=0)  # shared prefixes
    assert engine._batch.multiple == multiple
    prompts = [list(range(3, 3 + n)) for n in (5, 7, 6, 30, 1, 2, 3, 38)]
    params = SamplingParams(max_new_tokens=2, ignore_eos=True)
    handles = [engine.submit(p, params) for p in prompts]
    run_until_idle(engine)
    prefills = [tuple(ids.shape) for ids in spy.calls if ids.shape[1] > 1]
    assert prefills, spy.calls
    for b, t in prefills:
        assert (b * t) % multiple == 0 or t == 40, prefills  # 40: max_total_tokens, the cache row
    # the 38-token prompt: in bfloat16 padded to the row's end, not 64; in float32 not padded past 38
    assert any(t == 40 for _, t in prefills) == (multiple == PREFILL_MULTIPLE), prefills
    for prompt, handle in zip(prompts, handles, strict=True):
        assert list(read(handle)[1].token_ids) == reference(model, tok, prompt, params)[0]


@pytest.mark.parametrize("quantized", [False, True], ids=["fp32", "int8"])
def test_same_tokens_alone_and_among_16_concurrent(tiny: tuple[nn.Module, TextTokenizer], quantized: bool) -> None:
    model, tok = tiny
    if quantized:  # per-token activation scales: a row's tokens never depend on its company
        model = quantize_int8(tiny_model("decoder")[0])
    targets = [SamplingParams(max_new_tokens=12), SamplingParams(max_new_tokens=12, temperature=1.0, seed=42,
                                                                 top_p=0.9)]
    prompt = tok.encode("the same request", add_special_tokens=False)
    alone = []
    for p in targets:
        engine = make(model, tok, max_running=8)
        handle = engine.submit(prompt, p)
        run_until_idle(engine)
        alone.append(read(handle)[1].token_ids)
        assert list(alone[-1]) == reference(model, tok, prompt, p)[0]
    with make(model, tok, max_running=8) as engine:  # the engine thread; rows free and refill mid-way
        others = [engine.submit(q, p) for q, p in zip(prompts_of(tok, 8), mixed_params(8), strict=True)]
        mine = [engine.submit(prompt, p) for p in targets]
        others += [engine.submit(q, p) for q, p in zip(prompts_of(tok, 16)[8:], mixed_params(16)[8:], strict=True)]
        together = [h.result_sync(timeout=20).token_ids for h in mine]
        assert all(h.result_sync(timeout=20).finish_reason in ("stop", "length") for h in others)
    assert together == alone


def full_recomputation_greedy(model: nn.Module, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens without a KV cache: the whole sequence through the model at every step."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


def test_a_windowed_model_runs_on_rows_of_its_window(tiny: tuple[nn.Module, TextTokenizer]) -> None:
    """A sliding window of 4: cache rows hold 4 slots (so the same budget holds 32x the rows of
    128-token rows), and requests longer than the window, packed and moved among others, give the
    tokens of a full recomputation without a cache."""
    base, tok = tiny
    windowed = DecoderLM(base.cfg.replace(sliding_window=4)).eval()
    windowed.load_state_dict(base.state_dict())
    full = make(base, tok, max_total_tokens=128, max_running=1024, kv_cache_mib=1, paged=False)
    engine = make(windowed, tok, max_total_tokens=128, max_running=1024, kv_cache_mib=1)
    assert engine.cache.ring and engine.cache.slots == 4
    assert engine.limits.row_bytes * 32 == full.limits.row_bytes and engine.limits.rows == 32 * full.limits.rows
    prompts = prompts_of(tok, 6)
    assert min(len(p) for p in prompts) > 4
    want = [full_recomputation_greedy(windowed, p, 10) for p in prompts]
    assert want != [full_recomputation_greedy(base, p, 10) for p in prompts]  # the window changes the answer
    engine = make(windowed, tok, max_total_tokens=128, max_running=3)  # rows free, move and refill
    handles = [engine.submit(p, SamplingParams(max_new_tokens=10 - i % 3, ignore_eos=True))
               for i, p in enumerate(prompts)]
    run_until_idle(engine)
    assert [list(read(h)[1].token_ids) for h in handles] == [w[:10 - i % 3] for i, w in enumerate(want)]


# -- cancellation ----------------------------------------------------------------------------------

def test_cancel_running_frees_its_row_within_one_step(tiny: tuple[nn.Module, TextTokenizer]) -> None:
    model, tok = tiny
    engine = make(model, tok, max_running=2)
    long = engine.submit(tok.encode("long", add_special_tokens=False), SamplingParams(max_new_tokens=60, ignore_eos=True))
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    other = engine.submit(tok.encode("other one", add_special_tokens=False), params)
    for _ in range(3):
        engine.step()
    assert engine.stats().running == 2
    assert engine.cancel(long.request_id)
    engine.step()
    assert engine.stats().running == 1 and int(engine.cache.lengths[1]) == 0  # freed, the other moved to row 0
    deltas, final = read(long)
    assert final.finish_reason == "cancelled" and "".join(d.text for d in deltas) == final.text
    assert final.usage.completion_tokens == 4  # the prefill token + one decode token per step
    assert not engine.cancel(long.request_id)
    run_until_idle(engine)
    assert list(read(other)[1].token_ids) == reference(model, tok, tok.encode("other one", add_special_tokens=False),
                                                       params)[0]


def test_cancelled_waiting_request_is_never_prefilled(tiny: tuple[nn.Module, TextTokenizer]) -> None:
    model, tok = tiny
    faulty = FaultyLM(model, lambda ids, cache: False)
    engine = make(faulty, tok, max_running=1)
    first = engine.submit([10, 11, 12], SamplingParams(max_new_tokens=4))
    waiting = engine.submit([200, 201, 202, 203], SamplingParams(max_new_tokens=4))
    engine.step()
    assert engine.cancel(waiting.request_id)
    _, final = read(waiting)  # finished at once, before any further step
    assert final.finish_reason == "cancelled" and final.timing.queued_s is None
    assert final.usage.completion_tokens == 0 and final.text == ""
    assert engine.stats().waiting == 0
    run_until_idle(engine)
    assert read(first)[1].finish_reason in ("stop", "length")
    assert not any((ids == 200).any() for ids in faulty.calls)


# -- limits ----------------------------------------------------------------------------------------

def test_overloaded_at_submit_past_the_free_rows_and_the_queue(tiny: tuple[nn.Module, TextTokenizer]) -> None:
    model, tok = tiny
    engine = make(model, tok, max_running=3, max_queued=2)
    for i in range(5):  # 3 for the free rows (taken at the next step), 2 queued
        engine.submit([5, 6 + i])
    with pytest.raises(EngineOverloaded, match="max_queued") as err:
        engine.submit([9])
    assert isinstance(err.value, Overloaded) and err.value.status == 503
    assert engine.stats().waiting == 5
    engine.step()  # admits 3: their rows are held now
    assert engine.stats().running == 3 and engine.stats().waiting == 2
    with pytest.raises(EngineOverloaded, match="max_queued"):
        engine.submit([9])  # no free row: the 2 waiting fill the queue


def test_requests_being_admitted_hold_their_rows_for_admission(tiny: tuple[nn.Module, TextTokenizer],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """While a step prefills the requests it took from the queue, they hold their rows: requests that
    arrive meanwhile see no free row (before, they saw every row free until the step ended, and a
    burst got past max_queued while a long prefill ran)."""
    model, tok = tiny
    engine = make(model, tok, max_running=3, max_queued=2)
    for i in range(3):
        engine.submit([5, 6 + i])
    outcomes: list[str] = []
    forward = model.forward

    def arrivals_during_prefill(ids, *args, **kwargs):  # type: ignore[no-untyped-def]
        if ids.size(1) > 1 and not outcomes:
            for i in range(3):
                try:
                    engine.submit([7, 8 + i])
                    outcomes.append("queued")
                except EngineOverloaded:
                    outcomes.append("refused")
        return forward(ids, *args, **kwargs)

    monkeypatch.setattr(model, "forward", arrivals_during_prefill)
    engine.step()
    assert outcomes == ["queued", "queued", "refused"]  # the 3 rows are taken: only the queue's 2
    assert engine.stats().running == 3 and engine.stats().waiting == 2


@pytest.mark.parametrize("prompt_len, max_new, limit", [
    (41, 1, "max_prompt_tokens"),
    (2, 31, "max_new_tokens"),
    (30, 30, "max_total_tokens"),
])
def test_requests_over_a_limit_are_rejected_naming_it(tiny: tuple[nn.Module, TextTokenizer], prompt_len: int,
                                                      max_new: int, limit: str) -> None:
    model, tok = tiny
    engine = make(model, tok, max_total_tokens=50, max_prompt_tokens=40, max_new_tokens=30)
    with pytest.raises(RequestTooLarge, match=limit) as err:
        engine.submit([5] * prompt_len, SamplingParams(max_new_tokens=max_new))
    assert err.value.limit == limit and err.value.status == 422
    assert engine.stats().waiting == 0


def test_invalid_prompts_and_cache_budget(tiny: tuple[nn.Module, TextTokenizer]) -> None:
    model, tok = tiny
    engine = make(model, tok)
    for bad in ([], [model.cfg.vocab_size]):
        with pytest.raises(InvalidRequest, match="prompt"):
            engine.submit(bad)
    engine.submit([5], request_id="a")
    with pytest.raises(InvalidRequest, match="already in use"):
        engine.submit([5], request_id="a")
    row = 2 * model.cfg.n_layers * model.cfg.kv_heads * 128 * model.cfg.head_dim * 4  # float32 K and V
    rows = {"max_running": 64, "paged": False}
    assert make(model, tok, **rows, kv_cache_mib=(5 * row + 1) / 2**20).limits.rows == 5
    assert make(model, tok, **rows, kv_cache_mib=5 * row / 2**20).cache.nbytes() == 5 * row
    with pytest.raises(ValueError, match="kv_cache_mib"):
        make(model, tok, paged=False, kv_cache_mib=(row - 1) / 2**20)
    # paged: 64 sequences share blocks of 16 tokens (+ the null block); one full sequence must fit
    paged = make(model, tok, max_running=64, kv_cache_mib=(5 * row + 1) / 2**20)
    assert paged.limits.rows == 64 and paged.cache.blocks_total == 5 * 128 // 16
    trash = 2 * model.cfg.n_layers * model.cfg.head_dim * 4  # one trash slot per layer's keys and values
    assert paged.cache.nbytes() == (5 * 128 // 16 + 1) * row // 8 + trash
    with pytest.raises(ValueError, match="kv_cache_mib=.* holds 7 blocks of 16 tokens; one sequence of "
                                         "max_total_tokens=128 needs 8"):
        make(model, tok, kv_cache_mib=(row - 1) / 2**20)
    # never more blocks than max_running sequences of max_total_tokens fill, whatever the budget
    assert make(model, tok, max_running=3, kv_cache_mib=2**16).cache.blocks_total == 3 * 128 // 16


# -- finish reasons and streamed text --------------------------------------------------------------

def scripted(tiny: tuple[nn.Module, TextTokenizer], text: str, prompt: list[int], **config: Any) -> GenerationEngine:
    model, tok = tiny
    return make(ScriptedLM(model, tok.encode(text, add_special_tokens=False), len(prompt)), tok, **config)


@pytest.mark.parametrize("params, text, reason, n_tokens", [
    (SamplingParams(max_new_tokens=100), TEXT, "stop", len(TEXT.encode()) + 1),  # eos
    (SamplingParams(max_new_tokens=5), "héll", "length", 5),
    (SamplingParams(max_new_tokens=100, stop=("¿q", "xyz")), "héllo ", "stop", 10),  # cut at a stop string
    (SamplingParams(max_new_tokens=100, stop=("qué!",)), TEXT, "stop", len(TEXT.encode()) + 1),  # held back, released
])
def test_finish_reasons_and_streamed_text(tiny: tuple[nn.Module, TextTokenizer], params: SamplingParams,
                                          text: str, reason: str, n_tokens: int) -> None:
    prompt = [20, 21, 22]
    engine = scripted(tiny, TEXT, prompt)
    handle = engine.submit(prompt, params)
    run_until_idle(engine)
    deltas, final = read(handle)
    assert final.finish_reason == reason and final.text == text
    assert "".join(d.text for d in deltas) == final.text
    assert all(d.text and "\ufffd" not in d.text for d in deltas)
    assert final.usage.completion_tokens == n_tokens == len(final.timing.token_times_s)
    assert len(deltas) < n_tokens  # bytes of one character wait for the rest of it


def test_stop_token_id_ends_without_it(tiny: tuple[nn.Module, TextTokenizer]) -> None:
    model, tok = tiny
    prompt = [20, 21]
    question = tok.encode("¿", add_special_tokens=False)
    engine = scripted(tiny, TEXT, prompt)
    handle = engine.submit(prompt, SamplingParams(max_new_tokens=100, stop_token_ids=(question[0],)))
    run_until_idle(engine)
    final = read(handle)[1]
    assert final.finish_reason == "stop" and final.text == "héllo "
    assert list(final.token_ids) == tok.encode("héllo ", add_special_tokens=False)


def test_streamed_pieces_add_up_with_random_bytes(tiny: tuple[nn.Module, TextTokenizer]) -> None:
    model, tok = tiny
    engine = make(model, tok, max_running=4)
    handles = [engine.submit(p, SamplingParams(max_new_tokens=40, temperature=1.5, seed=i, stop=("e", "th")))
               for i, p in enumerate(prompts_of(tok, 6))]
    run_until_idle(engine)
    for handle in handles:
        deltas, final = read(handle)
        assert "".join(d.text for d in deltas) == final.text
        assert [d.completion_tokens for d in deltas] == sorted(d.completion_tokens for d in deltas)


# -- failures --------------------------------------------------------------------------------------

POISON = 250


def test_a_failing_prefill_fails_only_its_request(tiny: tuple[nn.Module, TextTokenizer]) -> None:
    model, tok = tiny
    engine = make(FaultyLM(model, lambda ids, cache: bool((ids == POISON).any())), tok, max_running=4)
    only_the_poisoned_fails(engine, model, tok, [[30, 31, 32], [40, POISON, 42, 43], [50, 51]])


def only_the_poisoned_fails(engine: GenerationEngine, model: nn.Module, tok: TextTokenizer,
                            prompts: list[list[int]]) -> None:
    """Run three prompts, the second holding POISON: it ends with the injected error, the others as
    offline decoding gives them."""
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    handles = [engine.submit(p, params) for p in prompts]
    run_until_idle(engine)
    bad = read(handles[1])[1]
    assert bad.finish_reason == "error" and "injected failure" in (bad.error or "")
    for i in (0, 2):
        assert list(read(handles[i])[1].token_ids) == reference(model, tok, prompts[i], params)[0]


def test_a_failing_decode_row_fails_alone_and_a_transient_failure_is_retried(
        tiny: tuple[nn.Module, TextTokenizer]) -> None:
    model, tok = tiny
    calls = {"decode": 0}

    def fails(ids: Tensor, cache: CacheView) -> bool:
        if ids.size(1) != 1:
            return False
        calls["decode"] += 1
        return calls["decode"] == 2 or bool((cache.lengths >= 40).any())  # once, and the long row always

    engine = make(FaultyLM(model, fails), tok, max_running=4)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    prompts = [[30, 31, 32], [60] * 38, [50, 51]]
    handles = [engine.submit(p, params) for p in prompts]
    run_until_idle(engine)
    bad = read(handles[1])[1]
    assert bad.finish_reason == "error" and bad.usage.completion_tokens == 3  # failed at length 40
    for i in (0, 2):
        assert list(read(handles[i])[1].token_ids) == reference(model, tok, prompts[i], params)[0]
    after = engine.submit([30, 31, 32], params)
    run_until_idle(engine)
    assert list(read(after)[1].token_ids) == reference(model, tok, [30, 31, 32], params)[0]


def test_a_broken_step_fails_running_requests_and_the_engine_goes_on(
        tiny: tuple[nn.Module, TextTokenizer], monkeypatch: pytest.MonkeyPatch) -> None:
    model, tok = tiny
    with make(model, tok) as engine:
        real_decode, broken = engine._decode, {"left": 1}

        def decode_once_broken() -> None:
            if broken["left"]:
                broken["left"] -= 1
                raise KeyError("scheduler bug")
            real_decode()

        monkeypatch.setattr(engine, "_decode", decode_once_broken)
        failed = engine.submit([30, 31], SamplingParams(max_new_tokens=5)).result_sync(timeout=10)
        assert failed.finish_reason == "error" and "scheduler bug" in (failed.error or "")
        ok = engine.submit([30, 31], SamplingParams(max_new_tokens=5)).result_sync(timeout=10)
        assert ok.finish_reason in ("stop", "length") and engine.stats().running == 0


# -- thread, asyncio front, metrics, shutdown ------------------------------------------------------

class Recorder(EngineObserver):
    def __init__(self) -> None:
        self.admitted: list[int] = []
        self.ttft: list[float] = []
        self.itl: list[float] = []
        self.generated = 0
        self.finished: list[Finished] = []

    def on_admitted(self, queued_s: float, prompt_tokens: int, cached_tokens: int = 0) -> None:
        self.admitted.append(prompt_tokens)

    def on_first_token(self, ttft_s: float) -> None:
        self.ttft.append(ttft_s)

    def on_inter_token(self, seconds: float) -> None:
        self.itl.append(seconds)

    def on_step(self, stats: EngineStats, generated: int, step_s: float) -> None:
        self.generated += generated

    def on_finished(self, event: Finished) -> None:
        self.finished.append(event)


def test_async_streaming_cancel_and_metrics(tiny: tuple[nn.Module, TextTokenizer]) -> None:
    model, tok = tiny
    recorder = Recorder()
    engine = make(model, tok, recorder, max_running=4).start()
    prompts = prompts_of(tok, 5)

    async def stream(prompt: list[int], cancel_after: int | None) -> tuple[str, Finished]:
        handle = engine.submit(prompt, SamplingParams(max_new_tokens=30, ignore_eos=True, temperature=1.0, seed=1))
        pieces = []
        async for event in handle:
            if isinstance(event, Finished):
                return "".join(pieces), event
            pieces.append(event.text)
            if cancel_after is not None and len(pieces) == cancel_after:
                handle.cancel()
        raise AssertionError("no Finished event")

    async def main() -> list[tuple[str, Finished]]:
        return await asyncio.wait_for(asyncio.gather(*(stream(p, 2 if i == 0 else None)
                                                       for i, p in enumerate(prompts))), 20)

    try:
        results = asyncio.run(main())
    finally:
        engine.shutdown()  # joins the loop: its last on_step has run
    stats = engine.stats()
    assert results[0][1].finish_reason == "cancelled" and results[0][1].usage.completion_tokens < 30
    assert all(final.finish_reason == "length" for _, final in results[1:])
    assert all(text == final.text for text, final in results)
    completion = sum(final.usage.completion_tokens for _, final in results)
    assert stats.generated_tokens == recorder.generated == completion
    assert stats.prompt_tokens == sum(recorder.admitted) == sum(len(p) for p in prompts)
    assert len(recorder.ttft) == 5 and len(recorder.itl) == completion - 5
    assert stats.finished == {"cancelled": 1, "length": 4} and len(recorder.finished) == 5
    for _, final in results:
        t = final.timing
        assert 0 <= (t.queued_s or 0) <= (t.first_token_s or 0) <= t.total_s
        assert len(t.inter_token_s) == final.usage.completion_tokens - 1 and min(t.inter_token_s) >= 0


def test_idle_engine_sleeps_and_shutdown_ends_open_requests(tiny: tuple[nn.Module, TextTokenizer]) -> None:
    model, tok = tiny

    class IdleSignal(EngineObserver):
        def __init__(self) -> None:
            self.idle = threading.Event()

        def on_step(self, stats: EngineStats, generated: int, step_s: float) -> None:
            if stats.running == 0 and stats.waiting == 0:
                self.idle.set()

    signal = IdleSignal()
    engine = make(model, tok, signal, max_running=1).start()
    time.sleep(0.1)
    assert engine.stats().steps == 0  # no busy loop while idle
    engine.submit([30], SamplingParams(max_new_tokens=3)).result_sync(timeout=10)
    assert signal.idle.wait(timeout=5)
    steps = engine.stats().steps
    time.sleep(0.1)
    assert engine.stats().steps == steps > 0
    engine.shutdown()
    with pytest.raises(EngineClosed):
        engine.submit([30])
    idle = make(model, tok)  # never started: shutdown ends what waits
    handle = idle.submit([30])
    idle.shutdown()
    final = read(handle)[1]
    assert final.finish_reason == "error" and "shut down" in (final.error or "")


def test_logprobs_follow_the_text_a_stop_string_cuts_and_carry_each_tokens_bytes(
        tiny: tuple[nn.Module, TextTokenizer]) -> None:
    model, tok = tiny
    engine = make(model, tok)
    prompt = tok.encode("héllo ¿qué? 日本", add_special_tokens=False)

    def answer(**extra: Any) -> tuple[list[Delta], Finished]:
        handle = engine.submit(prompt, SamplingParams(max_new_tokens=60, ignore_eos=True, logprobs=1, **extra))
        run_until_idle(engine)
        return read(handle)

    deltas, free = answer()
    assert free.logprobs is not None and len(free.logprobs) == 60
    raw = b"".join(bytes(e.bytes) for e in free.logprobs)
    assert raw.decode("utf-8", "replace") == free.text  # a byte of a character is that byte, not U+FFFD
    assert [e.offset for e in free.logprobs] == sorted(e.offset for e in free.logprobs)
    assert [e for d in deltas for e in d.logprobs] == list(free.logprobs)  # streamed = whole
    # a stop of two ASCII characters past the start, at its first occurrence: its tokens are its own
    at = next(i for i in range(4, len(free.text) - 1) if free.text[i:i + 2].isascii()
              and free.text[i:i + 2].isprintable() and free.text.index(free.text[i:i + 2]) == i)
    stop = free.text[at:at + 2]
    deltas, cut = answer(stop=(stop,))
    assert cut.text == free.text[:at] and cut.logprobs is not None
    assert all(e.offset < at for e in cut.logprobs) and len(cut.logprobs) < 60  # none from the stop string on
    assert raw.decode("utf-8", "replace").startswith(b"".join(bytes(e.bytes) for e in cut.logprobs)
                                                     .decode("utf-8", "replace")[:at])
    sent = 0
    for d in deltas:  # each piece's log-probabilities are those of tokens whose text it (or earlier) sent
        sent += len(d.text)
        assert all(e.offset < max(sent, 1) for e in d.logprobs)
    assert [e for d in deltas for e in d.logprobs] == list(cut.logprobs)


# -- admission that knows the deadline --------------------------------------------------------------

class AdmissionLog(EngineObserver):
    def __init__(self) -> None:
        self.calls: list[tuple[float | None, str | None]] = []

    def on_admission(self, wait_s: float | None, refused: str | None) -> None:
        self.calls.append((wait_s, refused))


def test_a_request_that_cannot_start_before_its_deadline_is_refused_at_once(
        tiny: tuple[nn.Module, TextTokenizer]) -> None:
    """The wait for a row (requests ahead x tokens per request x measured step time / rows) against the
    request's deadline: refused with EngineOverloaded at submit instead of queued into a 504."""
    model, tok = tiny
    log = AdmissionLog()
    engine = make(model, tok, log, max_running=1)
    long = SamplingParams(max_new_tokens=100, ignore_eos=True)
    first = engine.submit([5, 6, 7], long, deadline=time.perf_counter() + 0.001)  # a cold engine admits it
    for _ in range(5):
        engine.step()  # the step time is measured
    queued = engine.submit([5, 6], long)  # waits for the only row: ~100 steps
    wait = engine._wait.wait_s(2, 0, 1)  # both asked for 100 tokens
    assert wait > 0
    with pytest.raises(EngineOverloaded, match="deadline"):
        engine.submit([5], long, deadline=time.perf_counter() + wait / 4)
    late = engine.submit([5], long, deadline=time.perf_counter() + 1000 * wait)  # time enough: queued
    assert engine.stats().waiting == 2
    own = engine._wait.run_s(Ask(100, exact=True))  # its own 100 steps, once it has the row
    with pytest.raises(EngineOverloaded, match="deadline"):  # it would start in time, not end in time
        engine.submit([5], long, deadline=time.perf_counter() + engine._wait.wait_s(3, 0, 1) + own / 2, whole=True)
    assert [refused for _, refused in log.calls] == [None, None, "deadline", None, "deadline"]
    assert engine._wait.decode_s is not None
    engine.forget_timings()  # a replica's warm-up steps are cold: forgotten, the next request is admitted
    assert engine._wait.step_s is None and engine._wait.decode_s is None and engine.prefill_budget() > 0
    assert log.calls[0][0] == 0.0 and log.calls[2][0] > wait / 4
    run_until_idle(engine)
    for handle in (first, queued, late):
        assert read(handle)[1].finish_reason == "length"


def test_the_wait_estimate_follows_rows_tokens_and_step_time() -> None:
    from service.engine.admission import WaitEstimator

    est = WaitEstimator()
    est.on_asked([50])
    assert est.wait_s(10, 0, 4) == 0.0  # no step measured: never refuse
    est.on_step(0.02)
    assert est.wait_s(3, 4, 4) == 0.0  # a free row for each
    est.on_asked([50, 50])
    assert est.wait_s(6, 4, 4) == pytest.approx(2 * 50 * 0.02 / 4)  # two rows must free up
    for _ in range(50):
        est.on_finished(10)
    assert est.wait_s(6, 4, 4) == pytest.approx(2 * 10 * 0.02 / 4)  # measured tokens win


def test_before_any_request_finished_the_wait_uses_what_requests_are_expected_to_take() -> None:
    from service.engine.admission import Ask, WaitEstimator

    assert Ask(128).prior == 128 and Ask(128, expected=22).prior == 22 and Ask(8, expected=22).prior == 8
    est = WaitEstimator()
    est.on_step(0.02)
    est.on_asked([Ask(128, expected=22).prior] * 2)
    assert est.wait_s(6, 4, 4) == pytest.approx(2 * 22 * 0.02 / 4)  # not 128 tokens a request


def test_a_whole_answer_must_fit_its_own_decoding_before_its_deadline() -> None:
    """A stream's deadline covers its start, a whole answer's the wait and its own decoding: about
    min(max_new_tokens, tokens per request) steps, or all max_new_tokens when it ignores eos."""
    from service.engine.admission import Ask, WaitEstimator

    est = WaitEstimator()
    assert est.late_s([Ask(400, True, 1.5, whole=True)], 0.0, 1.0) is None  # cold: nothing measured, admit
    est.on_step(0.01)
    for _ in range(50):
        est.on_finished(20)
    assert est.run_s(Ask(400, exact=True)) == pytest.approx(4.0)  # ignores eos: all 400 steps
    assert est.run_s(Ask(400)) == pytest.approx(0.2)  # may stop at eos: the 20 a request takes
    assert est.run_s(Ask(5)) == pytest.approx(0.05)  # never past its max_new_tokens
    est.on_step(2.0, prefilled=True)  # a long prompt's step: the queue's wait counts it, decoding does not
    assert est.run_s(Ask(5)) == pytest.approx(0.05) and est.step_s == pytest.approx(0.8 * 0.01 + 0.2 * 2.0)
    est.step_s = 0.01
    now = 100.0
    stream, whole = Ask(400, True, now + 3.0), Ask(400, True, now + 3.0, whole=True)
    assert est.late_s([stream], 1.0, now) is None  # starts after 1 s: in time
    assert est.late_s([whole], 1.0, now) == pytest.approx(5.0)  # 1 s wait + 4 s of its own: too late
    assert est.late_s([Ask(400, False, now + 3.0, whole=True)], 1.0, now) is None  # 1.2 s in all
    assert est.late_s([stream, Ask(1, deadline=now + 0.5)], 1.0, now) == pytest.approx(1.0)  # any one late
    assert est.late_s([Ask(400, True, None, whole=True)], 1e9, now) is None  # no deadline


def test_the_engine_thread_runs_with_the_compiled_blocks_settings(tiny: tuple[nn.Module, TextTokenizer]) -> None:
    """torch keeps its compiler settings per thread: the engine's thread sets the ones compiled blocks
    need (a thread of torch's defaults allows 8 graphs, and past them a block runs eager)."""
    from models.execution.compiled import RECOMPILE_LIMIT

    fresh: list[int] = []
    probe = threading.Thread(target=lambda: fresh.append(torch._dynamo.config.recompile_limit))
    probe.start()
    probe.join()
    seen: list[tuple[int, bool]] = []
    model, tok = tiny

    def after_step() -> None:
        seen.append((torch._dynamo.config.recompile_limit, torch.fx.experimental._config.use_duck_shape))

    engine = GenerationEngine(model, tok, EngineConfig(max_total_tokens=64, kv_cache_mib=16), after_step=after_step)
    with engine.start():
        engine.submit([5, 6], SamplingParams(max_new_tokens=2)).result_sync(timeout=30)
    assert fresh == [8] and seen and seen[0] == (RECOMPILE_LIMIT, False)


def test_a_step_time_target_cuts_the_prefill_budget_to_the_measured_rate(tiny: tuple[nn.Module, TextTokenizer]) -> None:
    """prefill_step_ms: an admission step takes the prompt tokens the measured prefill rate computes in
    that time (at least one request, at most prefill_tokens); nothing changes before a measurement,
    and the tokens are those of offline generate."""
    model, tok = tiny
    spy = FaultyLM(model, lambda ids, cache: False)
    engine = make(spy, tok, max_running=8, prefill_step_ms=10.0)
    assert engine.prefill_budget() == 4096  # nothing measured yet
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    first = engine.submit(list(range(3, 35)), params)
    engine.step()  # one prefill measured
    assert engine._prefill_token_s is not None and engine._prefill_token_s > 0
    engine._prefill_token_s = 0.010 / 40  # 40 padded tokens in 10 ms
    assert engine.prefill_budget() == 40
    prompts = [list(range(4 + i, 36 + i)) for i in range(4)]  # 32 tokens each: one fits 40, two do not
    handles = [engine.submit(p, params) for p in prompts]
    engine._prefill_token_s = 0.010 / 40
    spy.calls.clear()
    engine.step()
    assert [tuple(ids.shape) for ids in spy.calls[:-1]] == [(1, 32)]  # one request this step
    run_until_idle(engine)
    for prompt, handle in zip([list(range(3, 35)), *prompts], [first, *handles], strict=True):
        assert list(read(handle)[1].token_ids) == reference(model, tok, prompt, params)[0]
    assert make(spy, tok).prefill_budget() == 4096  # no target: prefill_tokens
    engine._prefill_token_s = 1.0  # a very slow prefill: still one request a step
    assert engine.prefill_budget() == 1


def test_a_grammar_that_fails_mid_generation_ends_its_request_as_the_requests_fault(monkeypatch) -> None:  # noqa: ANN001
    """A structured output's matcher that refuses a token (a grammar it cannot follow on): that request
    ends with finish_reason "error" typed as the request's own fault (a 422 at the API, not a 500),
    naming the field, and the request beside it decodes on."""
    from service.engine import grammar as grammars
    from service.messages import GrammarSpec

    model, tok = tiny_model("decoder")
    engine = make(model, tok)
    compiled = engine.grammars.compile(GrammarSpec("regex", "(ab ){8}"))
    accept = grammars.Matcher.accept_token
    seen: list[int] = []

    def refuses_the_third(self, token: int) -> bool:  # noqa: ANN001
        seen.append(token)
        return accept(self, token) and len(seen) < 3

    monkeypatch.setattr(grammars.Matcher, "accept_token", refuses_the_third)
    free = engine.submit(prompts_of(tok, 1)[0], SamplingParams(max_new_tokens=12, ignore_eos=True))
    ruled = engine.submit(prompts_of(tok, 1)[0], SamplingParams(max_new_tokens=20), grammar=compiled)
    run_until_idle(engine)
    _, failed = read(ruled)
    assert failed.finish_reason == "error" and failed.error_type == "invalid_request_error"
    assert failed.error_param == "response_format" and "grammar failed after 2 tokens" in failed.error
    _, done = read(free)
    assert done.finish_reason == "length" and len(done.token_ids) == 12
