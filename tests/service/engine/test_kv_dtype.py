"""The engine's KV cache in bfloat16 (`kv_cache_dtype`) on a float32 model: the budget holds twice the
tokens, the plan says which cache decode steps read, and the engine's invariants hold on it (a request's
tokens and log-probabilities are the same alone and among others, chunked or whole, with or without a
prefix-cache hit), close to the float32 cache's.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from models.decoding import SamplingParams
from models.text import TextTokenizer
from models.tiny import tiny_model
from service.engine.config import EngineConfig

from .test_engine import make, read, run_until_idle

SYSTEM = [3 + (i * 5) % 80 for i in range(40)]  # a shared prefix of two and a half blocks
PROMPTS = [SYSTEM + [60 + 7 * i, 90 - 3 * i, 62 + 5 * i] for i in range(3)] + [[5, 6, 7], [30 + i for i in range(21)]]
PARAMS = SamplingParams(max_new_tokens=12, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def tiny() -> tuple[nn.Module, TextTokenizer]:
    return tiny_model("decoder")


def answers(engine, prompts: list[list[int]], together: bool) -> list[tuple[list[int], list[float]]]:
    """Each prompt's greedy tokens and their log-probabilities, submitted together or one at a time."""
    out = []
    if together:
        handles = [engine.submit(p, PARAMS) for p in prompts]
        run_until_idle(engine)
    else:
        handles = []
        for p in prompts:
            handles.append(engine.submit(p, PARAMS))
            run_until_idle(engine)
    for h in handles:
        final = read(h)[1]
        out.append((list(final.token_ids), [e.logprob for e in final.logprobs]))
    return out


def test_a_bfloat16_cache_holds_twice_the_tokens_and_says_so(tiny: tuple[nn.Module, TextTokenizer]) -> None:
    model, tok = tiny
    wide = make(model, tok, kv_cache_mib=0.25, max_running=64)
    narrow = make(model, tok, kv_cache_mib=0.25, max_running=64, kv_cache_dtype="bfloat16")
    assert narrow.cache._pool.dtype == torch.bfloat16 and wide.cache._pool.dtype == torch.float32
    assert narrow.limits.blocks - 1 == 2 * (wide.limits.blocks - 1)
    assert "bfloat16 KV" in str(narrow.plan.to_dict()["decode"]) and "float32 KV" in str(wide.plan.to_dict()["decode"])
    with pytest.raises(ValueError, match="kv_cache_dtype must be"):
        EngineConfig(kv_cache_dtype="fp8")


def test_a_bfloat16_cache_keeps_alone_among_chunked_and_cached_alike(tiny: tuple[nn.Module, TextTokenizer]) -> None:
    model, tok = tiny
    alone = [answers(make(model, tok, kv_cache_dtype="bfloat16", prefix_cache_mib=0), [p], False)[0] for p in PROMPTS]
    among = answers(make(model, tok, kv_cache_dtype="bfloat16", prefix_cache_mib=0), PROMPTS, True)
    chunked = answers(make(model, tok, kv_cache_dtype="bfloat16", prefix_cache_mib=0, prefill_chunk=8), PROMPTS, True)
    cached_engine = make(model, tok, kv_cache_dtype="bfloat16")
    cached = answers(cached_engine, PROMPTS, False)  # the second and third find the system prompt's blocks
    assert cached_engine.stats().cached_prompt_tokens >= 2 * 32
    wide = answers(make(model, tok, prefix_cache_mib=0), PROMPTS, True)
    for i, want in enumerate(alone):
        for name, got in (("among", among[i]), ("chunked", chunked[i]), ("cached", cached[i])):
            assert got[0] == want[0], (name, i)
            torch.testing.assert_close(torch.tensor(got[1]), torch.tensor(want[1]), rtol=0, atol=1e-5,
                                       msg=f"{name} {i}")
        # the float32 cache: close where both chose the same tokens
        same = next((j for j, (a, b) in enumerate(zip(want[0], wide[i][0], strict=True)) if a != b), len(want[0]))
        torch.testing.assert_close(torch.tensor(want[1][:same]), torch.tensor(wide[i][1][:same]), rtol=0, atol=5e-2)
    assert any(want[1] != w[1] for want, w in zip(alone, wide, strict=True))  # the cache is narrower
