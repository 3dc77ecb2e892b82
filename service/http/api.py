"""The HTTP API: FastAPI routes that validate, route and convert. No Ray and no model code here.

`create_api(settings, backend)` builds the app; the ingress deployment (service/app.py) calls it
in its replica with a backend of Ray handles, the tests with fakes. Each route family is a router
(inference.py, generation.py, ops.py); every model call runs under the request's deadline
(deadline.py).
"""

from __future__ import annotations

import functools
from typing import Any

from fastapi import FastAPI

from ..settings import Settings
from ..telemetry.metrics import ServiceMetrics, process_metrics
from .adapter_routes import adapter_router
from .auth import install_access_control
from .body_limit import BodyLimit
from .deadline import TIMEOUT_HEADER
from .errors import install_error_handlers
from .generation import SESSION_HEADER, generation_router
from .inference import inference_router
from .observability import Observability
from .ops import METRICS_PATH, ops_router
from .quotas import Quotas
from .routing import Backend, InputLimits, ModelRoutes
from .schemas import ErrorResponse
from .tokenize import tokenize_router

ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": text} for status, text in {
        400: "An adapter that cannot be served", 404: "No such model, or no model serves this task",
        413: "Body too large", 422: "Invalid request",
        503: "Overloaded or model not ready (see Retry-After)", 504: "Deadline exceeded"}.items()
}


def create_api(settings: Settings, backend: Backend, metrics: ServiceMetrics | None = None,
               proxy_echoes_id: bool = False) -> FastAPI:
    """The app. `metrics`: this process's by default; `proxy_echoes_id`: Ray Serve's proxy already
    returns X-Request-ID (service/http/observability.py)."""
    metrics = metrics if metrics is not None else process_metrics()
    routes = ModelRoutes(settings)
    app = FastAPI(
        title="transformer-serve",
        version="0.1.0",
        description="Classification, embeddings and translation on our own transformers, batched dynamically; "
                    "text generation (also OpenAI-compatible) with continuous batching. "
                    f"Errors are JSON {{\"error\": {{\"type\", \"message\", \"param\"?}}}}; send "
                    f"`{TIMEOUT_HEADER}: <seconds>` to lower the per-request deadline; generations with the same "
                    f"`{SESSION_HEADER}` go to the same replica while load allows.",
    )
    install_error_handlers(app, settings.retry_after_s)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes, retry_after_s=settings.retry_after_s,
                       timeout_s=settings.body_timeout_s)
    if settings.tenants:  # after the key check, which names the tenant; before the body is read
        app.add_middleware(Quotas, settings=settings, metrics=metrics)
    install_access_control(app, settings, ErrorResponse, (TIMEOUT_HEADER, SESSION_HEADER))  # keys, CORS: before the body
    endpoints = functools.cache(lambda: frozenset(_paths(app)))  # read at the first request: every route exists
    app.add_middleware(Observability, metrics=metrics, endpoints=endpoints,  # outermost
                       retry_after_s=settings.retry_after_s, access_log=settings.access_log,
                       proxy_echoes_id=proxy_echoes_id)
    limits = InputLimits(backend, settings.readiness_timeout_s)
    app.include_router(inference_router(settings, routes, backend, limits, ERRORS))
    app.include_router(ops_router(settings, routes, backend, metrics, endpoints=endpoints))
    app.include_router(generation_router(settings, routes, backend, limits, ERRORS))
    app.include_router(tokenize_router(routes, backend, limits, ERRORS))
    app.include_router(adapter_router(settings, routes, backend, ERRORS))
    return app


def _paths(app: FastAPI) -> set[str]:
    """Every path the app answers: its OpenAPI paths, /metrics and the docs' own."""
    return set(app.openapi()["paths"]) | {p for p in (METRICS_PATH, app.openapi_url, app.docs_url, app.redoc_url) if p}
