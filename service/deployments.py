"""Ray Serve deployments that own a model and its batcher: one deployment per model, scaled on its own.

A replica loads its model once in its constructor (onto its device, cast to its dtype), warms it
up, and only then joins the deployment: Serve routes nothing to a replica still loading, and the
ingress's /readyz answers 503 until every deployment has a replica. Inference runs under
torch.inference_mode in the replica's single inference thread (see service/runners.py).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch
from ray import serve
from ray.serve.deployment import Application, Deployment

from models.catalog import load_model

from .batching import BatchLimits
from .messages import Classification, Embeddings, ModelInfo, TranslateOptions
from .runners import RUNNERS, Runner, resolve_device
from .settings import DeploymentSettings, Settings

log = logging.getLogger("ray.serve")
GATE_TIMEOUT_S = 600.0


class ModelDeployment:
    """Common replica life cycle: load, warm up, report info and health."""

    def __init__(self, name: str, settings: Settings) -> None:
        dep = settings.deployments[name]
        assert dep.model is not None
        torch.set_num_threads(dep.threads())
        _wait_for_gate(dep.startup_gate)
        device, dtype = resolve_device(*settings.device_for(dep))
        loaded = load_model(dep.spec, settings.cache_path(), device=device, dtype=dtype)
        limits = _limits(dep)
        self.runner: Runner = RUNNERS[dep.model.kind](loaded, name, limits)
        started = time.perf_counter()
        self.runner.warm_up()
        log.info("%s: %s loaded on %s/%s in %.1f s, warmed up in %.2f s", name, dep.model.name, device,
                 str(dtype).removeprefix("torch."), loaded.load_seconds, time.perf_counter() - started)

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


# deployment kind (settings.TASK_KIND) -> deployment; the generator's joins here.
DEPLOYMENTS: dict[str, Deployment] = {"encoder": EncoderDeployment, "translator": TranslatorDeployment}


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
    options: dict[str, Any] = {
        "ray_actor_options": {"num_cpus": dep.num_cpus, "num_gpus": gpus},
        "max_ongoing_requests": dep.max_ongoing_requests,
        "max_queued_requests": dep.max_queued_requests,
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
