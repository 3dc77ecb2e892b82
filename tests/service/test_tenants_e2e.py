"""Tenants over real HTTP on a real Ray Serve (tiny:decoder): a tenant over its quota gets a 429 with
Retry-After and OpenAI's rate-limit headers while another is served, and the prefix cache is reused
within a tenant only; /metrics needs a key once keys are set."""

from __future__ import annotations

import re
from typing import Any

import httpx
import pytest

from service.testing.cluster import deploy, local_cluster, wait_for

pytestmark = pytest.mark.e2e
KEY_A, KEY_B = "tenant-a-key-0123456789", "tenant-b-key-0123456789"
PROMPT = "A long shared system prompt that both tenants send, word for word, to the same model. " * 2


@pytest.fixture(scope="module")
def url() -> Any:
    args = {
        "device": "cpu", "readiness_timeout_s": 2,
        "tenants": {"a": {"keys": [KEY_A], "requests_per_s": 0.2, "request_burst": 3},
                    "b": {"keys": [KEY_B], "tokens_per_min": 100_000}},
        "deployments": {"generator": {
            "model": {"name": "tiny-decoder", "tasks": ["generate"], "source": "tiny:decoder"},
            "num_cpus": 0, "torch_threads": 1, "engine": {"max_running": 8, "max_queued": 32}}},
    }
    with local_cluster() as base:
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
