"""One local Ray Serve with tiny models for every e2e module of this package (package-scoped: one
cluster start for overload, faults and cancellation; the fault tests leave it whole again), reached
as `python -m service` serves it: through the nginx front (service/front/) when nginx is installed
(always in CI: REQUIRE_NGINX=1), else through Serve's own proxy. `Live.serve_url` is Serve's proxy
of the same service (the front's backup), for the tests that check that path too.

Deployments, each sized for what it is used for:
- `encoder`: tiny:encoder, small batches; faults under classify load.
- `slow`: tiny:encoder whose batcher waits 8 s for company, so requests sit in its queue and a
  client can disconnect mid-request.
- `generator`: tiny:decoder with 16 rows and a deep queue; cancellation and engine faults
  (`ignore_eos` makes a request run for all its max_new_tokens).
- `burst`: tiny:decoder-wide with 1 row and 4 queue slots, 8 requests in the replica and 8 queued for
  it at the ingress: a small capacity to overload (the model, not the HTTP stack, is the bottleneck).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from service.settings import Settings
from service.testing.cluster import deploy, local_cluster, wait_for
from service.testing.replicas import serve_replicas
from tests.service.front_checks import client_url

APP = "reliability"
DEADLINE_S = 30.0  # request_timeout_s (the default): no request may take longer (+ slack for the HTTP hops)
RETRY_AFTER = "1"


def _encoder(name: str, batching: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"model": {"name": name, "tasks": ["classify", "embed"], "source": "tiny:encoder", "max_input_tokens": 64},
            "num_cpus": 0, "torch_threads": 1, "batching": batching, **extra}


def _decoder(name: str, engine: dict[str, Any], source: str = "tiny:decoder", **extra: Any) -> dict[str, Any]:
    return {"model": {"name": name, "tasks": ["generate"], "source": source}, "num_cpus": 0,
            "torch_threads": 1, "engine": {"max_total_tokens": None, "max_new_tokens": 500, **engine}, **extra}


def app_args() -> dict[str, Any]:
    return {
        "device": "cpu", "retry_after_s": int(RETRY_AFTER), "readiness_timeout_s": 1, "request_timeout_s": DEADLINE_S,
        "max_inputs": 8,
        "deployments": {
            "encoder": _encoder("tiny-encoder", {"max_batch_size": 16, "max_wait_ms": 2, "max_queued": 256}),
            "slow": _encoder("tiny-encoder-slow", {"max_batch_size": 256, "max_wait_ms": 8000, "max_queued": 256}),
            "generator": _decoder("tiny-decoder", {"max_running": 16, "max_queued": 256}),
            "burst": _decoder("tiny-decoder-burst", {"max_running": 1, "max_queued": 4}, "tiny:decoder-wide",
                              max_ongoing_requests=8, max_queued_requests=8),
        },
    }


@dataclass
class Live:
    url: str  # what clients use: the front
    serve_url: str  # Serve's own proxy (the same as url without nginx)

    @property
    def fronted(self) -> bool:
        return self.url != self.serve_url

    def client(self, timeout_s: float = DEADLINE_S + 5, via_serve: bool = False) -> httpx.Client:
        return httpx.Client(base_url=self.serve_url if via_serve else self.url, timeout=timeout_s)

    def async_client(self, connections: int = 256, timeout_s: float = DEADLINE_S + 5) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, timeout=timeout_s,
                                 limits=httpx.Limits(max_connections=connections,
                                                     max_keepalive_connections=connections))

    def pids(self, deployment: str) -> list[int]:
        return [p.pid for p in serve_replicas().get((APP, deployment), [])]

    def stats(self, deployment: str) -> dict[str, Any]:
        with self.client() as c:
            cards = {m["deployment"]: m for m in c.get("/v1/models").json()["data"]}
        card = cards[deployment]
        assert card["ready"], card
        return card["stats"]

    def wait_stats(self, deployment: str, done: Any, timeout_s: float = 10.0) -> dict[str, Any]:
        """Poll the deployment's stats until done(stats); the last stats. AssertionError naming them."""
        deadline = time.monotonic() + timeout_s
        while True:
            stats = self.stats(deployment)
            if done(stats):
                return stats
            assert time.monotonic() < deadline, f"{deployment} stats after {timeout_s} s: {stats}"
            time.sleep(0.1)


def engine_idle(stats: dict[str, Any]) -> bool:
    return stats["running"] == 0 and stats["waiting"] == 0 and stats["cache_usage"] == 0


@pytest.fixture(scope="package")
def live() -> Iterator[Live]:
    with local_cluster(num_cpus=4) as serve_url, ExitStack() as stack:
        url = client_url(stack, serve_url, Settings.build(app_args(), env={}).max_body_bytes, int(RETRY_AFTER))
        deploy(app_args(), name=APP, prefix="/")
        wait_for(url, "/readyz", 200, timeout_s=120)
        yield Live(url, serve_url)


def run(coro: Any) -> Any:
    return asyncio.run(coro)
