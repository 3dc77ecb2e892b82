"""Schemathesis over the whole API in process (the real app, EchoBackend instead of Ray): no 5xx,
every response as documented, invalid data refused. The long run is `python -m loadtests.fuzz`."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from loadtests.fuzz import fuzz, load_schema
from service.messages import Classification
from service.testing.fake_backend import EchoBackend, fake_app

OPERATIONS = {"POST /v1/classify", "POST /v1/embeddings", "POST /v1/rerank", "POST /v1/translate", "GET /v1/models",
              "POST /v1/generate", "POST /v1/completions", "POST /v1/chat/completions", "POST /tokenize",
              "POST /detokenize", "GET /healthz", "GET /readyz", "POST /v1/load_lora_adapter",
              "POST /v1/unload_lora_adapter"}


@pytest.mark.parametrize("keys", [False, True], ids=["open", "api-keys"])
def test_every_operation_answers_as_documented(keys: bool) -> None:
    app = fake_app({"api_keys": ["fuzz-key"]} if keys else None)
    report = fuzz(load_schema(app=app), max_examples=25, headers={"Authorization": "Bearer fuzz-key"} if keys else None)
    assert report.failures == [], "\n".join(report.failures)
    assert set(report.per_operation) == OPERATIONS
    assert report.cases >= 6 * 40 and report.statuses[200] > 0 and report.statuses[422] > 0
    assert all(status < 500 for status in report.statuses)
    assert (401 in report.statuses) == keys  # negative cases without the key


class BrokenBackend(EchoBackend):
    """A classify that answers a malformed result: the route fails with a 500."""

    def _classify(self, texts: list[str], truncate: bool, adapter: Any, timeout_s: float | None,
                  priority: int = 0) -> Any:
        return [Classification("x", 1.0, {"x": 1.0})] if len(texts) > 1 else None


def test_the_fuzzer_finds_a_broken_route() -> None:
    report = fuzz(load_schema(app=fake_app(backend=BrokenBackend())), max_examples=25)
    assert report.statuses[500] > 0
    assert report.failures and all(f.startswith("POST /v1/classify") for f in report.failures)


def test_405_names_the_allowed_methods() -> None:
    async def main() -> httpx.Response:
        transport = httpx.ASGITransport(app=fake_app())
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.request("TRACE", "/v1/generate")

    import asyncio

    r = asyncio.run(main())
    assert r.status_code == 405 and r.headers["Allow"] == "POST"
    assert r.json()["error"]["type"] == "method_not_allowed_error"


def test_a_vanishing_top_p_samples_the_best_token() -> None:
    """Found by the live fuzz: top_p=5e-324 is 0 in float32 and masked every token (NaN -> 500)."""
    import torch

    from models.decoding import BatchParams, RowSampler, SamplingParams, next_tokens

    logits = torch.tensor([[0.1, 2.0, -1.0, 0.5], [1.0, 0.0, 3.0, 0.2]])  # (B, V)
    params = [SamplingParams(temperature=2.0, top_p=5e-324, seed=1), SamplingParams(temperature=1.0, top_p=1e-9)]
    chosen = next_tokens(logits, BatchParams.build(params), [RowSampler(p) for p in params])
    assert chosen.tolist() == [1, 2]


def test_a_huge_top_k_filters_nothing() -> None:
    """Found by the live fuzz: top_k=99402005538995498385408 overflowed int64 in the engine (-> 500)."""
    import torch

    from models.decoding import BatchParams, SamplingParams, filter_top_k_top_p

    logits = torch.tensor([[0.1, 2.0, -1.0, 0.5]])  # (B, V)
    batch = BatchParams.build([SamplingParams(temperature=1.0, top_k=99402005538995498385408)])
    assert torch.equal(filter_top_k_top_p(logits, batch.top_k, batch.top_p), logits)
