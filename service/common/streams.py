"""Asyncio helpers for several streams read as one. No torch, no FastAPI, no Ray."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import TypeVar

T = TypeVar("T")
_END = object()


async def interleaved(streams: Sequence[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """(index of the stream, item) of every stream, each stream in order, the streams interleaved as
    their items arrive. An error in any stream is raised here (after the items before it). Closing
    this stops reading every stream (their own cleanup is the caller's)."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                await queue.put((i, item))
            await queue.put((i, _END))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # handed to the reader
            await queue.put((i, exc))

    tasks = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        open_streams = len(streams)
        while open_streams:
            i, item = await queue.get()
            if item is _END:
                open_streams -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item  # type: ignore[misc]
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
