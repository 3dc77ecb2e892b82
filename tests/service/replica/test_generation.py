"""The generator runner without Ray, on the tiny decoder: engine limits from the settings, prompts and
chat templates, defaults, errors naming fields, cancellation of a whole answer and of a stream."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path

import pytest

from models.catalog import LoadedModel, ModelSpec, load_model
from service.engine.config import EngineConfig
from service.errors import EngineOverloaded, InvalidRequest, RequestTooLarge
from service.messages import ChatMessage, GenerationDone, GenerationRequest, GenerationStarted, TextDelta
from service.replica.generator import GeneratorRunner

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors: one thread is fastest

POSITIONS = 512  # tiny:decoder's max_positions


def loaded(defaults: dict[str, object] | None = None, max_input_tokens: int | None = None) -> LoadedModel:
    spec = ModelSpec(name="tiny", tasks=("generate",), source="tiny:decoder", defaults=defaults or {},
                     max_input_tokens=max_input_tokens)
    return load_model(spec, Path("unused"))


def runner(config: EngineConfig | None = None, **defaults: object) -> GeneratorRunner:
    return GeneratorRunner(loaded(defaults), "gen", config or EngineConfig(max_total_tokens=None))


def test_engine_limits_follow_the_settings_within_the_model() -> None:
    model = loaded(max_input_tokens=100)
    engine = GeneratorRunner(model, "gen", EngineConfig(max_total_tokens=4096, kv_cache_mib=2, max_running=3)).engine
    limits = engine.limits
    assert limits.max_total_tokens == POSITIONS and limits.max_prompt_tokens == 100  # cut to the model's limits
    assert engine.config.kv_cache_bytes == 2 * 2**20 and engine.config.max_running == 3 and engine.config.max_new_tokens == 512
    assert limits.rows == min(3, 2 * 2**20 // limits.row_bytes) and limits.max_new_tokens == POSITIONS - 1
    limits = GeneratorRunner(model, "gen", EngineConfig(max_total_tokens=64, max_prompt_tokens=1000)).engine.limits
    assert (limits.max_total_tokens, limits.max_prompt_tokens, limits.max_new_tokens) == (64, 63, 63)


def test_a_default_max_new_tokens_shrinks_to_fit_but_a_requested_one_does_not() -> None:
    r = runner(max_new_tokens=100)
    prompt = "x" * (POSITIONS - 30)
    ids = r.prompt_ids(GenerationRequest("a", prompt=prompt))
    assert r.params(GenerationRequest("a", prompt="hi"), 2).max_new_tokens == 100
    assert r.params(GenerationRequest("a", prompt=prompt), len(ids)).max_new_tokens == 30
    with pytest.raises(RequestTooLarge, match="max_total_tokens") as e:
        asyncio.run(r.submit(GenerationRequest("a", prompt=prompt, max_new_tokens=31)))
    assert e.value.param == "max_new_tokens" and e.value.limit == "max_total_tokens"
    assert runner().params(GenerationRequest("a", prompt="hi"), 2).max_new_tokens == 64  # SamplingParams'


def test_ignore_eos_generates_exactly_max_new_tokens() -> None:
    r = runner()
    params = r.params(GenerationRequest("a", prompt="hi", max_new_tokens=40, ignore_eos=True), 2)
    assert params.ignore_eos and params.max_new_tokens == 40
    assert not r.params(GenerationRequest("a", prompt="hi"), 2).ignore_eos


def test_chat_uses_the_template_and_its_errors_name_messages() -> None:
    r = runner()
    messages = (ChatMessage("developer", "be brief"), ChatMessage("user", "hi"))
    ids = r.prompt_ids(GenerationRequest("a", messages=messages))
    assert r.loaded.tokenizer.decode(ids) == "<system>be brief\n<user>hi\n<assistant>"
    with pytest.raises(RequestTooLarge) as e:
        asyncio.run(r.submit(GenerationRequest("a", messages=(ChatMessage("user", "y" * POSITIONS),))))
    assert e.value.param == "messages" and e.value.limit == "max_prompt_tokens"
    with pytest.raises(InvalidRequest, match="could not be tokenized") as bad:
        asyncio.run(r.submit(GenerationRequest("a", prompt="bad \ud800")))
    assert bad.value.param == "prompt"
    r.loaded.tokenizer.chat_template = None
    with pytest.raises(InvalidRequest, match="no chat template"):
        r.prompt_ids(GenerationRequest("a", messages=messages))


def test_errors_name_the_fields_as_the_client_called_them() -> None:
    r = runner(EngineConfig(max_total_tokens=64))
    names = {"max_new_tokens": "max_completion_tokens"}
    with pytest.raises(RequestTooLarge) as e:
        asyncio.run(r.submit(GenerationRequest("a", messages=(ChatMessage("user", "hi"),), max_new_tokens=100, names=names)))
    assert e.value.param == "max_completion_tokens" and e.value.limit == "max_new_tokens"
    with pytest.raises(RequestTooLarge) as e:
        asyncio.run(r.submit(GenerationRequest("b", messages=(ChatMessage("user", "y" * 80),), names=names)))
    assert e.value.param == "messages" and e.value.limit == "max_prompt_tokens"


def _wait_finished(r: GeneratorRunner, n: int, timeout_s: float = 5.0) -> None:
    """Until n requests finished (Finished events go out just after the rows are freed)."""
    deadline = time.monotonic() + timeout_s
    while sum(r.engine.stats().finished.values()) < n:
        assert time.monotonic() < deadline, r.engine.stats()
        time.sleep(0.005)


def test_whole_answers_streams_and_cancellation() -> None:
    r = runner(EngineConfig(max_total_tokens=None, max_running=1, max_queued=1))
    r.warm_up()
    r.start()
    try:
        async def main() -> None:
            request = GenerationRequest("whole", prompt="héllo ¿qué?", max_new_tokens=30, temperature=0.8, seed=4)
            whole = await r.generate(request)
            events = [e async for e in r.stream(GenerationRequest("streamed", **{
                k: getattr(request, k) for k in ("prompt", "max_new_tokens", "temperature", "seed")}))]
            assert isinstance(events[0], GenerationStarted) and isinstance(events[-1], GenerationDone)
            assert all(isinstance(e, TextDelta) for e in events[1:-1])
            assert "".join(e.text for e in events[1:-1]) == whole.text == events[-1].text  # type: ignore[union-attr]
            assert events[0].prompt_tokens == whole.usage.prompt_tokens == len("héllo ¿qué?".encode())  # type: ignore[union-attr]

            long = GenerationRequest("long", prompt="go", max_new_tokens=500)
            task = asyncio.create_task(r.generate(long))
            while r.engine.stats().running == 0:
                await asyncio.sleep(0.001)
            queued, _ = await r.submit(GenerationRequest("queued", prompt="go"))
            with pytest.raises(EngineOverloaded):  # one row running, one request waiting: full
                await r.submit(GenerationRequest("refused", prompt="go"))
            queued.cancel()
            task.cancel()  # the client went away
            with pytest.raises(asyncio.CancelledError):
                await task
            stream = r.stream(GenerationRequest("stream", prompt="go", max_new_tokens=500))
            assert isinstance(await anext(stream), GenerationStarted)
            await anext(stream)
            await stream.aclose()  # the ingress closed it

        asyncio.run(main())
        _wait_finished(r, 7)
        info = r.info()
        # the two warm-ups (plain, structured), whole, streamed (by length, or a sampled end of text); the
        # rest were cancelled
        finished = dict(info.stats["finished"])
        assert finished.pop("cancelled") == 3 and sum(finished.values()) == 4 and set(finished) <= {"length", "stop"}
        assert info.stats["running"] == info.stats["waiting"] == 0
        assert info.limits["rows"] == 1 and info.max_input_tokens == POSITIONS - 1
    finally:
        r.close()
    assert not r.alive


def test_siblings_are_submitted_together_and_share_one_prefill_on_an_idle_engine() -> None:
    """A group (n > 1 siblings) reaches the running engine in one submission: the engine admits all of
    them in one step and computes the shared prompt once (one prefill row), where separate submissions
    on an idle engine let the first one be admitted alone. A group past the free rows and the queue is
    refused whole."""
    r = runner(EngineConfig(max_total_tokens=None, max_running=8, max_queued=8))
    prefill_rows: list[int] = []
    model = r.engine._batch.steps.prompt_model
    forward = model.forward

    def spy(ids, *args, **kwargs):  # type: ignore[no-untyped-def]
        if ids.size(1) > 1:
            prefill_rows.append(ids.size(0))
        return forward(ids, *args, **kwargs)

    model.forward = spy  # type: ignore[method-assign]
    r.warm_up()
    prefill_rows.clear()
    r.start()
    try:
        async def main() -> tuple[list[GenerationDone], list[GenerationDone], list[str]]:
            messages = (ChatMessage("user", "three ways to say hello"),)
            group = [GenerationRequest(f"s{i}", messages=messages, max_new_tokens=8, temperature=0.9, seed=7 + i,
                                       ignore_eos=True) for i in range(4)]
            together = await r.generate_group(group)
            alone = [await r.generate(GenerationRequest(f"a{i}", messages=messages, max_new_tokens=8,
                                                        temperature=0.9, seed=7 + i, ignore_eos=True))
                     for i in range(4)]
            streamed: list[str] = ["", "", "", ""]
            stream = r.stream_group([dataclasses.replace(g, request_id=f"t{i}") for i, g in enumerate(group)])
            async for i, event in stream:
                if isinstance(event, TextDelta):
                    streamed[i] += event.text
            return together, alone, streamed

        together, alone, streamed = asyncio.run(main())
        assert [d.text for d in together] == [d.text for d in alone] == streamed  # seeded: same alone
        assert len({d.text for d in together}) > 1  # four seeds, not one answer copied
        assert prefill_rows == [1] * 6, prefill_rows  # the group once, each alone once, the streamed group once

        async def refused() -> None:
            await r.submit_group([GenerationRequest(f"q{i}", prompt="go") for i in range(17)])

        with pytest.raises(EngineOverloaded):  # 8 free rows + 8 queued: one too many
            asyncio.run(refused())
        assert r.engine.stats().waiting == 0  # none of the seventeen was queued
    finally:
        r.close()


def test_a_grammar_that_fails_mid_generation_is_a_422_whole_and_a_typed_end_streamed(monkeypatch) -> None:  # noqa: ANN001
    """The runner turns a request's own failure in the engine (its grammar refused a token) into an
    InvalidRequest naming response_format for a whole answer, and a Done carrying the error's type for
    a stream (service/http/sse.py sends it as an invalid_request_error event), never an internal error."""
    from service.engine import grammar as grammars
    from service.messages import GrammarSpec

    accept = grammars.Matcher.accept_token
    monkeypatch.setattr(grammars.Matcher, "accept_token", lambda self, t: accept(self, t) and False)
    r = runner()
    r.start()
    try:
        request = GenerationRequest("g", prompt="say ab", max_new_tokens=8, grammar=GrammarSpec("regex", "(ab ){4}"),
                                    names={"grammar": "response_format"})

        async def main() -> list[object]:
            with pytest.raises(InvalidRequest, match="grammar failed after 0 tokens") as whole:
                await r.generate(request)
            events = [e async for e in r.stream(dataclasses.replace(request, request_id="s"))]
            return [whole.value, events[-1]]

        whole, last = asyncio.run(main())
    finally:
        r.close()
    assert isinstance(last, GenerationDone) and last.error_type == "invalid_request_error"
    assert whole.param is not None
