"""Which model deployment answers a request, and the interface the HTTP layer calls it through.

Built from the settings, so a deployment added to the config (e.g. a generator) gets its routes'
targets without code changes here; a task no configured model serves answers 404.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ..common.text_limits import check_prompt_chars, fit_chars, max_input_chars
from ..errors import InvalidItem, InvalidRequest, ModelNotFound, NotFound
from ..messages import AdapterRef, GenerationRequest, ModelInfo
from ..settings import Settings
from .adapters import AdapterRegistry


@dataclass(frozen=True)
class Route:
    deployment: str
    model: str  # what answers, as the client named it: a model, or one of its adapters
    languages: tuple[str, str] | None = None
    adapter: AdapterRef | None = None  # the LoRA adapter `model` names (None: the base model)


class Backend(Protocol):
    """How the ingress reaches model deployments (Ray handles in service/app.py; fakes in tests)."""

    async def call(self, deployment: str, method: str, *args: Any) -> Any:
        """Call a deployment method; raises ServiceError subclasses (Overloaded, NotReady, ...).
        Cancelling the awaiting task cancels the remote call."""
        ...

    def stream(self, deployment: str, method: str, *args: Any) -> AsyncIterator[Any]:
        """Call a streaming (generator) deployment method; an async generator of its items. Errors
        as for call(), from the first item on. Closing the generator early, or cancelling the task
        reading it, cancels the remote call."""
        ...

    async def info(self, deployment: str, timeout_s: float) -> ModelInfo:
        """One replica's ModelInfo; NotReady when no loaded replica answers within timeout_s."""
        ...

    async def readiness(self, deployments: list[str], timeout_s: float) -> dict[str, str]:
        """deployment -> "ready", or why not. Cheap enough for a probe every second, and never takes a
        model replica's request slot while the deployment is serving (service/ingress.py)."""
        ...

    async def replica_states(self) -> dict[str, dict[str, int]]:
        """deployment -> {replica state: replicas} as Serve's controller counts them (STARTING,
        RUNNING, STOPPING: draining, ...); {} when nothing says. Cheap enough for every scrape."""
        ...


async def probed_readiness(backend: Backend, deployments: Sequence[str], timeout_s: float) -> dict[str, str]:
    """Readiness from one info() call per deployment: "ready", or the error's text."""
    results = await asyncio.gather(*(backend.info(n, timeout_s) for n in deployments), return_exceptions=True)
    return {n: "ready" if isinstance(r, ModelInfo) else str(r) for n, r in zip(deployments, results, strict=True)}


class ModelRoutes:
    """task -> routes, in config order (the first is a task's default model), and the adapters of
    those models (service/http/adapters.py), each routed to its base model's deployment."""

    def __init__(self, settings: Settings) -> None:
        self.adapters = AdapterRegistry(settings)
        self.by_task: dict[str, list[Route]] = {}
        for name, dep in settings.deployments.items():
            assert dep.model is not None
            for task in dep.model.tasks:
                self.by_task.setdefault(task, []).append(Route(name, dep.model.name, dep.model.languages))

    def _routes(self, task: str) -> list[Route]:
        routes = self.by_task.get(task)
        if not routes:
            served = ", ".join(sorted(self.by_task)) or "none"
            raise NotFound(f"no model on this server serves {task!r} (served tasks: {served})")
        return routes

    def resolve(self, task: str, model: str | None) -> Route:
        routes = self._routes(task)
        if model is None:
            return routes[0]
        for route in routes:
            if route.model == model:
                return route
        entry = self.adapters.find(model)
        for route in routes if entry is not None else ():
            if route.deployment == entry.deployment:
                return Route(route.deployment, model, route.languages, AdapterRef(model, entry.path))
        if entry is not None or any(r.model == model for rs in self.by_task.values() for r in rs):
            raise InvalidRequest(f"model {model!r} does not serve {task}; available: "
                                 f"{', '.join(r.model for r in routes)}", "model")
        raise ModelNotFound(f"the model {model!r} does not exist for {task}; available: "
                            f"{', '.join(r.model for r in routes)} (and their adapters: GET /v1/models)", "model")

    def resolve_translation(self, source: str, target: str, model: str | None) -> Route:
        routes = self._routes("translate")
        if model is not None:
            routes = [self.resolve("translate", model)]
        for route in routes:
            if route.languages == (source, target):
                return route
        pairs = ", ".join(f"{r.languages[0]}->{r.languages[1]}" for r in routes if r.languages)
        param = "target_lang" if any(r.languages and r.languages[0] == source for r in routes) else "source_lang"
        raise InvalidRequest(f"no model translates {source!r} -> {target!r}; supported: {pairs}", param)


@dataclass(frozen=True)
class ItemName:
    """How an error names one input of a model call: the request parameter and a label for the message
    (e.g. inputs[2] and "inputs[2], sentence 5")."""

    param: str
    label: str


def item_error(error: InvalidItem, field: str, each: bool = True,
               names: Sequence[ItemName] | None = None) -> InvalidRequest:
    """A 422 for the item InvalidItem names: `field[i]`, `field` alone, or names[i]."""
    if names is not None:
        name = names[error.index]
        return InvalidRequest(f"{name.label}: {error.message}", name.param)
    param = f"{field}[{error.index}]" if each else field
    return InvalidRequest(f"{param}: {error.message}", param)


class InputLimits:
    """Each deployment's token limit on an input (ModelInfo.max_input_tokens), asked once, so the edge
    refuses or cuts an oversized text by its characters (service/common/text_limits.py) before it reaches a
    replica."""

    def __init__(self, backend: Backend, timeout_s: float) -> None:
        self.backend, self.timeout_s = backend, timeout_s
        self._tokens: dict[str, int] = {}

    async def max_tokens(self, deployment: str) -> int:
        if deployment not in self._tokens:
            self._tokens[deployment] = (await self.backend.info(deployment, self.timeout_s)).max_input_tokens
        return self._tokens[deployment]

    async def fit(self, deployment: str, texts: list[str], truncate: bool, field: str,
                  each: bool = True, names: Sequence[ItemName] | None = None) -> list[str]:
        """`texts` within the deployment's character cap: cut with `truncate`, else a 422 naming
        `field[i]` (or `field` alone when `each` is False: a single text such as rerank's query; or
        names[i] when given: the sentences of documents)."""
        try:
            return fit_chars(texts, max_input_chars(await self.max_tokens(deployment)), truncate)
        except InvalidItem as e:
            raise item_error(e, field, each, names) from None

    async def check_prompts(self, deployment: str, requests: Sequence[GenerationRequest]) -> None:
        """A 422 for a generation whose prompt is over the deployment's character cap."""
        limit = await self.max_tokens(deployment)
        for r in requests:
            check_prompt_chars(r.prompt_chars, limit, r.param(r.prompt_field))
