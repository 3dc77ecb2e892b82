"""The service across two Ray nodes on this machine (Ray's own `ray.cluster_utils.Cluster`: two raylets):
an ingress and an encoder replica on each node, a worker node killed under load: every request in
flight ends with an answer or a clear JSON 503 (never a hang or a 500: the proxy's own error for a
lost ingress replica is turned into ours, service/http/proxy_headers.py), the rest succeed, and the
service is whole again without a restart; and each node's /metrics covers its own replicas only.
docs/reliability.md has the figures."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import ray
from ray import serve

from service.telemetry.metrics import PREFIX
from service.testing.cluster import ROOT, deploy, free_port, local_ray_env, stop_kept, wait_for

pytestmark = pytest.mark.e2e
log = logging.getLogger(__name__)
APP = "two-nodes"
DEADLINE_S = 10.0
BODY = {"inputs": ["a text", "another one"]}


@dataclass
class TwoNodes:
    url: str
    cluster: Any
    worker: Any


def replica_nodes(deployment: str) -> list[str]:
    """The node id of every live replica of the deployment."""
    from ray.util.state import list_actors

    actors = list_actors(filters=[("state", "=", "ALIVE")], limit=1000)
    return [a.node_id for a in actors if a.class_name == f"ServeReplica:{APP}:{deployment}"]


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[TwoNodes]:
    from ray.cluster_utils import Cluster

    stop_kept()  # a Ray of its own: not the one the other end-to-end modules share
    local_ray_env()
    pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"head_node": 1}})
    worker = cluster.add_node(num_cpus=2)
    ray.init(address=cluster.address, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1"}})
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
        deploy({"device": "cpu", "readiness_timeout_s": 1, "request_timeout_s": DEADLINE_S, "retry_after_s": 1,
                "ingress": {"num_replicas": 2, "num_cpus": 0, "max_replicas_per_node": 1},
                "deployments": {"encoder": {
                    "model": {"name": "tiny-encoder", "tasks": ["classify", "embed"], "source": "tiny:encoder"},
                    "num_replicas": 2, "max_replicas_per_node": 1, "num_cpus": 1, "torch_threads": 1,
                    "batching": {"max_batch_size": 8, "max_wait_ms": 2}}}}, name=APP)
        url = f"http://127.0.0.1:{port}"
        wait_for(url, "/readyz", 200, timeout_s=120)
        yield TwoNodes(url, cluster, worker)
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


def ingress_urls() -> list[str]:
    """Each ingress replica's own HTTP address: throughput mode's direct ingress gives every ingress
    replica a port of its own (30000 and up), which Serve reports to a load balancer as its HTTP
    targets (the controller's target groups, as Ray's own Serve tests read them). They listen on
    `http_options.host` (127.0.0.1 here), while a target names the node's address."""
    from ray.serve.context import _get_global_client

    groups = ray.get(_get_global_client()._controller.get_target_groups.remote(APP))
    return sorted(f"http://127.0.0.1:{t.port}" for g in groups if g.protocol == "HTTP" for t in g.targets)


def scrape(url: str) -> dict[str, float]:
    """Two series of a node's /metrics: classify requests answered 200, and live encoder replicas."""
    from prometheus_client.parser import text_string_to_metric_families

    body = httpx.get(url + "/metrics", timeout=10).text
    out = {"classify": 0.0, "encoders": 0.0}
    for family in text_string_to_metric_families(body):
        for s in family.samples:
            if s.name == PREFIX + "requests_total" and s.labels == {"endpoint": "/v1/classify", "status": "200"}:
                out["classify"] += s.value
            elif s.name == PREFIX + "model_info" and s.labels.get("model") == "tiny-encoder":
                out["encoders"] += s.value
    return out


def test_each_nodes_metrics_are_its_own_replicas(two_nodes: TwoNodes) -> None:
    """/metrics on a node's ingress covers that node's replicas only (docs/observability.md), even with
    both raylets on one host: each node's processes write to their own subdirectory of the app's
    metrics directory. With one directory for both, each node would report both encoders and every
    request twice over."""
    urls = ingress_urls()
    assert len(urls) == 2, urls
    before = [scrape(u) for u in urls]
    for url, n in zip(urls, (3, 7), strict=True):
        with httpx.Client(base_url=url, timeout=DEADLINE_S) as c:
            assert all(c.post("/v1/classify", json=BODY).status_code == 200 for _ in range(n))
    after = [scrape(u) for u in urls]
    log.info("per-node /metrics: before %s, after %s", before, after)
    assert [a["classify"] - b["classify"] for a, b in zip(after, before, strict=True)] == [3, 7]
    assert [a["encoders"] for a in after] == [1, 1]  # one encoder replica on each node


async def keep_busy(client: httpx.AsyncClient, stop: asyncio.Event, out: list[tuple[int, float, str | None]]) -> None:
    while not stop.is_set():
        started = time.monotonic()
        try:
            r = await client.post("/v1/classify", json=BODY, headers={"X-Request-Timeout": str(DEADLINE_S)})
        except httpx.HTTPError as e:
            out.append((0, time.monotonic() - started, type(e).__name__))
            continue
        error = None if r.status_code == 200 else r.json().get("error", {}).get("type")
        out.append((r.status_code, time.monotonic() - started, error))


def test_a_worker_node_killed_under_load(two_nodes: TwoNodes) -> None:
    head_id = ray.get_runtime_context().get_node_id()
    for deployment in ("encoder", "Ingress"):  # one replica of each on each node
        nodes = replica_nodes(deployment)
        assert len(nodes) == 2 and head_id in nodes and len(set(nodes)) == 2, (deployment, nodes)
    outcomes: list[tuple[int, float, str | None]] = []

    async def main() -> float:
        stop = asyncio.Event()
        async with httpx.AsyncClient(base_url=two_nodes.url, timeout=DEADLINE_S + 10) as client:
            workers = [asyncio.create_task(keep_busy(client, stop, outcomes)) for _ in range(6)]
            await asyncio.sleep(2.0)
            killed = time.monotonic()
            await asyncio.to_thread(two_nodes.cluster.remove_node, two_nodes.worker, False)  # SIGKILL its raylet
            await asyncio.sleep(4.0)
            stop.set()
            await asyncio.gather(*workers)
            return killed

    run_started = time.monotonic()
    killed = asyncio.run(main())  # time.monotonic() of the kill
    counts = Counter(status for status, _, _ in outcomes)
    slowest = max(seconds for _, seconds, _ in outcomes)
    log.info("two nodes, worker killed %.1f s into the load: %s; slowest %.2f s", killed - run_started,
             dict(counts), slowest)
    assert set(counts) <= {200, 503}, [o for o in outcomes if o[0] not in (200, 503)]
    assert counts[200] > 10 and slowest < DEADLINE_S + 2  # none hangs
    assert all(error in ("model_not_ready", "overloaded_error") for status, _, error in outcomes if status == 503)
    with httpx.Client(base_url=two_nodes.url, timeout=DEADLINE_S) as c:  # whole again, no restart
        assert wait_for(two_nodes.url, "/readyz", 200, timeout_s=30).json()["deployments"]["encoder"] == "ready"
        assert all(c.post("/v1/classify", json=BODY).status_code == 200 for _ in range(20))
    log.info("whole again %.1f s after the kill", time.monotonic() - killed)
