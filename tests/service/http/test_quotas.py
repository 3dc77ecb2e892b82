"""Quotas per tenant (service/http/quotas.py) through the real API over a stand-in backend: a tenant
over its requests or tokens gets a 429 with Retry-After and OpenAI's rate-limit headers before any
model call, another tenant is not affected, and the buckets refill at their rates."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from service.http.api import create_api
from service.http.quotas import Bucket, Ledger, duration
from service.settings import Settings, TenantSettings
from service.telemetry.metrics import PREFIX, ServiceMetrics
from service.testing.fake_backend import EchoBackend, fake_settings

KEY_A, KEY_B, KEY_C = "tenant-a-key-0123456789", "tenant-b-key-0123456789", "tenant-c-key-0123456789"


def app_with(tenants: dict[str, Any], backend: EchoBackend | None = None) -> tuple[Any, EchoBackend, ServiceMetrics]:
    backend = backend or EchoBackend()
    metrics = ServiceMetrics(CollectorRegistry())
    return create_api(fake_settings({"tenants": tenants}), backend, metrics), backend, metrics


def calls(app: Any, requests: list[tuple[str, str, dict[str, Any]]]) -> list[httpx.Response]:
    """Requests one after another, in one event loop (the ingress's buckets live on it)."""
    async def main() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return [await client.post(path, json=body, headers={"Authorization": f"Bearer {key}"})
                    for key, path, body in requests]

    return asyncio.run(main())


def test_a_tenant_past_its_requests_gets_a_429_before_any_model_call_and_others_do_not() -> None:
    app, backend, metrics = app_with({"a": {"keys": [KEY_A], "requests_per_s": 0.5, "request_burst": 2},
                                      "b": {"keys": [KEY_B], "requests_per_s": 0.5, "request_burst": 2}})
    body = {"inputs": "hello"}
    got = calls(app, [(KEY_A, "/v1/classify", body)] * 3 + [(KEY_B, "/v1/classify", body)])
    assert [r.status_code for r in got] == [200, 200, 429, 200]
    refused = got[2]
    assert refused.json()["error"]["type"] == "rate_limit_error" and refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert "tenant 'a'" in refused.json()["error"]["message"] and "requests per second" in refused.json()["error"]["message"]
    assert int(refused.headers["retry-after"]) == 2  # one request back after 1 / 0.5 s
    assert refused.headers["x-ratelimit-limit-requests"] == "2" and refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert got[0].headers["x-ratelimit-remaining-requests"] == "1"
    assert backend.calls["classify"] == 3  # the refused request never reached a model
    value = metrics.registry.get_sample_value(f"{PREFIX}quota_refused_total", {"tenant": "a", "limit": "requests"})
    assert value == 1


def test_a_tenant_in_token_debt_waits_and_each_generation_is_charged_streams_included() -> None:
    app, backend, metrics = app_with({"a": {"keys": [KEY_A], "tokens_per_min": 60}})
    gen = {"prompt": "x" * 70, "max_new_tokens": 30}  # the echo backend: a token a character, 8 output tokens
    got = calls(app, [(KEY_A, "/v1/generate", gen), (KEY_A, "/v1/generate", gen)])
    assert [r.status_code for r in got] == [200, 429]
    assert got[0].headers["x-ratelimit-remaining-tokens"] == "0"  # in debt after the first: the second waits
    assert "tokens per minute" in got[1].json()["error"]["message"]
    assert got[1].headers["x-ratelimit-remaining-tokens"] == "0" and int(got[1].headers["retry-after"]) >= 1
    charged = metrics.registry.get_sample_value(f"{PREFIX}tenant_tokens_total", {"tenant": "a"})
    usage = got[0].json()["usage"]
    assert charged == usage["prompt_tokens"] + usage["completion_tokens"] > 60
    app, _, metrics = app_with({"a": {"keys": [KEY_A], "tokens_per_min": 10_000}})
    streamed = calls(app, [(KEY_A, "/v1/generate", {**gen, "stream": True})])[0]
    assert streamed.status_code == 200 and "x-ratelimit-remaining-tokens" in streamed.headers
    assert metrics.registry.get_sample_value(f"{PREFIX}tenant_tokens_total", {"tenant": "a"}) == charged


def test_a_tenant_without_quotas_is_counted_and_plain_keys_have_no_tenant() -> None:
    app, _, metrics = app_with({"c": {"keys": [KEY_C]}})
    app_keys = create_api(fake_settings({"api_keys": [KEY_A], "tenants": {"c": {"keys": [KEY_C]}}}), EchoBackend(),
                          ServiceMetrics(CollectorRegistry()))
    got = calls(app, [(KEY_C, "/v1/embeddings", {"input": "some words here"})])[0]
    assert got.status_code == 200 and "x-ratelimit-limit-requests" not in got.headers
    assert metrics.registry.get_sample_value(f"{PREFIX}tenant_requests_total", {"tenant": "c"}) == 1
    assert metrics.registry.get_sample_value(f"{PREFIX}tenant_tokens_total", {"tenant": "c"}) == got.json()["usage"][
        "prompt_tokens"]
    both = calls(app_keys, [(KEY_A, "/v1/classify", {"inputs": "x"}), (KEY_C, "/v1/classify", {"inputs": "x"}),
                            ("wrong-key-0123456789", "/v1/classify", {"inputs": "x"})])
    assert [r.status_code for r in both] == [200, 200, 401]


def test_a_key_in_two_tenants_fails_the_start() -> None:
    with pytest.raises(ValueError, match="in two tenants"):
        create_api(fake_settings({"tenants": {"a": {"keys": [KEY_A]}, "b": {"keys": [KEY_A]}}}), EchoBackend(),
                   ServiceMetrics(CollectorRegistry()))


def test_buckets_refill_at_their_rates_and_the_ingress_replicas_share_them() -> None:
    tenant = TenantSettings(keys=(KEY_A,), requests_per_s=4.0, tokens_per_min=600)
    ledger = Ledger(tenant, share=2, now=0.0)  # two ingress replicas: half the rates each
    assert ledger.requests is not None and ledger.requests.capacity == 2 and ledger.tokens is not None
    assert [ledger.admit(0.0) for _ in range(3)] == [None, None, ("requests", 0.5)]
    assert ledger.admit(0.5) is None  # 2 a second: one back after 0.5 s
    ledger.charge(400, 0.5)  # 300 a minute here: in debt by 100
    assert ledger.admit(10.0)[0] == "tokens"  # 5 a second: 50 back after 10 s, still in debt
    assert ledger.admit(21.0) is None
    b = Bucket.full(rate=1.0, capacity=3.0, now=0.0)
    b.level = -2
    b.refill(10.0)
    assert b.level == 3.0 and b.seconds_until(3.0) == 0
    assert [duration(s) for s in (0.02, 1.5, 360)] == ["20ms", "1.5s", "6m0s"]


def test_tenants_keys_are_api_keys() -> None:
    settings = Settings.build({"tenants": {"a": {"keys": "k1-0123456789,k2-0123456789"}}}, env={})
    assert [k.get_secret_value() for k in settings.tenants["a"].keys] == ["k1-0123456789", "k2-0123456789"]


class Recording(EchoBackend):
    """Keeps the generation requests the replicas would get."""

    def __init__(self) -> None:
        super().__init__()
        self.requests: list[Any] = []

    def _generate(self, request: Any) -> Any:
        self.requests.append(request)
        return super()._generate(request)


def test_each_tenants_generations_carry_its_cache_salt_unless_it_shares() -> None:
    backend = Recording()
    app, _, _ = app_with({"a": {"keys": [KEY_A]}, "b": {"keys": [KEY_B], "share_prefix_cache": True}}, backend)
    plain = create_api(fake_settings({"api_keys": [KEY_C], "tenants": {"a": {"keys": [KEY_A]}}}), backend,
                       ServiceMetrics(CollectorRegistry()))
    gen = {"prompt": "hello", "max_new_tokens": 4}
    got = calls(app, [(KEY_A, "/v1/generate", gen), (KEY_A, "/v1/completions", {"prompt": "hello", "max_tokens": 4, "cache_salt": "mine"}),
                      (KEY_B, "/v1/generate", gen), (KEY_B, "/v1/generate", {**gen, "cache_salt": "mine"})])
    got += calls(plain, [(KEY_C, "/v1/generate", gen)])
    assert [r.status_code for r in got] == [200] * 5
    assert [r.cache_salt for r in backend.requests] == ["tenant:a", "tenant:a\x1fmine", None, "mine", None]


def test_a_tenants_generations_run_at_its_priority_and_never_sooner() -> None:
    backend = Recording()
    app = create_api(fake_settings({"api_keys": [KEY_C], "tenants": {"a": {"keys": [KEY_A], "priority": 5}}}), backend,
                     ServiceMetrics(CollectorRegistry()))
    gen = {"prompt": "hello", "max_new_tokens": 4}
    got = calls(app, [(KEY_A, "/v1/generate", gen), (KEY_A, "/v1/generate", {**gen, "priority": 1}),
                      (KEY_A, "/v1/generate", {**gen, "priority": 9}), (KEY_C, "/v1/generate", {**gen, "priority": -3}),
                      (KEY_C, "/v1/generate", gen)])
    assert [r.status_code for r in got] == [200] * 5
    assert [r.priority for r in backend.requests] == [5, 5, 9, -3, None]
    assert [r.tenant for r in backend.requests] == ["a", "a", "a", None, None]  # whose share of a queue



def test_a_tenants_encoder_and_translator_calls_carry_its_priority() -> None:
    """The replicas batch (encoders) and admit (translators) a tenant's inputs at its priority."""
    backend = EchoBackend()
    app = create_api(fake_settings({"api_keys": [KEY_C], "tenants": {"a": {"keys": [KEY_A], "priority": 7}}}), backend,
                     ServiceMetrics(CollectorRegistry()))
    got = calls(app, [(KEY_A, "/v1/classify", {"inputs": "x"}), (KEY_A, "/v1/embeddings", {"input": "x"}),
                      (KEY_A, "/v1/rerank", {"query": "q", "texts": ["x"]}),
                      (KEY_A, "/v1/translate", {"inputs": "x", "source_lang": "en", "target_lang": "es"}),
                      (KEY_C, "/v1/classify", {"inputs": "x"})])
    assert [r.status_code for r in got] == [200] * 5
    assert backend.priorities == [7, 7, 7, 7, 0]
