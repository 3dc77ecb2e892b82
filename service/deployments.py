"""Ray Serve deployments that own a model: one deployment per model, scaled on its own.

A replica loads its model once in its constructor (onto its device, cast to its dtype), warms it
up, and only then joins the deployment: Serve routes nothing to a replica still loading, and the
ingress's /readyz answers 503 until every deployment has a replica. Everything a replica does
lives in its runner (service/replica/, no Ray): the deployments here only expose the runner's
methods as Serve methods, with the same life cycle for every kind.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, ClassVar, TypeVar

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.deployment import Application, Deployment

from models.catalog import LoadedModel

from .errors import ServiceError
from .fleet.load import LoadReport
from .messages import (
    AdapterRef,
    Classification,
    Embeddings,
    GenerationDone,
    GenerationEvent,
    GenerationRequest,
    ModelInfo,
    TextDelta,
    Tokenized,
    TranslateOptions,
    TranslationDone,
)
from .replica.encoder import EncoderRunner
from .replica.generator import GeneratorRunner
from .replica.loading import load_for_deployment
from .replica.runner import ModelRunner, off_loop
from .replica.threads import on_own_thread
from .replica.translator import TranslatorEngineRunner, TranslatorRunner, for_translator
from .settings import DeploymentSettings, Settings
from .telemetry.logs import serve_logging_config
from .telemetry.metrics import ServiceMetrics, bind_to_node, process_metrics, replica_actor_options

log = logging.getLogger(__name__)
T = TypeVar("T")


async def answered(call: Awaitable[T]) -> T | ServiceError:
    """A refusal (overloaded, over a limit, bad input) is returned as a value, not raised: Serve would
    log each raised error with its traceback and wrap it in a RayTaskError, which under a burst of
    refusals starved the replica's event loop (503s came seconds late instead of at once). The ingress
    (service/ingress.py) raises it again."""
    try:
        return await call
    except ServiceError as e:
        return e


async def answered_stream(events: AsyncIterator[T]) -> AsyncIterator[T | ServiceError]:
    """A stream's items; a ServiceError raised before or during it is its last item (as answered())."""
    try:
        async for event in events:
            yield event
    except ServiceError as e:
        yield e
    finally:  # Serve throws CancelledError in here when the caller goes away: close the inner stream now
        await events.aclose()  # type: ignore[attr-defined]


async def _now(fn: Callable[..., T], *args: Any) -> T:
    """fn(*args) as an awaitable, for answered()."""
    return fn(*args)


def multiplexed(capacity: int) -> Callable[[str], Awaitable[str]]:
    """Serve's model multiplexing over a replica's LoRA adapters: awaited with an adapter's name each
    time a request uses it here, Serve keeps the `capacity` most recently used names and reports them
    to the routers, which prefer this replica for requests carrying that name as their multiplexed
    model id (service/ingress.py). The adapters themselves are loaded and evicted by the runner's
    ReplicaAdapters (its slots, LRU among the ones no request holds); this only tells where they are."""

    @serve.multiplexed(max_num_models_per_replica=capacity)
    async def held_here(name: str) -> str:
        return name

    return held_here


class ModelDeployment:
    """The replica life cycle of every deployment kind: load, build the runner, warm up, start,
    report; info and health; close when the replica goes."""

    runner_class: ClassVar[type[ModelRunner]]

    def __init__(self, name: str, settings: Settings) -> None:
        bind_to_node(ray.get_runtime_context().get_node_id())
        metrics = process_metrics()
        metrics.replica = serve.get_replica_context().replica_id.unique_id  # per-replica metrics' label
        timed: dict[str, float] = {}

        def prepare() -> tuple[DeploymentSettings, LoadedModel, ModelRunner]:
            dep, loaded = load_for_deployment(name, settings)
            runner = self.build_runner(loaded, name, dep, metrics)
            timed["started"] = time.perf_counter()
            runner.warm_up()
            return dep, loaded, runner

        # load and warm up on a thread that ends first: the runner's thread has the process's only
        # OpenMP pool (service/replica/threads.py)
        dep, loaded, self.runner = on_own_thread(prepare, f"{name}-load")
        started = timed["started"]
        self.runner.start()
        dtype = str(loaded.dtype).removeprefix("torch.")
        log.info("%s: %s loaded on %s/%s in %.1f s, warmed up in %.2f s; execution plan %s", name, loaded.spec.name,
                 loaded.device, dtype, loaded.load_seconds, time.perf_counter() - started, loaded.plan.summary())
        metrics.model_loaded(loaded.spec.name, name, loaded.spec.kind, str(loaded.device), dtype,
                             loaded.load_seconds, self.runner.queue_capacity,
                             {p.phase: p.backend for p in loaded.plan.phases})
        if limits := self.runner.limits():
            log.info("%s: limits %s", name, limits)
        self._load = LoadReport(generator=loaded.spec.kind == "generator")
        if loaded.adapters is not None:
            self.runner.adapters.report = multiplexed(loaded.adapters.capacity)

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Load signals for Serve's autoscaler (service/fleet/load.py, autoscaling.py)."""
        return self._load(self.runner.stats())

    def build_runner(self, loaded: LoadedModel, name: str, dep: DeploymentSettings,
                     metrics: ServiceMetrics) -> ModelRunner:
        return self.runner_class.for_deployment(loaded, name, dep, metrics)

    async def info(self) -> ModelInfo:
        return self.runner.info()

    async def load_adapter(self, adapter: AdapterRef) -> None | ServiceError:
        """Load a LoRA adapter now (checked against the model: a 400 naming what is wrong)."""
        return await answered(self.runner.adapters.load(adapter))

    async def unload_adapter(self, name: str) -> bool | ServiceError:
        """Free an adapter's slot on this replica (False: it does not hold it)."""
        return await answered(_now(self.runner.adapters.unload, name))

    def check_health(self) -> None:
        self.runner.check_health()

    def __del__(self) -> None:
        runner = getattr(self, "runner", None)
        if runner is not None:
            runner.close()


@serve.deployment
class EncoderDeployment(ModelDeployment):
    """classify + embed + rerank on one encoder (with a classification head); one batcher for all."""

    runner_class = EncoderRunner
    runner: EncoderRunner

    # priority: the caller's tenant's (lower is sooner, service/http/quotas.py): its inputs are batched first
    async def classify(self, texts: list[str], truncate: bool, adapter: AdapterRef | None, timeout_s: float | None,
                       priority: int = 0) -> list[Classification] | ServiceError:
        return await answered(self.runner.classify(texts, truncate, timeout_s, adapter, priority))

    async def embed(self, texts: list[str], truncate: bool, adapter: AdapterRef | None, timeout_s: float | None,
                    priority: int = 0) -> Embeddings | ServiceError:
        return await answered(self.runner.embed(texts, truncate, timeout_s, adapter, priority))

    async def rerank(self, query: str, texts: list[str], truncate: bool, raw_scores: bool, adapter: AdapterRef | None,
                     timeout_s: float | None, priority: int = 0) -> list[float] | ServiceError:
        return await answered(self.runner.rerank(query, texts, truncate, raw_scores, timeout_s, adapter, priority))


@serve.deployment
class TranslatorDeployment(ModelDeployment):
    """Beam-search translation with per-request beam size and length inside shared batches."""

    runner_class = TranslatorRunner  # with translation.scheduler "batches"; "steps": TranslatorEngineRunner
    runner: TranslatorRunner | TranslatorEngineRunner

    def build_runner(self, loaded: LoadedModel, name: str, dep: DeploymentSettings,
                     metrics: ServiceMetrics) -> ModelRunner:
        return for_translator(loaded, name, dep, metrics)

    async def translate(self, texts: list[str], options: TranslateOptions, timeout_s: float | None,
                        priority: int = 0) -> list[str] | ServiceError:
        return await answered(self.runner.translate(texts, options, timeout_s, priority))

    async def translate_stream(self, texts: list[str], options: TranslateOptions, timeout_s: float | None,
                               priority: int = 0
                               ) -> AsyncIterator[tuple[int, TextDelta | TranslationDone] | ServiceError]:
        async for item in answered_stream(self.runner.translate_stream(texts, options, timeout_s, priority)):
            yield item


@serve.deployment
class GeneratorDeployment(ModelDeployment):
    """Text generation on a continuous-batching engine; `generate_stream` streams through Serve.
    A caller that goes away cancels the Serve call, which cancels the request in the engine, which
    frees the row within one step."""

    runner_class = GeneratorRunner
    runner: GeneratorRunner

    async def generate(self, request: GenerationRequest) -> GenerationDone | ServiceError:
        return await answered(self.runner.generate(request))

    async def generate_group(self, requests: list[GenerationRequest]) -> list[GenerationDone] | ServiceError:
        """Several generations submitted together (n > 1 siblings share their prompt's prefill)."""
        return await answered(self.runner.generate_group(requests))

    async def tokenize(self, request: GenerationRequest, add_special_tokens: bool) -> Tokenized:
        # a long prompt or chat on the text thread, never on the replica's event loop
        return await off_loop(request.render_chars, self.runner.tokenize, request, add_special_tokens)

    async def detokenize(self, tokens: list[int]) -> str:
        return self.runner.detokenize(tokens)

    async def generate_stream(self, request: GenerationRequest) -> AsyncIterator[GenerationEvent | ServiceError]:
        async for event in answered_stream(self.runner.stream(request)):
            yield event

    async def generate_group_stream(self, requests: list[GenerationRequest]
                                    ) -> AsyncIterator[tuple[int, GenerationEvent] | ServiceError]:
        async for item in answered_stream(self.runner.stream_group(requests)):
            yield item


# deployment kind (models.spec.TASK_KIND) -> deployment
DEPLOYMENTS: dict[str, Deployment] = {"encoder": EncoderDeployment, "translator": TranslatorDeployment,
                                      "generator": GeneratorDeployment}


DRAIN_POLL_S = 0.5  # how often a draining replica checks whether its requests have ended
PREFIX_ROUTER = "service.fleet.router:PrefixAffinityRouter"


def deployment_options(name: str, dep: DeploymentSettings, settings: Settings, cluster_gpus: float) -> dict[str, Any]:
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
    if dep.max_replicas_per_node is not None:
        options["max_replicas_per_node"] = dep.max_replicas_per_node
    # a stopping replica takes no new requests (Serve routes around it) and finishes its own, streams
    # included, for at most drain_grace_s (docs/deploy.md, Scaling knobs)
    options["graceful_shutdown_timeout_s"] = dep.drain_grace_s
    options["graceful_shutdown_wait_loop_s"] = DRAIN_POLL_S
    routing = dep.routing_policy()
    if routing.policy == "prefix":
        kwargs = routing.model_dump(exclude={"policy"})
        options["request_router_config"] = RequestRouterConfig(
            request_router_class=PREFIX_ROUTER, request_router_kwargs={**kwargs, "deployment": name})
    return options


def bind_model(name: str, settings: Settings, cluster_gpus: float) -> Application:
    dep = settings.deployments[name]
    assert dep.model is not None
    kind = dep.model.kind
    if kind not in DEPLOYMENTS:
        raise ValueError(f"deployment {name!r} serves {list(dep.model.tasks)}, but this server has no "
                         f"{kind} deployment yet (known: {sorted(DEPLOYMENTS)})")
    return DEPLOYMENTS[kind].options(name=name, **deployment_options(name, dep, settings, cluster_gpus)).bind(name, settings)
