"""The inference routes: /v1/classify, /v1/embeddings (OpenAI's), /v1/rerank (Text Embeddings
Inference's) and /v1/translate. Each validates, resolves the model's deployment, calls it under the
request's deadline and converts the result."""

from __future__ import annotations

import base64
import logging
from collections.abc import Callable
from typing import Any

import numpy as np
from fastapi import APIRouter, Request

from ..errors import InvalidItem, InvalidRequest
from ..messages import Classification as ClassificationResult
from ..messages import Embeddings, TranslateOptions
from ..settings import Settings
from .deadline import request_timeout, within
from .routing import Backend, InputLimits, ModelRoutes, Route
from .schemas import (
    Classification,
    ClassifyRequest,
    ClassifyResponse,
    Embedding,
    EmbeddingsRequest,
    EmbeddingsResponse,
    EmbeddingUsage,
    Rank,
    RerankRequest,
    TranslateRequest,
    TranslateResponse,
    check_texts,
)

log = logging.getLogger(__name__)


def truncated(vector: list[float], size: int) -> list[float]:
    """The first `size` components, L2-normalised again (Matryoshka embeddings)."""
    head = np.asarray(vector[:size], dtype=np.float32)
    norm = float(np.linalg.norm(head))
    return (head / norm if norm > 0 else head).tolist()


def inference_router(settings: Settings, routes: ModelRoutes, backend: Backend, limits: InputLimits,
                     errors: dict[int | str, dict[str, Any]]) -> APIRouter:
    router = APIRouter(tags=["inference"])

    async def call(route: Route, method: str, field: str, request: Request, *args: Any) -> Any:
        """The model call under the request's deadline; item errors name `<field>[i]`."""
        timeout = request_timeout(request, settings)
        try:
            return await within(backend.call(route.deployment, method, *args, timeout), timeout)
        except InvalidItem as e:
            raise InvalidRequest(f"{field}[{e.index}]: {e.message}", f"{field}[{e.index}]") from None

    @router.post("/v1/classify", response_model=ClassifyResponse, responses=errors)
    async def classify(body: ClassifyRequest, request: Request) -> ClassifyResponse:
        """Label probabilities per text: `{"inputs": str | [str], "model"?: str}`."""
        texts = check_texts(body.inputs, "inputs", settings.max_inputs)
        route = routes.resolve("classify", body.model)
        texts = await limits.fit(route.deployment, texts, body.truncate, "inputs")
        results: list[ClassificationResult] = await call(route, "classify", "inputs", request, texts, body.truncate)
        return ClassifyResponse(model=route.model, results=[
            Classification(label=r.label, score=r.score, scores=r.scores) for r in results])

    @router.post("/v1/embeddings", response_model=EmbeddingsResponse, responses=errors)
    async def embeddings(body: EmbeddingsRequest, request: Request) -> EmbeddingsResponse:
        """OpenAI-compatible sentence embeddings."""
        texts = check_texts(body.input, "input", settings.max_inputs)
        route = routes.resolve("embed", body.model)
        texts = await limits.fit(route.deployment, texts, body.truncate, "input")
        if body.dimensions is not None:  # refused before any work when the model cannot be cut there
            spec = settings.deployments[route.deployment].model
            sizes = tuple((spec.defaults if spec is not None else {}).get("dimensions") or ())
            if body.dimensions not in sizes:
                raise InvalidRequest(f"model {route.model!r} cannot return {body.dimensions} dimensions: "
                                     + (f"its embeddings may be cut to {list(sizes)}" if sizes else
                                        "its embeddings were not trained to be truncated"), "dimensions")
        if body.user is not None:
            log.info("embeddings for user %r", body.user)
        out: Embeddings = await call(route, "embed", "input", request, texts, body.truncate)
        vectors = out.vectors if body.dimensions is None else [truncated(v, body.dimensions) for v in out.vectors]
        encode: Callable[[list[float]], list[float] | str] = (
            _base64 if body.encoding_format == "base64" else (lambda v: v))
        return EmbeddingsResponse(
            model=route.model,
            data=[Embedding(index=i, embedding=encode(v)) for i, v in enumerate(vectors)],
            usage=EmbeddingUsage(prompt_tokens=out.prompt_tokens, total_tokens=out.prompt_tokens))

    @router.post("/v1/rerank", response_model=list[Rank], response_model_exclude_none=True, responses=errors)
    async def rerank(body: RerankRequest, request: Request) -> list[Rank]:
        """TEI's rerank: each text's relevance to the query from a cross-encoder, best first."""
        if not body.query:
            raise InvalidRequest("query is an empty string", "query")
        texts = check_texts(body.texts, "texts", settings.max_inputs)
        route = routes.resolve("rerank", body.model)
        texts = await limits.fit(route.deployment, texts, body.truncate, "texts")
        query, = await limits.fit(route.deployment, [body.query], body.truncate, "query", each=False)
        scores: list[float] = await call(route, "rerank", "texts", request, query, texts, body.truncate,
                                         body.raw_scores)
        order = sorted(range(len(texts)), key=lambda i: -scores[i])  # stable: ties keep request order
        return [Rank(index=i, score=scores[i], text=texts[i] if body.return_text else None) for i in order]

    @router.post("/v1/translate", response_model=TranslateResponse, responses=errors)
    async def translate(body: TranslateRequest, request: Request) -> TranslateResponse:
        """Beam-search translation; beam_size and max_new_tokens apply to this request only."""
        texts = check_texts(body.inputs, "inputs", settings.max_inputs)
        route = routes.resolve_translation(body.source_lang, body.target_lang, body.model)
        texts = await limits.fit(route.deployment, texts, body.truncate, "inputs")
        options = TranslateOptions(body.beam_size, body.max_new_tokens, body.truncate)
        out: list[str] = await call(route, "translate", "inputs", request, texts, options)
        return TranslateResponse(model=route.model, translations=out)

    return router


def _base64(vector: list[float]) -> str:
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
