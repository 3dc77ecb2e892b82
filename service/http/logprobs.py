"""Log-probabilities in OpenAI's two response shapes (torch-free): the legacy completion object
(tokens, token_logprobs, top_logprobs, text_offset) and chat's `content` list with bytes.
Both are built from the engine's TokenLogprob entries (service/messages.py), whole or per chunk."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel

from ..messages import TokenLogprob


class CompletionLogprobs(BaseModel):
    """/v1/completions: per output token its text, log-probability, the best alternatives (with the
    chosen token itself, as OpenAI: up to logprobs + 1 entries) and its character offset."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]
    refusal: None = None


def completion_logprobs(entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    """The completion shape of `entries`; text_offset is where each token's text starts in the answer."""
    top = [{**dict(e.top), e.token: e.logprob} for e in entries]
    return {"tokens": [e.token for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": top, "text_offset": [e.offset for e in entries]}


def _token(text: str, logprob: float, raw: Sequence[int] = ()) -> dict[str, Any]:
    """A token's entry; `raw`: its own bytes when known, else those of its text."""
    return {"token": text, "logprob": logprob, "bytes": list(raw) or list(text.encode("utf-8", "surrogatepass"))}


def chat_logprobs(entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    """The chat shape: {"content": [{token, logprob, bytes, top_logprobs: [...]}], "refusal": null}; a
    token's bytes are its own (a byte of a multi-byte character, for byte-level tokenizers)."""
    return {"content": [{**_token(e.token, e.logprob, e.bytes),
                         "top_logprobs": [_token(t, lp) for t, lp in e.top]} for e in entries], "refusal": None}
