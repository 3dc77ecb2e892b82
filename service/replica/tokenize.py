"""Texts to token ids on a model replica, each text's failure its own (InvalidItem names its index)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tokenizers import Encoding

from models.text import TextTokenizer

from ..common.text_limits import fit_chars, max_input_chars
from ..errors import InvalidItem, InvalidRequest


def tokenize(tokenizer: TextTokenizer, texts: Sequence[str], limit: int, truncate: bool) -> list[list[int]]:
    """Token ids (with the model's special tokens) per text, each at most `limit` long.

    Raises InvalidItem(index) for a text that is empty, breaks the tokenizer, or is too long
    without `truncate`. Truncation cuts the text's tokens and keeps the special tokens. A text over
    the character cap (service/common/text_limits.py) is refused or cut before it is tokenized.
    """
    texts = fit_chars(texts, max_input_chars(limit), truncate)
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


@dataclass(frozen=True)
class PairTokens:
    """A (query, text) pair encoded as the tokenizer's pair template does: ids and token type ids."""

    ids: list[int]
    types: list[int]


def tokenize_pairs(tokenizer: TextTokenizer, query: str, texts: Sequence[str], limit: int,
                   truncate: bool) -> list[PairTokens]:
    """(query, text) pairs with the model's special tokens, each at most `limit` tokens.

    Raises InvalidRequest naming `query` when the query cannot be tokenized or leaves no room for a
    text without `truncate`; InvalidItem(index) for a text that cannot be tokenized or makes its pair
    too long without `truncate`. Truncation cuts the ends of query and text as Hugging Face's
    fast tokenizers do (longest_first).
    """
    tok = tokenizer.tok
    special = tok.num_special_tokens_to_add(True)
    try:
        query, = fit_chars([query], max_input_chars(limit), truncate)
    except InvalidItem as e:
        raise InvalidRequest(f"query: {e.message}", "query") from None
    texts = fit_chars(texts, max_input_chars(limit), truncate)
    try:
        q = tok.encode(query, add_special_tokens=False)
    except Exception as e:
        raise InvalidRequest(f"query could not be tokenized ({type(e).__name__}: {e})", "query") from None
    if len(q) + special >= limit and not truncate:
        raise InvalidRequest(f"query has {len(q)} tokens; with a text and the special tokens a pair may have at "
                             f"most {limit} (send \"truncate\": true to cut it)", "query")
    out: list[PairTokens] = []
    for i, text in enumerate(texts):
        try:
            t = tok.encode(text, add_special_tokens=False)
        except Exception as e:
            raise InvalidItem(f"the text could not be tokenized ({type(e).__name__}: {e})", i) from None
        n = len(q.ids) + len(t.ids) + special
        if n > limit and not truncate:
            raise InvalidItem(f"the query and this text have {n} tokens; this model accepts at most {limit} "
                              f"per pair (send \"truncate\": true to cut them)", i)
        first, second = q, t
        if n > limit:
            keep_q, keep_t = longest_first(len(q.ids), len(t.ids), max(limit - special, 0))
            first, second = _cut(q, keep_q), _cut(t, keep_t)
        enc = tok.post_process(first, second, add_special_tokens=True)
        out.append(PairTokens(enc.ids, enc.type_ids))
    return out


def longest_first(a: int, b: int, budget: int) -> tuple[int, int]:
    """Lengths (a', b') of a pair cut to `budget` tokens as the `tokenizers` library's longest_first
    (which Hugging Face's fast tokenizers use): the longer sequence is cut to what the shorter leaves,
    and when both must be cut, the shorter gets budget // 2 and the longer the rest."""
    if a + b <= budget:
        return a, b
    short, long = sorted((a, b))
    long = short if short > budget else max(short, budget - short)
    if short + long > budget:
        short, long = budget // 2, budget // 2 + budget % 2
    return (long, short) if a > b else (short, long)


def _cut(encoding: Encoding, n: int) -> Encoding:
    """A copy of `encoding` cut to its first n tokens (truncate works in place)."""
    if len(encoding.ids) <= n:
        return encoding
    cut = Encoding.merge([encoding])
    cut.truncate(n)
    return cut
