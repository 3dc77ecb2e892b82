"""Prometheus metrics of the service, defined once (SPECS) and documented in docs/observability.md.

One prefix (`transformer_serve_`), base units (seconds, tokens, ratios in [0, 1]), and only bounded
labels: `endpoint` (a route, or "other"), `status`, `model`, a few fixed enums and `model_info`'s
deployment/kind/device/dtype; never request content. A labelled counter is exported at 0 for each
of its known label values from the first scrape (observers.py, `ServiceMetrics.routes_known`,
front_answers.py), so a panel shows 0 rather than "No data" before the first event.

Each replica is its own Ray worker process: the app sets PROMETHEUS_MULTIPROC_DIR through the
runtime_env, and each replica points it at its node's subdirectory (`bind_to_node`, before building
its metrics), so only one node's processes share files.
`render` (GET /metrics on the ingress) merges its node's files after dropping dead processes' live
gauges (`clean_dead_processes`); without the variable (tests, a plain process) it serves this
process's own registry.
"""

from __future__ import annotations

import functools
import os
import re
import tempfile
import uuid
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)

from ..errors import UNAVAILABLE
from .endpoints import is_api
from .front_answers import FrontAnswersCollector
from .memory import resident_bytes

PREFIX = "transformer_serve_"
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
WAIT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
COMPUTE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TOKEN_BUCKETS = (16, 64, 256, 1024, 4096, 16384, 65536)
RATIO_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


@dataclass(frozen=True)
class Spec:
    """One metric: its type, labels, help text; histogram buckets; how a gauge merges across the
    processes of a node (prometheus_client's multiprocess_mode: live* modes forget dead processes)."""

    kind: str  # counter | gauge | histogram
    labels: tuple[str, ...]
    help: str
    buckets: tuple[float, ...] = ()
    mode: str = "livesum"


# name without PREFIX -> spec; docs/observability.md lists the same (tests/service/telemetry/test_metrics.py checks)
SPECS: dict[str, Spec] = {
    # ingress (HTTP)
    "requests_total": Spec("counter", ("endpoint", "status"), "HTTP requests answered by the ingress"),
    "request_duration_seconds": Spec(
        "histogram", ("endpoint",), "Ingress latency: request received to last byte sent (a whole SSE stream)",
        LATENCY_BUCKETS),
    "requests_in_progress": Spec("gauge", ("endpoint",), "HTTP requests being answered by the ingress"),
    "rejected_requests_total": Spec(
        "counter", ("endpoint", "reason"), "Requests refused with 503 by the ingress (reason: the error type)"),
    "replicas": Spec("gauge", ("deployment", "state"), "Replicas of each deployment by Serve's state (STARTING, "
                     "RUNNING, STOPPING: draining its requests, ...), as the ingress saw at this scrape",
                     mode="livemax"),
    "tenant_requests_total": Spec("counter", ("tenant",), "Requests of a tenant's keys the ingress admitted "
                                                          "(service/http/quotas.py)"),
    "tenant_tokens_total": Spec("counter", ("tenant",), "Tokens charged to a tenant: generations' prompt and "
                                                        "output tokens, embeddings' input tokens"),
    "quota_refused_total": Spec("counter", ("tenant", "limit"), "Requests of a tenant refused with 429 by its "
                                                                 "quota (limit: requests or tokens)"),
    "routing_decisions_total": Spec(
        "counter", ("deployment", "decision"), "Generation requests the ingress routed, by why their replica "
        "(service/fleet/router.py: session, prefix, spread, new, other)"),
    # every model replica
    "model_info": Spec("gauge", ("model", "deployment", "kind", "device", "dtype"),
                       "Live model replicas (the value) and what they run"),
    "execution_plan_info": Spec("gauge", ("model", "phase", "backend"),
                                "Live model replicas (the value) computing each phase on each backend "
                                "(the execution plan, models/execution/)"),
    "model_load_seconds": Spec("gauge", ("model",), "Seconds the slowest live replica took to load its model",
                               mode="livemax"),
    "replica_resident_memory_bytes": Spec(
        "gauge", ("model",), "Resident memory of the model's largest live replica (after its last batch or step)",
        mode="livemax"),
    "queue_depth": Spec("gauge", ("model",), "Inputs (encoder, translator) or requests (generator) waiting "
                                             "in the replicas' queues"),
    "queue_capacity": Spec("gauge", ("model",), "Queue bound summed over the replicas; past it: 503"),
    "queue_wait_seconds": Spec("histogram", ("model",), "Time an input or request waited before computation",
                               WAIT_BUCKETS),
    "batch_size": Spec("histogram", ("model",), "Rows per batch (a generator: rows that got a token per step)",
                       SIZE_BUCKETS),
    "batch_tokens": Spec("histogram", ("model",), "Padded tokens computed per dynamic batch", TOKEN_BUCKETS),
    "batch_real_tokens_total": Spec("counter", ("model",), "Real (unpadded) tokens of dynamic batches"),
    "batch_computed_tokens_total": Spec("counter", ("model",), "Padded tokens computed by dynamic batches"),
    "batch_padding_efficiency_ratio": Spec("histogram", ("model",), "Real / padded tokens per dynamic batch",
                                           RATIO_BUCKETS),
    "batch_inference_seconds": Spec("histogram", ("model",), "Compute time per batch (a generator: per step)",
                                    COMPUTE_BUCKETS),
    "batch_dropped_items_total": Spec("counter", ("model", "reason"),
                                      "Inputs that never reached the model (rejected, cancelled, expired)"),
    "admission_wait_estimate_seconds": Spec(
        "histogram", ("model",), "A replica's estimate, when a request arrives, of its wait before computation "
                                 "starts (queued work x measured batch or step time)", WAIT_BUCKETS),
    "admission_refused_total": Spec(
        "counter", ("model", "reason"), "Requests a replica refused at once with 503 (reason: queue_full, or "
                                        "deadline: the estimated wait outlasts the request's deadline)"),
    # generator replicas
    "generation_time_to_first_token_seconds": Spec(
        "histogram", ("model",), "Time from a request's submission to its first token", LATENCY_BUCKETS),
    "generation_inter_token_latency_seconds": Spec(
        "histogram", ("model",), "Time between two consecutive tokens of one request", TOKEN_GAP_BUCKETS),
    "generation_prompt_tokens_total": Spec("counter", ("model", "replica"), "Prompt tokens admitted"),
    "generation_prompt_cached_tokens_total": Spec(
        "counter", ("model", "replica"), "Prompt tokens not computed: prefix cache hits and siblings' shared "
                                         "rows (hit rate = this / generation_prompt_tokens_total)"),
    "generation_prefix_cache_bytes": Spec("gauge", ("model",), "Keys/values held by the prefix cache, the "
                                                               "fullest live replica", mode="livemax"),
    "generation_generated_tokens_total": Spec("counter", ("model",), "Tokens generated"),
    "generation_running_requests": Spec("gauge", ("model",), "Requests decoding (holding a KV-cache row)"),
    "generation_waiting_requests": Spec("gauge", ("model",), "Requests waiting for a KV-cache row"),
    "generation_kv_cache_usage_ratio": Spec("gauge", ("model",), "KV-cache tokens held / capacity, the fullest "
                                                                 "live replica", mode="livemax"),
    "generation_kv_blocks": Spec("gauge", ("model", "kind"), "Paged KV cache: 16-token blocks used and free"),
    "compiled_recompile_limit_hits_total": Spec(
        "counter", ("model",), "Times a compiled block of the model passed torch's recompile limit while serving: "
                               "its new shapes run eager from then on (the replica's log names the block)"),
    "generation_preempted_total": Spec("counter", ("model",), "Requests preempted when KV blocks ran out "
                                                                "(recomputed when admitted again)"),
    "generation_spec_draft_tokens_total": Spec("counter", ("model", "method"), "Speculative decoding: drafted "
                                                                           "tokens verified"),
    "generation_spec_accepted_tokens_total": Spec("counter", ("model", "method"), "Speculative decoding: drafted "
                                                                              "tokens kept"),
    "generation_spec_verify_steps_total": Spec("counter", ("model", "method"), "Speculative decoding: verify steps"),
    "generation_spec_draft_steps_total": Spec("counter", ("model", "method"), "Speculative decoding: the draft "
                                                                            "model's own steps"),
    "generation_spec_step_seconds_total": Spec("counter", ("model", "method"), "Speculative decoding: time in "
                                                                           "verify steps, drafting included"),
    "generation_spec_plain_seconds_total": Spec("counter", ("model", "method"), "Speculative decoding: the time "
                                                "plain decode steps would have taken for the same tokens (estimated "
                                                "from measured steps); minus step_seconds: the time saved"),
    "generation_requests_finished_total": Spec("counter", ("model", "finish_reason"),
                                               "Generation requests ended (stop, length, cancelled, error)"),
    # LoRA adapters (models/adapters/): the requests each adapter answered, by its name
    "encoder_adapter_inputs_total": Spec("counter", ("model", "adapter", "task"), "Inputs (classify, embed, "
                                         "rerank) an adapter of an encoder answered"),
    "encoder_adapter_tokens_total": Spec("counter", ("model", "adapter"), "Tokens of the inputs an adapter of an "
                                                                          "encoder answered"),
    "generation_adapter_requests_total": Spec("counter", ("model", "adapter", "finish_reason"),
                                              "Generation requests an adapter of the model answered"),
    "generation_adapter_prompt_tokens_total": Spec("counter", ("model", "adapter"), "Prompt tokens of an "
                                                                                    "adapter's requests"),
    "generation_adapter_generated_tokens_total": Spec("counter", ("model", "adapter"), "Tokens an adapter "
                                                                                       "generated"),
    "generation_adapter_time_to_first_token_seconds": Spec(
        "histogram", ("model", "adapter"), "Time from an adapter's request's submission to its first token",
        LATENCY_BUCKETS),
}
# Collected by /metrics from files that processes outside Serve write (not built in each process); name ->
# spec, documented with SPECS
COLLECTED: dict[str, Spec] = {
    "front_answers_total": Spec("counter", ("endpoint", "status"), "Requests the nginx front answered itself, "
                                "never reaching the ingress (no ingress reachable, a body over the limit, "
                                "HTTP it could not take, an ingress silent past its timeout)"),
}
KINDS: dict[str, type] = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}
# Serve's replica states (ray.serve._private.common.ReplicaState, STOPPED aside: such a replica is gone)
REPLICA_STATES = ("STARTING", "UPDATING", "RECOVERING", "RUNNING", "STOPPING", "PENDING_MIGRATION")
OK = "200"  # the status every API route answers when it works: requests_total's series from the start


def _build(name: str, spec: Spec, registry: CollectorRegistry) -> Any:
    extra: dict[str, Any] = {}
    if spec.kind == "histogram":
        extra["buckets"] = spec.buckets
    if spec.kind == "gauge":
        extra["multiprocess_mode"] = spec.mode
    return KINDS[spec.kind](PREFIX + name, spec.help, spec.labels, registry=registry, **extra)


class ServiceMetrics:
    """The metrics of one process, registered in `registry` (a fresh one by default). Build one per
    process (`process_metrics()`): in multiprocess mode two objects would overwrite each other's values."""

    def __init__(self, registry: CollectorRegistry | None = None, replica: str = "") -> None:
        """`replica`: this process's Serve replica id, the `replica` label of per-replica metrics."""
        self.registry = registry if registry is not None else CollectorRegistry()
        self.replica = replica
        self.metrics: dict[str, Any] = {name: _build(name, spec, self.registry) for name, spec in SPECS.items()}

    def __getitem__(self, name: str) -> Any:
        """The metric named `name` (without PREFIX)."""
        return self.metrics[name]

    # -- ingress -----------------------------------------------------------------------------------

    def routes_known(self, endpoints: Collection[str]) -> None:
        """Export, at 0 until they move, requests_total{status=OK} and rejected_requests_total for each
        503 error type (UNAVAILABLE) on every API route (`is_api`) of `endpoints`. Other statuses
        are not a known set: they appear when first answered."""
        for endpoint in filter(is_api, endpoints):
            self["requests_total"].labels(endpoint, OK)
            for reason in UNAVAILABLE:
                self["rejected_requests_total"].labels(endpoint, reason)

    def replicas_seen(self, deployments: Collection[str], states: Mapping[str, Mapping[str, int]]) -> None:
        """replicas{deployment, state} from Serve's counts; each of REPLICA_STATES at 0 when absent."""
        for deployment in deployments:
            seen = states.get(deployment, {})
            for state in REPLICA_STATES:
                self["replicas"].labels(deployment, state).set(seen.get(state, 0))

    def request_started(self, endpoint: str) -> None:
        self["requests_in_progress"].labels(endpoint).inc()

    def request_finished(self, endpoint: str, status: int, seconds: float, reject_reason: str | None) -> None:
        """One answered request; `reject_reason` (the error type) when it was a 503."""
        self["requests_in_progress"].labels(endpoint).dec()
        self["requests_total"].labels(endpoint, str(status)).inc()
        self["request_duration_seconds"].labels(endpoint).observe(seconds)
        if reject_reason is not None:
            self["rejected_requests_total"].labels(endpoint, reject_reason).inc()

    # -- model replicas ----------------------------------------------------------------------------

    def model_loaded(self, model: str, deployment: str, kind: str, device: str, dtype: str, load_seconds: float,
                     queue_capacity: int, plan: Mapping[str, str]) -> None:
        """A replica is up: its model_info (1), its plan (phase -> backend), load time and queue bound."""
        self["model_info"].labels(model, deployment, kind, device, dtype).set(1)
        for phase, backend in plan.items():
            self["execution_plan_info"].labels(model, phase, backend).set(1)
        self["model_load_seconds"].labels(model).set(load_seconds)
        self["queue_capacity"].labels(model).set(queue_capacity)
        self["queue_depth"].labels(model).set(0)
        self["replica_resident_memory_bytes"].labels(model).set(resident_bytes())


# -- one process, one node ---------------------------------------------------------------------------

def multiproc_dir() -> Path | None:
    """The node's metrics directory when this process runs in multiprocess mode, else None."""
    path = os.environ.get(MULTIPROC_ENV)
    return Path(path) if path else None


NODE_DIR_PREFIX = "node-"


def bind_to_node(node_id: str) -> Path | None:
    """Point this process's metrics files at `<app dir>/node-<node_id>`: the processes of one Ray
    node share it and no other node's do, wherever the nodes run (on Kubernetes each pod has its
    own disk anyway; several raylets on one host would otherwise merge into one /metrics). Call
    before the process's metrics are built; calling again with the same node changes nothing.
    Returns the directory, None outside multiprocess mode."""
    path = multiproc_dir()
    if path is None:
        return None
    if path.name == NODE_DIR_PREFIX + node_id:
        return path
    if process_metrics.cache_info().currsize:
        raise RuntimeError("bind_to_node after this process's metrics were built")
    path = node_dir(path, node_id)
    os.environ[MULTIPROC_ENV] = str(path)
    return path


def node_dir(app_dir: Path, node_id: str) -> Path:
    """The directory of one Ray node's processes in an app's metrics directory."""
    return app_dir / (NODE_DIR_PREFIX + node_id)


@functools.cache
def process_metrics() -> ServiceMetrics:
    """This process's metrics, built on first use (never at import). In multiprocess mode the
    directory is created first: prometheus_client opens its files as the metrics are built."""
    path = multiproc_dir()
    if path is not None:
        path.mkdir(parents=True, exist_ok=True)
    return ServiceMetrics()


_PID_FILE = re.compile(r"_(\d+)\.db$")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_dead_processes(path: Path) -> list[int]:
    """Forget the live gauges (running requests, queue depth, ...) of processes of this node that
    died (a replica that crashed or was scaled down); their counters and histograms stay, so totals
    never go backwards. Returns the dead pids."""
    pids = {int(m.group(1)) for f in path.glob("*.db") if (m := _PID_FILE.search(f.name))}
    dead = sorted(pid for pid in pids if not _alive(pid))
    for pid in dead:
        multiprocess.mark_process_dead(pid, str(path))
    return dead


def render(metrics: ServiceMetrics, endpoints: Callable[[], Collection[str]] = frozenset) -> tuple[bytes, str]:
    """The Prometheus text format (body, content type): every process of this node in multiprocess
    mode, and the answers of a front on this node (front_answers.py: paths not in `endpoints()` are
    "other"); else `metrics`' own registry."""
    path = multiproc_dir()
    if path is None:
        return generate_latest(metrics.registry), CONTENT_TYPE_LATEST
    clean_dead_processes(path)
    for attempt in range(3):  # another process of the node may remove a file while we read
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path=str(path))
        registry.register(FrontAnswersCollector(path, PREFIX + "front_answers", COLLECTED["front_answers_total"].help,
                                                endpoints))
        try:
            return generate_latest(registry), CONTENT_TYPE_LATEST
        except FileNotFoundError:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def default_metrics_dir() -> str:
    """A fresh directory name for one deployed app: the same path on every node, each node's own
    files. Fresh per app, so a previous run's files (and reused pids) never mix in."""
    return str(Path(tempfile.gettempdir()) / "transformer-serve-metrics" / uuid.uuid4().hex[:12])


def replica_actor_options(metrics_dir: str | None) -> dict[str, Any]:
    """Ray actor options every replica of the app gets: PROMETHEUS_MULTIPROC_DIR in its runtime_env,
    set before the worker's Python starts, so before anything imports prometheus_client. Nothing
    without a directory (each process then keeps its own metrics)."""
    if metrics_dir is None:
        return {}
    return {"runtime_env": {"env_vars": {MULTIPROC_ENV: metrics_dir}}}
