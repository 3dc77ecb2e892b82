"""What a generation request streams back, and the handle a caller reads it from.

Every request yields zero or more `Delta` events (text pieces, safe to show) and then exactly one
`Finished`; the concatenation of the Delta texts equals `Finished.text`. The first event comes with
the first token: when that token shows no text yet (part of a character, a possible stop string),
it is an empty Delta, so a caller knows the request started (time to first token, its deadline). The engine thread produces
events; the handle delivers them to the caller's asyncio loop (call_soon_threadsafe into an
asyncio.Queue made on that loop) or, for a caller without a loop (tests, scripts), to a
thread-safe queue read by blocking calls.
"""

from __future__ import annotations

import asyncio
import queue
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from ..messages import FinishReason, TokenLogprob, Usage


@dataclass(frozen=True)
class Timing:
    """Seconds, all measured from submit()."""

    queued_s: float | None  # until admission (prefill); None = never admitted
    first_token_s: float | None  # time to first token; None = no token
    total_s: float  # until the Finished event
    token_times_s: tuple[float, ...]  # when each token was sampled

    @property
    def inter_token_s(self) -> tuple[float, ...]:
        t = self.token_times_s
        return tuple(b - a for a, b in zip(t[:-1], t[1:], strict=True))


@dataclass(frozen=True)
class Delta:
    """A piece of text that is final: complete characters, never the start of a stop string."""

    text: str
    completion_tokens: int  # tokens sampled so far
    logprobs: tuple[TokenLogprob, ...] = ()  # of the tokens since the last Delta (requests that ask)


@dataclass(frozen=True)
class Finished:
    request_id: str
    text: str  # the whole output, cut before the first stop string
    token_ids: tuple[int, ...]  # output tokens, without a final stop/eos token
    finish_reason: FinishReason  # stop: eos, stop token or stop string; length: max_new_tokens
    usage: Usage
    timing: Timing
    error: str | None = None  # finish_reason "error": what went wrong (no traceback)
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per output token; None: not asked for
    adapter: str | None = None  # the LoRA adapter that answered (None: the base model)
    # the request's own fault (an error type of service/errors.py's STATUS, and the field): a 4xx, not a 500
    error_type: str | None = None
    error_param: str | None = None


Event = Delta | Finished


class RequestHandle:
    """One request's events, in order. Async: `async for event in handle` or `await handle.result()`;
    sync (submitted outside an event loop): `handle.events()` or `handle.result_sync()`."""

    def __init__(self, request_id: str, cancel: Callable[[str], object],
                 loop: asyncio.AbstractEventLoop | None) -> None:
        self.request_id = request_id
        self._cancel = cancel
        self._loop = loop
        self._aqueue: asyncio.Queue[Event] | None = asyncio.Queue() if loop is not None else None
        self._queue: queue.SimpleQueue[Event] | None = queue.SimpleQueue() if loop is None else None
        self._done = False  # the consumer has read Finished

    def deliver(self, event: Event) -> bool:
        """Called by the engine (any thread). False when the caller's event loop is gone."""
        if self._queue is not None:
            self._queue.put(event)
            return True
        assert self._loop is not None and self._aqueue is not None
        try:
            self._loop.call_soon_threadsafe(self._aqueue.put_nowait, event)
        except RuntimeError:  # the loop is closed: nobody will read this request
            return False
        return True

    def cancel(self) -> None:
        """Stop generating (a disconnected client); a Finished with finish_reason "cancelled" follows."""
        self._cancel(self.request_id)

    def __aiter__(self) -> RequestHandle:
        return self

    async def __anext__(self) -> Event:
        if self._done:
            raise StopAsyncIteration
        if self._aqueue is None:
            raise RuntimeError("this request was submitted outside an event loop: read it with events()")
        event = await self._aqueue.get()
        self._done = isinstance(event, Finished)
        return event

    async def result(self) -> Finished:
        """Read to the end; the Finished event (check finish_reason == "error")."""
        async for event in self:
            if isinstance(event, Finished):
                return event
        raise RuntimeError(f"request {self.request_id}: its Finished event was already read")

    def events(self, timeout: float | None = None) -> Iterator[Event]:
        """Blocking iteration; raises TimeoutError when no event arrives within `timeout` seconds."""
        if self._queue is None:
            raise RuntimeError("this request was submitted on an event loop: read it with `async for`")
        while not self._done:
            try:
                event = self._queue.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"request {self.request_id}: no event within {timeout} s") from None
            self._done = isinstance(event, Finished)
            yield event

    def result_sync(self, timeout: float | None = None) -> Finished:
        for event in self.events(timeout):
            if isinstance(event, Finished):
                return event
        raise RuntimeError(f"request {self.request_id}: its Finished event was already read")
