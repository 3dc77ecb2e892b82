"""Whole documents for translation: a text cut into sentences, translated as separate inputs, and put
back together with everything between the sentences (paragraphs, line breaks, spaces) as it was.

Lines are cut first (a line break always ends a sentence, so titles, list items and paragraphs keep
their layout), then each line by sentencex (Wikimedia's rule-based segmenter, ~300 languages; a
language it does not know falls back to generic rules). `Document.join` is the inverse of `split`
for the sentences themselves: text == join(sentences) exactly. No torch, no FastAPI.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass

log = logging.getLogger(__name__)
_LINE_BREAK = re.compile(r"(\r\n|\n|\r)")


@dataclass(frozen=True)
class Document:
    """text == gaps[0] + sentences[0] + gaps[1] + ... + sentences[n - 1] + gaps[n]; every sentence
    non-empty and without whitespace at either end."""

    gaps: tuple[str, ...]
    sentences: tuple[str, ...]

    def join(self, sentences: Sequence[str]) -> str:
        """The document with each sentence replaced by its counterpart (a translation), in order."""
        if len(sentences) != len(self.sentences):
            raise ValueError(f"{len(self.sentences)} sentences, {len(sentences)} replacements")
        out = [self.gaps[0]]
        for sentence, gap in zip(sentences, self.gaps[1:], strict=True):
            out += [sentence, gap]
        return "".join(out)


def _segments(line: str, language: str) -> list[str]:
    from sentencex import segment

    try:
        parts = list(segment(language, line))
    except Exception:  # the segmenter must never cost a request: the line is one sentence
        log.exception("sentencex failed on a %d-character line (%s); kept whole", len(line), language)
        return [line]
    return parts if "".join(parts) == line else [line]


def split(text: str, language: str) -> Document:
    """`text` cut into sentences (language: the source language's code, e.g. "en")."""
    gaps, sentences = [""], []
    for piece in _LINE_BREAK.split(text):
        if not piece.strip():  # a line break, or a line of whitespace only
            gaps[-1] += piece
            continue
        for segment in _segments(piece, language):
            core = segment.strip()
            if not core:
                gaps[-1] += segment
                continue
            start = len(segment) - len(segment.lstrip())
            gaps[-1] += segment[:start]
            sentences.append(core)
            gaps.append(segment[start + len(core):])
    return Document(tuple(gaps), tuple(sentences))


class TooManySentences(Exception):
    """split_all stopped: the texts hold more sentences than its limit (`found`: as far as it split)."""

    def __init__(self, found: int) -> None:
        super().__init__(found)
        self.found = found


def split_all(texts: Sequence[str], language: str, limit: int | None = None) -> list[Document]:
    """Each text cut into sentences; past `limit` sentences in all it stops at that text and raises
    TooManySentences (a request over the cap costs the split of the texts up to the one that crosses it)."""
    docs, found = [], 0
    for text in texts:
        docs.append(split(text, language))
        found += len(docs[-1].sentences)
        if limit is not None and found > limit:
            raise TooManySentences(found)
    return docs
