"""The translation engine (service/engine/translation.py) on the tiny encoder-decoder: every request's
result is translate_ids' alone whatever it shares steps with and whenever it joins; greedy requests
stream; cancellation and overload behave as the generation engine's."""

from __future__ import annotations

import asyncio

import pytest

from models.beam_search import BeamParams, translate_ids
from models.tiny import tiny_model
from service.engine.events import Delta, Finished
from service.engine.translation import TranslationEngine, TranslationSubmission
from service.errors import EngineOverloaded

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TEXTS = ["hello", "hello world", "xyz", "hola", "a much longer sentence here", "b", "other words", "zzz yy"]
BEAMS = [1, 4, 2, 3, 1, 4, 2, 1]
NEW = [8, 6, 8, 5, 8, 7, 3, 8]


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("seq2seq")


def _alone(model, ids: list[int], params: BeamParams) -> list[int]:
    (out,) = translate_ids(model, [ids], params, banned_ids=[0])
    return out


def test_every_request_gets_its_alone_result_joining_at_any_step(tiny) -> None:
    """Requests submitted while others decode (rows for 6 beams: most wait for rows, then join a search in
    progress) each get translate_ids' result for them alone, text and tokens."""
    model, tok = tiny
    engine = TranslationEngine(model, tok, rows=6, max_new_tokens=8, banned_ids=[0])
    handles = []
    for i, text in enumerate(TEXTS):
        handles += engine.submit_many([TranslationSubmission(tok.encode(text), BeamParams(BEAMS[i], NEW[i]))])
        engine.step()
    joined_late = 0
    while engine.stats().waiting or engine.stats().running:
        joined_late += engine.stats().waiting > 0 and engine.stats().running > 0
        engine.step()
    assert joined_late >= 2
    results = [h.result_sync(timeout=5) for h in handles]
    for i, (text, res) in enumerate(zip(TEXTS, results, strict=True)):
        expected = _alone(model, tok.encode(text), BeamParams(BEAMS[i], NEW[i]))
        assert list(res.token_ids) == expected, i
        assert res.text == tok.decode(expected)
        assert res.usage.prompt_tokens == len(tok.encode(text)) and res.usage.completion_tokens == len(expected)
    assert len({r.text for r in results}) >= 5  # the tiny model's outputs differ: the check can fail
    stats = engine.stats()
    assert stats.finished.get("stop", 0) + stats.finished.get("length", 0) == len(TEXTS)
    assert stats.running == 0 and stats.prompt_tokens == sum(len(tok.encode(t)) for t in TEXTS)


def test_greedy_requests_stream_their_text(tiny) -> None:
    """(The tiny model's bytes are mostly not UTF-8, so pieces are held back; the shipped translator's
    stream is checked piece by piece in tests/service/engine/test_translator_engine_real.py.)"""
    model, tok = tiny
    engine = TranslationEngine(model, tok, rows=4, max_new_tokens=8, banned_ids=[0])
    greedy, beam = engine.submit_many([TranslationSubmission(tok.encode(TEXTS[4]), BeamParams(1, 8)),
                                       TranslationSubmission(tok.encode(TEXTS[1]), BeamParams(3, 8))])
    while engine.stats().waiting or engine.stats().running:
        engine.step()
    events = list(greedy.events(timeout=5))
    deltas = [e for e in events if isinstance(e, Delta)]
    assert deltas[0].completion_tokens == 1 and isinstance(events[-1], Finished)  # the first token is announced
    assert "".join(d.text for d in deltas) == events[-1].text == tok.decode(list(events[-1].token_ids))
    beam_events = list(beam.events(timeout=5))
    assert len(beam_events) <= 2 and beam_events[-1].text  # a beam search's text comes at its end


def test_a_cancelled_request_frees_its_rows_and_the_others_are_unchanged(tiny) -> None:
    model, tok = tiny
    engine = TranslationEngine(model, tok, rows=8, max_new_tokens=8, banned_ids=[0])
    subs = [TranslationSubmission(tok.encode(t), BeamParams(4, 8), request_id=str(i)) for i, t in enumerate(TEXTS[:2])]
    first, second = engine.submit_many(subs)
    engine.step()
    engine.step()
    assert engine.stats().running == 8
    assert engine.cancel("0")
    engine.step()
    assert engine.stats().running == 4  # its rows are free at the next step
    while engine.stats().running:
        engine.step()
    assert first.result_sync(timeout=5).finish_reason == "cancelled"
    assert list(second.result_sync(timeout=5).token_ids) == _alone(model, tok.encode(TEXTS[1]), BeamParams(4, 8))


def test_every_decoded_row_is_counted_and_every_step_timed(tiny) -> None:
    """generated_tokens counts decoder rows (a beam search's running steps included, which report no
    event), so the admission estimate gets a step time from every step that decoded."""
    model, tok = tiny
    engine = TranslationEngine(model, tok, rows=4, max_new_tokens=8, banned_ids=[0])
    engine.submit_many([TranslationSubmission(tok.encode(TEXTS[4]), BeamParams(4, 8))])
    engine.step()  # admitted: one row (the start token)
    engine.step()  # widened to its 4 beams
    engine.step()
    assert engine.stats().generated_tokens == 1 + 4 + 4 and engine._wait.step_s is not None


def test_overload_and_limits_are_refused_at_submit(tiny) -> None:
    model, tok = tiny
    engine = TranslationEngine(model, tok, rows=4, max_new_tokens=8, max_queued=2, banned_ids=[0])
    with pytest.raises(ValueError, match="beam_size 5"):
        engine.submit_many([TranslationSubmission(tok.encode("a"), BeamParams(5, 8))])
    with pytest.raises(ValueError, match="max_new_tokens 9"):
        engine.submit_many([TranslationSubmission(tok.encode("a"), BeamParams(1, 9))])
    with pytest.raises(EngineOverloaded):  # 4 free rows: 2 beam-2 sentences take them, 2 queue, 1 too many
        engine.submit_many([TranslationSubmission(tok.encode(t), BeamParams(2, 8)) for t in TEXTS[:5]])
    engine.submit_many([TranslationSubmission(tok.encode(t), BeamParams(2, 8)) for t in TEXTS[:4]])
    assert engine.stats().waiting == 4


def test_the_started_engine_answers_concurrent_requests_on_an_event_loop(tiny) -> None:
    model, tok = tiny
    engine = TranslationEngine(model, tok, rows=8, max_new_tokens=8, banned_ids=[0]).start()

    async def main() -> list[Finished]:
        async def one(i: int) -> Finished:
            (handle,) = engine.submit_many([TranslationSubmission(tok.encode(TEXTS[i]), BeamParams(BEAMS[i], NEW[i]))])
            return await handle.result()
        return await asyncio.gather(*(one(i) for i in range(len(TEXTS))))

    try:
        results = asyncio.run(main())
    finally:
        engine.shutdown()
    for i, res in enumerate(results):
        assert list(res.token_ids) == _alone(model, tok.encode(TEXTS[i]), BeamParams(BEAMS[i], NEW[i]))


class FaultyDecoder:
    """The tiny encoder-decoder, its decoder call raising when `fails(cross)` says so (cross: the
    step's CrossCache, one src_keep row per source in the call)."""

    def __init__(self, base, fails) -> None:
        self.base, self.fails = base, fails

    def __getattr__(self, name: str):
        return getattr(self.base, name)

    def decode(self, tokens, cross, cache=None):
        if self.fails(cross):
            raise RuntimeError("injected failure")
        return self.base.decode(tokens, cross, cache=cache)


def _run(engine: TranslationEngine, tok, texts: list[str], beams: list[int]) -> list[Finished]:
    handles = engine.submit_many([TranslationSubmission(tok.encode(t), BeamParams(b, 8))
                                  for t, b in zip(texts, beams, strict=True)])
    while engine.stats().waiting or engine.stats().running:
        engine.step()
    return [h.result_sync(timeout=5) for h in handles]


def test_a_failing_source_fails_alone_and_a_transient_failure_is_retried(tiny) -> None:
    """A decoder call that fails is retried one source at a time: the source that fails again is failed
    alone (the others get their alone results and the engine goes on); one that failed only once costs
    nothing."""
    model, tok = tiny
    texts, beams = [TEXTS[1], TEXTS[4], TEXTS[2]], [4, 3, 1]
    poison = len(tok.encode(TEXTS[4]))
    assert sorted(len(tok.encode(t)) for t in texts).count(poison) == 1
    engine = TranslationEngine(FaultyDecoder(model, lambda cross: poison in cross.src_keep.sum(-1).tolist()),
                               tok, rows=8, max_new_tokens=8, banned_ids=[0])
    results = _run(engine, tok, texts, beams)
    assert results[1].finish_reason == "error" and "injected failure" in (results[1].error or "")
    for i in (0, 2):
        assert results[i].finish_reason in ("stop", "length")
        assert list(results[i].token_ids) == _alone(model, tok.encode(texts[i]), BeamParams(beams[i], 8))
    assert engine.stats().finished["error"] == 1
    after = _run(engine, tok, [TEXTS[0]], [2])  # the engine goes on
    assert list(after[0].token_ids) == _alone(model, tok.encode(TEXTS[0]), BeamParams(2, 8))

    calls = {"n": 0}

    def once(cross) -> bool:  # the third decoder call fails (sources have widened to their beams)
        calls["n"] += 1
        return calls["n"] == 3

    engine = TranslationEngine(FaultyDecoder(model, once), tok, rows=8, max_new_tokens=8, banned_ids=[0])
    results = _run(engine, tok, texts, beams)
    assert calls["n"] > 3
    for i, res in enumerate(results):
        assert list(res.token_ids) == _alone(model, tok.encode(texts[i]), BeamParams(beams[i], 8)), i


def test_offline_translate_ids_raises_what_a_source_failed_with(tiny) -> None:
    """Offline (request-level batches) a source failing alone fails the call, as before the retry."""
    model, tok = tiny
    poison = len(tok.encode(TEXTS[4]))
    faulty = FaultyDecoder(model, lambda cross: poison in cross.src_keep.sum(-1).tolist())
    with pytest.raises(RuntimeError, match="injected failure"):
        translate_ids(faulty, [tok.encode(TEXTS[1]), tok.encode(TEXTS[4])], BeamParams(2, 8), banned_ids=[0])


def test_a_cold_engine_expects_a_translation_about_as_long_as_its_source(tiny) -> None:
    """Before any translation finished, admission takes a request to need about twice its source
    tokens (never past max_new_tokens), not max_new_tokens: a burst on a fresh replica is not refused
    for a wait ten times what it will be."""
    from service.engine.translation import EXPECTED_PER_SOURCE_TOKEN

    model, tok = tiny
    engine = TranslationEngine(model, tok, rows=4, max_new_tokens=128, banned_ids=[0])
    source = tok.encode(TEXTS[1])
    engine.submit_many([TranslationSubmission(source, BeamParams(4, 128)),
                        TranslationSubmission(source, BeamParams(4, 5))])
    assert engine._wait.asked == [EXPECTED_PER_SOURCE_TOKEN * len(source) + 2, 5]
    assert engine._wait.typical_tokens() < 128 / 4


def test_a_request_that_cannot_be_translated_before_its_deadline_is_refused_at_once(tiny) -> None:
    """The translation engine's own admission: once its steps are timed, a request whose wait for rows
    plus its own decoding outlasts its deadline is refused at submit (EngineOverloaded naming the
    deadline), nothing queued; with time enough it is queued and gets its alone result."""
    import time

    from service.telemetry.hooks import EngineObserver

    class Log(EngineObserver):
        def __init__(self) -> None:
            self.calls: list[tuple[float | None, str | None]] = []

        def on_admission(self, wait_s: float | None, refused: str | None) -> None:
            self.calls.append((wait_s, refused))

    model, tok = tiny
    log = Log()
    engine = TranslationEngine(model, tok, rows=4, max_new_tokens=8, banned_ids=[0], observer=log,
                               after_step=lambda: time.sleep(0.01))  # steps of ~10 ms: a wait worth refusing
    first = engine.submit_many([TranslationSubmission(tok.encode(TEXTS[4]), BeamParams(4, 8))])
    for _ in range(3):
        engine.step()  # the step time is measured; the first request holds every row
    before = engine.stats()
    with pytest.raises(EngineOverloaded, match="deadline"):
        engine.submit_many([TranslationSubmission(tok.encode(TEXTS[1]), BeamParams(4, 8),
                                                  deadline=time.perf_counter() + 0.005)])
    after = engine.stats()
    assert (after.waiting, after.running) == (before.waiting, before.running)
    late = engine.submit_many([TranslationSubmission(tok.encode(TEXTS[1]), BeamParams(4, 8),
                                                     deadline=time.perf_counter() + 60)])
    while engine.stats().waiting or engine.stats().running:
        engine.step()
    assert [refused for _, refused in log.calls] == [None, "deadline", None]
    assert log.calls[1][0] is not None and log.calls[1][0] > 0.005
    assert list(late[0].result_sync(timeout=5).token_ids) == _alone(model, tok.encode(TEXTS[1]), BeamParams(4, 8))
    assert first[0].result_sync(timeout=5).finish_reason in ("stop", "length")


def test_waiting_sources_are_admitted_by_priority_then_arrival(tiny) -> None:
    """Rows for one greedy search at a time: the sources start one after another, the soonest priority
    first (lower is sooner, a tenant's), in arrival order within a priority."""
    model, tok = tiny
    engine = TranslationEngine(model, tok, rows=1, max_new_tokens=4, banned_ids=[0])
    priorities = [3, 0, 3, -1, 0]
    handles = engine.submit_many([TranslationSubmission(tok.encode(TEXTS[i]), BeamParams(1, 4), priority=p)
                                  for i, p in enumerate(priorities)])
    admitted: list[int] = []
    while engine.stats().waiting or engine.stats().running:
        engine.step()
        for i, h in enumerate(handles):
            state = engine._live.get(h.request_id)
            if i not in admitted and (state is None or state.admitted is not None):
                admitted.append(i)
    assert admitted == [3, 1, 4, 0, 2]
    assert all(h.result_sync(timeout=5).error is None for h in handles)
