"""Tenants over real HTTP on a real Ray Serve (tiny:decoder, and MiniLM for embeddings): a tenant over
its quota gets a 429 with Retry-After and OpenAI's rate-limit headers while another is served, the
prefix cache is reused within a tenant only, /metrics needs a key once keys are set, and an encoder
serves a tenant of a sooner priority ahead of another tenant's queued flood."""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from service.testing.cluster import deploy, local_cluster, wait_for

pytestmark = pytest.mark.e2e
KEY_A, KEY_B, KEY_BULK = "tenant-a-key-0123456789", "tenant-b-key-0123456789", "tenant-bulk-key-0123456789"
PROMPT = "A long shared system prompt that both tenants send, word for word, to the same model. " * 2


@pytest.fixture(scope="module")
def url() -> Any:
    args = {
        "device": "cpu", "readiness_timeout_s": 2,
        "tenants": {"a": {"keys": [KEY_A], "requests_per_s": 0.2, "request_burst": 3},
                    "b": {"keys": [KEY_B], "tokens_per_min": 100_000},
                    "bulk": {"keys": [KEY_BULK], "priority": 10}},
        "deployments": {
            "generator": {"model": {"name": "tiny-decoder", "tasks": ["generate"], "source": "tiny:decoder"},
                          "num_cpus": 0, "torch_threads": 1, "engine": {"max_running": 8, "max_queued": 32}},
            # one input a batch, each ~tens of ms: a flood queues at the replica's batcher
            "encoder": {"model": {"name": "minilm", "tasks": ["embed"], "source": "zoo:minilm"},
                        "num_cpus": 0, "torch_threads": 1, "batching": {"max_batch_size": 1, "max_wait_ms": 0}}},
    }
    with local_cluster(keep=True) as base:
        deploy(args, "tenants", "/")
        wait_for(base, "/readyz", 200, timeout_s=120)
        yield base


def generate(c: httpx.Client, key: str) -> httpx.Response:
    return c.post("/v1/generate", json={"prompt": PROMPT, "max_new_tokens": 4},
                  headers={"Authorization": f"Bearer {key}"})


def cached_tokens(c: httpx.Client) -> float:
    text = c.get("/metrics", headers={"Authorization": f"Bearer {KEY_B}"}).text
    return sum(float(v) for v in re.findall(r"^transformer_serve_generation_prompt_cached_tokens_total\{[^}]*\} (\S+)$",
                                            text, re.MULTILINE))


def test_the_prefix_cache_is_reused_within_a_tenant_only_and_metrics_need_a_key(url: str) -> None:
    with httpx.Client(base_url=url, timeout=60) as c:
        assert c.get("/metrics").status_code == 401
        assert generate(c, KEY_A).status_code == 200
        before = cached_tokens(c)
        assert generate(c, KEY_B).status_code == 200  # the same prompt, another tenant: computed again
        after_b = cached_tokens(c)
        assert generate(c, KEY_A).status_code == 200  # its own tenant's cached prefix
        after_a = cached_tokens(c)
    assert after_b == before and after_a > after_b


def test_a_tenant_over_its_quota_gets_a_429_and_another_is_served(url: str) -> None:
    with httpx.Client(base_url=url, timeout=60) as c:
        answers = [generate(c, KEY_A) for _ in range(5)]  # past the burst of 3 (one back each 5 s)
        refused = next(r for r in answers if r.status_code == 429)
        other = generate(c, KEY_B)
    error = refused.json()["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded"
    assert int(refused.headers["retry-after"]) >= 1 and refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert other.status_code == 200 and int(other.headers["x-ratelimit-remaining-tokens"]) < 100_000


def test_an_encoder_serves_a_sooner_tenant_ahead_of_another_tenants_queued_flood(url: str) -> None:
    """Tenant "bulk" (priority 10) floods the encoder with 40 embeddings, one input a batch; tenant b's
    request (priority 0) sent once they queue is batched next, so most of the flood finishes after it.
    First come, first served it would finish behind them (the flood's queue is ~1-2 s of work)."""
    text = "a sentence of some length for the encoder to embed, " * 20  # ~200 tokens
    flood_n = 40

    def embed(key: str) -> float:
        r = httpx.post(f"{url}/v1/embeddings", json={"model": "minilm", "input": text}, timeout=120,
                       headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200, r.text
        return time.perf_counter()

    embed(KEY_BULK)  # the replica's first call (allocations, kernels) before anything is timed
    with ThreadPoolExecutor(flood_n + 1) as pool:
        flood = [pool.submit(embed, KEY_BULK) for _ in range(flood_n)]
        time.sleep(0.3)  # the flood reaches the replica and queues
        done = pool.submit(embed, KEY_B).result()
        after = sum(f.result() > done for f in flood)
    assert after >= flood_n // 2, f"only {after} of the {flood_n} flood requests finished after the sooner tenant's"
