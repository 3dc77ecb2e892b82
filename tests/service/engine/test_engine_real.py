"""The continuous-batching engine on the shipped SmolLM2 (slow): a request gives the same tokens alone
and among others admitted in the same steps, in float32 and in bfloat16, greedy and seeded."""

from __future__ import annotations

import os

import pytest
import torch

from models import zoo
from models.catalog import DEFAULT_SPECS, load_model
from models.decoding import SamplingParams
from service.engine.config import EngineConfig
from service.engine.core import GenerationEngine

pytestmark = pytest.mark.slow
OTHERS = ["Write a haiku about the sea.", "List three prime numbers.",
          "Explain what a transformer model is in one sentence, please, for a child of ten.", "Hi!",
          "Translate 'good morning' into French.", "What is 12 times 7?", "Name a colour."]


def run(engine: GenerationEngine, requests: list[tuple[list[int], SamplingParams]]) -> list[list[int]]:
    handles = [engine.submit(ids, params) for ids, params in requests]
    for _ in range(1000):
        engine.step()
        stats = engine.stats()
        if stats.running == 0 and stats.waiting == 0:
            break
    return [list(h.result_sync(timeout=5).token_ids) for h in handles]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_smollm2_tokens_are_the_same_alone_and_among_others(dtype: torch.dtype) -> None:
    """float32 (our panel kernels: a row's products do not depend on its batch): greedy and seeded.
    bfloat16 on a CPU: greedy only. oneDNN picks its bf16 kernels by row count, so a row's logits move
    by an ulp or two with the batch (measured on an AVX-512 EPYC: up to 0.5 on logits of 10-30 from the
    first decode step); an argmax survives that, a seeded draw near a boundary does not."""
    lm = load_model(DEFAULT_SPECS["generator"], zoo.default_cache_dir(), dtype=dtype)
    tok = lm.tokenizer
    engine = GenerationEngine(lm.model, tok, EngineConfig(max_total_tokens=256, max_running=8, kv_cache_mib=512))

    def chat(text: str) -> list[int]:
        return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False)

    prompt = chat("What is the capital of France?")
    greedy = SamplingParams(max_new_tokens=24)
    seeded = SamplingParams(max_new_tokens=24, temperature=0.8, top_p=0.95, seed=11)
    with torch.inference_mode():
        alone = [run(engine, [(prompt, params)])[0] for params in (greedy, seeded)]
        mixed = run(engine, [(chat(t), greedy) for t in OTHERS[:3]] + [(prompt, greedy)]
                    + [(chat(t), seeded) for t in OTHERS[3:6]] + [(prompt, seeded)] + [(chat(OTHERS[6]), greedy)])
    assert mixed[3] == alone[0] and "Paris" in tok.decode(alone[0])
    if dtype == torch.float32:
        assert mixed[7] == alone[1]
    assert len({tuple(m) for m in mixed}) >= 6  # the others really are other requests


@pytest.mark.parametrize("twin", ["float", "bfloat16"])
def test_shipped_smollm2_with_twin_prompts_is_the_same_alone_among_others_and_preempted(twin: str) -> None:
    """The shipped Q4_1 generator with prompts on its float32 twin (prompt_weights "float", as "auto"
    picks on CPUs without VNNI) or its bfloat16 one (as "auto" picks on CPUs with AVX512-BF16; a CPU
    without them refuses it: test_quant.py); eager here to keep the test short: a request's greedy
    tokens alone, among others, and when preempted on a small pool are the same, and it still knows
    Paris. Its plan runs the decode steps on the native backend (models/execution/native.py)."""
    import dataclasses

    from loadtests.experiments.engine_models import shipped_generator
    from models.kernels import native

    if not native.available():
        if os.environ.get("REQUIRE_NATIVE_KERNELS"):  # CI: the kernels must build there
            pytest.fail("REQUIRE_NATIVE_KERNELS is set but the native kernels are not available")
        pytest.skip("no AVX2 or AVX-512 CPU, or no compiler: the shipped generator serves float32 weights there")
    if twin == "bfloat16" and not native.has_bf16():
        twin = "float"  # this CPU has no bfloat16 panels: the float32 twin's case again
    spec, _, cache_dir = shipped_generator()
    lm = load_model(dataclasses.replace(spec, prompt_weights=twin, compile=False), cache_dir)
    assert lm.prompt_model is not None and lm.plan.backend("decode") == "native"
    weights = {"float": "float32", "bfloat16": "bfloat16 panels"}[twin]
    assert lm.plan["prefill"].detail.startswith(f"{weights}, prompt_weights: {twin}")
    steps = []
    real = lm.executor.step
    lm.executor.step = lambda ids, cache, *rest: steps.append(ids.size(0)) or real(ids, cache, *rest)
    tok = lm.tokenizer

    def chat(text: str) -> list[int]:
        return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False)

    def engine(blocks: int) -> GenerationEngine:
        cfg = lm.model.cfg
        block_mib = 16 * 2 * cfg.n_layers * cfg.kv_heads * cfg.head_dim * 4 / 2**20
        return GenerationEngine(lm.executor, tok, EngineConfig(max_total_tokens=128, max_running=8,
                                                               kv_cache_mib=blocks * block_mib, prefix_cache_mib=0))

    greedy = SamplingParams(max_new_tokens=24, ignore_eos=True)
    requests = [(chat(t), greedy) for t in ["What is the capital of France?", *OTHERS[:2]]]
    with torch.inference_mode():
        roomy = engine(64)
        alone = [run(roomy, [r])[0] for r in requests]
        mixed = run(roomy, requests)
        small = engine(9)  # 3 requests of 4 blocks each: the newest are preempted and recomputed
        squeezed = run(small, requests)
    assert "Paris" in tok.decode(alone[0])
    assert mixed == alone
    assert small.stats().preempted >= 1 and squeezed == alone
    assert len(steps) >= 4 * 23 and max(steps) == 3  # every decode step, alone and with three rows, took the op


GROUNDED = ("Fix the spelling in this note and keep everything else the same: The new librray opens on "
            "Monday 3 March at 9am. Membres can borow up to ten books for three weeks, and the cafe on the "
            "ground flor serves coffee until 5pm. Please bring your old card to the front desk.")


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_shipped_smollm2_speculative_gives_the_plain_tokens(method: str) -> None:
    """The shipped Q4_1 generator (ngram: prompt lookup) and its float32 weights with the Q4_1 blocks
    drafting (draft): greedy and seeded requests, alone and among others, give the tokens of decoding
    without drafts, and drafts were kept."""
    import dataclasses

    from service.engine.config import SpeculativeConfig
    from service.engine.core import engine_runtime
    from service.replica.loading import draft_spec

    spec_cfg = (SpeculativeConfig(method="ngram") if method == "ngram"
                else SpeculativeConfig(method="draft", max_draft_tokens=4, draft={"quantize": "q4_1"}))
    base = DEFAULT_SPECS["generator"]
    spec = base if method == "ngram" else dataclasses.replace(base, quantize=None, prompt_weights="same")
    plain_cfg = EngineConfig(max_total_tokens=512, max_running=8, kv_cache_mib=512)
    fast_cfg = dataclasses.replace(plain_cfg, speculative=spec_cfg)
    lm = load_model(spec, zoo.default_cache_dir(), runtime=engine_runtime(fast_cfg))
    draft = None
    if method == "draft":
        draft = load_model(draft_spec(spec, spec_cfg.draft), zoo.default_cache_dir(),
                           runtime=engine_runtime(fast_cfg)).executor
    tok = lm.tokenizer

    def chat(text: str) -> list[int]:
        return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False)

    greedy = SamplingParams(max_new_tokens=48)
    seeded = SamplingParams(max_new_tokens=48, temperature=0.8, top_p=0.95, seed=11)
    requests = [(chat(GROUNDED), greedy), (chat(GROUNDED), seeded)] + [(chat(t), greedy) for t in OTHERS[:4]]
    with torch.inference_mode():
        plain = run(GenerationEngine(lm.executor, tok, plain_cfg), requests)
        engine = GenerationEngine(lm.executor, tok, fast_cfg, draft=draft)
        alone = [run(engine, [r])[0] for r in requests[:2]]
        together = run(engine, requests)
    assert together == plain and alone == plain[:2]
    assert "librar" in tok.decode(plain[0]).lower()
    stats = engine.stats()  # the q4_1 blocks agree with their float32 weights on most greedy tokens
    assert stats.spec_drafted > 0 and stats.spec_accepted > 0, stats
    if method == "draft":
        assert stats.spec_accepted > 0.5 * stats.spec_drafted, stats


def test_shipped_smollm2_with_adapters_is_the_same_alone_and_among_others(tmp_path) -> None:  # noqa: ANN001
    """The shipped Q4_1 generator with two rank-16 LoRA adapters (int8 factors beside the blocks, our
    update kernel in the native decode step and in the prompts): a request's greedy tokens on each
    adapter and on the bare model are the same alone and in one batch with the others, and an adapter
    changes the answer."""
    import dataclasses

    from loadtests.experiments.engine_models import shipped_generator
    from models.adapters import read_adapter
    from models.adapters.peft import random_llama_factors, save_adapter
    from models.kernels import native
    from service.engine.core import Submission

    if not native.available():
        pytest.skip("no AVX2 or AVX-512 CPU, or no compiler: the shipped generator serves float32 weights there")
    spec, _, cache_dir = shipped_generator()
    lm = load_model(dataclasses.replace(spec, compile=False, max_adapters=2, max_lora_rank=16), cache_dir)
    assert lm.plan.backend("decode") == "native" and "LoRA adapters: 2 slots" in lm.plan["decode"].detail
    assert "rank <= 16 (int8, our kernel)" in lm.plan["decode"].detail
    names = []
    for i in range(2):
        path = save_adapter(tmp_path / f"a{i}", random_llama_factors(lm.model, 16, seed=i, std=0.05), 16, 32)
        lm.adapters.load(read_adapter(path))
        names.append(path.name)
    tok = lm.tokenizer
    engine = GenerationEngine(lm.executor, tok, EngineConfig(max_total_tokens=256, max_running=8, kv_cache_mib=256,
                                                             prefix_cache_mib=0), adapters=lm.adapters)
    greedy = SamplingParams(max_new_tokens=24, ignore_eos=True)

    def chat(text: str) -> list[int]:
        return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False)

    def together(jobs: list[tuple[str, str | None]]) -> list[list[int]]:
        subs = [Submission(chat(text), greedy, adapter=None if name is None else lm.adapters.acquire(name))
                for text, name in jobs]
        handles = engine.submit_many(subs)
        for _ in range(1000):
            engine.step()
            if engine.stats().running == 0 and engine.stats().waiting == 0:
                break
        return [list(h.result_sync(timeout=5).token_ids) for h in handles]

    jobs = [(text, name) for text in ("What is the capital of France?", OTHERS[0]) for name in (None, *names)]
    with torch.inference_mode():
        alone = [together([job])[0] for job in jobs]
        mixed = together(jobs)
    assert mixed == alone
    assert "Paris" in tok.decode(alone[0])
    assert alone[1] != alone[0] or alone[2] != alone[0]  # the adapters change the answer
