"""The engine with a prompt model (ModelSpec.prompt_weights "float": prompts on the float32 weights,
decode steps on the quantized blocks). The stand-in here is a second tiny decoder with other weights,
so any prompt token computed with the wrong model changes the tokens: a request's tokens must be
those of prefilling its prompt with the prompt model and decoding with the decode model, alone or
batched, chunked or whole, with or without a prefix hit, preempted or not.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from models.cache.dense import KVCache
from models.decoding import SamplingParams
from models.text import TextTokenizer
from models.tiny import tiny_model
from service.engine.config import EngineConfig
from service.engine.core import GenerationEngine
from service.engine.prefix_cache import BLOCK

from .test_engine import read, reference, run_until_idle
from .test_paged_engine import mib_for_blocks

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def models() -> tuple[nn.Module, nn.Module, TextTokenizer]:
    """(decode model, prompt model, tokenizer): the tiny decoder with its weights spread x3 (so that
    attention depends on the keys), and a copy of it with every weight moved by a seeded 20 %."""
    model, tok = tiny_model("decoder")
    with torch.no_grad():
        for weight in model.parameters():
            if weight.dim() >= 2:
                weight.mul_(3.0)
    prompt_model = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for weight in prompt_model.parameters():
            weight.mul_(1 + 0.2 * torch.randn(weight.shape, generator=gen))
    return model, prompt_model, tok


def two_models(prompt_model: nn.Module, model: nn.Module, prompt: list[int], new: int) -> list[int]:
    """Greedy: the prompt through prompt_model, then one token at a time through model (one row)."""
    return as_first_computed([(prompt_model, prompt)], model, new)


def engine_for(model: nn.Module, prompt_model: nn.Module, tok: TextTokenizer, **config: object) -> GenerationEngine:
    config = {"max_total_tokens": 128, "max_running": 8, "kv_cache_mib": 256, "max_new_tokens": None,
              "max_queued": 64, "prefill_tokens": 4096, **config}
    return GenerationEngine(model, tok, EngineConfig(**config), prompt_model=prompt_model)


SYSTEM = list(range(30, 30 + 2 * BLOCK + 5))  # 2 full blocks and 5 tokens, shared by three prompts


def prompts() -> list[list[int]]:
    return [SYSTEM + [90, 91], [7, 8, 9], SYSTEM + [95], list(range(40, 40 + 50)), SYSTEM + [92, 93, 94, 95]]


@pytest.mark.parametrize("chunk", [None, 8], ids=["whole", "chunked"])
def test_prompts_take_the_prompt_model_and_steps_the_decode_model(
        models: tuple[nn.Module, nn.Module, TextTokenizer], chunk: int | None) -> None:
    """Alone and batched (prefix hits among them), whole or in chunks: the two-model reference's
    tokens, which differ from either model's own."""
    model, prompt_model, tok = models
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    wants = [two_models(prompt_model, model, p, 12) for p in prompts()]
    assert wants != [reference(model, tok, p, params)[0] for p in prompts()]
    assert wants != [reference(prompt_model, tok, p, params)[0] for p in prompts()]
    alone = []
    for p in prompts():
        engine = engine_for(model, prompt_model, tok, prefill_chunk=chunk)
        handle = engine.submit(p, params)
        run_until_idle(engine)
        alone.append(list(read(handle)[1].token_ids))
    assert alone == wants
    engine = engine_for(model, prompt_model, tok, prefill_chunk=chunk)
    first = engine.submit(prompts()[0], params)
    engine.step()  # its system prompt is in the prefix cache before the others arrive
    handles = [first] + [engine.submit(p, params) for p in prompts()[1:]]
    run_until_idle(engine)
    assert [list(read(h)[1].token_ids) for h in handles] == wants
    assert engine.stats().cached_prompt_tokens >= 2 * 2 * BLOCK  # two hits on the system prompt


def test_a_preempted_request_recomputes_its_prompt_and_output_with_the_models_that_made_them(
        models: tuple[nn.Module, nn.Module, TextTokenizer]) -> None:
    """Four requests growing to 5 blocks each on a pool of 10: the newest are preempted and
    recomputed (prompt with the prompt model, output so far with the decode model), and each gives
    the tokens of a run nobody preempts."""
    model, prompt_model, tok = models
    params = SamplingParams(max_new_tokens=60, ignore_eos=True)
    asked = [[20 + i] + list(range(50, 60)) for i in range(4)]
    engine = engine_for(model, prompt_model, tok, max_running=4, kv_cache_mib=mib_for_blocks(model, 10),
                        prefix_cache_mib=1.0)
    handles = [engine.submit(p, params) for p in asked]
    history = run_until_idle(engine)
    assert history[-1].preempted >= 2
    assert [list(read(h)[1].token_ids) for h in handles] == [two_models(prompt_model, model, p, 60) for p in asked]
    assert engine.cache.blocks_free + len(engine._batch.prefix) == engine.cache.blocks_total



def as_first_computed(parts: list[tuple[nn.Module, list[int]]], model: nn.Module, new: int) -> list[int]:
    """Greedy: each part's tokens through its model (a prompt model's in one forward, the decode
    model's one at a time, as decode steps computed them), then `new` tokens through model."""
    cache = KVCache.for_model(model.cfg, 1, sum(len(t) for _, t in parts) + new)
    with torch.inference_mode():
        for part, tokens in parts:
            for piece in ([tokens] if part is not model else [[t] for t in tokens]):
                logits = part(torch.tensor([piece]), cache=cache.view(0, 1))[0, -1]  # (V,)
                cache.advance(len(piece), 0, 1)
        out = [int(logits.argmax())]
        while len(out) < new:
            logits = model(torch.tensor([[out[-1]]]), cache=cache.view(0, 1))[0, -1]  # (V,)
            cache.advance(1, 0, 1)
            out.append(int(logits.argmax()))
    return out


def test_a_next_turn_reuses_an_answer_with_the_keys_its_decode_steps_computed(
        models: tuple[nn.Module, nn.Module, TextTokenizer]) -> None:
    """A finished request's blocks hold its prompt's keys from the prompt model and its answer's from
    the decode model: a next turn (prompt, answer, question) finds 3 blocks and computes only the
    rest with the prompt model, giving the tokens of that mix; a request never cached gives others."""
    model, prompt_model, tok = models
    engine = engine_for(model, prompt_model, tok, prefix_cache_mib=1.0)
    prompt = list(range(30, 47))  # 17 tokens: one full block
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    handle = engine.submit(prompt, params)
    run_until_idle(engine)
    answer = list(read(handle)[1].token_ids)
    assert answer == two_models(prompt_model, model, prompt, 40)
    turn = prompt + answer + [60, 61, 62, 63]  # the row held 17 + 39 tokens: 3 full blocks
    assert engine._batch.prefix.lookup(turn) == 3 * BLOCK
    handle = engine.submit(turn, params)
    run_until_idle(engine)
    want = as_first_computed([(prompt_model, prompt), (model, answer[:31]), (prompt_model, turn[48:])], model, 40)
    assert list(read(handle)[1].token_ids) == want
    assert want != two_models(prompt_model, model, turn, 40)  # the mix is what the test tells apart
