"""HeapTrimmer: the interval, off switches, a failing trim; glibc's malloc_trim really returns
freed heap memory here; the runners and the engine trim on their inference thread."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from models.catalog import ModelSpec, load_model
from models.decoding import SamplingParams
from models.tiny import tiny_model
from service.engine.config import EngineConfig
from service.engine.core import GenerationEngine
from service.replica.config import BatchLimits
from service.replica.encoder import EncoderRunner
from service.replica.heap import HeapTrimmer, glibc_malloc_trim
from service.telemetry.memory import resident_bytes


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_trims_at_most_once_per_interval() -> None:
    calls: list[int] = []
    clock = Clock()
    heap = HeapTrimmer(1.0, lambda: calls.append(1), clock)
    assert heap.enabled and not heap.maybe_trim()  # the interval counts from construction
    clock.now += 1.0
    assert heap.maybe_trim() and not heap.maybe_trim()
    clock.now += 0.5
    assert not heap.maybe_trim()
    clock.now += 0.5
    assert heap.maybe_trim()
    assert len(calls) == heap.calls == 2 and heap.seconds >= 0


def test_interval_zero_never_trims_and_a_negative_one_is_refused() -> None:
    clock = Clock()
    heap = HeapTrimmer(0, lambda: pytest.fail("trimmed"), clock)
    clock.now += 1e6
    assert not heap.enabled and not heap.maybe_trim()
    with pytest.raises(ValueError, match="interval_s"):
        HeapTrimmer(-1)


def test_a_failing_trim_is_logged_once_and_turned_off(caplog: pytest.LogCaptureFixture) -> None:
    def broken() -> None:
        raise OSError("no")

    clock = Clock()
    heap = HeapTrimmer(1.0, broken, clock)
    for _ in range(3):
        clock.now += 2
        assert not heap.maybe_trim()
    assert not heap.enabled and heap.calls == 0
    assert sum("malloc_trim failed" in r.getMessage() for r in caplog.records) == 1


def test_glibc_malloc_trim_returns_freed_heap_pages_to_the_os() -> None:
    """Blocks freed below a live one stay in glibc's heap (RSS) until malloc_trim gives them back."""
    assert glibc_malloc_trim() is not None, "this Linux should have glibc's malloc_trim"
    script = textwrap.dedent("""
        import ctypes, sys
        sys.path.insert(0, sys.argv[1])
        from service.replica.heap import glibc_malloc_trim
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
        libc.free.argtypes = [ctypes.c_void_p]
        libc.mallopt(-3, 1 << 30)  # M_MMAP_THRESHOLD: keep the blocks in the heap, as glibc does after big frees
        libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD: no automatic trimming of the top
        def rss():
            return int(open("/proc/self/statm").read().split()[1]) * 4096 >> 20
        blocks = [libc.malloc(1 << 20) for _ in range(200)]
        for b in blocks:
            ctypes.memset(b, 1, 1 << 20)
        keep = libc.malloc(64)  # a live block above them: the heap top cannot shrink
        for b in blocks:
            libc.free(b)
        before = rss()
        glibc_malloc_trim()()
        print(before, rss())
    """)
    out = subprocess.run([sys.executable, "-c", script, str(Path(__file__).parents[3])], capture_output=True,
                         text=True, timeout=60, check=True).stdout.split()
    before, after = int(out[0]), int(out[1])
    assert before - after > 150, (before, after)  # of the 200 MiB freed


def test_the_encoder_runner_trims_on_its_inference_thread() -> None:
    threads: list[str] = []
    heap = HeapTrimmer(1e-9, lambda: threads.append(threading.current_thread().name))
    spec = ModelSpec(name="tiny-encoder", tasks=("embed",), source="tiny:encoder", max_input_tokens=64)
    runner = EncoderRunner(load_model(spec, Path("/nonexistent")), "enc", BatchLimits(max_wait_ms=0), heap=heap)

    async def main() -> None:
        for text in ("one", "two", "three"):
            await runner.embed([text], False, 5.0)
        runner.close()

    asyncio.run(main())
    assert len(threads) == 3 and all(name.startswith("enc-inference") for name in threads)


def test_the_engine_loop_calls_after_step_on_its_thread() -> None:
    model, tok = tiny_model("decoder")
    threads: list[str] = []
    engine = GenerationEngine(model, tok, EngineConfig(max_total_tokens=64), name="eng",
                              after_step=lambda: threads.append(threading.current_thread().name)).start()
    try:
        done = engine.submit([30], SamplingParams(max_new_tokens=4, ignore_eos=True)).result_sync(timeout=10)
    finally:
        engine.shutdown()
    assert done.usage.completion_tokens == 4
    assert len(threads) == engine.stats().steps >= 3 and set(threads) == {"eng"}  # the prefill samples one


def test_resident_bytes_reads_this_process_and_is_zero_without_proc(tmp_path: Path) -> None:
    assert 2**20 < resident_bytes() < 2**40
    assert resident_bytes(str(tmp_path / "missing")) == 0
