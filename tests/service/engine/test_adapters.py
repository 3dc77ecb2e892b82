"""The engine with LoRA adapters (models/adapters/): rows of different adapters and of the base model in
one batch each decode what they decode alone, the prefix cache never serves one adapter's keys to
another (or to the base), and every slot a request held is released when it ends.
"""

from __future__ import annotations

import copy

import pytest
from torch import nn

from models.adapters import ResidentAdapters, read_adapter
from models.adapters.peft import random_llama_factors, save_adapter
from models.decoding import SamplingParams
from models.text import TextTokenizer
from models.tiny import tiny_model
from service.engine.config import EngineConfig
from service.engine.core import GenerationEngine, Submission
from service.errors import InvalidRequest

from .test_engine import read, run_until_idle

pytestmark = pytest.mark.usefixtures("one_torch_thread")
PARAMS = SamplingParams(max_new_tokens=12, ignore_eos=True)
CONFIG = {"max_total_tokens": 160, "max_running": 8, "kv_cache_mib": 64, "max_new_tokens": None, "max_queued": 64,
          "prefill_tokens": 4096}


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> tuple[nn.Module, TextTokenizer, ResidentAdapters]:
    model, tok = tiny_model("decoder")
    model = copy.deepcopy(model)
    resident = ResidentAdapters([model], capacity=3, rank=8)
    root = tmp_path_factory.mktemp("adapters")
    for i, rank in enumerate((4, 8)):
        factors = random_llama_factors(model, rank, seed=i, std=0.3)
        resident.load(read_adapter(save_adapter(root / f"a{i}", factors, rank, 2 * rank)))
    return model, tok, resident


def engine_for(served, **config) -> GenerationEngine:  # noqa: ANN001
    model, tok, resident = served
    return GenerationEngine(model, tok, EngineConfig(**{**CONFIG, **config}), adapters=resident)


def run(engine: GenerationEngine, jobs: list[tuple[list[int], str | None]]) -> list[tuple[list[int], int]]:
    """Each job (prompt, adapter name) submitted at once and run to the end: (tokens, cached prompt tokens)."""
    subs = [Submission(p, PARAMS, adapter=engine.adapters.acquire(a) if a else None) for p, a in jobs]
    handles = engine.submit_many(subs)
    run_until_idle(engine)
    out = []
    for h in handles:
        _, done = read(h)
        out.append((list(done.token_ids), done.usage.prompt_tokens))
    return out


def test_rows_of_two_adapters_and_the_base_decode_in_one_batch_what_each_decodes_alone(served) -> None:
    _, tok, resident = served
    prompts = [tok.encode(f"question {i}: " + "xyz" * i, add_special_tokens=False) for i in range(3)]
    jobs = [(p, a) for p in prompts for a in ("a0", "a1", None)]
    together = run(engine_for(served), jobs)
    alone = [run(engine_for(served), [job])[0] for job in jobs]
    assert [t for t, _ in together] == [t for t, _ in alone]
    by_adapter = {a: [t for (t, _), (_, b) in zip(together, jobs, strict=True) if b == a] for a in ("a0", "a1", None)}
    assert by_adapter["a0"] != by_adapter[None] and by_adapter["a1"] != by_adapter[None]
    assert resident._users == [0, 0, 0]  # every hold released


def test_the_prefix_cache_reuses_blocks_only_within_one_adapter(served) -> None:
    _, tok, _ = served
    engine = engine_for(served)
    prompt = tok.encode("a long shared system prompt, " * 2, add_special_tokens=False)
    assert len(prompt) > 48
    first = run(engine, [(prompt, "a0")])
    again = run(engine, [(prompt, "a0")])
    other = run(engine, [(prompt, "a1")])
    base = run(engine, [(prompt, None)])
    assert engine._batch.prefix is not None
    stats = engine.stats()
    assert again[0][0] == first[0][0]
    # cached tokens: only the second a0 request hit; a1 and the base computed the prompt again
    assert stats.cached_prompt_tokens == len(prompt) // 16 * 16 - (16 if len(prompt) % 16 == 0 else 0)
    fresh = run(engine_for(served), [(prompt, "a1")])
    assert other[0][0] == fresh[0][0] and base[0][0] != first[0][0]


def test_an_adapter_on_a_model_without_slots_is_refused(served) -> None:
    model, tok, resident = served
    plain = GenerationEngine(model, tok, EngineConfig(**CONFIG))
    held = resident.acquire("a0")
    with pytest.raises(InvalidRequest, match="serves no adapters"):
        plain.submit_many([Submission([5, 6, 7], PARAMS, adapter=held)])
    resident.release(held.slot)


def test_the_prefix_cache_reuses_blocks_only_within_one_cache_salt(served) -> None:
    """A tenant's or a request's cache_salt: the same prompt under another salt (or none) computes its
    prompt again; under the same salt it hits; a salt that spells an adapter's key is still apart."""
    _, tok, resident = served
    engine = engine_for(served)
    prompt = tok.encode("a long shared system prompt, " * 2, add_special_tokens=False)
    hit = len(prompt) // 16 * 16 - (16 if len(prompt) % 16 == 0 else 0)

    def cached(salt: str, adapter: str | None = None) -> int:
        before = engine.stats().cached_prompt_tokens
        held = resident.acquire(adapter) if adapter else None
        handle = engine.submit_many([Submission(prompt, PARAMS, adapter=held, cache_salt=salt)])[0]
        run_until_idle(engine)
        read(handle)
        return engine.stats().cached_prompt_tokens - before

    assert [cached("tenant:a"), cached("tenant:b"), cached(""), cached("tenant:a"), cached("")] == [0, 0, 0, hit, hit]
    held = resident.acquire("a0")
    key = held.key
    resident.release(held.slot)
    assert cached("", "a0") == 0 and cached(key) == 0 and cached(f"adapter:{key}") == 0 and cached("", "a0") == hit
