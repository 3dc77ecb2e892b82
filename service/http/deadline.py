"""Every model call of the HTTP layer runs under its request's deadline: the settings'
request_timeout_s, lowered by an `X-Request-Timeout: <seconds>` header. Past it the call is
cancelled (so is the work on the model replica: Serve cancels the remote call, the replica drops
the request's queued inputs or frees its engine row) and the answer is 504."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request

from ..errors import DeadlineExceeded, InvalidRequest
from ..settings import Settings

TIMEOUT_HEADER = "X-Request-Timeout"
T = TypeVar("T")


def request_timeout(request: Request, settings: Settings) -> float:
    """The request's deadline in seconds from now (422 naming the header when it is not a positive number)."""
    raw = request.headers.get(TIMEOUT_HEADER)
    if raw is None:
        return settings.request_timeout_s
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (value > 0 and math.isfinite(value)):
        raise InvalidRequest(f"{TIMEOUT_HEADER} must be a positive number of seconds, got {raw!r}", TIMEOUT_HEADER)
    return min(value, settings.request_timeout_s)


async def within(call: Awaitable[T], timeout_s: float, what: str = "the request did not finish") -> T:
    """`await call`, cancelled after `timeout_s` seconds with DeadlineExceeded ("<what> within N s")."""
    try:
        return await asyncio.wait_for(call, timeout_s)
    except asyncio.TimeoutError:  # wait_for cancelled the call, and with it the model replica's work
        raise DeadlineExceeded(f"{what} within {timeout_s:g} s") from None
