"""A replica's torch work on the thread that serves it, so that the process has one OpenMP thread pool.

torch's CPU ops parallelise with OpenMP (libgomp), which keeps a pool of threads per thread that starts
a parallel region. With more pooled threads in the process than CPUs (a pool left by the thread that
loaded the model, and the engine's or batcher's own), libgomp stops spinning between regions: each
region then waits for its threads to be woken (a futex, ~30 µs on these VMs), and a decode step runs
about 150 regions. SmolLM2's batch-1 decode on the engine thread ran 105 tok/s after a load on the
replica's main thread and 310 tok/s after a load on a thread that had ended (docs/benchmarks.md,
"One OpenMP pool per replica"). So a replica loads and warms up its model on a thread of its own that
ends before the engine's or batcher's thread starts: a pool ends with its thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def on_own_thread(fn: Callable[[], T], name: str = "model-load") -> T:
    """fn() on a new thread, joined: its result, or its exception raised here. The thread (and the
    OpenMP threads its torch ops started) has ended when this returns."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["result"] = fn()
        except BaseException as e:  # noqa: BLE001 - raised again on the calling thread
            out["error"] = e

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["result"]
