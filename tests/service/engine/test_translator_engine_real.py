"""The translation engine on the shipped en->es translator (slow): sources joining a search in
progress, of every length, into the cross-attention slots that earlier sources freed, each get the
tokens translate_ids gives them alone; a greedy request's streamed pieces are its text."""

from __future__ import annotations

from pathlib import Path

import pytest

from models import zoo
from models.beam_search import BeamParams, translate_ids
from models.catalog import DEFAULT_SPECS, load_model
from models.train.eval_translator import read_test
from service.engine.events import Delta, Finished
from service.engine.translation import TranslationEngine, TranslationSubmission
from service.replica.translator import banned_ids

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]
TEST_SET = Path(__file__).parents[3] / "models/weights/translator-en-es/test.tsv"


@pytest.fixture(scope="module")
def translator():
    loaded = load_model(DEFAULT_SPECS["translator"], zoo.default_cache_dir())
    sources, _ = read_test(TEST_SET)
    return loaded, sources[:24]


def test_joining_sources_get_their_alone_tokens_and_greedy_text_streams(translator) -> None:
    loaded, texts = translator
    model, tok = loaded.model, loaded.tokenizer
    banned = banned_ids(loaded)
    beams = [4, 1, 2, 4, 1, 3] * 4
    subs = [TranslationSubmission(tok.encode(t), BeamParams(b, 64)) for t, b in zip(texts, beams, strict=True)]
    engine = TranslationEngine(model, tok, rows=12, max_new_tokens=64, banned_ids=banned)
    handles, joined_late = [], 0
    for i in range(0, len(subs), 3):  # three more sources every other step, more than the rows hold
        handles += engine.submit_many(subs[i: i + 3])
        engine.step()
        engine.step()
    while engine.stats().waiting or engine.stats().running:
        joined_late += engine.stats().waiting > 0 and engine.stats().running > 0
        engine.step()
    assert joined_late > 0
    assert engine.search._slots.capacity < len(subs)  # freed slots were taken again
    texts = set()
    for sub, handle in zip(subs, handles, strict=True):
        events = list(handle.events(timeout=5))
        done = events[-1]
        assert isinstance(done, Finished) and done.error is None
        (alone,) = translate_ids(model, [list(sub.source_ids)], sub.params, banned_ids=banned)
        assert list(done.token_ids) == alone
        assert done.text == tok.decode(alone)
        texts.add(done.text)
        if sub.params.beam_size == 1:  # streamed piece by piece, the pieces make the text
            pieces = [e.text for e in events if isinstance(e, Delta)]
            assert len(pieces) > 2 and "".join(pieces) == done.text
    assert len(texts) == len(subs)  # every source its own translation: a mixed-up slot would show
