"""Documents for /v1/translate: cut into sentences (service/common/documents.py), translated as one call,
put back with the text's own layout. The API tests run the real HTTP layer over EchoBackend, whose
translator reverses each input it is given, so every sentence's place in the answer is visible."""

from __future__ import annotations

import random

import pytest

from service.common import documents
from service.common.documents import Document, split
from service.testing.fake_backend import MAX_TOKENS, EchoBackend, fake_app
from tests.service.http_checks import send

TR = {"source_lang": "en", "target_lang": "es"}


def test_a_document_is_cut_at_sentences_and_line_breaks_keeping_everything_between() -> None:
    text = "  Title\n\nDr. Smith went to Washington. He arrived at 3 p.m.!  \r\n\tA list item\n   \n"
    doc = split(text, "en")
    assert doc.sentences == ("Title", "Dr. Smith went to Washington.", "He arrived at 3 p.m.!", "A list item")
    assert doc.gaps == ("  ", "\n\n", " ", "  \r\n\t", "\n   \n")
    assert doc.join(doc.sentences) == text
    assert doc.join(["1", "2", "3", "4"]) == "  1\n\n2 3  \r\n\t4\n   \n"
    assert split(" \n ", "en") == Document((" \n ",), ())
    with pytest.raises(ValueError, match="4 sentences, 1 replacements"):
        doc.join(["x"])


def test_joining_the_sentences_gives_back_any_text() -> None:
    rng = random.Random(0)
    pieces = ["a", "Bc", ". ", " ", "\n", "?", "!", "\t", "Mr.", "\r\n", "é", "  ", "3.5", "¿Qué?", "...", "\r"]
    for _ in range(2000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 40)))
        doc = split(text, rng.choice(["en", "es", "xx"]))
        assert doc.join(doc.sentences) == text, repr(text)
        assert all(s and s == s.strip() for s in doc.sentences), doc
        assert not any(ch in s for s in doc.sentences for ch in "\r\n")  # a line break always ends a sentence


def test_a_segmenter_failure_keeps_the_line_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    import sentencex

    def broken(language: str, text: str) -> list[str]:
        raise RuntimeError("segmenter bug")

    monkeypatch.setattr(sentencex, "segment", broken)
    assert split("One. Two.\nThree.", "en").sentences == ("One. Two.", "Three.")


def test_translate_cuts_documents_into_sentences_translated_in_one_call() -> None:
    backend = EchoBackend()
    texts = ["Hello there. General Kenobi!\n\nA new paragraph.", "  one sentence  ", " \n "]
    r = send(fake_app(backend=backend), "POST", "/v1/translate", json={"inputs": texts, **TR})
    assert r.status_code == 200, r.text
    assert r.json()["translations"] == [".ereht olleH !iboneK lareneG\n\n.hpargarap wen A", "  ecnetnes eno  ", " \n "]
    assert r.json()["sentences"] == [3, 1, 0]
    assert backend.calls == {"translate": 1}  # every sentence of every text in one model call


def test_without_split_sentences_each_text_is_one_input() -> None:
    r = send(fake_app(), "POST", "/v1/translate", json={"inputs": "Hello there. General Kenobi!", **TR,
                                                          "split_sentences": False})
    assert r.status_code == 200 and r.json() == {"model": r.json()["model"], "translations": ["!iboneK lareneG .ereht olleH"],
                                                 "sentences": [1]}


def test_a_sentence_over_the_models_limit_is_named_or_cut_with_truncate() -> None:
    long = "x" * (MAX_TOKENS + 1)  # over the model's tokens, within its character cap: refused by the replica
    body = {"inputs": ["Fine.", f"Also fine. {long}. End."], **TR}
    r = send(fake_app(), "POST", "/v1/translate", json=body)
    assert r.status_code == 422
    error = r.json()["error"]
    assert error["param"] == "inputs[1]" and error["message"].startswith("inputs[1], sentence 2: the text has 66 tokens")
    r = send(fake_app(), "POST", "/v1/translate", json={**body, "truncate": True})
    assert r.status_code == 200 and r.json()["sentences"] == [1, 3]
    way_over = "y" * 5000  # over the character cap too: refused at the edge, before any model call
    backend = EchoBackend()
    r = send(fake_app(backend=backend), "POST", "/v1/translate", json={"inputs": f"Ok.\n{way_over}", **TR})
    assert r.status_code == 422 and r.json()["error"]["message"].startswith("inputs[0], sentence 2: the text has 5000 characters")
    assert backend.calls == {}


def test_document_limits_in_characters_and_sentences() -> None:
    backend = EchoBackend()
    app = fake_app({"max_document_chars": 40, "max_body_bytes": 1 << 20}, backend)
    r = send(app, "POST", "/v1/translate", json={"inputs": ["short.", "Go on. " * 10], **TR})
    assert r.status_code == 422 and r.json()["error"]["param"] == "inputs[1]"
    assert "70 characters" in r.json()["error"]["message"]
    r = send(app, "POST", "/v1/translate", json={"inputs": ["short.", "Go on. " * 10], **TR, "truncate": True})
    assert r.status_code == 200 and r.json()["sentences"] == [1, 6]  # cut to 40 characters: 5 whole, 1 cut
    # at most the translator's queue: the engine's (translation.max_queued), or the batcher's with batches
    for translator in ({"translation": {"max_queued": 100}, "batching": {"max_queued": 500}},
                       {"translation": {"scheduler": "batches", "max_queued": 500}, "batching": {"max_queued": 100}}):
        many = fake_app({"max_body_bytes": 1 << 20, "deployments": {"translator": translator}}, backend)
        r = send(many, "POST", "/v1/translate", json={"inputs": "A.\n" * 101, **TR})
        assert r.status_code == 422 and "more than 100 sentences (101 in" in r.json()["error"]["message"]
        assert send(many, "POST", "/v1/translate", json={"inputs": "A.\n" * 100, **TR}).status_code == 200
    assert backend.calls == {"translate": 3}  # the truncated request and the two of 100 sentences


def test_the_split_stops_at_the_text_that_crosses_the_sentence_cap(monkeypatch) -> None:  # noqa: ANN001
    """A request of many texts over the cap: the texts after the one that crosses it are never split."""
    from service.common import documents

    split = documents.split
    seen: list[str] = []
    monkeypatch.setattr(documents, "split", lambda text, language: seen.append(text) or split(text, language))
    with pytest.raises(documents.TooManySentences) as e:
        documents.split_all(["The cat sat. The dog ran. Birds fly.", "It rained. We left.", "Fine.", "Yes."], "en",
                            limit=4)
    assert e.value.found == 5 and len(seen) == 2


def test_a_long_document_is_cut_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    threads = []
    split_all = documents.split_all

    def spy(texts: list[str], language: str, limit: int | None = None) -> list[Document]:
        threads.append(threading.current_thread() is threading.main_thread())
        return split_all(texts, language, limit)

    monkeypatch.setattr(documents, "split_all", spy)
    app = fake_app({"max_body_bytes": 1 << 20})
    assert send(app, "POST", "/v1/translate", json={"inputs": "Short. Text.", **TR}).status_code == 200
    assert send(app, "POST", "/v1/translate", json={"inputs": "A longer sentence with words in it. " * 200,
                                                    **TR}).status_code == 200
    assert threads == [True, False]
