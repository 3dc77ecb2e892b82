"""The inference routes: /v1/classify, /v1/embeddings (OpenAI's), /v1/rerank (Text Embeddings
Inference's) and /v1/translate. Each validates, resolves the model's deployment, calls it under the
request's deadline and converts the result."""

from __future__ import annotations

import asyncio
import base64
import functools
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from ..common import documents
from ..common.text_limits import fit_chars
from ..errors import InvalidItem, InvalidRequest
from ..messages import Classification as ClassificationResult
from ..messages import Embeddings, TranslateOptions, TranslationDone
from ..settings import Settings
from .deadline import request_timeout, within
from .quotas import charge_tokens, tenant_priority
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
from .sse import SSE_HEADERS, STREAMED_200, guarded, sse

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
        """The model call under the request's deadline and at its tenant's priority (its inputs batched
        ahead of less urgent tenants'); item errors name `<field>[i]` (or names[i])."""
        timeout = request_timeout(request, settings)
        try:
            return await within(backend.call(route.deployment, method, *args, timeout, tenant_priority()), timeout)
        except InvalidItem as e:
            raise item_error(e, field, names=names) from None

    @router.post("/v1/classify", response_model=ClassifyResponse, responses=errors)
    async def classify(body: ClassifyRequest, request: Request) -> ClassifyResponse:
        """Label probabilities per text: `{"inputs": str | [str], "model"?: str}`."""
        texts = check_texts(body.inputs, "inputs", settings.max_inputs)
        route = routes.resolve("classify", body.model)
        texts = await limits.fit(route.deployment, texts, body.truncate, "inputs")
        results: list[ClassificationResult] = await call(route, "classify", "inputs", request, texts, body.truncate,
                                                             route.adapter)
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
        out: Embeddings = await call(route, "embed", "input", request, texts, body.truncate, route.adapter)
        charge_tokens(out.prompt_tokens)
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
                                         body.raw_scores, route.adapter)
        order = sorted(range(len(texts)), key=lambda i: -scores[i])  # stable: ties keep request order
        return [Rank(index=i, score=scores[i], text=texts[i] if body.return_text else None) for i in order]

    @router.post("/v1/translate", response_model=TranslateResponse, responses={**errors, 200: STREAMED_200})
    async def translate(body: TranslateRequest, request: Request) -> TranslateResponse | StreamingResponse:
        """Beam-search translation; beam_size and max_new_tokens apply to this request only. Texts are
        cut into sentences and put back together (service/common/documents.py) unless split_sentences is false."""
        texts = check_texts(body.inputs, "inputs", settings.max_inputs)
        route = routes.resolve_translation(body.source_lang, body.target_lang, body.model)
        options = TranslateOptions(body.beam_size, body.max_new_tokens, body.truncate)
        if not body.split_sentences:
            texts = await limits.fit(route.deployment, texts, body.truncate, "inputs")
            if body.stream:
                docs = [documents.Document(("", ""), (t,)) for t in texts]
                return await streamed(route, request, docs, texts, options, None)
            out: list[str] = await call(route, "translate", "inputs", request, texts, options)
            return TranslateResponse(model=route.model, translations=out, sentences=[1] * len(out))
        try:
            texts = fit_chars(texts, settings.max_document_chars, body.truncate)
        except InvalidItem as e:  # fit_chars words its message for a model's limit: this is the document's
            raise InvalidRequest(f"inputs[{e.index}]: the text has {len(texts[e.index])} characters; a document "
                                 f"takes at most {settings.max_document_chars} (max_document_chars; send "
                                 f"\"truncate\": true to cut it)", f"inputs[{e.index}]") from None
        dep = settings.deployments[route.deployment]
        most = dep.translation.max_queued if dep.translation.scheduler == "steps" else dep.batching.max_queued
        split = functools.partial(documents.split_all, texts, body.source_lang, most)  # stops past the cap
        try:
            docs = await asyncio.to_thread(split) if sum(map(len, texts)) > OFF_LOOP_CHARS else split()
        except documents.TooManySentences as e:
            raise InvalidRequest(f"inputs hold more than {most} sentences ({e.found} in the texts read so far); at "
                                 f"most {most} per request (the translator's queue)", "inputs") from None
        sentences = [s for doc in docs for s in doc.sentences]
        names = [ItemName(f"inputs[{i}]", f"inputs[{i}], sentence {j + 1}")
                 for i, doc in enumerate(docs) for j in range(len(doc.sentences))]
        if sentences:
            sentences = await limits.fit(route.deployment, sentences, body.truncate, "inputs", names=names)
        if body.stream:
            return await streamed(route, request, docs, sentences, options, names)
        if sentences:
            translated = await call(route, "translate", "inputs", request, sentences, options, names=names)
            if not isinstance(translated, list) or len(translated) != len(sentences):
                raise TypeError(f"the translator answered {type(translated).__name__} for {len(sentences)} inputs")
            sentences = translated
        out, start = [], 0
        for doc in docs:
            out.append(doc.join(sentences[start:start + len(doc.sentences)]))
            start += len(doc.sentences)
        return TranslateResponse(model=route.model, translations=out, sentences=[len(d.sentences) for d in docs])

    async def streamed(route: Route, request: Request, docs: Sequence[documents.Document], sentences: list[str],
                       options: TranslateOptions, names: Sequence[ItemName] | None) -> StreamingResponse:
        """The translation as server-sent events, each text's pieces in order: the replica's stream is
        opened and its first event awaited under the deadline (a refusal or a bad sentence is an error
        status, not a stream); then the client reads as long as it wants."""
        timeout = request_timeout(request, settings)
        events = backend.stream(route.deployment, "translate_stream", sentences, options, timeout, tenant_priority())
        first: list[Any] = []
        if sentences:
            try:
                first.append(await within(anext(events), timeout, "the translation did not start"))
            except InvalidItem as e:
                await events.aclose()
                raise item_error(e, "inputs", names=names) from None
            except BaseException:
                await events.aclose()
                raise
        return StreamingResponse(translation_events(route.model, docs, first, events), media_type="text/event-stream",
                                 headers=SSE_HEADERS)

    return router


def translation_events(model: str, docs: Sequence[documents.Document], first: list[Any],
                       events: AsyncIterator[Any]) -> AsyncIterator[bytes]:
    """`{"index", "text"}` events: each document's gaps and its sentences' translations in order (a
    sentence's pieces as they come; those of later sentences wait for the ones before them), then
    `{"model", "translations", "sentences"}`. An error after the stream started is a last `{"error"}`."""
    order = [(i, j) for i, doc in enumerate(docs) for j in range(len(doc.sentences))]  # sentence k -> (text, j)
    pieces: list[list[str]] = [[] for _ in order]
    done = [False] * len(order)
    sent = [0] * len(order)  # pieces of sentence k already sent
    out = [doc.gaps[0] for doc in docs]  # each text so far
    opened = [not doc.sentences for doc in docs]  # its leading gap was sent (a text of whitespace: at once)
    cursor = 0  # the first sentence not yet sent whole

    def ready() -> list[bytes]:
        nonlocal cursor
        chunks: list[bytes] = []
        while cursor < len(order):
            i, j = order[cursor]
            if not opened[i]:
                opened[i] = True
                if docs[i].gaps[0]:
                    chunks.append(sse({"index": i, "text": docs[i].gaps[0]}))
            new = "".join(pieces[cursor][sent[cursor]:])
            sent[cursor] = len(pieces[cursor])
            if new:
                chunks.append(sse({"index": i, "text": new}))
                out[i] += new
            if not done[cursor]:
                break
            gap = docs[i].gaps[j + 1]
            if gap:
                chunks.append(sse({"index": i, "text": gap}))
                out[i] += gap
            cursor += 1
        return chunks

    async def items() -> AsyncIterator[Any]:
        for item in first:
            yield item
        async for item in events:
            yield item

    async def chunks() -> AsyncIterator[bytes]:
        for i, doc in enumerate(docs):  # texts of whitespace only: no sentence to wait for
            if not doc.sentences and doc.gaps[0]:
                yield sse({"index": i, "text": doc.gaps[0]})
        async for k, event in items():
            if isinstance(event, TranslationDone):
                done[k] = True
            else:
                pieces[k].append(event.text)
            for chunk in ready():
                yield chunk
        yield sse({"model": model, "translations": out, "sentences": [len(d.sentences) for d in docs]})

    return guarded(chunks(), events, "translation")


def _base64(vector: list[float]) -> str:
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
