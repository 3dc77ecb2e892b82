"""The inference routes: /v1/classify, /v1/embeddings (OpenAI's), /v1/rerank (Text Embeddings
Inference's) and /v1/translate. Each validates, resolves the model's deployment, calls it under the
request's deadline and converts the result."""

from __future__ import annotations

import asyncio
import base64
import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from fastapi import APIRouter, Request

from .. import documents
from ..errors import InvalidItem, InvalidRequest
from ..messages import Classification as ClassificationResult
from ..messages import Embeddings, TranslateOptions
from ..settings import Settings
from ..text_limits import fit_chars
from .deadline import request_timeout, within
from .routing import Backend, InputLimits, ItemName, ModelRoutes, Route, item_error
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
OFF_LOOP_CHARS = 4096  # documents longer than this in all are cut into sentences in a worker thread (~0.1 ms per KB)


def truncated(vector: list[float], size: int) -> list[float]:
    """The first `size` components, L2-normalised again (Matryoshka embeddings)."""
    head = np.asarray(vector[:size], dtype=np.float32)
    norm = float(np.linalg.norm(head))
    return (head / norm if norm > 0 else head).tolist()


def inference_router(settings: Settings, routes: ModelRoutes, backend: Backend, limits: InputLimits,
                     errors: dict[int | str, dict[str, Any]]) -> APIRouter:
    router = APIRouter(tags=["inference"])

    async def call(route: Route, method: str, field: str, request: Request, *args: Any,
                   names: Sequence[ItemName] | None = None) -> Any:
        """The model call under the request's deadline; item errors name `<field>[i]` (or names[i])."""
        timeout = request_timeout(request, settings)
        try:
            return await within(backend.call(route.deployment, method, *args, timeout), timeout)
        except InvalidItem as e:
            raise item_error(e, field, names=names) from None

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
        """Beam-search translation; beam_size and max_new_tokens apply to this request only. Texts are
        cut into sentences and put back together (service/documents.py) unless split_sentences is false."""
        texts = check_texts(body.inputs, "inputs", settings.max_inputs)
        route = routes.resolve_translation(body.source_lang, body.target_lang, body.model)
        options = TranslateOptions(body.beam_size, body.max_new_tokens, body.truncate)
        if not body.split_sentences:
            texts = await limits.fit(route.deployment, texts, body.truncate, "inputs")
            out: list[str] = await call(route, "translate", "inputs", request, texts, options)
            return TranslateResponse(model=route.model, translations=out, sentences=[1] * len(out))
        try:
            texts = fit_chars(texts, settings.max_document_chars, body.truncate)
        except InvalidItem as e:  # fit_chars words its message for a model's limit: this is the document's
            raise InvalidRequest(f"inputs[{e.index}]: the text has {len(texts[e.index])} characters; a document "
                                 f"takes at most {settings.max_document_chars} (max_document_chars; send "
                                 f"\"truncate\": true to cut it)", f"inputs[{e.index}]") from None
        split = functools.partial(documents.split_all, texts, body.source_lang)
        docs = await asyncio.to_thread(split) if sum(map(len, texts)) > OFF_LOOP_CHARS else split()
        sentences = [s for doc in docs for s in doc.sentences]
        names = [ItemName(f"inputs[{i}]", f"inputs[{i}], sentence {j + 1}")
                 for i, doc in enumerate(docs) for j in range(len(doc.sentences))]
        most = settings.deployments[route.deployment].batching.max_queued
        if len(sentences) > most:
            raise InvalidRequest(f"inputs hold {len(sentences)} sentences; at most {most} per request "
                                 f"(the translator's queue)", "inputs")
        if sentences:
            sentences = await limits.fit(route.deployment, sentences, body.truncate, "inputs", names=names)
            translated = await call(route, "translate", "inputs", request, sentences, options, names=names)
            if not isinstance(translated, list) or len(translated) != len(sentences):
                raise TypeError(f"the translator answered {type(translated).__name__} for {len(sentences)} inputs")
            sentences = translated
        out, start = [], 0
        for doc in docs:
            out.append(doc.join(sentences[start:start + len(doc.sentences)]))
            start += len(doc.sentences)
        return TranslateResponse(model=route.model, translations=out, sentences=[len(d.sentences) for d in docs])

    return router


def _base64(vector: list[float]) -> str:
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
