"""An in-process stand-in for the model deployments: the whole HTTP API without Ray or models.

`fake_app()` builds the real FastAPI app (service.http.api.create_api) over an `EchoBackend`, which
answers every deployment method from its arguments alone (a label by text length, unit vectors,
relevance by shared characters, reversed texts, a fixed generation), streams the way a generator
replica does, and keeps the limits a replica enforces that the edge cannot know (tokens per text,
the engine's max_new_tokens), so a fuzzer exercises every route, stream and error path of the HTTP
layer in milliseconds.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from typing import Any

from fastapi import FastAPI

from ..errors import InvalidItem, InvalidRequest, RequestTooLarge
from ..http.api import create_api
from ..http.routing import probed_readiness
from ..messages import (
    AdapterRef,
    Classification,
    Embeddings,
    GenerationDone,
    GenerationRequest,
    GenerationStarted,
    ModelInfo,
    TextDelta,
    Tokenized,
    TranslateOptions,
    Usage,
)
from ..settings import Settings

LABELS = ("negative", "positive")
MAX_TOKENS = 64  # tokens (bytes) per text, as a tiny model's max_input_tokens
MAX_NEW = 32  # the generator's max_new_tokens
DIM = 4


def fake_settings(extra: Mapping[str, Any] | None = None) -> Settings:
    """Settings with one deployment per task kind (tiny sources: nothing loads them here)."""
    args = {
        "deployments": {
            "encoder": {"model": {"name": "enc", "tasks": ["classify", "embed", "rerank"], "source": "tiny:encoder"}},
            "translator": {"model": {"name": "en-es", "tasks": ["translate"], "source": "tiny:seq2seq",
                                     "languages": ["en", "es"]}},
            "generator": {"model": {"name": "gen", "tasks": ["generate"], "source": "tiny:decoder"}},
        },
        "max_inputs": 8, "max_body_bytes": 1 << 16, "request_timeout_s": 5, **(extra or {}),
    }
    return Settings.build(args, env={})


def _tokens(texts: list[str], truncate: bool) -> list[int]:
    """Token counts (UTF-8 bytes); InvalidItem for a text over MAX_TOKENS, as a replica does."""
    lengths = []
    for i, text in enumerate(texts):
        n = len(text.encode("utf-8", "surrogatepass"))
        if n > MAX_TOKENS and not truncate:
            raise InvalidItem(f"the text has {n} tokens; the model takes at most {MAX_TOKENS}", i)
        lengths.append(min(n, MAX_TOKENS))
    return lengths


class EchoBackend:
    """Answers from the arguments alone; counts calls per method (`calls`)."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self.priorities: list[int] = []  # each encoder or translator call's priority, in turn

    async def call(self, deployment: str, method: str, *args: Any) -> Any:
        self.calls[method] = self.calls.get(method, 0) + 1
        await asyncio.sleep(0)
        return getattr(self, "_" + method)(*args)

    def _classify(self, texts: list[str], truncate: bool, adapter: AdapterRef | None,
                  timeout_s: float | None, priority: int = 0) -> list[Classification]:
        self.priorities.append(priority)
        _tokens(texts, truncate)
        return [Classification(LABELS[len(t) % 2], 0.75, {LABELS[len(t) % 2]: 0.75, LABELS[1 - len(t) % 2]: 0.25})
                for t in texts]

    def _embed(self, texts: list[str], truncate: bool, adapter: AdapterRef | None, timeout_s: float | None,
               priority: int = 0) -> Embeddings:
        self.priorities.append(priority)
        lengths = _tokens(texts, truncate)
        return Embeddings([[1.0 if j == len(t) % DIM else 0.0 for j in range(DIM)] for t in texts], sum(lengths))

    def _rerank(self, query: str, texts: list[str], truncate: bool, raw_scores: bool, adapter: AdapterRef | None,
                timeout_s: float | None, priority: int = 0) -> list[float]:
        self.priorities.append(priority)
        _tokens([query + t for t in texts], truncate)  # a pair's tokens: query and text
        shared = [len(set(query) & set(t)) / max(len(set(t)), 1) for t in texts]  # in [0, 1]
        return [4 * s - 2 for s in shared] if raw_scores else shared

    def _translate(self, texts: list[str], options: TranslateOptions, timeout_s: float | None,
                   priority: int = 0) -> list[str]:
        self.priorities.append(priority)
        _tokens(texts, options.truncate)
        return [t[::-1] for t in texts]

    def _generate(self, request: GenerationRequest) -> GenerationDone:
        text, prompt_tokens = self._check(request)
        return GenerationDone(request.request_id, text, "length", Usage(prompt_tokens, len(text)))

    def _generate_group(self, requests: list[GenerationRequest]) -> list[GenerationDone]:
        return [self._generate(r) for r in requests]

    def _check(self, request: GenerationRequest) -> tuple[str, int]:
        if request.max_new_tokens is not None and request.max_new_tokens > MAX_NEW:
            raise RequestTooLarge(f"max_new_tokens is {request.max_new_tokens}; at most {MAX_NEW}",
                                  request.param("max_new_tokens"), "max_new_tokens")
        prompt = request.prompt if request.prompt is not None else "".join(m.content for m in request.messages or ())
        prompt_tokens = _tokens([prompt], truncate=True)[0]
        return "ok" * min(request.max_new_tokens or 2, 4), prompt_tokens

    def _tokenize(self, request: GenerationRequest, add_special_tokens: bool) -> Tokenized:
        _, prompt_tokens = self._check(request)
        text = request.prompt if request.prompt is not None else "".join(m.content for m in request.messages or ())
        ids = tuple(text.encode("utf-8", "surrogatepass")[:prompt_tokens])
        return Tokenized(ids, tuple(chr(i) for i in ids), MAX_TOKENS + MAX_NEW)

    def _detokenize(self, tokens: list[int]) -> str:
        for i, t in enumerate(tokens):
            if not 0 <= t < 256:
                raise InvalidRequest(f"token id {t} is outside the vocabulary (size 256)", f"tokens[{i}]")
        return bytes(tokens).decode("utf-8", "replace")

    async def stream(self, deployment: str, method: str, request: Any) -> AsyncIterator[Any]:
        """generate_stream (one request's events) or generate_group_stream ((index, event) of several)."""
        self.calls[method] = self.calls.get(method, 0) + 1
        if method == "generate_stream":
            async for _, event in self._events([request]):
                yield event
        else:
            async for item in self._events(request):
                yield item

    async def _events(self, requests: list[GenerationRequest]) -> AsyncIterator[tuple[int, Any]]:
        checked = [self._check(r) for r in requests]
        for i, (r, (_, prompt_tokens)) in enumerate(zip(requests, checked, strict=True)):
            yield i, GenerationStarted(r.request_id, prompt_tokens)
        for i, (r, (text, prompt_tokens)) in enumerate(zip(requests, checked, strict=True)):
            for piece in (text[:2], text[2:]):
                if piece:
                    await asyncio.sleep(0)
                    yield i, TextDelta(piece)
            yield i, GenerationDone(r.request_id, text, "length", Usage(prompt_tokens, len(text)))

    async def readiness(self, deployments: list[str], timeout_s: float) -> dict[str, str]:
        return await probed_readiness(self, deployments, timeout_s)

    async def replica_states(self) -> dict[str, dict[str, int]]:
        return {}

    async def info(self, deployment: str, timeout_s: float) -> ModelInfo:
        by_deployment = {
            "encoder": ModelInfo("enc", deployment, ("classify", "embed", "rerank"), "cpu", "float32", MAX_TOKENS,
                                 labels=LABELS),
            "translator": ModelInfo("en-es", deployment, ("translate",), "cpu", "float32", MAX_TOKENS,
                                    languages=("en", "es")),
            "generator": ModelInfo("gen", deployment, ("generate",), "cpu", "float32", MAX_TOKENS,
                                   limits={"max_new_tokens": MAX_NEW}),
        }
        return by_deployment[deployment]


def fake_app(extra: Mapping[str, Any] | None = None, backend: EchoBackend | None = None) -> FastAPI:
    """The real API over an EchoBackend; `extra` overrides settings (e.g. api_keys)."""
    return create_api(fake_settings(extra), backend or EchoBackend())
