"""Server-sent events of the generation routes: the three stream formats (ours, OpenAI's completion
and chat chunks) and the body that writes them. Described in docs/serving.md."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from ..errors import InternalError, InvalidRequest, ServiceError
from ..messages import GenerationDone, GenerationEvent, GenerationStarted, TextDelta
from .logprobs import chat_logprobs, completion_logprobs

log = logging.getLogger(__name__)
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE = b"data: [DONE]\n\n"  # OpenAI's end of stream
# OpenAPI's 200 of a route that answers JSON or, with "stream": true, server-sent events
STREAMED_200 = {"description": "JSON, or server-sent events with `\"stream\": true`",
                "content": {"text/event-stream": {}}}


def sse(payload: dict[str, Any]) -> bytes:
    """One server-sent event: `data: <json>` and a blank line."""
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


# -- stream formats: events -> SSE payloads -------------------------------------------------------

class StreamFormat(Protocol):
    end: bytes  # written after the last event (b"" for none)
    index: int  # the choice this format renders (n > 1, several prompts)
    final_usage: bool  # render a usage chunk after Done (False: the response sums all choices' once)

    def render(self, event: GenerationEvent) -> list[dict[str, Any]]:
        ...


@dataclass
class GenerateFormat:
    """/v1/generate: `{"text"}` per piece, then `{"model", "text": "", "finish_reason", "usage"}`."""

    model: str
    end: bytes = b""
    index: int = 0
    final_usage: bool = True

    def render(self, event: GenerationEvent) -> list[dict[str, Any]]:
        if isinstance(event, TextDelta):
            return [{"text": event.text}]
        if isinstance(event, GenerationDone):
            return [{"model": self.model, "text": "", "finish_reason": event.finish_reason, "usage": event.usage.as_dict()}]
        return []


@dataclass
class _OpenAIFormat:
    """OpenAI's streamed chunk envelope: id, object, created, model, choices (+ usage when asked)."""

    id: str
    created: int
    model: str
    include_usage: bool
    end: bytes = DONE
    index: int = 0
    final_usage: bool = True
    object_name: ClassVar[str] = ""

    def chunk(self, choices: list[dict[str, Any]], used: dict[str, int] | None = None) -> dict[str, Any]:
        out = {"id": self.id, "object": self.object_name, "created": self.created, "model": self.model,
               "choices": choices}
        return out | {"usage": used} if self.include_usage else out


@dataclass
class CompletionFormat(_OpenAIFormat):
    """OpenAI's text_completion chunks; a usage chunk (no choices) last when include_usage. With
    `logprobs`, each chunk carries its tokens' (text offsets counted over the whole completion)."""

    logprobs: bool = False
    object_name: ClassVar[str] = "text_completion"

    def render(self, event: GenerationEvent) -> list[dict[str, Any]]:
        if isinstance(event, TextDelta):
            lp = completion_logprobs(event.logprobs) if self.logprobs else None
            return [self.chunk([{"index": self.index, "text": event.text, "logprobs": lp, "finish_reason": None}])]
        if isinstance(event, GenerationDone):
            last = [self.chunk([{"index": self.index, "text": "", "logprobs": None,
                                 "finish_reason": event.finish_reason}])]
            return last + ([self.chunk([], event.usage.as_dict())] if self.include_usage and self.final_usage else [])
        return []


@dataclass
class ChatFormat(_OpenAIFormat):
    """OpenAI's chat.completion.chunk: the role first, then content deltas, then finish_reason."""

    logprobs: bool = False
    object_name: ClassVar[str] = "chat.completion.chunk"

    def render(self, event: GenerationEvent) -> list[dict[str, Any]]:
        def choice(delta: dict[str, str], finish: str | None = None, lp: Any = None) -> dict[str, Any]:
            return {"index": self.index, "delta": delta, "logprobs": lp, "finish_reason": finish}

        if isinstance(event, GenerationStarted):
            return [self.chunk([choice({"role": "assistant", "content": ""})])]
        if isinstance(event, TextDelta):
            lp = chat_logprobs(event.logprobs) if self.logprobs else None
            return [self.chunk([choice({"content": event.text}, lp=lp)])]
        last = [self.chunk([choice({}, event.finish_reason)])]
        return last + ([self.chunk([], event.usage.as_dict())] if self.include_usage and self.final_usage else [])


def sse_body(first: Sequence[tuple[int, GenerationEvent]], rest: AsyncIterator[tuple[int, GenerationEvent]],
             formats: Sequence[StreamFormat],
             usage: Callable[[list[tuple[int, GenerationDone]]], dict[str, Any]] | None = None
             ) -> AsyncIterator[bytes]:
    """The event stream of a response: (choice index, event) items, `first` already read from the
    replica and then `rest`, for one or several choices (formats[i] renders choice i), then
    `usage(every choice's Done)` as a last payload when given. An error after the stream started
    (the replica died, the engine failed the request) is a last `{"error": {...}}` event: the
    status is already sent. Closing the body (the client went away) closes `rest`, which cancels
    the model call."""

    async def items() -> AsyncIterator[tuple[int, GenerationEvent]]:
        for item in first:
            yield item
        async for item in rest:
            yield item

    async def chunks() -> AsyncIterator[bytes]:
        done: list[tuple[int, GenerationDone]] = []
        async for i, event in items():
            if isinstance(event, GenerationDone):
                if event.error is not None:
                    if event.error_type == InvalidRequest.type:  # the request's own fault: say what it was
                        yield sse(InvalidRequest(event.error, event.error_param).body())
                    else:
                        yield sse(InternalError("the generation failed; see the server log").body())
                    return
                done.append((i, event))
            for payload in formats[i].render(event):
                yield sse(payload)
        if usage is not None:
            yield sse(usage(done))
        if formats[0].end:
            yield formats[0].end

    return guarded(chunks(), rest, "generation")


async def guarded(chunks: AsyncIterator[bytes], source: AsyncIterator[Any], what: str) -> AsyncIterator[bytes]:
    """A response's events `chunks`; an error after the stream started (the replica died, the engine
    failed it) is a last `{"error": {...}}` event, as the status is already sent. `source`, the
    replica's stream the chunks come from, is closed at the end whatever happens: also when the
    client went away, which cancels the model call."""
    try:
        async for chunk in chunks:
            yield chunk
    except ServiceError as e:
        yield sse(e.body())
    except Exception:
        log.exception("%s stream failed", what)
        yield sse(InternalError("internal error; see the server log").body())
    finally:
        await chunks.aclose()  # type: ignore[attr-defined]
        await source.aclose()  # type: ignore[attr-defined]
