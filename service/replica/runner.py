"""The life cycle every model replica shares, without Ray: a loaded model, warmed up, started,
reporting its info and health, closed; and the base of the replicas that batch dynamically.

    runner = RunnerClass.for_deployment(loaded, name, deployment_settings, metrics)
    runner.warm_up(); runner.start()     # before the replica joins its deployment
    runner.info(); runner.check_health()
    runner.close()

service/deployments.py wraps one runner per Ray Serve replica; the tests drive runners directly.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from models.catalog import LoadedModel

from ..messages import ModelInfo
from ..telemetry.hooks import BatchObserver
from ..telemetry.metrics import ServiceMetrics
from ..telemetry.observers import PrometheusBatchObserver
from .adapters import ReplicaAdapters
from .batcher import DynamicBatcher
from .config import BatchLimits
from .heap import HeapTrimmer

if TYPE_CHECKING:
    from ..settings import DeploymentSettings

T = TypeVar("T")


# Texts up to this many characters in all are tokenized on the event loop (tens of microseconds);
# longer ones in a worker thread, so a long text never stalls the replica's other requests.
INLINE_TOKENIZE_CHARS = 4096


_texts: list[ThreadPoolExecutor] = []  # the process's one text thread (off_loop), made on first use


async def off_loop(chars: int, fn: Callable[..., T], *args: Any) -> T:
    """fn(*args) (rendering and tokenizing `chars` characters) on the event loop when small, else on
    the process's one text thread: long texts take turns there instead of each taking a thread, so
    however many arrive at once, at most one holds the GIL beside the engine's and batcher's threads."""
    if chars <= INLINE_TOKENIZE_CHARS:
        return fn(*args)
    return await on_text_thread(fn, *args)


async def on_text_thread(fn: Callable[..., T], *args: Any) -> T:
    """fn(*args) on the process's one text thread (off_loop; a grammar's compilation too)."""
    if not _texts:
        _texts.append(ThreadPoolExecutor(max_workers=1, thread_name_prefix="texts"))
    return await asyncio.get_running_loop().run_in_executor(_texts[0], functools.partial(fn, *args))


def chars(texts: Sequence[str]) -> int:
    return sum(len(t) for t in texts)


def deadline(timeout_s: float | None) -> float | None:
    """A request's timeout as a time.monotonic() deadline (the batcher drops it when passed)."""
    return None if timeout_s is None else time.monotonic() + timeout_s


class ModelRunner:
    """One loaded model on one replica. Subclasses implement warm_up, and where they differ from
    a batcher's: start, alive, queue_capacity, stats, limits, close."""

    loop_name = "model loop"  # what stopped, in a failed health check

    def __init__(self, loaded: LoadedModel, deployment: str, heap: HeapTrimmer | None = None) -> None:
        self.loaded, self.deployment = loaded, deployment
        self.heap = heap or HeapTrimmer(0)
        self.loaded_at = time.time()
        self.adapters = ReplicaAdapters(loaded.adapters)  # its LoRA adapter slots (none: every request is refused)

    @classmethod
    def for_deployment(cls, loaded: LoadedModel, deployment: str, settings: DeploymentSettings,
                       metrics: ServiceMetrics) -> ModelRunner:
        """The runner a deployment's replica builds from its settings, reporting to `metrics`."""
        raise NotImplementedError

    def warm_up(self) -> None:
        """Run the model once (allocations, kernels) before the replica is ready."""
        raise NotImplementedError

    def start(self) -> None:
        """Begin serving (a runner with its own thread starts it here)."""

    @property
    def alive(self) -> bool:
        raise NotImplementedError

    def check_health(self) -> None:
        """Raise when the runner can no longer serve (Serve then replaces the replica)."""
        if not self.alive:
            raise RuntimeError(f"{self.deployment}: the {self.loop_name} has stopped")

    @property
    def queue_capacity(self) -> int:
        raise NotImplementedError

    @property
    def max_input_tokens(self) -> int:
        return self.loaded.max_input_tokens

    def stats(self) -> dict[str, Any]:
        return {}

    def limits(self) -> dict[str, Any]:
        return {}

    def speculative(self) -> dict[str, Any] | None:
        """Generators: what drafts for speculative decoding (None: it does not speculate)."""
        return None

    def adapter_info(self) -> dict[str, Any] | None:
        """Its LoRA adapter slots and the adapters in them (None: it serves none)."""
        return self.adapters.info()

    def info(self) -> ModelInfo:
        """What /v1/models and /readyz report about this replica's model."""
        spec, loaded = self.loaded.spec, self.loaded
        return ModelInfo(
            name=spec.name, deployment=self.deployment, tasks=tuple(spec.tasks), device=str(loaded.device),
            dtype=str(loaded.dtype).removeprefix("torch."), max_input_tokens=self.max_input_tokens,
            labels=tuple(loaded.labels), languages=spec.languages, defaults=dict(spec.defaults),
            loaded_at=self.loaded_at, load_seconds=loaded.load_seconds, stats=self.stats(), limits=self.limits(),
            quantize=loaded.quantize, kernels=dict(loaded.kernels), compiled=loaded.compiled,
            block_activation_bits=loaded.block_activation_bits,
            prompt_weights=loaded.prompt_weights, plan=loaded.plan.to_dict(),
            speculative=self.speculative(), adapters=self.adapter_info())

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop serving: requests still open fail or are cancelled."""


class EngineRunner(ModelRunner):
    """A runner that owns a step engine (service/engine/loop.py: generation, translation): warmed up
    by stepping it on this thread, then started; its scheduler thread is its health."""

    engine: Any  # a StepLoop subclass

    def warm_up_steps(self, steps: int, what: str) -> None:
        """Step the engine (before start()) until what was submitted ended; RuntimeError if it did not
        within `steps` steps or ended in an error. What these steps measured is then forgotten."""
        for _ in range(steps):
            self.engine.step()
            stats = self.engine.stats()
            if stats.running == 0 and stats.waiting == 0:
                break
        else:
            raise RuntimeError(f"{self.deployment}: {what} did not finish in {steps} steps")
        if stats.finished.get("error"):
            raise RuntimeError(f"{self.deployment}: {what} failed: {stats}")
        self.engine.forget_timings()  # cold steps: admission measures the served ones

    def start(self) -> None:
        self.engine.start()

    @property
    def alive(self) -> bool:
        return self.engine.alive

    def stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = dataclasses.asdict(self.engine.stats())
        stats["finished"] = dict(stats["finished"])
        return stats

    def close(self, timeout_s: float = 5.0) -> None:
        self.engine.shutdown(timeout_s)


class BatchedRunner(ModelRunner):
    """A runner whose inputs are batched dynamically (encoder, translator): one inference thread, the
    batcher; `run_batch` computes one batch there."""

    loop_name = "batching loop"

    def __init__(self, loaded: LoadedModel, deployment: str, limits: BatchLimits,
                 observer: BatchObserver | None = None, heap: HeapTrimmer | None = None) -> None:
        super().__init__(loaded, deployment, heap)
        self.observer = observer or BatchObserver()
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{deployment}-inference")
        self.batcher: DynamicBatcher[Any, Any] = DynamicBatcher(self._compute, limits, self.executor,
                                                                name=deployment, observer=observer)

    @classmethod
    def for_deployment(cls, loaded: LoadedModel, deployment: str, settings: DeploymentSettings,
                       metrics: ServiceMetrics) -> BatchedRunner:
        spec = loaded.spec
        observer = PrometheusBatchObserver(metrics, spec.name, tuple(spec.adapters), tuple(spec.tasks))
        return cls(loaded, deployment, settings.batching, observer,
                   HeapTrimmer(settings.heap_trim_interval_s))

    def _compute(self, payloads: list[Any]) -> list[Any]:
        """One batch on the inference thread, then the C heap trimmed if its interval passed."""
        try:
            return self.run_batch(payloads)
        finally:
            self.heap.maybe_trim()

    def run_batch(self, payloads: list[Any]) -> list[Any]:
        raise NotImplementedError

    @property
    def alive(self) -> bool:
        return self.batcher.alive

    @property
    def queue_capacity(self) -> int:
        return self.batcher.limits.max_queued

    def stats(self) -> dict[str, Any]:
        return {**self.batcher.stats.as_dict(), "queued": self.batcher.queued}  # queued: inputs waiting now

    def close(self, timeout_s: float = 5.0) -> None:
        """The inference thread stops; a batch still queued for it fails (its items' requests with it)."""
        self.executor.shutdown(wait=False, cancel_futures=True)
