"""The monitoring assets against the real thing: a Prometheus server (Debian package `prometheus`)
scrapes a real Ray Serve running tiny models while traffic goes to every endpoint; then every
PromQL expression of every dashboard panel must return data and every alert rule must evaluate.
Before any traffic, the first /metrics already has every counter a panel queries (at 0).

Also: promtool checks the shipped config and rules; the dashboard is valid JSON whose expressions
use only metrics the service defines and cover the required panels.

Without the `prometheus` / `promtool` binaries these tests skip, unless REQUIRE_PROMETHEUS=1
(set by .ci/run, which installs the package), when they fail.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from service.telemetry.metrics import COLLECTED, PREFIX, SPECS
from service.testing.cluster import deploy, free_port, local_cluster, wait_for
from tests.service.adapter_files import encoder_adapter
from tests.service.front_checks import client_url

ROOT = Path(__file__).resolve().parents[2]
PROM_DIR = ROOT / "deploy" / "prometheus"
GRAFANA_DIR = ROOT / "deploy" / "grafana"
DASHBOARD = GRAFANA_DIR / "dashboards" / "transformer-serve.json"
JOB = "transformer-serve"
GRAFANA_VARS = {"$__rate_interval": "1m", "$__interval": "15s", "$model": ".*"}
REQUIRED_PANELS = ("request rate", "error rate", "latency p50 / p95 / p99", "batch size", "padding efficiency",
                   "queue depth", "tokens/s", "time to first token", "inter-token latency", "kv-cache usage",
                   "running / waiting")
MAX_INPUTS = 4
MAX_BODY = 65536


def binary(name: str) -> str:
    """The path of `name`; skip without it, or fail when REQUIRE_PROMETHEUS=1."""
    path = shutil.which(name)
    if path is None:
        message = (f"`{name}` not found: install the Debian package `prometheus` (apt-get install prometheus) "
                   "to run the monitoring tests")
        if os.environ.get("REQUIRE_PROMETHEUS") == "1":
            pytest.fail(f"{message}; REQUIRE_PROMETHEUS=1 makes this a failure")
        pytest.skip(message)
    return path


def panel_queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, expression) of every target of every panel (rows' nested panels too)."""
    out = []
    for panel in dashboard["panels"]:
        for inner in [panel, *panel.get("panels", [])]:
            out += [(inner["title"], t["expr"]) for t in inner.get("targets", []) if t.get("expr")]
    return out


def concrete(expr: str) -> str:
    """Grafana's variables replaced by values Prometheus understands."""
    for var, value in sorted(GRAFANA_VARS.items(), key=lambda kv: -len(kv[0])):
        expr = expr.replace(var, value)
    assert "$" not in expr, f"an unknown Grafana variable in {expr!r}"
    return expr


def alert_rules() -> list[dict[str, Any]]:
    return [rule for group in yaml.safe_load((PROM_DIR / "alerts.yml").read_text())["groups"]
            for rule in group["rules"]]


# -- static checks ------------------------------------------------------------------------------------

def test_promtool_accepts_the_config_and_the_rules() -> None:
    promtool = binary("promtool")
    for args in (["check", "config", str(PROM_DIR / "prometheus.yml")],
                 ["check", "rules", str(PROM_DIR / "alerts.yml")]):
        done = subprocess.run([promtool, *args], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr


def test_the_scrape_config_targets_the_compose_service() -> None:
    config = yaml.safe_load((PROM_DIR / "prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    assert job["job_name"] == JOB and job["metrics_path"] == "/metrics"
    assert job["static_configs"] == [{"targets": ["serve:8000"]}]
    assert config["rule_files"] == ["alerts.yml"]
    names = [r["alert"] for r in alert_rules()]
    for topic in ("ErrorRate", "LatencyP99", "QueueSaturated", "ReplicaDown"):
        assert any(topic in n for n in names), topic


def test_grafana_provisioning_points_at_prometheus_and_the_dashboards() -> None:
    (source,) = yaml.safe_load((GRAFANA_DIR / "provisioning/datasources/prometheus.yml").read_text())["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090" and source["uid"]
    (provider,) = yaml.safe_load((GRAFANA_DIR / "provisioning/dashboards/dashboards.yml").read_text())["providers"]
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards"
    dashboard = json.loads(DASHBOARD.read_text())
    uids = {p["datasource"]["uid"] for p in dashboard["panels"]}
    uids |= {t["datasource"]["uid"] for p in dashboard["panels"] for t in p["targets"]}
    assert uids == {source["uid"]}


def test_the_dashboard_covers_the_required_panels_with_known_metrics() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"] and dashboard["panels"]
    titles = [p["title"].lower() for p in dashboard["panels"]]
    for required in REQUIRED_PANELS:
        assert any(required in t for t in titles), required
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    defined = SPECS | COLLECTED
    known = {PREFIX + n for n in defined} | {PREFIX + n + s for n in defined for s in ("_bucket", "_sum", "_count")}
    used: set[str] = set()
    for title, expr in panel_queries(dashboard):
        names = set(re.findall(rf"\b{PREFIX}\w+", expr))
        assert names and names <= known, (title, names - known)
        used |= names
    for rule in alert_rules():
        names = set(re.findall(rf"\b{PREFIX}\w+", rule["expr"]))
        assert names <= known, (rule["alert"], names - known)
        used |= names
    used_bases = {re.sub(r"_(bucket|sum|count)$", "", n) for n in used}
    unused = {PREFIX + n for n in defined} - used_bases
    assert not unused, f"metrics no panel or alert shows: {sorted(unused)}"


# -- a real Prometheus scraping a real Serve ----------------------------------------------------------

def tiny_adapter(path: Path) -> Path:
    """A rank-4 LoRA adapter of tiny:decoder (PEFT's format), so the adapter panels have data."""
    from models.adapters.peft import random_llama_factors, save_adapter
    from models.tiny import tiny_model

    return save_adapter(path, random_llama_factors(tiny_model("decoder")[0], 4, seed=0), 4, 8)


def app_args(metrics_dir: Path, adapter: Path, encoder_adapter: Path) -> dict[str, Any]:
    tiny_encoder = {"name": "tiny-encoder", "tasks": ["classify", "embed"], "source": "tiny:encoder",
                    "max_input_tokens": 64, "adapters": {"tiny-classifier": str(encoder_adapter)}}
    return {
        "device": "cpu", "max_inputs": MAX_INPUTS, "retry_after_s": 1, "metrics_dir": str(metrics_dir),
        "max_body_bytes": MAX_BODY,
        "deployments": {
            # the queue holds one full request; a batch waits 300 ms for company: a second request is a 503
            "encoder": {"model": tiny_encoder, "num_cpus": 0, "torch_threads": 1,
                        "batching": {"max_batch_size": 8, "max_wait_ms": 300, "max_queued": MAX_INPUTS}},
            "translator": {"model": {"name": "tiny-en-es", "tasks": ["translate"], "source": "tiny:seq2seq",
                                     "languages": ["en", "es"], "max_input_tokens": 64,
                                     "defaults": {"beam_size": 2, "max_new_tokens": 8}},
                           "num_cpus": 0, "torch_threads": 1, "batching": {"max_wait_ms": 5}},
            "generator": {"model": {"name": "tiny-decoder", "tasks": ["generate"], "source": "tiny:decoder",
                                    "defaults": {"max_new_tokens": 12}, "adapters": {"tiny-adapter": str(adapter)}},
                          "num_cpus": 0, "torch_threads": 1,
                          "engine": {"max_running": 4, "max_queued": 16, "max_total_tokens": None,
                                     "speculative": {"method": "ngram"}}},
        },
    }


@dataclass
class Stack:
    serve_url: str  # where clients go: the nginx front (its answers in /metrics), or Serve's proxy without nginx
    prom_url: str
    log: Path
    fronted: bool


def start_prometheus(tmp: Path, target: str) -> tuple[subprocess.Popen[bytes], str, Path]:
    port = free_port()
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(PROM_DIR / "alerts.yml")],
        "scrape_configs": [{"job_name": JOB, "metrics_path": "/metrics", "static_configs": [{"targets": [target]}]}],
    }
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    log = tmp / "prometheus.log"
    proc = subprocess.Popen(
        [binary("prometheus"), f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=log.open("wb"), stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}", log


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    binary("prometheus")  # skip before starting anything
    tmp = tmp_path_factory.mktemp("prometheus")
    with local_cluster(num_cpus=4) as serve_url, ExitStack() as front:
        deploy(app_args(tmp / "metrics", tiny_adapter(tmp / "adapter"),
                        encoder_adapter(tmp / "encoder-adapter", 0, ("ham", "spam"))), name="prom", prefix="/")
        url = client_url(front, serve_url, MAX_BODY, 1, metrics_dir=str(tmp / "metrics"))  # as python -m service
        wait_for(url, "/readyz", 200, timeout_s=120)
        proc, prom_url, log = start_prometheus(tmp, url.removeprefix("http://"))
        try:
            wait_for(prom_url, "/-/ready", 200, timeout_s=30)
            yield Stack(url, prom_url, log, url != serve_url)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def drive_traffic(url: str) -> dict[str, int]:
    """Requests on every endpoint, streams, client errors and a 503; the status of each kind."""
    seen: dict[str, int] = {}
    gen = {"max_tokens": 6, "temperature": 0}
    with httpx.Client(base_url=url, timeout=60) as c:
        for i in range(3):
            seen["classify"] = c.post("/v1/classify", json={"inputs": [f"good {i}", "bad"]}).status_code
            seen["embeddings"] = c.post("/v1/embeddings", json={"input": f"text {i}"}).status_code
            seen["encoder adapter"] = c.post("/v1/classify", json={"inputs": f"good {i}",
                                                                   "model": "tiny-classifier"}).status_code
            seen["translate"] = c.post("/v1/translate", json={"inputs": f"hello {i}", "source_lang": "en",
                                                              "target_lang": "es"}).status_code
            seen["generate"] = c.post("/v1/generate", json={"prompt": f"once {i}", "max_new_tokens": 6}).status_code
            seen["adapter"] = c.post("/v1/generate", json={"prompt": f"once {i}", "max_new_tokens": 6,
                                                           "model": "tiny-adapter"}).status_code
            seen["completions"] = c.post("/v1/completions", json={"prompt": f"a {i}", **gen}).status_code
            seen["chat"] = c.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": f"hi {i}"}], **gen}).status_code
            for path, body in (("/v1/generate", {"prompt": "stream", "max_new_tokens": 6}),
                               ("/v1/completions", {"prompt": "stream", **gen}),
                               ("/v1/chat/completions", {"messages": [{"role": "user", "content": "s"}], **gen})):
                with c.stream("POST", path, json={**body, "stream": True}) as r:
                    r.read()
                    seen[f"stream {path}"] = r.status_code
        seen["invalid"] = c.post("/v1/classify", json={"inputs": []}).status_code
        seen["not found"] = c.get("/v1/nothing-here").status_code
        seen["models"] = c.get("/v1/models").status_code
        # the nginx front answers this itself (Serve's proxy passes it to the ingress, which refuses it too)
        seen["too large"] = c.post("/v1/classify", content=b"x" * (MAX_BODY + 1),
                                   headers={"content-type": "application/json"}).status_code

    async def overload() -> list[int]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as ac:
            full = asyncio.create_task(ac.post("/v1/classify", json={"inputs": ["q"] * MAX_INPUTS}))
            await asyncio.sleep(0.1)  # the first request's inputs fill the encoder's queue for 300 ms
            refused = await ac.post("/v1/classify", json={"inputs": "one more"})
            return [(await full).status_code, refused.status_code]

    seen["full"], seen["overloaded"] = asyncio.run(overload())
    return seen


def query(prom_url: str, expr: str) -> dict[str, Any]:
    r = httpx.get(f"{prom_url}/api/v1/query", params={"query": expr}, timeout=30)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", f"{expr}: {r.status_code} {body}"
    return body["data"]


def wait_for_scrapes(stack: Stack, since: float, n: int, timeout_s: float = 30) -> None:
    """Until Prometheus has scraped the service successfully `n` times after `since` (a time.time())."""
    deadline = time.monotonic() + timeout_s
    while True:
        window = max(1, math.ceil(time.time() - since))
        done = query(stack.prom_url, f'sum_over_time(up{{job="{JOB}"}}[{window}s])')["result"]
        if done and float(done[0]["value"][1]) >= n:
            return
        assert time.monotonic() < deadline, f"Prometheus did not scrape the service {n} times; see {stack.log}"
        time.sleep(0.5)


def dashboard_counters(fronted: bool) -> set[str]:
    """The counters the dashboard queries (full names); the front's only with a front."""
    defined = SPECS | COLLECTED
    names = {n.removeprefix(PREFIX) for n in re.findall(rf"\b{PREFIX}\w+", DASHBOARD.read_text())}
    counters = {PREFIX + n for n in names if n in defined and defined[n].kind == "counter"}
    # the tenants' exist only where tenants (API keys with quotas) are configured: not in this keyless stack
    # (each configured tenant's are at 0 from the start: tests/service/telemetry/test_metrics.py)
    counters -= {PREFIX + n for n in ("tenant_requests_total", "tenant_tokens_total", "quota_refused_total")}
    return counters if fronted else counters - {PREFIX + "front_answers_total"}


@pytest.mark.e2e
def test_prometheus_scrapes_every_replica_and_every_panel_and_alert_evaluates(stack: Stack) -> None:
    first = httpx.get(stack.serve_url + "/metrics", timeout=30).text  # before any traffic: nothing moved yet
    counters = dashboard_counters(stack.fronted)
    assert f"{PREFIX}admission_refused_total" in counters
    missing = sorted(n for n in counters if not re.search(rf"^{n}{{", first, re.MULTILINE))
    assert not missing, f"counters a panel queries, absent before they first move: {missing}"
    seen = drive_traffic(stack.serve_url)
    expected = {k: 200 for k in seen} | {"invalid": 422, "not found": 404, "overloaded": 503, "too large": 413}
    assert seen == expected

    with httpx.Client(base_url=stack.serve_url, timeout=30) as c:  # request ids through the front
        r = c.get("/healthz", headers={"X-Request-ID": "prom-test-1"})
        assert r.headers.get_list("x-request-id") == ["prom-test-1"]
        assert len(c.get("/healthz").headers.get_list("x-request-id")) == 1
        text = c.get("/metrics").text  # the ingress's view covers every model replica of the node
    for model in ("tiny-encoder", "tiny-en-es", "tiny-decoder"):
        assert f'{PREFIX}model_info{{' in text and f'model="{model}"' in text, model
    assert f'{PREFIX}generation_generated_tokens_total{{model="tiny-decoder"}}' in text

    # two successful scrapes after the last request, so every series has a rate (on a loaded machine a
    # scrape may miss its 1 s timeout)
    traffic_end = time.time()
    wait_for_scrapes(stack, traffic_end, 2)
    up = query(stack.prom_url, f'up{{job="{JOB}"}}')["result"]
    assert [s["value"][1] for s in up] == ["1"]

    empty = panel_queries(json.loads(DASHBOARD.read_text()))
    if not stack.fronted:  # no nginx here (REQUIRE_NGINX=1, as in CI, makes that a failure): no front answers
        empty = [(title, expr) for title, expr in empty if f"{PREFIX}front_answers" not in expr]
    tenants = ("tenant_requests_total", "tenant_tokens_total", "quota_refused_total")  # keyless stack: no tenants
    empty = [(title, expr) for title, expr in empty if not any(f"{PREFIX}{n}" in expr for n in tenants)]
    for scrapes in (2, 3, 4):  # a panel empty now gets the next successful scrapes before it fails
        empty = [(title, expr) for title, expr in empty if not query(stack.prom_url, concrete(expr))["result"]]
        if not empty:
            break
        wait_for_scrapes(stack, traffic_end, scrapes + 1)
    assert not empty, "panels without data:\n" + "\n".join(f"{t}: {e}" for t, e in empty)

    rules = alert_rules()
    for rule in rules:
        query(stack.prom_url, rule["expr"])  # parses and evaluates (a quiet service fires nothing)
    deadline = time.monotonic() + 20
    while True:
        loaded = httpx.get(f"{stack.prom_url}/api/v1/rules", timeout=30).json()["data"]["groups"]
        health = {r["name"]: (r["health"], r.get("lastError", "")) for g in loaded for r in g["rules"]}
        if all(h == "ok" for h, _ in health.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert health == {r["alert"]: ("ok", "") for r in rules}
