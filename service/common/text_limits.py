"""How long a text may be in characters, checked before any tokenization (at the edge and again on
the replica), so an oversized text is refused, or cut, for the cost of len(). No torch, no FastAPI.

A model takes at most `max_input_tokens` tokens; a text of more than CHARS_PER_TOKEN times that
many characters is refused without `truncate` and cut to that many characters with it. Text
averages about 4 characters per token in the languages our tokenizers cover, so the cap refuses
only texts far over the token limit (or made mostly of characters no token covers, such as
whitespace), and the tokens a truncation keeps are the same as the whole text's.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import InvalidItem, RequestTooLarge

CHARS_PER_TOKEN = 16


def max_input_chars(max_input_tokens: int) -> int:
    return CHARS_PER_TOKEN * max_input_tokens


def fit_chars(texts: Sequence[str], limit: int | None, truncate: bool) -> list[str]:
    """`texts` within `limit` characters: cut with `truncate`, else InvalidItem(index) for the first
    text over it. None: no limit."""
    if limit is None or all(len(t) <= limit for t in texts):
        return list(texts)
    if truncate:
        return [t[:limit] for t in texts]
    i = next(i for i, t in enumerate(texts) if len(t) > limit)
    raise InvalidItem(f"the text has {len(texts[i])} characters; this model takes at most {limit} "
                      f"({CHARS_PER_TOKEN} per token of its limit; send \"truncate\": true to cut it)", i)


def check_prompt_chars(chars: int, max_prompt_tokens: int, param: str | None) -> None:
    """RequestTooLarge (422 naming `param` and max_prompt_tokens) for a prompt over its character cap."""
    cap = max_input_chars(max_prompt_tokens)
    if chars > cap:
        raise RequestTooLarge(f"the prompt has {chars} characters; at most {cap} ({CHARS_PER_TOKEN} per token of "
                              f"max_prompt_tokens, {max_prompt_tokens})", param, "max_prompt_tokens")
