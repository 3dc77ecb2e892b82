"""The HTTP API: FastAPI routes that validate, route and convert. No Ray and no model code here.

`create_api(settings, backend)` builds the app; the ingress deployment (service/app.py) calls it
in its replica with a backend of Ray handles. Each request gets a deadline (settings, lowered by an
`X-Request-Timeout: <seconds>` header); past it the model call is cancelled and the answer is 504.
"""

from __future__ import annotations

import asyncio
import base64
import math
from collections.abc import Callable
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .auth import install_access_control
from .errors import (
    DeadlineExceeded,
    InvalidItem,
    InvalidRequest,
    PayloadTooLarge,
    ServiceError,
    error_response,
    install_error_handlers,
)
from .generation_api import generation_router
from .messages import Classification as ClassificationResult
from .messages import Embeddings, ModelInfo, TranslateOptions
from .metrics import ServiceMetrics, process_metrics, render
from .observability import Observability
from .routing import Backend, ModelRoutes, Route
from .schemas import (
    Classification,
    ClassifyRequest,
    ClassifyResponse,
    Embedding,
    EmbeddingsRequest,
    EmbeddingsResponse,
    ErrorResponse,
    Health,
    ModelCard,
    ModelList,
    Readiness,
    TranslateRequest,
    TranslateResponse,
    Usage,
    check_texts,
)
from .settings import Settings

TIMEOUT_HEADER = "X-Request-Timeout"
METRICS_PATH = "/metrics"
ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": text} for status, text in {
        404: "No model serves this task", 413: "Body too large", 422: "Invalid request",
        503: "Overloaded or model not ready (see Retry-After)", 504: "Deadline exceeded"}.items()
}


class BodyLimit:
    """ASGI middleware: 413 when Content-Length or the bytes actually sent exceed max_bytes, before
    anything parses the body. The body is buffered (the routes parse all of it anyway)."""

    def __init__(self, app: ASGIApp, max_bytes: int, retry_after_s: float) -> None:
        self.app, self.max_bytes, self.retry_after_s = app, max_bytes, retry_after_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:
            if not declared.isdigit():
                await self._reject(scope, receive, send, InvalidRequest("Content-Length is not a number"))
                return
            if int(declared) > self.max_bytes:
                await self._reject(scope, receive, send, self._too_large(int(declared)))
                return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._reject(scope, receive, send, self._too_large(size, at_least=True))
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body, sent = b"".join(chunks), False

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _too_large(self, size: int, at_least: bool = False) -> PayloadTooLarge:
        return PayloadTooLarge(f"the request body has {'more than ' if at_least else ''}{size} bytes; "
                               f"the limit is {self.max_bytes}")

    async def _reject(self, scope: Scope, receive: Receive, send: Send, err: ServiceError) -> None:
        await error_response(err, self.retry_after_s)(scope, receive, send)


def request_timeout(request: Request, settings: Settings) -> float:
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


def create_api(settings: Settings, backend: Backend, metrics: ServiceMetrics | None = None,
               proxy_echoes_id: bool = False) -> FastAPI:
    """The app. `metrics`: this process's by default; `proxy_echoes_id`: Ray Serve's proxy already
    returns X-Request-ID (service/observability.py)."""
    metrics = metrics if metrics is not None else process_metrics()
    routes = ModelRoutes(settings)
    app = FastAPI(
        title="transformer-serve",
        version="0.1.0",
        description="Classification, embeddings and translation on our own transformers, batched dynamically; "
                    "text generation (also OpenAI-compatible) with continuous batching. "
                    f"Errors are JSON {{\"error\": {{\"type\", \"message\", \"param\"?}}}}; send "
                    f"`{TIMEOUT_HEADER}: <seconds>` to lower the per-request deadline.",
    )
    install_error_handlers(app, settings.retry_after_s)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes, retry_after_s=settings.retry_after_s)
    install_access_control(app, settings, ErrorResponse, (TIMEOUT_HEADER,))  # keys, CORS: before the body
    app.add_middleware(Observability, metrics=metrics, endpoints=lambda: _paths(app),  # outermost
                       retry_after_s=settings.retry_after_s, access_log=settings.access_log,
                       proxy_echoes_id=proxy_echoes_id)

    async def call(route: Route, method: str, field: str, timeout: float, *args: Any) -> Any:
        """The model call under the request's deadline; item errors name `<field>[i]`."""
        try:
            return await asyncio.wait_for(backend.call(route.deployment, method, *args, timeout), timeout)
        except asyncio.TimeoutError:
            raise DeadlineExceeded(f"the request did not finish within {timeout:g} s") from None
        except InvalidItem as e:
            raise InvalidRequest(f"{field}[{e.index}]: {e.message}", f"{field}[{e.index}]") from None

    @app.post("/v1/classify", response_model=ClassifyResponse, responses=ERRORS, tags=["inference"])
    async def classify(body: ClassifyRequest, request: Request) -> ClassifyResponse:
        """Label probabilities per text: `{"inputs": str | [str], "model"?: str}`."""
        texts = check_texts(body.inputs, "inputs", settings.max_inputs)
        route = routes.resolve("classify", body.model)
        results: list[ClassificationResult] = await call(
            route, "classify", "inputs", request_timeout(request, settings), texts, body.truncate)
        return ClassifyResponse(model=route.model, results=[
            Classification(label=r.label, score=r.score, scores=r.scores) for r in results])

    @app.post("/v1/embeddings", response_model=EmbeddingsResponse, responses=ERRORS, tags=["inference"])
    async def embeddings(body: EmbeddingsRequest, request: Request) -> EmbeddingsResponse:
        """OpenAI-compatible sentence embeddings."""
        texts = check_texts(body.input, "input", settings.max_inputs)
        route = routes.resolve("embed", body.model)
        out: Embeddings = await call(route, "embed", "input", request_timeout(request, settings), texts,
                                     body.truncate)
        encode: Callable[[list[float]], list[float] | str] = (
            _base64 if body.encoding_format == "base64" else (lambda v: v))
        return EmbeddingsResponse(
            model=route.model,
            data=[Embedding(index=i, embedding=encode(v)) for i, v in enumerate(out.vectors)],
            usage=Usage(prompt_tokens=out.prompt_tokens, total_tokens=out.prompt_tokens))

    @app.post("/v1/translate", response_model=TranslateResponse, responses=ERRORS, tags=["inference"])
    async def translate(body: TranslateRequest, request: Request) -> TranslateResponse:
        """Beam-search translation; beam_size and max_new_tokens apply to this request only."""
        texts = check_texts(body.inputs, "inputs", settings.max_inputs)
        route = routes.resolve_translation(body.source_lang, body.target_lang, body.model)
        options = TranslateOptions(body.beam_size, body.max_new_tokens, body.truncate)
        out: list[str] = await call(route, "translate", "inputs", request_timeout(request, settings), texts,
                                    options)
        return TranslateResponse(model=route.model, translations=out)

    async def probe_all() -> dict[str, ModelInfo | Exception]:
        names = list(settings.deployments)
        results = await asyncio.gather(*(backend.info(n, settings.readiness_timeout_s) for n in names),
                                       return_exceptions=True)
        return dict(zip(names, results, strict=True))

    @app.get("/v1/models", response_model=ModelList, tags=["service"])
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
                    defaults=result.defaults, stats=result.stats, limits=result.limits or None))
            else:
                cards.append(ModelCard(id=dep.model.name, created=0, deployment=name, tasks=list(dep.model.tasks),
                                       ready=False, defaults=dep.model.defaults))
        tasks = {task: [r.model for r in rs] for task, rs in routes.by_task.items()}
        return ModelList(data=cards, tasks=tasks)

    app.include_router(generation_router(routes, backend, lambda r: request_timeout(r, settings), ERRORS))

    @app.get(METRICS_PATH, response_class=Response, include_in_schema=False)  # an ops route, like /docs
    async def prometheus_metrics() -> Response:
        """Prometheus text format: the metrics of every replica on this node (docs/observability.md)."""
        body, content_type = await asyncio.to_thread(render, metrics)
        return Response(body, media_type=content_type)

    @app.get("/healthz", response_model=Health, tags=["service"])
    async def healthz() -> Health:
        """Liveness: 200 while the server answers."""
        return Health()

    @app.get("/readyz", response_model=Readiness, responses={503: {"model": Readiness}}, tags=["service"])
    async def readyz() -> Any:
        """Readiness: 200 only when every model deployment has a loaded, warmed-up replica."""
        states = {name: "ready" if isinstance(r, ModelInfo) else str(r) for name, r in (await probe_all()).items()}
        ready = all(s == "ready" for s in states.values())
        body = Readiness(status="ready" if ready else "not_ready", deployments=states)
        if ready:
            return body
        headers = {"Retry-After": str(max(1, math.ceil(settings.retry_after_s)))}
        return JSONResponse(body.model_dump(), status_code=503, headers=headers)

    return app


def _paths(app: FastAPI) -> set[str]:
    """Every path the app answers: its OpenAPI paths, /metrics and the docs' own."""
    return set(app.openapi()["paths"]) | {p for p in (METRICS_PATH, app.openapi_url, app.docs_url, app.redoc_url) if p}


def _base64(vector: list[float]) -> str:
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")

