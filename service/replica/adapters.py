"""A replica's LoRA adapters (models/adapters/ResidentAdapters): a request's adapter held for it, loaded
from its directory first when this replica does not hold it (off the event loop: reading the file and
writing the slot never delay the engine's steps or other requests; on a thread that ends, as the model
loaded, so that its torch ops leave no second OpenMP pool: service/replica/threads.py), the least
recently used one no request holds making room. Errors are the API's: a file that cannot be served is a 400 naming why,
every slot held by running requests a 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from models.adapters import (
    AdapterError,
    AdapterHead,
    AdaptersFull,
    Held,
    LoraAdapter,
    ResidentAdapters,
    read_adapter,
)

from ..errors import InvalidAdapter, InvalidRequest, Overloaded
from ..messages import AdapterRef
from .threads import on_own_thread

log = logging.getLogger(__name__)


class ReplicaAdapters:
    """The replica's side of its model's adapter slots; one per runner, used on its event loop."""

    def __init__(self, resident: ResidentAdapters | None) -> None:
        self.resident = resident
        self._loading: dict[str, asyncio.Lock] = {}  # one load per adapter at a time
        # told each adapter this replica serves a request on (under Serve: Serve's model multiplexing,
        # service/deployments.py, which reports the replica's adapters to the routers); None: nobody
        self.report: Callable[[str], Awaitable[object]] | None = None

    async def _reported(self, name: str) -> None:
        if self.report is None:
            return
        try:
            await self.report(name)
        except Exception as e:  # routing is a preference: the request is served anyway
            log.warning("adapter %s: not reported for routing: %r", name, e)

    async def hold(self, ref: AdapterRef) -> Held:
        """`ref`'s slot, held for one request (release it unless the engine took it)."""
        if self.resident is None:
            raise InvalidRequest(f"model {ref.name!r} is an adapter, and this deployment serves none "
                                 "(max_adapters: 0)", "model")
        try:
            held = self.resident.acquire(ref.name)
        except KeyError:
            lock = self._loading.setdefault(ref.name, asyncio.Lock())
            async with lock:
                try:
                    held = self.resident.acquire(ref.name)
                except KeyError:
                    held = await self.load(ref, hold=True)
        await self._reported(ref.name)
        return held

    async def load(self, ref: AdapterRef, hold: bool = False) -> Held | None:
        """Read `ref`'s directory and put it in a slot (held for a request with `hold`)."""
        assert self.resident is not None
        started = time.perf_counter()
        resident = self.resident

        def read_and_load() -> tuple[LoraAdapter, Held | int]:
            adapter = read_adapter(ref.path, ref.name)
            return adapter, (resident.load_held if hold else resident.load)(adapter)

        try:
            adapter, held = await asyncio.to_thread(on_own_thread, read_and_load, f"adapter-{ref.name}")
        except AdaptersFull as e:
            raise Overloaded(f"{ref.name}: {e}; retry later") from None
        except AdapterError as e:
            raise InvalidAdapter(str(e), "model") from None
        log.info("adapter %s loaded from %s in %.2f s (rank %d, %.1f MiB)", ref.name, ref.path,
                 time.perf_counter() - started, adapter.rank, adapter.nbytes / 2**20)
        if not hold:
            await self._reported(ref.name)
        return held if hold else None  # type: ignore[return-value]

    def unload(self, name: str) -> bool:
        """Free `name`'s slot; False when this replica does not hold it. InvalidAdapter while in use."""
        if self.resident is None or name not in self.resident:
            return False
        try:
            self.resident.unload(name)
        except KeyError:
            return False
        except AdapterError as e:
            raise InvalidAdapter(str(e), "lora_name") from None
        return True

    def release(self, held: Held) -> None:
        assert self.resident is not None
        self.resident.release(held.slot)

    @contextlib.asynccontextmanager
    async def holding(self, ref: AdapterRef | None) -> AsyncIterator[Held | None]:
        """`ref`'s slot held while the block runs (None: the base model); for a batched request, whose
        rows carry the slot until its results are back."""
        if ref is None:
            yield None
            return
        held = await self.hold(ref)
        try:
            yield held
        finally:
            self.release(held)

    def head(self, slot: int) -> AdapterHead | None:
        """The classification head of the adapter in `slot` (-1, or no adapters: None, the model's own)."""
        return None if slot < 0 or self.resident is None else self.resident.head(slot)

    def info(self) -> dict | None:
        """For ModelInfo: the slots, their rank and the adapters held now."""
        if self.resident is None:
            return None
        return {"slots": self.resident.capacity, "max_rank": self.resident.rank, "resident": self.resident.names}
