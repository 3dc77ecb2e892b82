"""End to end over real HTTP: a local Ray + Serve running the app with tiny models.

One module fixture starts Ray, deploys the app on a free 127.0.0.1 port and watches /readyz go
from 503 to 200 (the `gated` deployment waits for a file before loading). Batching knobs are small
so concurrent requests really share batches. The `gated` deployment also has a tiny queue and a
long max_wait, for the 503 and 504 paths.
"""

from __future__ import annotations

import asyncio
import base64
import json
import math
import random
import threading
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from models.beam_search import BeamParams, translate_ids
from models.tiny import tiny_model
from service.testing.cluster import local_cluster, wait_for
from tests.service.front_checks import client_url
from tests.service.http_checks import assert_error

pytestmark = pytest.mark.e2e
MAX_INPUTS, MAX_BODY, LIMIT = 8, 16384, 64
SMALL_BATCHES = {"max_batch_size": 8, "max_wait_ms": 25, "max_batch_tokens": 256, "max_queued": 256,
                 "overhead_tokens": 16}


def _encoder(name: str) -> dict[str, Any]:
    return {"name": name, "tasks": ["classify", "embed"], "source": "tiny:encoder", "max_input_tokens": LIMIT,
            "defaults": {"dimensions": [8, 16]}}  # as a Matryoshka model's spec lists the sizes it may be cut to


def app_args(gate: Path) -> dict[str, Any]:
    return {
        "device": "cpu", "max_inputs": MAX_INPUTS, "max_body_bytes": MAX_BODY, "retry_after_s": 2,
        "readiness_timeout_s": 1,
        "deployments": {
            "encoder": {"model": _encoder("tiny-encoder"), "num_cpus": 0, "batching": SMALL_BATCHES},
            "translator": {
                "model": {"name": "tiny-en-es", "tasks": ["translate"], "source": "tiny:seq2seq",
                          "languages": ["en", "es"], "max_input_tokens": LIMIT,
                          "defaults": {"beam_size": 2, "max_new_tokens": 10}, "dense_kernel": "onednn"},
                "num_cpus": 0, "batching": SMALL_BATCHES},
            "gated": {"model": {**_encoder("tiny-encoder-gated"), "quantize": "int8"}, "num_cpus": 0,
                      "startup_gate": str(gate),
                      "batching": {"max_batch_size": 64, "max_wait_ms": 1000, "max_queued": MAX_INPUTS}},
        },
    }


@dataclass
class Server:
    url: str  # the nginx front when installed (as `python -m service` serves), else Serve's proxy
    readyz_before: httpx.Response
    call_before: httpx.Response
    serve_url: str  # Serve's proxy: it routes by route prefix between applications, the front serves one

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60)

    def async_client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, timeout=60,
                                 limits=httpx.Limits(max_connections=64, max_keepalive_connections=64))


@pytest.fixture(scope="module")  # module: other e2e modules start their own Ray
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    from ray import serve

    from service.app import build_app_from_settings
    from service.settings import Settings

    gate = tmp_path_factory.mktemp("gate") / "open"
    settings = Settings.build(app_args(gate), env={})
    with local_cluster(keep=True) as serve_url, ExitStack() as stack:  # through the front, as users reach it
        url = client_url(stack, serve_url, settings.max_body_bytes, math.ceil(settings.retry_after_s))
        app = build_app_from_settings(settings)
        deploying = threading.Thread(target=serve.run, args=(app,), kwargs={"name": "e2e", "route_prefix": "/"},
                                     daemon=True)
        deploying.start()
        with httpx.Client(base_url=url, timeout=30) as client:
            wait_for(url, "/healthz", 200, timeout_s=180)
            readyz_before = client.get("/readyz")
            call_before = client.post("/v1/classify", json={"inputs": "hi", "model": "tiny-encoder-gated"})
            gate.touch()
            deploying.join(timeout=180)
            wait_for(url, "/readyz", 200, timeout_s=60)
        yield Server(url, readyz_before, call_before, serve_url)


# -- life cycle, discovery ----------------------------------------------------------------------


def test_the_replicas_own_log_lines_reach_the_worker_logs_at_once(server: Server) -> None:
    """Our log lines in a model replica go to the process's stderr (Ray's worker-*.err, forwarded to the
    driver), not into the stream Serve puts in place of sys.stderr in throughput mode: that one feeds a
    logger whose file handler buffers 1,000 records, so they reached no file and died with the replica."""
    import glob
    import os

    import ray

    logs = ray._private.worker.global_worker.node.get_logs_dir_path()
    loaded = [line for path in glob.glob(os.path.join(logs, "worker-*.err"))
              for line in Path(path).read_text(encoding="utf-8", errors="replace").splitlines()
              if "service.deployments" in line and "loaded on cpu" in line]
    assert len(loaded) >= 3, loaded  # the encoder, translator and gated replicas each log one
    assert all(json.loads(line)["logger"] == "service.deployments" and "_ray_" not in line for line in loaded)

def test_readyz_is_503_before_the_models_load_and_200_after(server: Server) -> None:
    before = server.readyz_before
    assert before.status_code == 503 and before.headers["Retry-After"] == "2"
    assert before.json()["status"] == "not_ready" and before.json()["deployments"]["gated"] != "ready"
    assert_error(server.call_before, 503, "model_not_ready")
    assert server.call_before.headers["Retry-After"] == "2"
    with server.client() as c:
        r = c.get("/readyz")
        assert r.status_code == 200
        assert r.json() == {"status": "ready", "deployments": {"encoder": "ready", "translator": "ready",
                                                               "gated": "ready"}}
        assert c.get("/healthz").json() == {"status": "ok"}


def test_models_report_the_dense_kernels_their_config_chose(server: Server) -> None:
    from models.projections.dense import onednn_available

    with server.client() as c:
        cards = {m["deployment"]: m for m in c.get("/v1/models").json()["data"]}
    if onednn_available():  # the translator's config says onednn: every float shape packed
        assert cards["translator"]["kernels"] and set(cards["translator"]["kernels"].values()) == {"onednn"}
    # auto: a block's projections on our panels where they build, every other shape whatever this CPU
    # measured, with the measured ratio
    auto = cards["encoder"]["kernels"] or {}
    assert all(v == "panels (blocks)" or v.split()[0] in ("onednn", "aten", "panels") and v.endswith("x")
               for v in auto.values())
    from models.kernels import native

    if native.available():
        assert "panels (blocks)" in auto.values()


def test_a_quantized_deployment_serves_its_int8_model(server: Server) -> None:
    from models.catalog import ModelSpec, load_model
    from models.inputs import PaddedBatch

    texts = ["héllo ¿qué?", "a longer text for the quantized encoder", "x"]
    with server.client() as c:
        cards = {m["deployment"]: m for m in c.get("/v1/models").json()["data"]}
        assert cards["gated"]["quantize"] == "int8" and cards["encoder"]["quantize"] is None
        assert cards["gated"]["block_activation_bits"] is None and cards["encoder"]["compiled"] is False
        int8 = [d["embedding"] for d in c.post("/v1/embeddings", json={
            "input": texts, "model": "tiny-encoder-gated"}).json()["data"]]
        fp32 = [d["embedding"] for d in c.post("/v1/embeddings", json={"input": texts}).json()["data"]]
        alone = [c.post("/v1/embeddings", json={"input": t, "model": "tiny-encoder-gated"}).json()["data"][0][
            "embedding"] for t in texts]
    spec = ModelSpec(**{**_encoder("tiny-encoder-gated"), "tasks": ("classify", "embed"), "quantize": "int8"})
    loaded = load_model(spec, Path("/nonexistent"))
    with torch.inference_mode():
        for text, got, got_alone, got_fp32 in zip(texts, int8, alone, fp32, strict=True):
            batch = PaddedBatch.from_token_lists([loaded.tokenizer.encode(text)])
            want = loaded.model.embed(batch.ids, batch.keep)[0]
            assert torch.allclose(torch.tensor(got), want, atol=1e-5)  # the replica runs the int8 model
            assert torch.allclose(torch.tensor(got_alone), torch.tensor(got), atol=1e-5)  # batched = alone
            assert not torch.allclose(torch.tensor(got_fp32), want, atol=1e-5)  # and it is not the fp32 one


def test_openapi_and_docs(server: Server) -> None:
    with server.client() as c:
        spec = c.get("/openapi.json").json()
        assert {"/v1/classify", "/v1/embeddings", "/v1/translate", "/v1/models", "/healthz", "/readyz"} <= set(
            spec["paths"])
        assert "ClassifyRequest" in spec["components"]["schemas"]
        docs = c.get("/docs")
        assert docs.status_code == 200 and "swagger" in docs.text.lower()


def test_models_lists_each_loaded_model_and_the_tasks_it_serves(server: Server) -> None:
    with server.client() as c:
        body = c.get("/v1/models").json()
    assert body["object"] == "list"
    assert body["tasks"] == {"classify": ["tiny-encoder", "tiny-encoder-gated"],
                             "embed": ["tiny-encoder", "tiny-encoder-gated"], "translate": ["tiny-en-es"]}
    cards = {m["id"]: m for m in body["data"]}
    assert set(cards) == {"tiny-encoder", "tiny-en-es", "tiny-encoder-gated"}
    assert all(m["ready"] and m["object"] == "model" and m["device"] == "cpu" and m["dtype"] == "float32"
               for m in cards.values())
    assert cards["tiny-encoder"]["labels"] == ["negative", "neutral", "positive"]
    assert cards["tiny-en-es"]["languages"] == ["en", "es"] and cards["tiny-en-es"]["max_input_tokens"] == LIMIT


# -- the endpoints ----------------------------------------------------------------------------------

def test_classify_gives_one_result_per_input_in_order(server: Server) -> None:
    with server.client() as c:
        one = c.post("/v1/classify", json={"inputs": "good movie"}).json()
        many = c.post("/v1/classify", json={"inputs": ["good movie", "bad", "so-so film"]}).json()
    assert one["model"] == "tiny-encoder" and len(one["results"]) == 1 and len(many["results"]) == 3
    for r in many["results"]:
        assert set(r["scores"]) == {"negative", "neutral", "positive"}
        assert sum(r["scores"].values()) == pytest.approx(1.0, abs=1e-5)
        assert r["score"] == max(r["scores"].values()) and r["scores"][r["label"]] == r["score"]
    assert one["results"][0]["scores"] == pytest.approx(many["results"][0]["scores"], abs=1e-5)


def test_embeddings_have_openai_shape(server: Server) -> None:
    texts = ["hello", "a longer sentence"]
    with server.client() as c:
        body = c.post("/v1/embeddings", json={"input": texts}).json()
        b64 = c.post("/v1/embeddings", json={"input": texts, "encoding_format": "base64"}).json()
    assert body["object"] == "list" and body["model"] == "tiny-encoder"
    assert [d["index"] for d in body["data"]] == [0, 1] and all(d["object"] == "embedding" for d in body["data"])
    tokens = sum(len(t.encode()) for t in texts)  # the tiny tokenizer: one token per byte
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    for d, e in zip(body["data"], b64["data"], strict=True):
        vec = np.asarray(d["embedding"])
        assert vec.shape == (32,) and np.linalg.norm(vec) == pytest.approx(1.0, abs=1e-5)
        decoded = np.frombuffer(base64.b64decode(e["embedding"]), dtype="<f4")
        np.testing.assert_allclose(decoded, vec, atol=1e-6)


def test_embeddings_are_cut_only_to_the_sizes_the_model_lists(server: Server) -> None:
    with server.client() as c:
        full = c.post("/v1/embeddings", json={"input": "hello", "user": "user-42"}).json()["data"][0]["embedding"]
        cut = c.post("/v1/embeddings", json={"input": "hello", "dimensions": 8}).json()["data"][0]["embedding"]
        refused = c.post("/v1/embeddings", json={"input": "hello", "dimensions": 12})
    head = np.asarray(full[:8])
    np.testing.assert_allclose(cut, head / np.linalg.norm(head), atol=1e-6)
    assert refused.status_code == 422 and refused.json()["error"]["param"] == "dimensions"
    assert "[8, 16]" in refused.json()["error"]["message"]


def test_translate_honours_per_request_beam_size_and_length(server: Server) -> None:
    model, tok = tiny_model("seq2seq")
    text = "the cat sat on the mat"
    cases = [(1, 4), (3, 7), (None, None)]
    seen: list[str] = []
    with server.client() as c:
        for beam, max_new in cases:
            body = {"inputs": [text], "source_lang": "en", "target_lang": "es"}
            body |= {k: v for k, v in (("beam_size", beam), ("max_new_tokens", max_new)) if v is not None}
            r = c.post("/v1/translate", json=body)
            assert r.status_code == 200, r.text
            params = BeamParams(beam or 2, max_new or 10)  # None: the model's defaults
            expected = tok.decode(translate_ids(model, [tok.encode(text)], params, banned_ids=[0])[0])
            assert r.json() == {"model": "tiny-en-es", "translations": [expected], "sentences": [1]}
            seen.append(expected)
    assert len(set(seen)) == len(cases)  # each case its own translation: a mixed-up answer fails


def _sse(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[len("data: "):]) for line in text.splitlines() if line.startswith("data: ")]


@pytest.mark.parametrize("beam", [1, 3])
def test_a_streamed_translation_is_the_whole_one_in_pieces(server: Server, beam: int) -> None:
    """`"stream": true`: each text's pieces, in order, join to its translation (documents keep their
    layout), and the last event has what the JSON answer has; greedy pieces come token by token."""
    texts = ["The cat sat. The dog ran!\n\nA bird sang.", "   ", "one more text"]
    body = {"inputs": texts, "source_lang": "en", "target_lang": "es", "beam_size": beam, "max_new_tokens": 6}
    with server.client() as c:
        whole = c.post("/v1/translate", json=body)
        assert whole.status_code == 200, whole.text
        r = c.post("/v1/translate", json=body | {"stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
    events = _sse(r.text)
    assert events[-1] == whole.json()
    pieces = events[:-1]
    assert ["".join(e["text"] for e in pieces if e["index"] == i) for i in range(len(texts))] == \
        whole.json()["translations"]
    assert whole.json()["translations"][1] == "   " and whole.json()["sentences"] == [3, 0, 1]
    assert len({e["index"] for e in pieces}) == 3 and all(set(e) == {"index", "text"} for e in pieces)


def test_a_streamed_translation_names_a_bad_sentence_before_it_starts(server: Server) -> None:
    body = {"inputs": ["fine", "x " * 400], "source_lang": "en", "target_lang": "es", "stream": True,
            "split_sentences": False}
    with server.client() as c:
        r = c.post("/v1/translate", json=body)
    assert r.status_code == 422 and r.json()["error"]["param"] == "inputs[1]", r.text


# -- batching invariance and isolation ---------------------------------------------------------

def _texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    words = ["the", "a", "cat", "dog", "sat", "ran", "on", "under", "mat", "tree", "quickly", "slowly", "red",
             "blue", "big", "small"]
    return [" ".join(rng.choice(words) for _ in range(rng.choice([1, 2, 3, 6, 10])))[:60] for _ in range(n)]


def test_results_are_the_same_alone_and_among_concurrent_requests(server: Server) -> None:
    texts = _texts(12, seed=1)
    beams = [1, 2, 3, 4]
    with server.client() as c:  # alone: one request at a time, so each forms its own batch
        scores = {t: c.post("/v1/classify", json={"inputs": t}).json()["results"][0]["scores"] for t in texts}
        vectors = {t: c.post("/v1/embeddings", json={"input": t}).json()["data"][0]["embedding"] for t in texts}
        solo_tr = {(t, b): c.post("/v1/translate", json={"inputs": t, "source_lang": "en", "target_lang": "es",
                                                          "beam_size": b, "max_new_tokens": 4 + b}).json()
                   ["translations"][0] for t in texts[:6] for b in beams}
    # the tiny translator's outputs depend on the text and the beam size (models/tiny.py), so a request
    # answered with another's translation, or with another beam size, fails the comparisons below
    assert len(set(solo_tr.values())) >= 8  # of 24 (6 texts x 4 beam sizes; 12 as the tiny model is now)

    async def client_session(i: int, ac: httpx.AsyncClient) -> None:
        rng = random.Random(100 + i)
        for _ in range(3):
            chosen = rng.sample(texts, rng.randint(1, 4))
            kind = rng.choice(["classify", "embed", "translate"])
            if kind == "classify":
                r = await ac.post("/v1/classify", json={"inputs": chosen})
                assert r.status_code == 200, r.text
                for t, res in zip(chosen, r.json()["results"], strict=True):
                    assert res["scores"] == pytest.approx(scores[t], abs=1e-5)
            elif kind == "embed":
                r = await ac.post("/v1/embeddings", json={"input": chosen})
                assert r.status_code == 200, r.text
                for t, d in zip(chosen, r.json()["data"], strict=True):
                    np.testing.assert_allclose(d["embedding"], vectors[t], atol=1e-5)
            else:
                b = rng.choice(beams)
                chosen = rng.sample(texts[:6], rng.randint(1, 3))
                r = await ac.post("/v1/translate", json={"inputs": chosen, "source_lang": "en", "target_lang": "es",
                                                         "beam_size": b, "max_new_tokens": 4 + b})
                assert r.status_code == 200, r.text
                assert r.json()["translations"] == [solo_tr[(t, b)] for t in chosen]

    async def main() -> None:
        async with server.async_client() as ac:
            await asyncio.gather(*(client_session(i, ac) for i in range(24)))

    asyncio.run(main())
    with server.client() as c:
        stats = {m["deployment"]: m["stats"] for m in c.get("/v1/models").json()["data"]}
    assert stats["encoder"]["largest_batch"] > 1 and stats["translator"]["largest_batch"] > 1


def test_a_bad_input_fails_only_its_own_request(server: Server) -> None:
    texts = _texts(16, seed=2)
    with server.client() as c:
        solo = {t: c.post("/v1/classify", json={"inputs": t}).json()["results"][0]["scores"] for t in texts}
    # a lone surrogate is valid JSON but not Unicode text: the edge refuses it, naming the input
    bad = b'{"inputs": ["fine text", "broken \\ud800 text"]}'

    async def main() -> list[httpx.Response]:
        async with server.async_client() as ac:
            good = [ac.post("/v1/classify", json={"inputs": t}) for t in texts]
            broken = ac.post("/v1/classify", content=bad, headers={"content-type": "application/json"})
            return await asyncio.gather(broken, *good)

    broken, *good = asyncio.run(main())
    error = assert_error(broken, 422, "invalid_request_error", "inputs[1]")
    assert "lone surrogate" in error["message"]
    for t, r in zip(texts, good, strict=True):
        assert r.status_code == 200
        assert r.json()["results"][0]["scores"] == pytest.approx(solo[t], abs=1e-5)


# -- bad input, overload, deadlines ------------------------------------------------------------

TR = {"source_lang": "en", "target_lang": "es"}
BAD_INPUT = [
    ("/v1/classify", {"inputs": 3}, "inputs"),
    ("/v1/classify", {"inputs": ["ok", 1]}, "inputs[1]"),
    ("/v1/classify", {"inputs": None}, "inputs"),
    ("/v1/classify", {}, "inputs"),
    ("/v1/classify", {"inputs": []}, "inputs"),
    ("/v1/classify", {"inputs": ["ok", ""]}, "inputs[1]"),
    ("/v1/classify", {"inputs": ["x"] * (MAX_INPUTS + 1)}, "inputs"),
    ("/v1/classify", {"inputs": ["ok", "y" * (LIMIT + 1)]}, "inputs[1]"),
    ("/v1/classify", {"inputs": "ok", "truncate": "yes"}, "truncate"),
    ("/v1/classify", {"inputs": "ok", "beam": 2}, "beam"),
    ("/v1/classify", ["ok"], None),
    ("/v1/embeddings", {"input": "ok", "encoding_format": "int8"}, "encoding_format"),
    ("/v1/embeddings", {"inputs": "ok"}, "input"),
    ("/v1/translate", {"inputs": "ok", "source_lang": "en", "target_lang": "fr"}, "target_lang"),
    ("/v1/translate", {"inputs": "ok", "source_lang": "fr", "target_lang": "es"}, "source_lang"),
    ("/v1/translate", {"inputs": "ok", "target_lang": "es"}, "source_lang"),
    ("/v1/translate", {"inputs": "ok", **TR, "beam_size": 0}, "beam_size"),
    ("/v1/translate", {"inputs": "ok", **TR, "beam_size": 9}, "beam_size"),
    ("/v1/translate", {"inputs": "ok", **TR, "beam_size": "2"}, "beam_size"),
    ("/v1/translate", {"inputs": "ok", **TR, "beam_size": 2.5}, "beam_size"),
    ("/v1/translate", {"inputs": "ok", **TR, "max_new_tokens": 0}, "max_new_tokens"),
    ("/v1/translate", {"inputs": "ok", **TR, "max_new_tokens": 1000}, "max_new_tokens"),  # model: <= 255
    ("/v1/translate", {"inputs": ["z" * (LIMIT + 5)], **TR}, "inputs[0]"),
]


@pytest.mark.parametrize(("path", "body", "param"), BAD_INPUT)
def test_bad_input_is_a_422_naming_the_field(server: Server, path: str, body: Any, param: str | None) -> None:
    with server.client() as c:
        assert_error(c.post(path, json=body), 422, "invalid_request_error", param)


@pytest.mark.parametrize("raw", [b'{"inputs": ["ok", ', b"not json", b""])
def test_malformed_json_is_a_422(server: Server, raw: bytes) -> None:
    with server.client() as c:
        assert_error(c.post("/v1/classify", content=raw, headers={"content-type": "application/json"}),
               422, "invalid_request_error")


def test_truncate_accepts_a_long_text(server: Server) -> None:
    with server.client() as c:
        cut = c.post("/v1/classify", json={"inputs": "y" * (LIMIT + 30), "truncate": True})
        exact = c.post("/v1/classify", json={"inputs": "y" * LIMIT})
        tr = c.post("/v1/translate", json={"inputs": "z" * (LIMIT + 5), **TR, "truncate": True})
    assert cut.status_code == 200 and cut.json()["results"][0]["scores"] == pytest.approx(
        exact.json()["results"][0]["scores"], abs=1e-5)
    assert tr.status_code == 200 and len(tr.json()["translations"]) == 1


def test_bad_timeout_header_wrong_method_and_unknown_path(server: Server) -> None:
    with server.client() as c:
        assert_error(c.post("/v1/classify", json={"inputs": "ok"}, headers={"X-Request-Timeout": "soon"}),
               422, "invalid_request_error", "X-Request-Timeout")
        assert_error(c.get("/v1/classify"), 405, "method_not_allowed_error")
        assert_error(c.get("/v1/nothing"), 404, "not_found_error")


def test_an_oversized_body_is_a_413(server: Server) -> None:
    big = json.dumps({"inputs": ["x" * 1000] * 20}).encode()
    assert len(big) > MAX_BODY

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit counts what actually arrives
        for i in range(0, len(big), 1024):
            yield big[i: i + 1024]

    with server.client() as c:
        assert_error(c.post("/v1/classify", content=big, headers={"content-type": "application/json"}),
               413, "request_too_large")
        assert_error(c.post("/v1/classify", content=chunks(), headers={"content-type": "application/json"}),
               413, "request_too_large")


def test_overload_answers_503_with_retry_after_at_once(server: Server) -> None:
    async def main() -> list[httpx.Response]:
        async with server.async_client() as ac:
            return await asyncio.gather(*(
                ac.post("/v1/classify", json={"inputs": f"burst {i}", "model": "tiny-encoder-gated"})
                for i in range(30)))

    responses = asyncio.run(main())
    statuses = [r.status_code for r in responses]
    assert set(statuses) == {200, 503}, statuses
    assert statuses.count(200) <= MAX_INPUTS
    for r in responses:
        if r.status_code == 503:
            assert_error(r, 503, "overloaded_error")
            assert r.headers["Retry-After"] == "2"
            assert r.elapsed.total_seconds() < 0.9  # refused at once, not after the 1 s batching wait
    with server.client() as c:  # the queue drains and serves again
        assert c.post("/v1/classify", json={"inputs": "after", "model": "tiny-encoder-gated"}).status_code == 200


def test_a_deadline_answers_504_and_never_wedges_the_batcher(server: Server) -> None:
    with server.client() as c:
        r = c.post("/v1/classify", json={"inputs": "late", "model": "tiny-encoder-gated"},
                   headers={"X-Request-Timeout": "0.2"})
        assert_error(r, 504, "timeout_error")
        assert r.elapsed.total_seconds() < 0.9
        ok = c.post("/v1/classify", json={"inputs": "after", "model": "tiny-encoder-gated"})
        assert ok.status_code == 200
        stats = {m["deployment"]: m["stats"] for m in c.get("/v1/models").json()["data"]}["gated"]
    assert stats["cancelled"] + stats["expired"] >= 1  # the timed-out item was dropped, not computed


def test_a_client_that_disconnects_never_wedges_the_batcher(server: Server) -> None:
    def gated_stats(c: httpx.Client) -> dict[str, Any]:
        return {m["deployment"]: m["stats"] for m in c.get("/v1/models").json()["data"]}["gated"]

    with server.client() as c:
        before = gated_stats(c)
        with pytest.raises(httpx.ReadTimeout):  # the client gives up while its item waits to be batched
            c.post("/v1/classify", json={"inputs": "gone", "model": "tiny-encoder-gated"}, timeout=0.5)
        ok = c.post("/v1/classify", json={"inputs": "after", "model": "tiny-encoder-gated"})
        assert ok.status_code == 200
        after = gated_stats(c)
    assert after["cancelled"] == before["cancelled"] + 1  # dropped before compute, not computed
    assert after["items"] == before["items"] + 1


@pytest.mark.slow
def test_the_shipped_translator_translates_a_document_sentence_by_sentence(server: Server) -> None:
    """The default en->es translator as a second app: a document of three paragraphs comes back with
    its layout, each of its 5 sentences translated as it is alone (split_sentences false, one input each).
    A second application on its own route prefix is reached through Serve's proxy (the nginx front of
    `python -m service` follows its one application)."""
    from ray import serve

    from service.common.documents import split
    from service.testing.cluster import deploy

    document = ("The weather is nice today. We are going to the beach!\n\n"
                "  My brother likes to read books.\nHe reads every night.\n\n"
                "Where is the train station? ")
    deploy({"device": "cpu", "deployments": {"translator": {"num_cpus": 0}}}, "shipped-translator", "/shipped")
    try:
        wait_for(f"{server.serve_url}/shipped", "/readyz", 200, timeout_s=300)
        with httpx.Client(base_url=f"{server.serve_url}/shipped", timeout=120) as c:
            body = {"source_lang": "en", "target_lang": "es", "beam_size": 4}
            r = c.post("/v1/translate", json={"inputs": document, **body})
            assert r.status_code == 200, r.text
            sentences = split(document, "en").sentences
            assert r.json()["sentences"] == [len(sentences)] == [5]
            alone = c.post("/v1/translate", json={"inputs": list(sentences), **body, "split_sentences": False})
            assert alone.status_code == 200, alone.text
            assert r.json()["translations"] == [split(document, "en").join(alone.json()["translations"])]
            translation = r.json()["translations"][0]
            assert translation.count("\n\n") == 2 and translation.startswith(alone.json()["translations"][0])
            assert "  " + alone.json()["translations"][2] in translation and translation.endswith("? ")
            # streamed, greedy: the same text as the JSON answer, piece by piece as its tokens are chosen
            greedy = {"inputs": document, **body, "beam_size": 1}
            whole = c.post("/v1/translate", json=greedy)
            streamed = _sse(c.post("/v1/translate", json=greedy | {"stream": True}).text)
            assert streamed[-1] == whole.json()
            assert "".join(e["text"] for e in streamed[:-1]) == whole.json()["translations"][0]
            assert len(streamed) - 1 > 3 * len(sentences)  # pieces of sentences, not whole ones
    finally:
        serve.delete("shipped-translator")
