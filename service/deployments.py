"""Ray Serve deployments that own a model and its batcher: one deployment per model, scaled on its own.

A replica loads its model once in its constructor (onto its device, cast to its dtype), warms it
up, and only then joins the deployment: Serve routes nothing to a replica still loading, and the
ingress's /readyz answers 503 until every deployment has a replica. Inference runs under
torch.inference_mode in the replica's single inference thread (see service/runners.py); a
generator's in its engine's scheduler thread (service/generation.py, service/engine.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import torch
from ray import serve
from ray.serve.deployment import Application, Deployment

from models.catalog import LoadedModel, load_model

from .batching import BatchLimits
from .generation import GeneratorRunner, engine_config
from .heap import HeapTrimmer
from .logs import configure_logging, serve_logging_config
from .messages import (
    Classification,
    Embeddings,
    GenerationDone,
    GenerationEvent,
    GenerationRequest,
    ModelInfo,
    TranslateOptions,
)
from .metrics import ServiceMetrics, process_metrics, replica_actor_options
from .runners import RUNNERS, Runner, resolve_device
from .settings import DeploymentSettings, Settings

log = logging.getLogger("ray.serve")
GATE_TIMEOUT_S = 600.0


def _load(name: str, settings: Settings) -> tuple[DeploymentSettings, LoadedModel]:
    """The replica's model: threads set, startup gate passed, loaded onto its device in its dtype."""
    dep = settings.deployments[name]
    assert dep.model is not None
    configure_logging(settings.log_json)  # this replica's own loggers; Serve's follow serve_logging_config
    torch.set_num_threads(dep.threads())
    _wait_for_gate(dep.startup_gate)
    device, dtype = resolve_device(*settings.device_for(dep))
    return dep, load_model(dep.spec, settings.cache_path(), device=device, dtype=dtype)


def _log_loaded(name: str, loaded: LoadedModel, warm_up_started: float) -> None:
    log.info("%s: %s loaded on %s/%s in %.1f s, warmed up in %.2f s", name, loaded.spec.name, loaded.device,
             str(loaded.dtype).removeprefix("torch."), loaded.load_seconds, time.perf_counter() - warm_up_started)


def _report_loaded(metrics: ServiceMetrics, name: str, kind: str, loaded: LoadedModel, queue_capacity: int) -> None:
    metrics.model_loaded(loaded.spec.name, name, kind, str(loaded.device), str(loaded.dtype).removeprefix("torch."),
                         loaded.load_seconds, queue_capacity)


class ModelDeployment:
    """Common replica life cycle: load, warm up, report info and health."""

    def __init__(self, name: str, settings: Settings) -> None:
        dep, loaded = _load(name, settings)
        assert dep.model is not None
        metrics = process_metrics()
        self.runner: Runner = RUNNERS[dep.model.kind](loaded, name, _limits(dep),
                                                      metrics.batch_observer(loaded.spec.name),
                                                      HeapTrimmer(dep.heap_trim_interval_s))
        started = time.perf_counter()
        self.runner.warm_up()
        _log_loaded(name, loaded, started)
        _report_loaded(metrics, name, dep.model.kind, loaded, dep.batching.max_queued)

    async def info(self) -> ModelInfo:
        return self.runner.info()

    def check_health(self) -> None:
        if not self.runner.batcher.alive:
            raise RuntimeError(f"{self.runner.deployment}: the batching loop has stopped")


@serve.deployment
class EncoderDeployment(ModelDeployment):
    """classify + embed on one encoder (with a classification head); one batcher for both."""

    async def classify(self, texts: list[str], truncate: bool, timeout_s: float | None) -> list[Classification]:
        return await self.runner.classify(texts, truncate, timeout_s)  # type: ignore[attr-defined]

    async def embed(self, texts: list[str], truncate: bool, timeout_s: float | None) -> Embeddings:
        return await self.runner.embed(texts, truncate, timeout_s)  # type: ignore[attr-defined]


@serve.deployment
class TranslatorDeployment(ModelDeployment):
    """Beam-search translation with per-request beam size and length inside shared batches."""

    async def translate(self, texts: list[str], options: TranslateOptions, timeout_s: float | None) -> list[str]:
        return await self.runner.translate(texts, options, timeout_s)  # type: ignore[attr-defined]


@serve.deployment
class GeneratorDeployment:
    """Text generation on one decoder-only LM: one continuous-batching engine per replica, started
    after the model loaded and warmed up. `generate` answers whole; `generate_stream` is a streaming
    method (call it with `handle.options(stream=True)`). A cancelled call (client gone, deadline)
    cancels its request in the engine, which frees the row within one step."""

    def __init__(self, name: str, settings: Settings) -> None:
        dep, loaded = _load(name, settings)
        metrics = process_metrics()
        self.runner = GeneratorRunner(loaded, name, engine_config(dep.engine, loaded),
                                      metrics.engine_observer(loaded.spec.name), HeapTrimmer(dep.heap_trim_interval_s))
        started = time.perf_counter()
        self.runner.warm_up()
        self.runner.start()
        _log_loaded(name, loaded, started)
        _report_loaded(metrics, name, "generator", loaded, self.runner.engine.limits.max_queued)
        log.info("%s: generation engine limits %s", name, self.runner.engine.limits)

    async def generate(self, request: GenerationRequest) -> GenerationDone:
        return await self.runner.generate(request)

    async def generate_stream(self, request: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        events = self.runner.stream(request)
        try:
            async for event in events:
                yield event
        finally:  # Serve throws CancelledError in here when the caller goes away: close the inner stream now
            await events.aclose()

    async def info(self) -> ModelInfo:
        return self.runner.info()

    def check_health(self) -> None:
        if not self.runner.alive:
            raise RuntimeError(f"{self.runner.deployment}: the generation engine has stopped")

    def __del__(self) -> None:
        runner = getattr(self, "runner", None)
        if runner is not None:
            runner.close()


# deployment kind (settings.TASK_KIND) -> deployment
DEPLOYMENTS: dict[str, Deployment] = {"encoder": EncoderDeployment, "translator": TranslatorDeployment,
                                      "generator": GeneratorDeployment}


def _limits(dep: DeploymentSettings) -> BatchLimits:
    b = dep.batching
    return BatchLimits(max_batch_size=b.max_batch_size, max_wait_s=b.max_wait_ms / 1000.0,
                       max_batch_tokens=b.max_batch_tokens, max_queued=b.max_queued,
                       overhead_tokens=b.overhead_tokens)


def _wait_for_gate(path: str | None) -> None:
    if path is None:
        return
    deadline = time.monotonic() + GATE_TIMEOUT_S
    while not Path(path).exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def deployment_options(dep: DeploymentSettings, settings: Settings, cluster_gpus: float) -> dict[str, Any]:
    """Serve options from the settings: replicas or autoscaling, CPUs/GPUs, queue bounds."""
    device, _ = settings.device_for(dep)
    gpus = dep.num_gpus
    if gpus is None:
        gpus = 1.0 if cluster_gpus > 0 and (device == "auto" or device.startswith("cuda")) else 0.0
    actor = {"num_cpus": dep.num_cpus, "num_gpus": gpus, **replica_actor_options(settings.metrics_dir)}
    options: dict[str, Any] = {
        "ray_actor_options": actor,
        "max_ongoing_requests": dep.max_ongoing_requests,
        "max_queued_requests": dep.max_queued_requests,
        "logging_config": serve_logging_config(settings.log_json, settings.access_log),
    }
    if dep.autoscaling_config is not None:
        options["autoscaling_config"] = dep.autoscaling_config
    else:
        options["num_replicas"] = dep.num_replicas
    return options


def bind_model(name: str, settings: Settings, cluster_gpus: float) -> Application:
    dep = settings.deployments[name]
    assert dep.model is not None
    kind = dep.model.kind
    if kind not in DEPLOYMENTS:
        raise ValueError(f"deployment {name!r} serves {list(dep.model.tasks)}, but this server has no "
                         f"{kind} deployment yet (known: {sorted(DEPLOYMENTS)})")
    return DEPLOYMENTS[kind].options(name=name, **deployment_options(dep, settings, cluster_gpus)).bind(name, settings)
