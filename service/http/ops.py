"""The service routes: /v1/models, /healthz, /readyz and /metrics."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Collection
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from ..messages import ModelInfo
from ..settings import Settings
from ..telemetry.metrics import ServiceMetrics, render
from .routing import Backend, ModelRoutes
from .schemas import Health, ModelCard, ModelList, PhaseCard, Readiness

METRICS_PATH = "/metrics"


def ops_router(settings: Settings, routes: ModelRoutes, backend: Backend, metrics: ServiceMetrics,
               endpoints: Callable[[], Collection[str]]) -> APIRouter:
    """`endpoints()`: the API's paths, for the front's answers in /metrics (other paths are "other")."""
    router = APIRouter(tags=["service"])

    async def probe_all() -> dict[str, ModelInfo | Exception]:
        names = list(settings.deployments)
        results = await asyncio.gather(*(backend.info(n, settings.readiness_timeout_s) for n in names),
                                       return_exceptions=True)
        return dict(zip(names, results, strict=True))

    @router.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        """Every configured model, whether it is loaded, and which tasks it serves."""
        cards = []
        for name, result in (await probe_all()).items():
            dep = settings.deployments[name]
            assert dep.model is not None
            if isinstance(result, ModelInfo):
                cards.append(ModelCard(
                    id=result.name, created=int(result.loaded_at), deployment=name, tasks=list(result.tasks),
                    ready=True, device=result.device, dtype=result.dtype, max_input_tokens=result.max_input_tokens,
                    labels=list(result.labels) or None,
                    languages=list(result.languages) if result.languages else None,
                    defaults=result.defaults, stats=result.stats, limits=result.limits or None,
                    quantize=result.quantize, kernels=result.kernels or None, compiled=result.compiled,
                    block_activation_bits=result.block_activation_bits, prompt_weights=result.prompt_weights,
                    plan={phase: PhaseCard(**card) for phase, card in result.plan.items()} or None,
                    speculative=result.speculative, adapters=result.adapters))
            else:
                cards.append(ModelCard(id=dep.model.name, created=0, deployment=name, tasks=list(dep.model.tasks),
                                       ready=False, defaults=dict(dep.model.defaults), quantize=dep.model.quantize))
        bases = {card.deployment: card for card in cards}
        for entry in routes.adapters.listed():  # each adapter a model of its own, as vLLM lists them
            base = bases[entry.deployment]
            cards.append(ModelCard(id=entry.name, created=base.created, deployment=entry.deployment,
                                   tasks=base.tasks, ready=base.ready, parent=entry.base, root=entry.path,
                                   max_input_tokens=base.max_input_tokens, defaults=base.defaults))
        tasks = {task: [r.model for r in rs] for task, rs in routes.by_task.items()}
        return ModelList(data=cards, tasks=tasks)

    @router.get(METRICS_PATH, response_class=Response, include_in_schema=False)  # an ops route, like /docs
    async def prometheus_metrics() -> Response:
        """Prometheus text format: the metrics of every replica on this node (docs/observability.md)."""
        metrics.replicas_seen(list(settings.deployments), await backend.replica_states())
        body, content_type = await asyncio.to_thread(render, metrics, endpoints)
        return Response(body, media_type=content_type)

    @router.get("/healthz", response_model=Health)
    async def healthz() -> Health:
        """Liveness: 200 while the server answers."""
        return Health()

    @router.get("/readyz", response_model=Readiness, responses={503: {"model": Readiness}})
    async def readyz() -> Any:
        """Readiness: 200 only when every model deployment has a loaded, warmed-up replica. Cached for
        about a second; it does not queue behind model requests (service/ingress.py)."""
        states = await backend.readiness(list(settings.deployments), settings.readiness_timeout_s)
        ready = all(s == "ready" for s in states.values())
        body = Readiness(status="ready" if ready else "not_ready", deployments=states)
        if ready:
            return body
        headers = {"Retry-After": str(max(1, math.ceil(settings.retry_after_s)))}
        return JSONResponse(body.model_dump(), status_code=503, headers=headers)

    return router
