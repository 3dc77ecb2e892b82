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


def completion_logprobs(entries: Sequence[TokenLogprob], offset: int = 0) -> tuple[dict[str, Any], int]:
    """The completion shape of `entries`, whose text starts at character `offset`; and the offset after."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e.token)
    top = [{**dict(e.top), e.token: e.logprob} for e in entries]
    return {"tokens": [e.token for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": top, "text_offset": offsets}, offset


def _token(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", "surrogatepass"))}


def chat_logprobs(entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    """The chat shape: {"content": [{token, logprob, bytes, top_logprobs: [...]}], "refusal": null}."""
    return {"content": [{**_token(e.token, e.logprob), "top_logprobs": [_token(t, lp) for t, lp in e.top]}
                        for e in entries], "refusal": None}
