"""LoRA adapters over real HTTP on a real Ray Serve (tiny:decoder, tiny:encoder): configured adapters,
one found in an adapter_dir, one loaded at run time, each a model in /v1/models; rows of two adapters and
the base in one concurrent load answer what each answers alone, and what the model with that adapter
computes here (generation, classification by an adapter's own head, embeddings); an unknown model is a
404 in OpenAI's shape, a malformed adapter a 400 that leaves the replica serving.
"""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from models.adapters import ResidentAdapters, read_adapter
from models.adapters.peft import random_llama_factors, save_adapter
from models.tiny import tiny_model
from service.testing.cluster import deploy, local_cluster, wait_for
from tests.service.adapter_files import encoder_adapter
from tests.service.http_checks import assert_error

pytestmark = pytest.mark.e2e
TINY = "tiny-decoder"
ENCODER = "tiny-encoder"
BODY = {"max_new_tokens": 12, "temperature": 0}
def make_adapters(root: Path) -> dict[str, Path]:
    """Rank-4 and rank-8 adapters of tiny:decoder (random, large enough to change its answers)."""
    model, _ = tiny_model("decoder")
    out = {}
    for i, name in enumerate(("a0", "a1", "d0", "r0")):
        rank = 4 if i % 2 == 0 else 8
        where = root / "dir" / name if name == "d0" else root / name
        out[name] = save_adapter(where, random_llama_factors(model, rank, seed=i, std=0.3), rank, 2 * rank)
    out["spam"] = encoder_adapter(root / "spam", 20, ("ham", "spam"))
    out["e0"] = encoder_adapter(root / "e0", 21, None)
    out["routed"] = encoder_adapter(root / "encoder-dir" / "routed", 22, ("ham", "spam"))
    bad = root / "bad"
    save_adapter(bad, random_llama_factors(model, 2, seed=9), 2, 4)
    (bad / "adapter_model.safetensors").write_bytes(b"\x00" * 64)
    out["bad"] = bad
    return out


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_adapters(tmp_path_factory.mktemp("adapters"))


@pytest.fixture(scope="module")
def url(adapters: dict[str, Path]) -> Any:
    args = {
        "device": "cpu", "readiness_timeout_s": 2, "runtime_adapters": True,
        "deployments": {"generator": {
            "model": {"name": TINY, "tasks": ["generate"], "source": "tiny:decoder",
                      "adapters": {"a0": str(adapters["a0"]), "a1": str(adapters["a1"])},
                      "adapter_dir": str(adapters["d0"].parent), "max_adapters": 3, "max_lora_rank": 8},
            "num_cpus": 0, "torch_threads": 1, "engine": {"max_running": 16, "max_queued": 64}},
            "encoder": {"model": {"name": ENCODER, "tasks": ["classify", "embed"], "source": "tiny:encoder",
                                  "adapters": {"spam": str(adapters["spam"]), "e0": str(adapters["e0"])},
                                  "adapter_dir": str(adapters["routed"].parent)},
                        "num_cpus": 0, "torch_threads": 1, "num_replicas": 2}},
    }
    with local_cluster(keep=True) as base:
        deploy(args, "adapters", "/")
        wait_for(base, "/readyz", 200, timeout_s=120)
        yield base


def reference(adapter: Path | None, prompt: str) -> str:
    """What tiny:decoder with `adapter` (None: none) answers greedily, computed here."""
    model, tok = tiny_model("decoder")
    model = copy.deepcopy(model)
    slots = None
    if adapter is not None:
        resident = ResidentAdapters([model], capacity=1, rank=8)
        slots = torch.tensor([resident.load(read_adapter(adapter))])
    ids = torch.tensor([tok.encode(prompt)])
    out: list[int] = []
    with torch.no_grad():
        for _ in range(BODY["max_new_tokens"]):
            nxt = int(model(ids, adapters=slots)[0, -1].argmax())
            if nxt in model.cfg.eos_token_ids:
                break
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], 1)
    return tok.decode(out)


def generate(c: httpx.Client, model: str | None, prompt: str) -> str:
    r = c.post("/v1/generate", json={"prompt": prompt, **BODY, **({"model": model} if model else {})})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == (model or TINY)
    return r.json()["text"]


def test_each_adapter_is_a_model_with_its_parent(url: str) -> None:
    with httpx.Client(base_url=url, timeout=60) as c:
        cards = {m["id"]: m for m in c.get("/v1/models").json()["data"]}
    assert {"a0", "a1", "d0"} <= set(cards) and "bad" not in cards
    assert all(cards[a]["parent"] == TINY and cards[a]["ready"] for a in ("a0", "a1", "d0"))
    assert cards[TINY]["adapters"]["slots"] == 3 and cards[TINY]["adapters"]["max_rank"] == 8
    assert "LoRA adapters: 3 slots" in cards[TINY]["plan"]["decode"]["detail"]


def test_two_adapters_and_the_base_in_one_load_answer_as_alone_and_as_computed_here(url: str,
                                                                                     adapters: dict[str, Path]) -> None:
    prompts = [f"story {i}: once" for i in range(3)]
    jobs = [(m, p) for p in prompts for m in ("a0", "d0", None)]
    with httpx.Client(base_url=url, timeout=60) as c:
        alone = [generate(c, m, p) for m, p in jobs]

    async def together() -> list[str]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as ac:
            async def one(m: str | None, p: str) -> str:
                r = await ac.post("/v1/generate", json={"prompt": p, **BODY, **({"model": m} if m else {})})
                assert r.status_code == 200, r.text
                return r.json()["text"]
            return list(await asyncio.gather(*(one(m, p) for m, p in jobs * 2)))

    assert asyncio.run(together()) == alone * 2
    for (m, p), text in zip(jobs[:3], alone[:3], strict=True):
        assert text == reference(adapters[m] if m else None, p)
    assert len({alone[0], alone[1], alone[2]}) == 3  # each adapter changes the answer


def test_the_openai_client_chooses_an_adapter_by_model_and_an_unknown_one_is_a_404(url: str) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    done = client.completions.create(model="a1", prompt="hello", max_tokens=8, temperature=0)
    assert done.model == "a1" and done.choices[0].text
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt="hello", max_tokens=8)
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    with httpx.Client(base_url=url, timeout=60) as c:
        for path, body in (("/v1/generate", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": [
                {"role": "user", "content": "hi"}]})):
            error = assert_error(c.post(path, json={**body, "model": "no-such-model"}), 404, "not_found_error", "model")
            assert error["code"] == "model_not_found"


def test_an_adapter_loaded_at_run_time_serves_until_unloaded(url: str, adapters: dict[str, Path]) -> None:
    with httpx.Client(base_url=url, timeout=60) as c:
        r = c.post("/v1/load_lora_adapter", json={"lora_name": "r0", "lora_path": str(adapters["r0"])})
        assert r.status_code == 200 and "added" in r.text
        assert generate(c, "r0", "story 0: once") == reference(adapters["r0"], "story 0: once")
        assert "r0" in {m["id"] for m in c.get("/v1/models").json()["data"]}
        assert_error(c.post("/v1/load_lora_adapter", json={"lora_name": "r0", "lora_path": str(adapters["r0"])}),
                     400, "invalid_adapter_error", "lora_name")
        assert c.post("/v1/unload_lora_adapter", json={"lora_name": "r0"}).status_code == 200
        assert_error(c.post("/v1/generate", json={"prompt": "hi", "model": "r0"}), 404, "not_found_error", "model")
        assert_error(c.post("/v1/unload_lora_adapter", json={"lora_name": "a0"}), 400, "invalid_adapter_error")


def test_a_malformed_adapter_is_a_400_naming_the_problem_and_the_replica_serves_on(url: str,
                                                                                   adapters: dict[str, Path]) -> None:
    with httpx.Client(base_url=url, timeout=60) as c:
        error = assert_error(c.post("/v1/load_lora_adapter", json={"lora_name": "broken",
                                                                   "lora_path": str(adapters["bad"])}),
                             400, "invalid_adapter_error")
        assert "safetensors" in error["message"]
        assert_error(c.post("/v1/load_lora_adapter", json={"lora_name": "nowhere", "lora_path": "/nonexistent"}),
                     400, "invalid_adapter_error", "lora_path")
        assert "broken" not in {m["id"] for m in c.get("/v1/models").json()["data"]}
        assert generate(c, None, "still here?")


def test_metrics_count_each_adapters_requests_and_tokens(url: str) -> None:
    with httpx.Client(base_url=url, timeout=60) as c:
        generate(c, "a1", "count me")
        text = c.get("/metrics").text
    lines = [line for line in text.splitlines() if 'adapter="a1"' in line]
    assert any(line.startswith("transformer_serve_generation_adapter_requests_total") for line in lines), lines
    assert any(line.startswith("transformer_serve_generation_adapter_generated_tokens_total") and
               float(line.rsplit(" ", 1)[1]) > 0 for line in lines), lines
    with httpx.Client(base_url=url, timeout=60) as c:
        assert c.post("/v1/classify", json={"inputs": ["one", "two"], "model": "spam"}).status_code == 200
        text = c.get("/metrics").text
    inputs = [line for line in text.splitlines()
              if line.startswith("transformer_serve_encoder_adapter_inputs_total") and 'adapter="spam"' in line]
    assert any('task="classify"' in line and float(line.rsplit(" ", 1)[1]) >= 2 for line in inputs), inputs
    assert any('task="embed"' in line for line in inputs), inputs  # exported from the start


def encoded_here(adapter: Path | None, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """tiny:encoder's (label scores by its own or the adapter's head, embeddings) for `texts`, computed here."""
    model, tok = tiny_model("encoder")
    model = copy.deepcopy(model)
    slots, head = None, None
    if adapter is not None:
        resident = ResidentAdapters([model], capacity=1, rank=4)
        slot = resident.load(read_adapter(adapter))
        slots, head = torch.tensor([slot] * len(texts)), resident.head(slot)
    scores, vectors = [], []
    with torch.no_grad():
        for i, text in enumerate(texts):
            ids = torch.tensor([tok.encode(text)])
            keep = torch.ones_like(ids, dtype=torch.bool)
            hidden = model(ids, keep, adapters=None if slots is None else slots[i:i + 1])
            weights = None if head is None else head.weights
            scores.append(model.scores(model.logits(hidden, keep, weights), weights)[0])
            vectors.append(model.pool(hidden, keep)[0])
    return torch.stack(scores), torch.stack(vectors)


def test_classification_and_embedding_adapters_answer_as_computed_here_beside_the_base(
        url: str, adapters: dict[str, Path]) -> None:
    texts = ["win a free prize now", "lunch at noon?", "meeting moved"]
    jobs = [(m, t) for t in texts for m in ("spam", "e0", None)]

    async def together() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as ac:
            async def one(m: str | None, t: str) -> dict[str, Any]:
                model = {"model": m} if m else {}
                c, e = await asyncio.gather(ac.post("/v1/classify", json={"inputs": t, **model}),
                                            ac.post("/v1/embeddings", json={"input": t, **model}))
                assert c.status_code == 200 and e.status_code == 200, (c.text, e.text)
                assert c.json()["model"] == (m or ENCODER) == e.json()["model"]
                return {"scores": c.json()["results"][0]["scores"], "label": c.json()["results"][0]["label"],
                        "vector": e.json()["data"][0]["embedding"]}
            return list(await asyncio.gather(*(one(m, t) for m, t in jobs * 2)))

    answers = asyncio.run(together())
    for name in ("spam", "e0", None):
        scores, vectors = encoded_here(adapters[name] if name else None, texts)
        labels = ("ham", "spam") if name == "spam" else ("negative", "neutral", "positive")
        for i, text in enumerate(texts):
            for answer in (answers[jobs.index((name, text))], answers[len(jobs) + jobs.index((name, text))]):
                assert list(answer["scores"]) == list(labels)
                got = torch.tensor([answer["scores"][label] for label in labels])
                torch.testing.assert_close(got, scores[i], atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(torch.tensor(answer["vector"]), vectors[i], atol=1e-5, rtol=1e-5)
    base_vectors = torch.tensor([a["vector"] for a in answers[2:len(jobs):3]])
    e0_vectors = torch.tensor([a["vector"] for a in answers[1:len(jobs):3]])
    assert not torch.allclose(base_vectors, e0_vectors, atol=1e-3)  # the adapter changes the embeddings
    with httpx.Client(base_url=url, timeout=60) as c:
        cards = {m["id"]: m for m in c.get("/v1/models").json()["data"]}
        assert cards["spam"]["parent"] == ENCODER and cards["e0"]["parent"] == ENCODER
        error = assert_error(c.post("/v1/classify", json={"inputs": "hi", "model": "a0"}), 422,
                             "invalid_request_error", "model")
        assert "does not serve classify" in error["message"]


def test_an_adapters_requests_go_to_the_replica_that_holds_it(url: str) -> None:
    """Serve's model multiplexing on the encoder's two replicas (Serve's own router): an adapter found in
    adapter_dir loads on the replica its first request reaches, which reports it; the requests after
    go there, so no other replica loads it (by chance: 1 in 2^9 over 10 requests)."""
    import glob
    import os
    import time

    import ray

    with httpx.Client(base_url=url, timeout=60) as c:
        assert c.post("/v1/classify", json={"inputs": "first", "model": "routed"}).status_code == 200
        time.sleep(2)  # the replica's report reaches Serve's routers (pushed every 0.1 s, then long-polled)
        for i in range(10):
            assert c.post("/v1/classify", json={"inputs": f"next {i}", "model": "routed"}).status_code == 200
    logs = ray._private.worker.global_worker.node.get_logs_dir_path()
    loads = [line for path in glob.glob(os.path.join(logs, "worker-*.err"))
             for line in Path(path).read_text(encoding="utf-8", errors="replace").splitlines()
             if "adapter routed loaded from" in line]
    assert len(loads) == 1, loads
