"""Texts to token ids on a model replica, each text's failure its own (InvalidItem names its index)."""

from __future__ import annotations

from collections.abc import Sequence

from models.text import TextTokenizer

from ..errors import InvalidItem


def tokenize(tokenizer: TextTokenizer, texts: Sequence[str], limit: int, truncate: bool) -> list[list[int]]:
    """Token ids (with the model's special tokens) per text, each at most `limit` long.

    Raises InvalidItem(index) for a text that is empty, breaks the tokenizer, or is too long
    without `truncate`. Truncation cuts the text's tokens and keeps the special tokens.
    """
    out: list[list[int]] = []
    for i, text in enumerate(texts):
        try:
            ids = tokenizer.encode(text)
        except Exception as e:  # e.g. lone surrogates that are not UTF-8
            raise InvalidItem(f"the text could not be tokenized ({type(e).__name__}: {e})", i) from None
        if len(ids) > limit:
            if not truncate:
                raise InvalidItem(f"the text has {len(ids)} tokens; this model accepts at most {limit} "
                                  f"(send \"truncate\": true to cut it)", i)
            ids = _truncate(tokenizer, text, limit)
        if not ids:
            raise InvalidItem("the text has no tokens", i)
        out.append(ids)
    return out


def _truncate(tokenizer: TextTokenizer, text: str, limit: int) -> list[int]:
    n_special = len(tokenizer.encode(""))
    enc = tokenizer.tok.encode(text, add_special_tokens=False)
    enc.truncate(max(limit - n_special, 0))
    return tokenizer.tok.post_process(enc).ids
