"""Metrics, request ids and logs, in process (no Ray): names and labels as documented in
docs/observability.md, histograms that observe what they claim (fed by a real DynamicBatcher,
a real GenerationEngine on the tiny decoder, and the HTTP API with a fake backend), every counter
a dashboard queries exported at 0 for its known labels from the first scrape, the multiprocess
merge of several processes, and JSON log lines carrying the request id.

Every test reads a fresh CollectorRegistry (`ServiceMetrics(CollectorRegistry())`).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import re
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from models.decoding import SamplingParams
from models.execution.compiled import compile_blocks
from models.tiny import tiny_model
from service.engine.config import EngineConfig
from service.engine.core import GenerationEngine
from service.errors import UNAVAILABLE, DeadlineExceeded, EngineOverloaded, NotReady, Overloaded
from service.http.api import create_api
from service.messages import FINISH_REASONS, Classification, ModelInfo
from service.replica.batcher import DynamicBatcher
from service.replica.config import BatchLimits
from service.settings import Settings
from service.telemetry import metrics as metrics_module
from service.telemetry.endpoints import is_api
from service.telemetry.front_answers import answers_file, write_totals
from service.telemetry.hooks import (
    CANCELLED,
    DEADLINE,
    DROPS,
    EXPIRED,
    QUEUE_FULL,
    REFUSALS,
    REJECTED,
    EngineStats,
)
from service.telemetry.logs import REQUEST_ID, JsonFormatter, PlainFormatter, valid_request_id
from service.telemetry.memory import resident_bytes
from service.telemetry.metrics import (
    COLLECTED,
    PREFIX,
    REPLICA_STATES,
    SPECS,
    ServiceMetrics,
    bind_to_node,
    clean_dead_processes,
    render,
)
from service.telemetry.observers import PrometheusBatchObserver, PrometheusEngineObserver

ROOT = Path(__file__).resolve().parents[3]
DOCS = ROOT / "docs" / "observability.md"
BOUNDED_LABELS = {"endpoint", "status", "model", "reason", "finish_reason", "deployment", "kind", "device", "dtype",
                  "phase", "backend", "method", "decision", "state", "task",
                  "tenant", "limit",  # tenant: a group of API keys the operator configures; limit: requests | tokens
                  "replica",  # replica: a Serve replica id (new ones as replicas come and go, as in Ray's own metrics)
                  "adapter"}  # adapter: a LoRA adapter the operator serves (configured, in adapter_dir or loaded)
ENCODER = {"name": "enc", "tasks": ["classify", "embed"], "source": "tiny:encoder"}


def value(metrics: ServiceMetrics, name: str, **labels: str) -> float:
    """One sample (full name, e.g. `..._count`) from the registry; 0 when absent."""
    got = metrics.registry.get_sample_value(PREFIX + name, labels)
    return 0.0 if got is None else got


@pytest.fixture
def metrics() -> ServiceMetrics:
    return ServiceMetrics(CollectorRegistry())


# -- names and labels ---------------------------------------------------------------------------------

def documented() -> dict[str, tuple[str, tuple[str, ...]]]:
    """docs/observability.md's metric table: name -> (type, labels)."""
    rows = re.findall(r"^\| `(transformer_serve_\w+)` \| (\w+) \| ([^|]*) \|", DOCS.read_text(), re.MULTILINE)
    return {name: (kind, tuple(re.findall(r"`(\w+)`", labels))) for name, kind, labels in rows}


def test_every_metric_is_documented_with_its_type_and_labels() -> None:
    defined = {PREFIX + name: (spec.kind, spec.labels) for name, spec in (SPECS | COLLECTED).items()}
    assert documented() == defined


def test_names_use_one_prefix_base_units_and_bounded_labels(metrics: ServiceMetrics) -> None:
    for name, spec in SPECS.items():
        assert set(spec.labels) <= BOUNDED_LABELS, name
        if spec.kind == "counter":
            assert name.endswith("_total"), name
        if spec.kind == "histogram":
            assert name.endswith(("_seconds", "_tokens", "_size", "_ratio")), name
            assert list(spec.buckets) == sorted(spec.buckets), name
        if name.endswith("_ratio"):
            assert spec.kind != "counter" and (not spec.buckets or spec.buckets[-1] == 1.0), name
    families = {f.name for f in metrics.registry.collect()}
    assert families == {PREFIX + n.removesuffix("_total") for n in SPECS}  # prometheus_client's family names


# -- the dynamic batcher ------------------------------------------------------------------------------

def test_batch_metrics_observe_the_batches_the_batcher_ran(metrics: ServiceMetrics) -> None:
    lengths = [3, 5, 8, 2, 7]
    ran: list[list[int]] = []

    def run_batch(payloads: list[int]) -> list[int]:
        ran.append(payloads)
        return payloads

    async def main() -> None:
        batcher = DynamicBatcher(run_batch, BatchLimits(max_batch_size=2, max_wait_ms=10, max_queued=6),
                                 name="b", observer=PrometheusBatchObserver(metrics, "m"))
        assert await batcher.submit_many(lengths, lengths) == lengths
        with pytest.raises(Overloaded):
            await batcher.submit_many([1] * 7, [1] * 7)
        await batcher.close()

    asyncio.run(main())
    m = {"model": "m"}
    assert value(metrics, "batch_size_count", **m) == len(ran) >= 3  # at most 2 rows per batch
    assert value(metrics, "batch_size_sum", **m) == len(lengths)
    real = sum(lengths)
    computed = sum(len(b) * max(b) for b in ran)
    assert value(metrics, "batch_real_tokens_total", **m) == real
    assert value(metrics, "batch_computed_tokens_total", **m) == computed
    assert value(metrics, "batch_tokens_sum", **m) == computed
    assert value(metrics, "batch_padding_efficiency_ratio_count", **m) == len(ran)
    efficiencies = [sum(b) / (len(b) * max(b)) for b in ran]
    assert value(metrics, "batch_padding_efficiency_ratio_sum", **m) == pytest.approx(sum(efficiencies))
    assert value(metrics, "batch_inference_seconds_count", **m) == len(ran)
    assert value(metrics, "queue_wait_seconds_count", **m) == len(lengths)  # one wait per item
    assert value(metrics, "queue_wait_seconds_sum", **m) > 0
    assert value(metrics, "queue_depth", **m) == 0  # all taken
    assert value(metrics, "batch_dropped_items_total", model="m", reason="rejected") == 7
    assert 2**20 < value(metrics, "replica_resident_memory_bytes", **m) == pytest.approx(resident_bytes(), rel=0.5)


# -- the generation engine ----------------------------------------------------------------------------

def test_engine_metrics_observe_what_the_engine_did(metrics: ServiceMetrics) -> None:
    torch.set_num_threads(1)
    model, tok = tiny_model("decoder")
    engine = GenerationEngine(model, tok, EngineConfig(max_running=2, max_total_tokens=64),
                              PrometheusEngineObserver(metrics, "gen"))
    handles = [engine.submit(tok.encode(p), SamplingParams(max_new_tokens=n, ignore_eos=True))
               for p, n in (("hello", 5), ("a longer prompt", 3), ("x", 4))]
    peak_waiting = 0.0
    for _ in range(100):
        engine.step()
        peak_waiting = max(peak_waiting, value(metrics, "generation_waiting_requests", model="gen"))
        if engine.stats().running == engine.stats().waiting == 0:
            break
    results = [h.result_sync() for h in handles]
    m = {"model": "gen"}
    generated = sum(r.usage.completion_tokens for r in results)
    assert generated == 12
    assert value(metrics, "generation_generated_tokens_total", **m) == generated
    assert value(metrics, "generation_prompt_tokens_total", **m, replica="") == sum(r.usage.prompt_tokens for r in results)
    assert value(metrics, "generation_time_to_first_token_seconds_count", **m) == 3
    assert value(metrics, "generation_inter_token_latency_seconds_count", **m) == generated - 3
    assert value(metrics, "queue_wait_seconds_count", **m) == 3
    assert value(metrics, "generation_requests_finished_total", model="gen", finish_reason="length") == 3
    assert value(metrics, "batch_size_sum", **m) == generated  # rows that got a token, summed over steps
    assert peak_waiting == 1  # two rows: the third request waited
    for gauge in ("generation_running_requests", "generation_waiting_requests", "queue_depth",
                  "generation_kv_cache_usage_ratio"):
        assert value(metrics, gauge, **m) == 0, gauge
    assert 2**20 < value(metrics, "replica_resident_memory_bytes", **m) == pytest.approx(resident_bytes(), rel=0.5)


def test_a_compiled_block_passing_the_recompile_limit_while_serving_is_counted(metrics: ServiceMetrics) -> None:
    """torch's "hit config.recompile_limit" warning while a model serves (its new shapes run eager from
    then on) counts on that model's counter at the next batch or step; hits before the observer was
    made (a warm-up's, which made the plan eager) do not."""
    compile_blocks(tiny_model("decoder")[0])  # watches torch's log from now on (nothing compiles until called)
    hit = "torch._dynamo hit config.recompile_limit (8)\n   function: 'forward' (models/layers.py:114)"
    logging.getLogger("torch._dynamo.convert_frame").warning(hit)  # before the observers: not counted
    engine, batcher = PrometheusEngineObserver(metrics, "gen"), PrometheusBatchObserver(metrics, "enc")
    stats = EngineStats(running=1, waiting=0, rows=2, cache_usage=0.1, cache_bytes=1, prompt_tokens=1,
                        generated_tokens=1, steps=1)
    engine.on_step(stats, 1, 0.01)
    batcher.on_batch(1, 4, 4, 0.01, [0.0])
    assert value(metrics, "compiled_recompile_limit_hits_total", model="gen") == 0
    logging.getLogger("torch._dynamo.convert_frame").warning(hit)
    logging.getLogger("torch._dynamo.convert_frame").warning("torch._dynamo: something else")
    engine.on_step(stats, 1, 0.01)
    batcher.on_batch(1, 4, 4, 0.01, [0.0])
    assert value(metrics, "compiled_recompile_limit_hits_total", model="gen") == 1
    assert value(metrics, "compiled_recompile_limit_hits_total", model="enc") == 1


def test_admission_estimates_and_refusals_reach_their_metrics(metrics: ServiceMetrics) -> None:
    """Both observers' on_admission (the engines' and the batchers' deadline admission): every wait
    estimate observed, every refusal counted by its reason, per model."""
    engine, batcher = PrometheusEngineObserver(metrics, "gen"), PrometheusBatchObserver(metrics, "enc")
    engine.on_admission(0.0, None)
    engine.on_admission(0.4, "deadline")
    batcher.on_admission(2.5, "deadline")
    batcher.on_admission(None, "queue_full")
    assert value(metrics, "admission_wait_estimate_seconds_count", model="gen") == 2
    assert value(metrics, "admission_wait_estimate_seconds_sum", model="gen") == pytest.approx(0.4)
    assert value(metrics, "admission_wait_estimate_seconds_count", model="enc") == 1
    assert value(metrics, "admission_refused_total", model="gen", reason="deadline") == 1
    assert value(metrics, "admission_refused_total", model="enc", reason="deadline") == 1
    assert value(metrics, "admission_refused_total", model="enc", reason="queue_full") == 1
    assert value(metrics, "admission_refused_total", model="gen", reason="queue_full") == 0


# -- the ingress --------------------------------------------------------------------------------------

class Backend:
    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error

    async def call(self, deployment: str, method: str, *args: Any) -> Any:
        if self.error is not None:
            raise self.error
        return [Classification("pos", 1.0, {"pos": 1.0}) for _ in args[0]]

    async def info(self, deployment: str, timeout_s: float) -> ModelInfo:
        return ModelInfo(name="enc", deployment=deployment, tasks=("classify", "embed"), device="cpu",
                         dtype="float32", max_input_tokens=8)

    async def replica_states(self) -> dict[str, dict[str, int]]:
        return {"encoder": {"RUNNING": 2, "STOPPING": 1}}


def call_api(metrics: ServiceMetrics, requests: list[tuple[str, str, dict[str, Any]]],
             error: BaseException | None = None, proxy_echoes_id: bool = False,
             settings: dict[str, Any] | None = None) -> list[httpx.Response]:
    args = {"deployments": {"encoder": {"model": ENCODER}}, **(settings or {})}
    app = create_api(Settings.build(args, env={}), Backend(error), metrics, proxy_echoes_id=proxy_echoes_id)

    async def main() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return [await client.request(method, path, **kw) for method, path, kw in requests]

    return asyncio.run(main())


def test_requests_are_counted_by_endpoint_and_status(metrics: ServiceMetrics) -> None:
    call_api(metrics, [("POST", "/v1/classify", {"json": {"inputs": ["a", "b"]}}),
                       ("POST", "/v1/classify", {"json": {"inputs": []}}),
                       ("GET", "/no/such/path/with-content", {}),
                       ("GET", "/healthz", {})])
    assert value(metrics, "requests_total", endpoint="/v1/classify", status="200") == 1
    assert value(metrics, "requests_total", endpoint="/v1/classify", status="422") == 1
    assert value(metrics, "requests_total", endpoint="other", status="404") == 1  # never the raw path
    assert value(metrics, "requests_total", endpoint="/healthz", status="200") == 1
    assert value(metrics, "request_duration_seconds_count", endpoint="/v1/classify") == 2
    assert value(metrics, "request_duration_seconds_sum", endpoint="/v1/classify") > 0
    assert value(metrics, "requests_in_progress", endpoint="/v1/classify") == 0


@pytest.mark.parametrize("error, reason", [(Overloaded("full"), "overloaded_error"),
                                           (NotReady("loading"), "model_not_ready")])
def test_503_refusals_are_counted_by_error_type(metrics: ServiceMetrics, error: Exception, reason: str) -> None:
    (r,) = call_api(metrics, [("POST", "/v1/classify", {"json": {"inputs": "a"}})], error=error)
    assert r.status_code == 503
    assert value(metrics, "rejected_requests_total", endpoint="/v1/classify", reason=reason) == 1
    assert value(metrics, "requests_total", endpoint="/v1/classify", status="503") == 1


def test_an_unexpected_error_is_a_counted_500_with_a_request_id(metrics: ServiceMetrics) -> None:
    (r,) = call_api(metrics, [("POST", "/v1/classify", {"json": {"inputs": "a"}})], error=RuntimeError("secret"))
    assert r.status_code == 500 and "secret" not in r.text
    assert r.json()["error"]["type"] == "internal_error"
    assert valid_request_id(r.headers["x-request-id"])
    assert value(metrics, "requests_total", endpoint="/v1/classify", status="500") == 1


def test_request_ids_are_kept_when_valid_else_generated(metrics: ServiceMetrics) -> None:
    good = "req-1.2:abc=="
    ok, bad_chars, too_long, missing, not_found = call_api(metrics, [
        ("POST", "/v1/classify", {"json": {"inputs": "a"}, "headers": {"X-Request-ID": good}}),
        ("GET", "/healthz", {"headers": {"X-Request-ID": "a b<script>"}}),
        ("GET", "/healthz", {"headers": {"X-Request-ID": "x" * 129}}),
        ("GET", "/healthz", {}),
        ("GET", "/nowhere", {"headers": {"X-Request-ID": good}}),
    ])
    assert ok.headers.get_list("x-request-id") == [good]
    assert not_found.status_code == 404 and not_found.headers["x-request-id"] == good  # errors too
    generated = [r.headers["x-request-id"] for r in (bad_chars, too_long, missing)]
    assert all(valid_request_id(g) and len(g) == 32 for g in generated) and len(set(generated)) == 3


def test_behind_serves_proxy_only_a_replaced_id_is_added(metrics: ServiceMetrics) -> None:
    """Serve's proxy copies the incoming X-Request-ID onto every response; adding it again would
    send it twice. A replaced (invalid) id is the one the logs use, so it is sent."""
    kept, replaced = call_api(metrics, [("GET", "/healthz", {"headers": {"X-Request-ID": "abc"}}),
                                        ("GET", "/healthz", {"headers": {"X-Request-ID": "a b"}})],
                              proxy_echoes_id=True)
    assert "x-request-id" not in kept.headers
    assert valid_request_id(replaced.headers["x-request-id"]) and replaced.headers["x-request-id"] != "a b"


def test_metrics_route_serves_the_text_format(metrics: ServiceMetrics) -> None:
    _, r = call_api(metrics, [("POST", "/v1/classify", {"json": {"inputs": "a"}}), ("GET", "/metrics", {})])
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(r.text) for s in f.samples}
    assert samples[(PREFIX + "requests_total", (("endpoint", "/v1/classify"), ("status", "200")))] == 1
    # Serve's replica states as the backend reports them, every other state at 0
    assert samples[(PREFIX + "replicas", (("deployment", "encoder"), ("state", "STOPPING")))] == 1
    assert samples[(PREFIX + "replicas", (("deployment", "encoder"), ("state", "RUNNING")))] == 2
    assert samples[(PREFIX + "replicas", (("deployment", "encoder"), ("state", "STARTING")))] == 0


# -- counters from the start --------------------------------------------------------------------------

DASHBOARDS = ROOT / "deploy" / "grafana" / "dashboards"
# counters a dashboard queries that neither the observers nor the API export: the front's (from its
# file: tests/service/front/test_front.py) and the ingress deployment's routers' (service/ingress.py)
ELSEWHERE = {"front_answers_total", "routing_decisions_total"}


def dashboard_counters() -> set[str]:
    """The counters (names without PREFIX) the Grafana dashboards query."""
    names = {n for f in DASHBOARDS.glob("*.json") for n in re.findall(rf"\b{PREFIX}(\w+)", f.read_text())}
    defined = SPECS | COLLECTED
    return {n for n in names if n in defined and defined[n].kind == "counter"}


def counter_labels(text: str) -> dict[str, dict[tuple[str, ...], float]]:
    """A scrape's counters: name without PREFIX -> {label values (in label order): value}."""
    out: dict[str, dict[tuple[str, ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            name = s.name.removeprefix(PREFIX)
            if family.type == "counter" and name in SPECS | COLLECTED:
                labels = tuple(s.labels[label] for label in (SPECS | COLLECTED)[name].labels)
                out.setdefault(name, {})[labels] = s.value
    return out


def first_scrape(metrics: ServiceMetrics) -> tuple[str, set[str]]:
    """GET /metrics as the ingress's very first request: the body, and the API's routes (`/v1/...`)."""
    app = create_api(Settings.build({"deployments": {"encoder": {"model": ENCODER}},
                                     "tenants": {"team-a": {"keys": ["team-a-key-0123456789"], "requests_per_s": 5}},
                                     "protect_metrics": False},
                                    env={}), Backend(), metrics)
    routes = {path for path in app.openapi()["paths"] if is_api(path)}

    async def main() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return await client.get("/metrics")

    return asyncio.run(main()).text, routes


def test_the_first_scrape_shows_every_counter_a_dashboard_queries_at_0_for_its_known_labels(
        metrics: ServiceMetrics) -> None:
    """A fresh replica's observers and the ingress's first request export each labelled counter at 0
    for every known label value (the producers' constants), so no panel starts as "No data"; the
    counters exported elsewhere are ELSEWHERE."""
    PrometheusBatchObserver(metrics, "enc", adapters=("spam-filter",), tasks=("classify", "embed"))
    PrometheusEngineObserver(metrics, "gen", speculative="ngram", adapters=("support-bot",))
    text, routes = first_scrape(metrics)
    counters = counter_labels(text)
    assert set(COLLECTED) <= ELSEWHERE
    wanted = dashboard_counters() - ELSEWHERE
    assert "admission_refused_total" in wanted and "requests_total" in wanted  # the dashboards were read
    assert wanted <= set(counters), sorted(wanted - set(counters))
    assert {v for series in counters.values() for v in series.values()} == {0.0}
    assert set(counters["admission_refused_total"]) == {(m, r) for m in ("enc", "gen") for r in REFUSALS}
    assert set(counters["batch_dropped_items_total"]) == {("enc", r) for r in DROPS}
    assert set(counters["generation_requests_finished_total"]) == {("gen", r) for r in FINISH_REASONS}
    assert set(counters["encoder_adapter_inputs_total"]) == {("enc", "spam-filter", t) for t in ("classify", "embed")}
    assert set(counters["quota_refused_total"]) == {("team-a", "requests"), ("team-a", "tokens")}
    assert "/v1/classify" in routes and "/v1/chat/completions" in routes
    assert set(counters["requests_total"]) == {(route, "200") for route in routes}
    assert set(counters["rejected_requests_total"]) == {(route, r) for route in routes for r in UNAVAILABLE}
    assert set(UNAVAILABLE) == {"overloaded_error", "model_not_ready"}  # the reasons 503s carry (errors.STATUS)


def test_the_batcher_reports_exactly_the_known_drop_and_refusal_reasons(metrics: ServiceMetrics) -> None:
    """A real DynamicBatcher driven into every drop (rejected, cancelled, expired) and refusal (queue
    full, deadline): the reasons it reports are the constants exported from the start, no other."""
    executor = ThreadPoolExecutor(max_workers=1)

    def run_batch(payloads: list[int]) -> list[int]:
        time.sleep(0.05)
        return payloads

    async def main() -> None:
        batcher = DynamicBatcher(run_batch, BatchLimits(max_batch_size=4, max_wait_ms=2000, max_queued=4),
                                 executor, name="b", observer=PrometheusBatchObserver(metrics, "m"))
        assert await batcher.submit_many([1] * 4, [1] * 4) == [1] * 4  # a full batch: the time per token measured
        late = asyncio.ensure_future(batcher.submit(3, 1, deadline=time.monotonic() + 0.01))  # nothing ahead
        gone = asyncio.ensure_future(batcher.submit(2, 1))
        waiting = asyncio.ensure_future(batcher.submit(4, 1))  # waits for company (max_wait_ms)
        await asyncio.sleep(0.05)
        gone.cancel()  # its caller went away
        await asyncio.sleep(0.01)
        with pytest.raises(Overloaded, match="deadline"):  # 1 input ahead x the measured time
            await batcher.submit(5, 1, deadline=time.monotonic())
        with pytest.raises(Overloaded, match="inputs are queued"):  # drops `gone` and `late`, still full
            await batcher.submit_many([6] * 4, [1] * 4)
        with pytest.raises(DeadlineExceeded):
            await late
        await batcher.close()
        await asyncio.gather(waiting, return_exceptions=True)

    asyncio.run(asyncio.wait_for(main(), 20))
    executor.shutdown()
    counters = counter_labels(generate_latest(metrics.registry).decode())
    assert counters["batch_dropped_items_total"] == {("m", REJECTED): 4, ("m", CANCELLED): 1, ("m", EXPIRED): 1}
    assert set(DROPS) == {REJECTED, CANCELLED, EXPIRED}
    assert counters["admission_refused_total"] == {("m", r): 1 for r in REFUSALS}


def test_the_engine_reports_only_the_known_refusals_and_finish_reasons(metrics: ServiceMetrics) -> None:
    """A real GenerationEngine (tiny decoder): a full queue refused, a request cancelled while waiting,
    one run to its length; every label it increments is one exported from the start."""
    torch.set_num_threads(1)
    model, tok = tiny_model("decoder")
    engine = GenerationEngine(model, tok, EngineConfig(max_running=1, max_queued=1, max_total_tokens=64),
                              PrometheusEngineObserver(metrics, "gen"))
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    ran, cancelled = (engine.submit(tok.encode(p), params) for p in ("hello", "there"))
    with pytest.raises(EngineOverloaded):
        engine.submit(tok.encode("one too many"), params)
    cancelled.cancel()
    for _ in range(20):
        engine.step()
    assert (ran.result_sync().finish_reason, cancelled.result_sync().finish_reason) == ("length", "cancelled")
    counters = counter_labels(generate_latest(metrics.registry).decode())
    assert counters["admission_refused_total"] == {("gen", QUEUE_FULL): 1, ("gen", DEADLINE): 0}
    finished = counters["generation_requests_finished_total"]
    assert set(finished) == {("gen", r) for r in FINISH_REASONS}  # no reason outside the constant
    assert (finished[("gen", "length")], finished[("gen", "cancelled")]) == (1, 1)


# -- several processes of a node ----------------------------------------------------------------------

CHILD = textwrap.dedent("""
    import sys
    from service.telemetry.metrics import bind_to_node, process_metrics
    bind_to_node(sys.argv[2])  # as every replica does with its Ray node id
    m = process_metrics()
    m["requests_total"].labels("/v1/classify", "200").inc(int(sys.argv[1]))
    m["generation_running_requests"].labels("gen").set(int(sys.argv[1]))
    m["model_load_seconds"].labels("gen").set(float(sys.argv[1]))
    print("ready", flush=True)
    sys.stdin.readline()  # stay alive until told
""")


@pytest.fixture
def children(tmp_path: Path) -> Iterator[tuple[Path, list[subprocess.Popen[str]]]]:
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "metrics"), "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(n), node], env=env, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) for n, node in ((2, "a"), (5, "a"), (11, "b"))]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        yield tmp_path / "metrics", procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def test_render_merges_the_processes_of_a_node_and_forgets_dead_gauges(
        children: tuple[Path, list[subprocess.Popen[str]]], monkeypatch: pytest.MonkeyPatch) -> None:
    base, (live, dying, elsewhere) = children
    path = base / "node-a"  # the two processes of node a; node b's process writes to its own directory
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(path))
    write_totals(answers_file(path, 99), {("/v1/classify", 503): 4, ("/nope", 413): 1})  # a front on node a

    def scrape() -> dict[tuple[str, str], float]:
        body, _ = render(ServiceMetrics(CollectorRegistry()), lambda: {"/v1/classify"})
        return {(s.name, s.labels.get("model", s.labels.get("endpoint", ""))): s.value
                for f in text_string_to_metric_families(body.decode()) for s in f.samples}

    before = scrape()
    assert before[(PREFIX + "requests_total", "/v1/classify")] == 7
    assert before[(PREFIX + "generation_running_requests", "gen")] == 7  # livesum
    assert before[(PREFIX + "model_load_seconds", "gen")] == 5  # livemax
    assert before[(PREFIX + "front_answers_total", "/v1/classify")] == 4  # the front's, by endpoint
    assert before[(PREFIX + "front_answers_total", "other")] == 1
    dying.communicate("\n")
    assert clean_dead_processes(path) == [dying.pid]
    after = scrape()
    assert after[(PREFIX + "requests_total", "/v1/classify")] == 7  # totals never go backwards
    assert after[(PREFIX + "generation_running_requests", "gen")] == 2  # only the live process
    assert after[(PREFIX + "model_load_seconds", "gen")] == 2
    live.communicate("\n")
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(base / "node-b"))
    on_b = scrape()
    assert on_b[(PREFIX + "requests_total", "/v1/classify")] == 11  # node b: only its own process
    assert (PREFIX + "front_answers_total", "/v1/classify") not in on_b  # no front there
    elsewhere.communicate("\n")


def test_a_process_binds_to_its_node_before_its_metrics_exist(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    monkeypatch.setattr(metrics_module, "process_metrics", functools.cache(lambda: "built"))
    assert bind_to_node("n1") == tmp_path / "node-n1"
    assert bind_to_node("n1") == tmp_path / "node-n1"  # again: unchanged, not node-n1/node-n1
    assert os.environ["PROMETHEUS_MULTIPROC_DIR"] == str(tmp_path / "node-n1")
    metrics_module.process_metrics()
    with pytest.raises(RuntimeError, match="after this process's metrics were built"):
        bind_to_node("n2")
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR")
    assert bind_to_node("n3") is None  # one process, its own registry: nothing to bind


# -- logs ---------------------------------------------------------------------------------------------

def test_json_log_lines_carry_the_request_id_and_extras() -> None:
    record = logging.LogRecord("service.x", logging.WARNING, __file__, 1, "hello %s", ("world",), None)
    record.status = 503
    token = REQUEST_ID.set("rid-1")
    try:
        line = json.loads(JsonFormatter().format(record))
    finally:
        REQUEST_ID.reset(token)
    assert line["message"] == "hello world" and line["level"] == "WARNING" and line["logger"] == "service.x"
    assert line["request_id"] == "rid-1" and line["status"] == 503 and line["ts"].endswith("Z")


@pytest.mark.parametrize("access_log", [False, True])
def test_access_lines_only_when_turned_on(metrics: ServiceMetrics, caplog: pytest.LogCaptureFixture,
                                          access_log: bool) -> None:
    with caplog.at_level(logging.INFO, logger="service.access"):
        call_api(metrics, [("GET", "/healthz", {"headers": {"X-Request-ID": "rid-7"}})],
                 settings={"access_log": access_log})
    lines = [r for r in caplog.records if r.name == "service.access"]
    if not access_log:
        assert lines == []
        return
    (line,) = lines
    assert line.status == 200 and line.path == "/healthz"  # type: ignore[attr-defined]
    assert json.loads(JsonFormatter().format(line))["request_id"] == "rid-7"


@pytest.mark.parametrize("raw, ok", [("abc-123", True), ("a" * 128, True), ("a" * 129, False), ("", False),
                                     ("a b", False), ("é", False), (None, False), ("Root=1-5f;Parent=x", True)])
def test_valid_request_ids(raw: str | None, ok: bool) -> None:
    assert valid_request_id(raw) == (raw if ok else None)


def test_every_replica_gets_the_metrics_dir_and_quiet_serve_logs(tmp_path: Path) -> None:
    from service.deployments import deployment_options

    args = {"deployments": {"encoder": {"model": ENCODER}}, "metrics_dir": str(tmp_path)}
    settings = Settings.build(args, env={})
    opts = deployment_options("encoder", settings.deployments["encoder"], settings, cluster_gpus=0)
    assert opts["ray_actor_options"]["runtime_env"] == {"env_vars": {"PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}}
    assert opts["logging_config"] == {"encoding": "JSON", "enable_access_log": False}
    loud = Settings.build({**args, "access_log": True, "log_json": False}, env={})
    assert deployment_options("encoder", loud.deployments["encoder"], loud, 0)["logging_config"] == {
        "encoding": "TEXT", "enable_access_log": True}


def test_access_lines_escape_the_path_and_plain_logs_carry_the_request_id(
        metrics: ServiceMetrics, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="service.access"):
        call_api(metrics, [("GET", "/v1/x%0Afake line%1B[31m", {"headers": {"X-Request-ID": "rid-8"}})],
                 settings={"access_log": True})
    (line,) = [r for r in caplog.records if r.name == "service.access"]
    text = PlainFormatter().format(line)
    assert "\n" not in text and "\x1b" not in text and "\\n" in text and "\\x1b" in text
    assert "[rid-8]" in text and line.path == "/v1/x\\nfake line\\x1b[31m"  # type: ignore[attr-defined]
    outside = logging.LogRecord("service.x", logging.INFO, __file__, 1, "no request", None, None)
    assert "[-]: no request" in PlainFormatter().format(outside)


def test_replicas_by_state_are_exported_for_every_state_of_every_deployment() -> None:
    metrics = ServiceMetrics()
    metrics.replicas_seen(["generator", "encoder"], {"generator": {"RUNNING": 1, "STOPPING": 1}})
    assert value(metrics, "replicas", deployment="generator", state="STOPPING") == 1
    assert value(metrics, "replicas", deployment="generator", state="RUNNING") == 1
    for state in REPLICA_STATES:
        assert metrics.registry.get_sample_value(PREFIX + "replicas", {"deployment": "encoder", "state": state}) == 0
    metrics.replicas_seen(["generator", "encoder"], {})  # the drain ended; the controller said nothing new
    assert value(metrics, "replicas", deployment="generator", state="STOPPING") == 0


def test_a_configured_adapters_counters_are_exported_from_the_start(metrics: ServiceMetrics) -> None:
    PrometheusEngineObserver(metrics, "gen", adapters=("support-bot",))
    names = {s.name for f in metrics.registry.collect() for s in f.samples if s.labels.get("adapter") == "support-bot"}
    assert {PREFIX + n for n in ("generation_adapter_requests_total", "generation_adapter_prompt_tokens_total",
                                 "generation_adapter_generated_tokens_total")} <= names
