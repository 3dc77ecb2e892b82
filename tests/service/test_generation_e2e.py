"""Generation end to end over real HTTP: a local Ray + Serve with tiny decoders, and the default
SmolLM2 for one slow test.

One module fixture starts Ray and Serve's HTTP proxy on a free 127.0.0.1 port; the tiny app is
deployed on it at "/", SmolLM2 (slow test only) as a second app under "/smollm2". Deployments:
- `generator`: `tiny:decoder` (byte tokenizer, chat template), 16 rows, for results and formats;
- `long`: the same architecture saved with 4096 positions and no end-of-sequence token, so a
  request runs for thousands of steps; one row and one queue slot, for overload, cancellation and
  deadlines. It has no chat template.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from models.config import DecoderConfig
from models.decoder import DecoderLM
from models.decoding import SamplingParams
from models.generate import generate
from models.tiny import VOCAB, byte_tokenizer, tiny_model
from service.testing.cluster import deploy, local_cluster, wait_for
from tests.service.http_checks import assert_error

pytestmark = pytest.mark.e2e
TINY, LONG = "tiny-decoder", "tiny-decoder-long"
MAX_POSITIONS = 512  # tiny:decoder's; its engine: max_prompt_tokens 511, max_total_tokens 512
RETRY_AFTER = "2"
TEXT = "héllo ¿qué? 日本"


def long_decoder(path: Path, d_model: int = 32, d_ff: int = 64, n_layers: int = 2) -> Path:
    """tiny:decoder's architecture with 4096 positions and no eos: only max_new_tokens stops it (wider
    and deeper when asked: slower steps)."""
    cfg = DecoderConfig(vocab_size=VOCAB, d_model=d_model, n_heads=4, n_kv_heads=2, d_ff=d_ff, n_layers=n_layers,
                        max_positions=4096, position="rotary", norm="rmsnorm", activation="swiglu",
                        attn_bias=False, mlp_bias=False, eos_token_ids=())
    from models.checkpoints.format import save_checkpoint

    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = DecoderLM(cfg).eval()
    save_checkpoint(model, path)
    byte_tokenizer().save(str(path / "tokenizer.json"))
    return path


def app_args(long_dir: Path) -> dict[str, Any]:
    return {
        "device": "cpu", "retry_after_s": int(RETRY_AFTER), "readiness_timeout_s": 2,
        "deployments": {
            "generator": {
                "model": {"name": TINY, "tasks": ["generate"], "source": "tiny:decoder",
                          "defaults": {"max_new_tokens": 24}},
                "num_cpus": 0, "torch_threads": 1,
                "engine": {"max_running": 16, "max_queued": 32, "max_total_tokens": None, "max_new_tokens": 256}},
            "long": {
                "model": {"name": LONG, "tasks": ["generate"], "source": f"dir:{long_dir}"},
                "num_cpus": 0, "torch_threads": 1,
                "engine": {"max_running": 1, "max_queued": 1, "max_total_tokens": 4096, "max_new_tokens": 4000}},
        },
    }


def tools_decoder(path: Path) -> Path:
    """tiny:decoder's weights and chat template with 2048 positions: room for the tools' system prompt."""
    from models.checkpoints.format import save_checkpoint
    from models.tiny import CHAT_TEMPLATE

    model, tok = tiny_model("decoder")
    wide = DecoderLM(model.cfg.replace(max_positions=2048)).eval()
    wide.load_state_dict(model.state_dict())
    save_checkpoint(wide, path)
    tok.tok.save(str(path / "tokenizer.json"))
    (path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return path


@dataclass
class Cluster:
    url: str

    def client(self, prefix: str = "") -> httpx.Client:
        return httpx.Client(base_url=self.url + prefix, timeout=60)

    def async_client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, timeout=60,
                                 limits=httpx.Limits(max_connections=64, max_keepalive_connections=64))

    def openai(self, prefix: str = "") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}{prefix}/v1", api_key="unused", max_retries=0, timeout=60)


@contextlib.contextmanager
def second_app(cluster: Cluster, args: dict[str, Any], name: str, timeout_s: float) -> Iterator[None]:
    """Another app of the service on the same Serve, at /<name>, ready inside the block, deleted after."""
    from ray import serve

    deploy(args, name, f"/{name}")
    try:
        wait_for(f"{cluster.url}/{name}", "/readyz", 200, timeout_s=timeout_s)
        yield
    finally:
        serve.delete(name)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with local_cluster(keep=True) as url:
        yield Cluster(url)


@pytest.fixture(scope="module")
def server(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Cluster:
    deploy(app_args(long_decoder(tmp_path_factory.mktemp("long-decoder"))), "generation", "/")
    wait_for(cluster.url, "/readyz", 200, timeout_s=120)
    return cluster


# -- helpers --------------------------------------------------------------------------------------

def sse_payloads(lines: Iterator[str]) -> list[Any]:
    """The `data:` payloads of a server-sent event stream, decoded ("[DONE]" kept as is)."""
    out: list[Any] = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
        else:
            assert line == "", f"unexpected SSE line {line!r}"
    return out


def generate_both(c: httpx.Client, body: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """/v1/generate without and with stream; the JSON answer and the stream's events."""
    whole = c.post("/v1/generate", json=body)
    assert whole.status_code == 200, whole.text
    with c.stream("POST", "/v1/generate", json={**body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_payloads(r.iter_lines())
    return whole.json(), events


def stats(c: httpx.Client, deployment: str) -> dict[str, Any]:
    cards = {m["deployment"]: m for m in c.get("/v1/models").json()["data"]}
    return cards[deployment]["stats"]


def wait_idle(c: httpx.Client, deployment: str, timeout_s: float = 5.0) -> tuple[dict[str, Any], float]:
    """Poll the engine's stats until nothing runs or waits; the stats and the seconds it took."""
    started = time.monotonic()
    while True:
        s = stats(c, deployment)
        if s["running"] == 0 and s["waiting"] == 0:
            return s, time.monotonic() - started
        assert time.monotonic() - started < timeout_s, f"{deployment} still busy after {timeout_s} s: {s}"
        time.sleep(0.02)




# -- /v1/generate ----------------------------------------------------------------------------------

@pytest.mark.parametrize("params", [
    {"max_new_tokens": 40},
    {"max_new_tokens": 40, "temperature": 0.9, "top_k": 50, "top_p": 0.9, "repetition_penalty": 1.2, "seed": 11},
], ids=["greedy", "seeded-sampled"])
def test_streamed_text_adds_up_to_the_whole_answer(server: Cluster, params: dict[str, Any]) -> None:
    with server.client() as c:
        whole, events = generate_both(c, {"prompt": TEXT, **params})
    assert whole["model"] == TINY and whole["finish_reason"] in ("stop", "length")
    *pieces, last = events
    assert pieces and all(set(p) == {"text"} and p["text"] for p in pieces)
    assert "".join(p["text"] for p in pieces) == whole["text"]
    assert last == {"model": TINY, "text": "", "finish_reason": whole["finish_reason"], "usage": whole["usage"]}
    u = whole["usage"]
    assert u["prompt_tokens"] == len(TEXT.encode()) and u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    assert whole["finish_reason"] == "stop" or u["completion_tokens"] == 40
    # random bytes from the byte-level model: multi-byte characters are split over tokens
    assert any(ord(ch) > 127 for ch in whole["text"])


def test_greedy_http_answer_is_offline_generate(server: Cluster) -> None:
    model, tok = tiny_model("decoder")
    prompt = "the quick brown fox"
    ref = generate(model, [tok.encode(prompt)], SamplingParams(max_new_tokens=30))[0]
    with server.client() as c:
        body = c.post("/v1/generate", json={"prompt": prompt, "max_new_tokens": 30}).json()
    assert body["text"] == tok.decode(ref.tokens)
    assert body["finish_reason"] == ref.finish_reason
    assert body["usage"]["completion_tokens"] == len(ref.tokens) + (ref.finish_reason == "stop")


def test_stop_strings_and_model_defaults(server: Cluster) -> None:
    with server.client() as c:
        free = c.post("/v1/generate", json={"prompt": "abc", "max_new_tokens": 60}).json()["text"]
        assert len(free) >= 12
        stop = free[10:12]
        cut, events = generate_both(c, {"prompt": "abc", "max_new_tokens": 60, "stop": [stop, "\x00zz"]})
        default = c.post("/v1/generate", json={"prompt": "abc"}).json()
    assert cut["text"] == free[:free.index(stop)] and cut["finish_reason"] == "stop"
    assert "".join(e["text"] for e in events[:-1]) == cut["text"]
    assert default["usage"]["completion_tokens"] <= 24  # the model's default max_new_tokens
    assert default["finish_reason"] == "stop" or default["usage"]["completion_tokens"] == 24


def _request_mix(n: int) -> list[dict[str, Any]]:
    rng = random.Random(5)
    kinds = [{}, {"repetition_penalty": 1.3}, {"temperature": 0.8, "seed": 1, "top_k": 20},
             {"temperature": 1.1, "top_p": 0.85, "seed": 2}]
    return [{"prompt": f"request {i}: " + "xyz" * rng.randint(0, 20), "max_new_tokens": rng.randint(3, 60),
             **kinds[i % len(kinds)]} for i in range(n)]


def test_same_text_alone_and_among_16_concurrent_requests(server: Cluster) -> None:
    bodies = _request_mix(16)
    with server.client() as c:
        alone = [c.post("/v1/generate", json=b).json() for b in bodies]

    async def one(ac: httpx.AsyncClient, i: int, body: dict[str, Any]) -> dict[str, Any]:
        if i % 2 == 0:
            r = await ac.post("/v1/generate", json=body)
            assert r.status_code == 200, r.text
            return r.json()
        async with ac.stream("POST", "/v1/generate", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            events = sse_payloads(iter([line async for line in r.aiter_lines()]))
        last = events[-1]
        return {"model": last["model"], "text": "".join(e["text"] for e in events[:-1]),
                "finish_reason": last["finish_reason"], "usage": last["usage"]}

    async def main() -> list[dict[str, Any]]:
        async with server.async_client() as ac:
            return await asyncio.gather(*(one(ac, i, b) for i, b in enumerate(bodies)))

    with server.client() as c:
        steps_before = stats(c, "generator")["steps"]
        together = asyncio.run(main())
        steps = stats(c, "generator")["steps"] - steps_before
    assert together == alone
    assert steps < sum(a["usage"]["completion_tokens"] for a in alone)  # they shared decode steps


# -- OpenAI's API through the official client -------------------------------------------------------

def test_openai_completions_with_and_without_stream(server: Cluster) -> None:
    client = server.openai()
    # seed 4: four sampled tokens, then the end of text (a finish by "stop" after several chunks)
    params = {"model": TINY, "prompt": "hello there", "max_tokens": 20, "temperature": 0.7, "seed": 4,
              "stop": "\x00never"}
    whole = client.completions.create(**params)
    with server.client() as c:
        native = c.post("/v1/generate", json={"prompt": "hello there", "max_new_tokens": 20, "temperature": 0.7,
                                               "seed": 4, "stop": ["\x00never"]}).json()
    assert whole.object == "text_completion" and whole.id.startswith("cmpl-") and whole.model == TINY
    assert len(whole.choices) == 1 and whole.choices[0].text == native["text"]
    assert whole.choices[0].finish_reason == native["finish_reason"]
    assert whole.usage is not None and whole.usage.model_dump(exclude_none=True) == native["usage"]
    chunks = list(client.completions.create(**params, stream=True, stream_options={"include_usage": True}))
    assert all(ch.object == "text_completion" and ch.id == chunks[0].id for ch in chunks)
    texts = [ch.choices[0].text for ch in chunks if ch.choices]
    assert "".join(texts) == whole.choices[0].text and len([t for t in texts if t]) >= 2
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert finish[-1] == whole.choices[0].finish_reason and set(finish[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_openai_chat_completions_with_and_without_stream(server: Cluster) -> None:
    client = server.openai()
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi ¿qué tal?"}]
    whole = client.chat.completions.create(model=TINY, messages=messages, max_tokens=25, temperature=0,  # type: ignore[arg-type]
                                           extra_body={"repetition_penalty": 1.2})
    assert whole.object == "chat.completion" and whole.id.startswith("chatcmpl-")
    message = whole.choices[0].message
    assert message.role == "assistant" and whole.choices[0].finish_reason in ("stop", "length")
    _, tok = tiny_model("decoder")
    prompt = tok.apply_chat_template(messages)
    assert whole.usage is not None and whole.usage.prompt_tokens == len(tok.encode(prompt, add_special_tokens=False))
    stream = client.chat.completions.create(model=TINY, messages=messages, max_tokens=25, temperature=0,  # type: ignore[arg-type]
                                            extra_body={"repetition_penalty": 1.2}, stream=True)
    chunks = list(stream)
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert [m.id for m in client.models.list()] == [TINY, LONG]


def test_openai_client_sees_422_for_unsupported_parameters(server: Cluster) -> None:
    client = server.openai()
    with pytest.raises(openai.UnprocessableEntityError, match="echo"):
        client.completions.create(model=TINY, prompt="hi", echo=True)
    with pytest.raises(openai.UnprocessableEntityError, match="frequency_penalty"):
        client.chat.completions.create(model=TINY, messages=[{"role": "user", "content": "hi"}],
                                       frequency_penalty=2.5)
    with pytest.raises(openai.UnprocessableEntityError, match="top_logprobs needs logprobs"):
        client.chat.completions.create(model=TINY, messages=[{"role": "user", "content": "hi"}], top_logprobs=2)


# -- log-probabilities, penalties, logit bias ---------------------------------------------------------

def offline_logprobs(prompt: str, n_new: int, k: int) -> tuple[list[int], list[float], list[list[int]]]:
    """Greedy tokens of tiny:decoder with each step's log-softmax at the chosen token and the top k ids."""
    model, tok = tiny_model("decoder")
    ids = tok.encode(prompt)
    chosen, lps, tops = [], [], []
    with torch.no_grad():
        for _ in range(n_new):
            logp = model(torch.tensor([ids]))[0, -1].float().log_softmax(-1)  # (V,)
            token = int(logp.argmax())
            if token == 1:  # tiny:decoder's eos
                break
            chosen.append(token)
            lps.append(float(logp[token]))
            tops.append(logp.topk(k).indices.tolist())
            ids.append(token)
    return chosen, lps, tops


def test_completion_logprobs_are_the_models_own_streamed_and_not(server: Cluster) -> None:
    client = server.openai()
    _, tok = tiny_model("decoder")
    tokens, lps, tops = offline_logprobs("log me", 12, 3)
    params = {"model": TINY, "prompt": "log me", "max_tokens": 12, "temperature": 0, "logprobs": 3}
    whole = client.completions.create(**params)
    plain = client.completions.create(**{**params, "logprobs": None})
    assert whole.choices[0].text == plain.choices[0].text == tok.decode(tokens)  # asking changes nothing
    lp = whole.choices[0].logprobs
    assert lp is not None and lp.tokens == [tok.decode([t], skip_special_tokens=False) for t in tokens]
    assert lp.token_logprobs == pytest.approx(lps, abs=1e-4)
    for best, top, token in zip(tops, lp.top_logprobs or [], lp.tokens, strict=True):
        assert set(top) >= {tok.decode([t], skip_special_tokens=False) for t in best} and token in top
    from models.text import IncrementalDetokenizer

    detok, offsets, text = IncrementalDetokenizer(tok, prompt=tok.encode("log me")), [], ""
    for t in tokens:  # where each token's text starts in the answer, as the detokenizer releases it
        offsets.append(len(text))
        text += detok.push(t)
    assert lp.text_offset == offsets
    chunks = list(client.completions.create(**params, stream=True))
    streamed = [t for ch in chunks if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.tokens]
    offsets = [o for ch in chunks if ch.choices and ch.choices[0].logprobs for o in ch.choices[0].logprobs.text_offset]
    assert streamed == lp.tokens and offsets == lp.text_offset


def test_chat_logprobs_in_openais_shape(server: Cluster) -> None:
    client = server.openai()
    messages = [{"role": "user", "content": "hola"}]
    whole = client.chat.completions.create(model=TINY, messages=messages, max_tokens=10, temperature=0,  # type: ignore[arg-type]
                                           logprobs=True, top_logprobs=2)
    content = whole.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content and "".join(c.token for c in content) == whole.choices[0].message.content
    raw = b"".join(bytes(entry.bytes or []) for entry in content)  # each token's own bytes
    assert raw.decode("utf-8", "replace") == whole.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy: the chosen is the best
    stream = client.chat.completions.create(model=TINY, messages=messages, max_tokens=10, temperature=0,  # type: ignore[arg-type]
                                            logprobs=True, top_logprobs=2, stream=True)
    streamed = [c.token for ch in stream if ch.choices and ch.choices[0].logprobs
                for c in ch.choices[0].logprobs.content or []]
    assert streamed == [c.token for c in content]


def test_penalties_and_logit_bias_change_the_text_as_defined(server: Cluster) -> None:
    _, tok = tiny_model("decoder")
    forced = tok.encode("z", add_special_tokens=False)[0]
    with server.client() as c:
        def text(**params: Any) -> str:
            body = {"prompt": "penalise me", "max_new_tokens": 30, "ignore_eos": True, **params}
            r = c.post("/v1/generate", json=body)
            assert r.status_code == 200, r.text
            return r.json()["text"]

        free = text()
        assert text(logit_bias={str(forced): 100}) == "z" * 30
        repeated = max(set(free), key=free.count)
        for name in ("frequency_penalty", "presence_penalty"):
            penalised = text(**{name: 2.0})
            assert penalised != free and penalised == text(**{name: 2.0})  # deterministic
            assert penalised.count(repeated) <= free.count(repeated)
        assert text(presence_penalty=-2.0) != free  # negative values reward repetition
        via_openai = server.openai().completions.create(
            model=TINY, prompt="penalise me", max_tokens=30, frequency_penalty=2.0, logit_bias={str(forced): 5},
            extra_body={"ignore_eos": True})
        assert via_openai.choices[0].text == text(frequency_penalty=2.0, logit_bias={str(forced): 5})


# -- n, best_of, several prompts -------------------------------------------------------------------

def native_text(c: httpx.Client, prompt: str, seed: int, **extra: Any) -> dict[str, Any]:
    body = {"prompt": prompt, "max_new_tokens": 16, "temperature": 0.9, "seed": seed, **extra}
    r = c.post("/v1/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_n_choices_are_the_seeds_siblings_alone_and_among_others(server: Cluster) -> None:
    client = server.openai()
    params = {"model": TINY, "prompt": "three ways", "max_tokens": 16, "temperature": 0.9, "seed": 7, "n": 3}
    alone = client.completions.create(**params)

    async def crowd() -> list[Any]:
        async with server.async_client() as c:
            bodies = [params] + [{**params, "prompt": f"other {i}", "n": 2} for i in range(6)]
            return await asyncio.gather(*(c.post("/v1/completions", json=b) for b in bodies))

    among = asyncio.run(crowd())[0].json()
    with server.client() as c:
        singles = [native_text(c, "three ways", seed) for seed in (7, 8, 9)]
    texts = [ch.text for ch in sorted(alone.choices, key=lambda ch: ch.index)]
    assert [ch.index for ch in alone.choices] == [0, 1, 2]
    assert texts == [s["text"] for s in singles] == [ch["text"] for ch in among["choices"]]
    assert len(set(texts)) == 3
    assert alone.usage is not None and alone.usage.prompt_tokens == singles[0]["usage"]["prompt_tokens"]
    assert alone.usage.completion_tokens == sum(s["usage"]["completion_tokens"] for s in singles)


def test_several_prompts_each_get_n_choices_in_order(server: Cluster) -> None:
    client = server.openai()
    out = client.completions.create(model=TINY, prompt=["first", "second one"], max_tokens=16, temperature=0.9,
                                    seed=3, n=2)
    with server.client() as c:
        want = [native_text(c, p, seed)["text"] for p in ("first", "second one") for seed in (3, 4)]
    assert [ch.index for ch in out.choices] == [0, 1, 2, 3] and [ch.text for ch in out.choices] == want


def test_best_of_returns_the_candidate_with_the_best_mean_logprob(server: Cluster) -> None:
    client = server.openai()
    out = client.completions.create(model=TINY, prompt="pick one", max_tokens=16, temperature=1.0, seed=11,
                                    best_of=4, n=1)
    with server.client() as c:
        candidates = []
        for seed in range(11, 15):
            body = {"model": TINY, "prompt": "pick one", "max_tokens": 16, "temperature": 1.0, "seed": seed,
                    "logprobs": 0}
            choice = c.post("/v1/completions", json=body).json()["choices"][0]
            lps = choice["logprobs"]["token_logprobs"]
            candidates.append((sum(lps) / len(lps), choice["text"]))
    assert len({t for _, t in candidates}) > 1
    assert out.choices[0].text == max(candidates)[1] and out.choices[0].logprobs is None
    assert out.usage is not None and out.usage.completion_tokens >= 4  # every candidate's tokens are billed


def test_chat_n_streams_each_choice_with_its_index(server: Cluster) -> None:
    client = server.openai()
    params = {"model": TINY, "messages": CHAT, "max_tokens": 12, "temperature": 0.9, "seed": 5, "n": 2}
    whole = client.chat.completions.create(**params)  # type: ignore[call-overload]
    chunks = list(client.chat.completions.create(**params, stream=True, stream_options={"include_usage": True}))
    texts = {0: "", 1: ""}
    for ch in chunks:
        for choice in ch.choices:
            texts[choice.index] += choice.delta.content or ""
    assert [texts[0], texts[1]] == [c.message.content for c in whole.choices] and texts[0] != texts[1]
    finishes = [c for ch in chunks for c in ch.choices if c.finish_reason]
    assert sorted(c.index for c in finishes) == [0, 1]
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


# -- structured outputs (token masks from llguidance) ------------------------------------------------

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "color", "ok", "n"],
          "properties": {"name": {"type": "string", "maxLength": 8}, "color": {"enum": ["red", "green", "blue"]},
                         "ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99}}}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


def test_json_schema_outputs_always_validate(server: Cluster) -> None:
    """50 seeded samples of a random tiny model: every one parses and validates, and they differ."""
    import jsonschema

    with server.client() as c:  # n=10 at a time: the tiny engine queues 32
        bodies = [c.post("/v1/chat/completions", json={
            "model": TINY, "messages": CHAT, "max_tokens": 160, "temperature": 1.0, "seed": 100 * i, "n": 10,
            "response_format": JSON_SCHEMA}).json() for i in range(5)]
    texts = [choice["message"]["content"] for body in bodies for choice in body["choices"]]
    assert len(texts) == 50
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)
    assert len(set(texts)) > 40


def test_json_object_regex_and_grammar(server: Cluster) -> None:
    import re

    client = server.openai()
    # any JSON object: free-form strings may run to max_tokens ("length"); every finished one parses
    whole = client.chat.completions.create(model=TINY, messages=CHAT, max_tokens=200, temperature=0.8, seed=1, n=8,  # type: ignore[arg-type]
                                           response_format={"type": "json_object"})
    finished = [c.message.content or "" for c in whole.choices if c.finish_reason == "stop"]
    assert finished and all(isinstance(json.loads(text), dict) for text in finished)
    assert all((c.message.content or "").startswith("{") for c in whole.choices)
    stream = client.chat.completions.create(model=TINY, messages=CHAT, max_tokens=200, temperature=0.8, seed=1,  # type: ignore[arg-type]
                                            response_format={"type": "json_object"}, stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) == whole.choices[0].message.content
    with server.client() as c:
        for seed in range(5):
            body = {"prompt": "code:", "max_new_tokens": 20, "temperature": 1.0, "seed": seed}
            code = c.post("/v1/generate", json={**body, "regex": "[a-c]{3}-[0-9]{2}"}).json()
            assert re.fullmatch("[a-c]{3}-[0-9]{2}", code["text"]), code
            answer = c.post("/v1/generate", json={**body, "grammar": 'start: "yes" | "no" | "maybe"'}).json()
            assert answer["text"] in ("yes", "no", "maybe") and answer["finish_reason"] == "stop", answer


def test_structured_output_sources_the_library_refuses_are_a_422(server: Cluster) -> None:
    with server.client() as c:
        for body, param, words in [
            ({"prompt": "x", "regex": "(ab"}, "regex", "cannot be compiled"),
            ({"prompt": "x", "grammar": "start: undefined_rule"}, "grammar", "cannot be compiled"),
            ({"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {
                "name": "bad", "schema": {"type": "nope"}}}}, "response_format", "cannot be compiled"),
            ({"prompt": "x", "regex": "a", "grammar": 'start: "a"'}, "grammar", "at most one"),
            ({"prompt": "x", "regex": "a+", "ignore_eos": True}, "ignore_eos", "structured output"),
            ({"prompt": "x", "response_format": {"type": "json_schema"}}, "response_format.json_schema.json_schema", None),
            ({"prompt": "x", "response_format": {"type": "xml"}}, "response_format", None),
        ]:
            error = assert_error(c.post("/v1/generate", json=body), 422, "invalid_request_error", param)
            assert words is None or words in error["message"], error


# -- tool calls (tiny:decoder's template knows no tools: the documented system-prompt format) -------

@pytest.fixture(scope="module")
def tools_server(server: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A second app at /tools: tiny:decoder with 2048 positions (the tools' prompt is long in bytes)."""
    path = tools_decoder(tmp_path_factory.mktemp("tools-decoder"))
    with second_app(server, {"device": "cpu", "deployments": {"generator": {
            "model": {"name": TINY, "tasks": ["generate"], "source": f"dir:{path}"},
            "num_cpus": 0, "torch_threads": 1, "engine": {"max_running": 8, "max_queued": 16, "max_new_tokens": 256}}}},
            "tools", timeout_s=120):
        yield server

WEATHER_PARAMS = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                  "properties": {"city": {"enum": ["Paris", "Lima", "Oslo"]}, "unit": {"enum": ["C", "F"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER_PARAMS}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
             "additionalProperties": False}}}]


def test_a_forced_tool_call_is_parsed_and_validates(tools_server: Cluster) -> None:
    import jsonschema

    client = tools_server.openai("/tools")
    seen = set()
    for seed in range(6):
        out = client.chat.completions.create(  # type: ignore[call-overload]
            model=TINY, messages=CHAT, max_tokens=200, temperature=1.0, seed=seed, tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "get_weather"}})
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, WEATHER_PARAMS)
        seen.add(json.dumps(arguments, sort_keys=True))
    assert len(seen) > 1  # sampled arguments differ: the constraint does not fix the answer
    required = client.chat.completions.create(model=TINY, messages=CHAT, max_tokens=200, temperature=1.0, seed=3,  # type: ignore[call-overload]
                                              tools=TOOLS, tool_choice="required")
    assert required.choices[0].message.tool_calls[0].function.name in ("get_weather", "get_time")


def test_tools_reach_the_prompt_and_tool_messages_come_back(tools_server: Cluster) -> None:
    from service.common.tool_calls import Tool, ToolCall, render_in_prompt

    _, tok = tiny_model("decoder")
    history = [{"role": "user", "content": "weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    client = tools_server.openai("/tools")
    out = client.chat.completions.create(model=TINY, messages=history, max_tokens=10, temperature=0, tools=TOOLS)  # type: ignore[call-overload]
    tools = [Tool(t["function"]["name"], t["function"].get("description", ""), json.dumps(t["function"]["parameters"]))
             for t in TOOLS]
    ours = [{"role": "user", "content": "weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": (ToolCall("call_1", "get_weather",
                                                                         '{"city": "Paris", "unit": "C"}'),)},
            {"role": "tool", "content": '{"temperature": 21}'}]
    prompt = tok.apply_chat_template(render_in_prompt(ours, tools))
    assert out.usage is not None and out.usage.prompt_tokens == len(tok.encode(prompt, add_special_tokens=False))
    assert out.choices[0].finish_reason in ("stop", "length")  # auto: the tiny model writes no call block
    with tools_server.client("/tools") as c:  # /tokenize renders the same chat, tools included
        counted = c.post("/tokenize", json={"model": TINY, "messages": history, "tools": TOOLS}).json()
        plain = c.post("/tokenize", json={"model": TINY, "messages": history}).json()
        assert counted["count"] == out.usage.prompt_tokens > plain["count"]
        assert_error(c.post("/tokenize", json={"prompt": "x", "tools": TOOLS}), 422, "invalid_request_error")


def test_a_tool_schema_the_library_refuses_is_a_422_whether_forced_or_not(tools_server: Cluster) -> None:
    broken = [{"type": "function", "function": {"name": "broken", "parameters": {"type": "nope"}}}]
    with tools_server.client("/tools") as c:
        for choice in (None, "auto", "required"):
            body = {"model": TINY, "messages": CHAT, "max_tokens": 4, "tools": broken}
            error = assert_error(c.post("/v1/chat/completions", json={**body, "tool_choice": choice}), 422,
                                 "invalid_request_error", "tools")
            assert "cannot be compiled" in error["message"], error
        ok = c.post("/v1/chat/completions", json={"model": TINY, "messages": CHAT, "max_tokens": 4, "tools": broken,
                                                  "tool_choice": "none"})
        assert ok.status_code == 200, ok.text  # none: the tools are neither shown nor used


def test_a_streamed_tool_call_arrives_whole(tools_server: Cluster) -> None:
    client = tools_server.openai("/tools")
    params = {"model": TINY, "messages": CHAT, "max_tokens": 200, "temperature": 0.7, "seed": 1, "tools": TOOLS,
              "tool_choice": {"type": "function", "function": {"name": "get_time"}}}
    whole = client.chat.completions.create(**params)  # type: ignore[call-overload]
    chunks = list(client.chat.completions.create(**params, stream=True))  # type: ignore[call-overload]
    calls = [tc for ch in chunks for c in ch.choices for tc in (c.delta.tool_calls or [])]
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        (c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


# -- conformance with OpenAI's published shapes (the `openai` package's types) -------------------------

def no_extras(obj: Any, path: str = "") -> list[str]:
    """Paths of fields OpenAI's types do not define (their models keep unknown keys in model_extra)."""
    from pydantic import BaseModel

    found: list[str] = []
    if isinstance(obj, BaseModel):
        found += [f"{path}.{k}" for k in (obj.model_extra or {})]
        for name in type(obj).model_fields:
            found += no_extras(getattr(obj, name), f"{path}.{name}")
    elif isinstance(obj, list):
        for i, item in enumerate(obj):
            found += no_extras(item, f"{path}[{i}]")
    return found


def test_responses_match_openais_types_field_for_field(tools_server: Cluster) -> None:
    from openai.types import Completion
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    with tools_server.client("/tools") as c:
        chat = {"model": TINY, "messages": CHAT, "max_tokens": 12, "temperature": 0.7, "seed": 1, "n": 2,
                "logprobs": True, "top_logprobs": 2}
        completion = {"model": TINY, "prompt": ["a", "b"], "max_tokens": 12, "logprobs": 2, "temperature": 0}
        tool = {**chat, "tools": TOOLS, "tool_choice": "required", "max_tokens": 200, "logprobs": False,
                "top_logprobs": None}
        bodies = [(ChatCompletion, c.post("/v1/chat/completions", json=chat).json()),
                  (ChatCompletion, c.post("/v1/chat/completions", json=tool).json()),
                  (Completion, c.post("/v1/completions", json=completion).json())]
        for route, body, kind in [("/v1/chat/completions", chat, ChatCompletionChunk),
                                  ("/v1/completions", completion, Completion)]:
            with c.stream("POST", route, json={**body, "stream": True,
                                               "stream_options": {"include_usage": True}}) as r:
                bodies += [(kind, p) for p in sse_payloads(r.iter_lines()) if p != "[DONE]"]
    for kind, body in bodies:
        if kind is Completion and body.get("choices") and body["choices"][0]["finish_reason"] is None:
            # OpenAI's streamed completion chunks carry finish_reason null too, but its type (shared with
            # the whole answer) does not allow it: the client builds chunks without validating
            body = {**body, "choices": [{**ch, "finish_reason": "stop"} for ch in body["choices"]]}
        assert no_extras(kind.model_validate(body)) == [], (kind.__name__, body)

# -- /tokenize and /detokenize (vLLM's shapes) --------------------------------------------------------

def test_tokenize_counts_what_a_generation_would_see(server: Cluster) -> None:
    _, tok = tiny_model("decoder")
    with server.client() as c:
        prompt = c.post("/tokenize", json={"prompt": TEXT, "return_token_strs": True}).json()
        bare = c.post("/tokenize", json={"prompt": TEXT, "add_special_tokens": False}).json()
        chat = c.post("/tokenize", json={"messages": CHAT}).json()
        whole = c.post("/v1/generate", json={"prompt": TEXT, "max_new_tokens": 2}).json()
        back = c.post("/detokenize", json={"tokens": prompt["tokens"]}).json()
        assert_error(c.post("/detokenize", json={"tokens": [5, VOCAB]}), 422, "invalid_request_error", "tokens[1]")
        assert_error(c.post("/tokenize", json={"prompt": "a", "messages": CHAT}), 422, "invalid_request_error", None)
        assert_error(c.post("/tokenize", json={"messages": CHAT, "model": LONG}), 422, "invalid_request_error",
                     "messages")
    assert prompt["tokens"] == tok.encode(TEXT) and prompt["count"] == whole["usage"]["prompt_tokens"]
    assert prompt["max_model_len"] == MAX_POSITIONS and bare["token_strs"] is None
    # each token's own text: a byte of a multi-byte character alone is U+FFFD, whole ones are themselves
    assert len(prompt["token_strs"]) == prompt["count"] and prompt["token_strs"][0] == "h"
    assert bare["tokens"] == tok.encode(TEXT, add_special_tokens=False)
    assert chat["tokens"] == tok.encode(tok.apply_chat_template(CHAT), add_special_tokens=False)
    assert back == {"prompt": tok.decode(prompt["tokens"], skip_special_tokens=False)}


# -- bad input -------------------------------------------------------------------------------------

CHAT = [{"role": "user", "content": "hi"}]
BAD = [
    ("/v1/generate", {"prompt": "hi", "temperature": -0.1}, "temperature", None),
    ("/v1/generate", {"prompt": "hi", "temperature": "0.5"}, "temperature", None),
    ("/v1/generate", {"prompt": "hi", "top_p": 1.5}, "top_p", None),
    ("/v1/generate", {"prompt": "hi", "top_p": 0}, "top_p", None),
    ("/v1/generate", {"prompt": "hi", "top_k": -1}, "top_k", None),
    ("/v1/generate", {"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty", None),
    ("/v1/generate", {"prompt": "hi", "seed": -1}, "seed", None),
    ("/v1/generate", {"prompt": "hi", "seed": 1.5}, "seed", None),
    ("/v1/generate", {"prompt": "hi", "max_new_tokens": 0}, "max_new_tokens", None),
    ("/v1/generate", {"prompt": "hi", "max_new_tokens": 10**12}, "max_new_tokens", None),
    ("/v1/generate", {"prompt": "hi", "max_new_tokens": MAX_POSITIONS}, "max_new_tokens", "max_new_tokens"),
    ("/v1/generate", {"prompt": "x" * 300, "max_new_tokens": 250}, "max_new_tokens", "max_total_tokens"),
    ("/v1/generate", {"prompt": "x" * MAX_POSITIONS}, "prompt", "max_prompt_tokens"),
    ("/v1/generate", {"prompt": ""}, "prompt", None),
    ("/v1/generate", {"prompt": 3}, "prompt", None),
    ("/v1/generate", {}, "prompt", None),
    ("/v1/generate", {"prompt": "hi", "stop": [""]}, "stop[0]", None),
    ("/v1/generate", {"prompt": "hi", "stop": ["a"] * 9}, "stop", None),
    ("/v1/generate", {"prompt": "hi", "stop": 5}, "stop", None),
    ("/v1/generate", {"prompt": "hi", "stream": "yes"}, "stream", None),
    ("/v1/generate", {"prompt": "hi", "beam": 2}, "beam", None),
    ("/v1/generate", {"prompt": "hi", "stream": True, "max_new_tokens": 600}, "max_new_tokens", "max_new_tokens"),
    ("/v1/completions", {"prompt": "hi", "n": 17}, "n", None),
    ("/v1/completions", {"prompt": ["a"] * 5, "n": 16}, "n", "at most"),
    ("/v1/completions", {"prompt": "hi", "n": 3, "best_of": 2}, "best_of", None),
    ("/v1/completions", {"prompt": "hi", "n": 1, "best_of": 2, "stream": True}, "best_of", "streamed"),
    ("/v1/completions", {"prompt": ["a", ""]}, "prompt[1]", None),
    ("/v1/completions", {"prompt": []}, "prompt", None),
    ("/v1/completions", {"prompt": "hi", "frequency_penalty": 2.5}, "frequency_penalty", None),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": -2.1}, "presence_penalty", None),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": "1"}, "presence_penalty", None),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs", None),
    ("/v1/completions", {"prompt": "hi", "logprobs": True}, "logprobs", None),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"abc": 1}}, "logit_bias", None),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias.5", None),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"99999": 1}}, "logit_bias", "outside the vocabulary"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias", None),
    ("/v1/generate", {"prompt": "hi", "logit_bias": [1, 2]}, "logit_bias", None),
    ("/v1/completions", {"prompt": "hi", "echo": True}, "echo", None),
    ("/v1/completions", {"prompt": [1, 2]}, "prompt[0]", None),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 600}, "max_tokens", "max_new_tokens"),
    ("/v1/completions", {"prompt": "hi", "stream": True, "max_tokens": 600}, "max_tokens", "max_new_tokens"),
    ("/v1/chat/completions", {"messages": []}, "messages", None),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, "messages[0]", "tool_call_id"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages[0]", "content is required"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": TOOLS, "tool_choice": {
        "type": "function", "function": {"name": "nope"}}}, "tool_choice", "not among the tools"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": TOOLS + TOOLS[:1]}, "tools", "duplicate"),
    ("/v1/chat/completions", {"messages": CHAT, "tool_choice": "required"}, "tool_choice", "needs tools"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": TOOLS, "tool_choice": "required",
                              "response_format": {"type": "json_object"}}, "response_format", "forced tool call"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function", "function": {"name": "bad name"}}]},
     "tools[0].function.name", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, "messages[0].content", None),
    ("/v1/chat/completions", {"messages": CHAT, "n": 0}, "n", None),
    ("/v1/chat/completions", {"messages": CHAT, "temperature": 2.5}, "temperature", None),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": 1}, "logprobs", None),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs", None),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": -1}, "top_logprobs", None),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 1}, "top_logprobs", "needs logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": []}, "tools", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "y" * MAX_POSITIONS}]}, "messages",
     "max_prompt_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "model": LONG}, "messages", "chat template"),
]


@pytest.mark.parametrize(("path", "body", "param", "names"), BAD)
def test_bad_parameters_are_a_422_naming_them(server: Cluster, path: str, body: dict[str, Any], param: str,
                                              names: str | None) -> None:
    with server.client() as c:
        error = assert_error(c.post(path, json=body), 422, "invalid_request_error", param)
    if names is not None:
        assert names in error["message"]


def test_malformed_bodies_are_a_422(server: Cluster) -> None:
    with server.client() as c:
        for raw, param in [(b'{"prompt": "bad \\ud800 text"}', "prompt"), (b'{"prompt": ', None), (b"[]", None)]:
            assert_error(c.post("/v1/generate", content=raw, headers={"content-type": "application/json"}),
                   422, "invalid_request_error", param)


# -- overload, cancellation, deadlines (the `long` deployment: one row, one queue slot) -------------

LONG_BODY = {"prompt": "go", "model": LONG, "max_new_tokens": 4000}


def test_a_full_engine_answers_503_with_retry_after(server: Cluster) -> None:
    async def queued_stream() -> None:
        """A stream that waits in the one queue slot (its response starts with its first token)."""
        async with server.async_client() as ac, ac.stream("POST", "/v1/generate",
                                                           json={**LONG_BODY, "stream": True}) as r:
            async for _ in r.aiter_lines():
                pass

    with server.client() as c:
        before = stats(c, "long")
        with c.stream("POST", "/v1/generate", json={**LONG_BODY, "stream": True}) as running:
            lines = running.iter_lines()  # kept: dropping a half-read iterator closes the connection
            next(lines)  # text arrives: it holds the only row
            loop = asyncio.new_event_loop()
            waiting = loop.create_task(queued_stream())
            deadline = time.monotonic() + 10
            while stats(c, "long")["waiting"] < 1:  # accepted into the one queue slot
                loop.run_until_complete(asyncio.sleep(0.05))
                assert time.monotonic() < deadline, stats(c, "long")
            with server.client() as c3:
                for body in (LONG_BODY, {**LONG_BODY, "stream": True}):
                    r = c3.post("/v1/generate", json=body)
                    assert_error(r, 503, "overloaded_error")
                    assert r.headers["Retry-After"] == RETRY_AFTER and r.elapsed.total_seconds() < 2
            waiting.cancel()  # the queued client goes away
            with contextlib.suppress(asyncio.CancelledError):
                loop.run_until_complete(waiting)
            loop.close()
        idle, _ = wait_idle(c, "long")
        ok = c.post("/v1/generate", json={**LONG_BODY, "max_new_tokens": 5})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 5
    cancelled = idle["finished"].get("cancelled", 0) - before["finished"].get("cancelled", 0)
    assert cancelled == 2  # the running stream and the queued one, each cancelled when its client left


def test_a_client_that_disconnects_frees_its_row(server: Cluster) -> None:
    with server.client() as c:
        wait_idle(c, "long")
        before = stats(c, "long")
        with c.stream("POST", "/v1/generate", json={**LONG_BODY, "stream": True}) as r:
            lines = r.iter_lines()
            first = sse_payloads(iter([next(lines)]))[0]
            assert first["text"] and stats(c, "long")["running"] == 1
        after, seconds = wait_idle(c, "long")  # the stream was closed after one event
        assert after["finished"].get("cancelled", 0) == before["finished"].get("cancelled", 0) + 1
        assert after["generated_tokens"] - before["generated_tokens"] < 4000
        assert seconds < 2.0
        with pytest.raises(httpx.ReadTimeout):  # a non-streaming client that gives up
            c.post("/v1/generate", json=LONG_BODY, timeout=1.0)
        gone, _ = wait_idle(c, "long")
        assert gone["finished"].get("cancelled", 0) == before["finished"].get("cancelled", 0) + 2


def test_a_deadline_answers_504_and_cancels_the_generation(server: Cluster) -> None:
    with server.client() as c:
        wait_idle(c, "long")
        before = stats(c, "long")["finished"].get("cancelled", 0)
        r = c.post("/v1/generate", json=LONG_BODY, headers={"X-Request-Timeout": "0.3"})
        assert_error(r, 504, "timeout_error")
        assert r.elapsed.total_seconds() < 2
        after, _ = wait_idle(c, "long")
    assert after["finished"].get("cancelled", 0) == before + 1


def test_models_and_readiness_include_the_generators(server: Cluster) -> None:
    with server.client() as c:
        body = c.get("/v1/models").json()
        ready = c.get("/readyz").json()
        spec = c.get("/openapi.json").json()
    assert body["object"] == "list" and body["tasks"] == {"generate": [TINY, LONG]}
    cards = {m["id"]: m for m in body["data"]}
    assert cards[TINY]["owned_by"] == "transformer-serve" and cards[TINY]["ready"]
    assert cards[TINY]["limits"]["rows"] == 16 and cards[TINY]["max_input_tokens"] == MAX_POSITIONS - 1
    assert cards[LONG]["limits"]["max_total_tokens"] == 4096 and cards[TINY]["defaults"] == {"max_new_tokens": 24}
    assert ready == {"status": "ready", "deployments": {"generator": "ready", "long": "ready"}}
    assert {"/v1/generate", "/v1/completions", "/v1/chat/completions"} <= set(spec["paths"])


def test_models_show_the_execution_plan_and_metrics_export_it(server: Cluster) -> None:
    """Each generator's card has the plan chosen at load (phase -> backend, detail, why not each other
    backend), the same as the replica's info metric says; a backend the machine lacks, asked for by
    name, fails the deployment's start with a message naming it."""
    from models.kernels import native

    with server.client() as c:
        cards = {m["id"]: m for m in c.get("/v1/models").json()["data"]}
        metrics = c.get("/metrics").text
    plan = cards[TINY]["plan"]
    assert list(plan) == ["prefill", "decode"]
    # tiny:decoder fused and packed as loaded: its decode steps are native where our kernels run
    decode = plan["decode"]["backend"]
    assert decode == ("native" if native.available() else "torch")
    exported = {tuple(sorted(re.findall(r'(\w+)="([^"]*)"', line))) for line in metrics.splitlines()
                if line.startswith("transformer_serve_execution_plan_info{") and line.endswith(" 1.0")}
    for phase, card in plan.items():
        assert set(card["not_taken"]) == {"torch", "compiled", "native", "cuda_graphs"} - {card["backend"]}
        assert (("backend", card["backend"]), ("model", TINY), ("phase", phase)) in exported, exported
    assert plan["decode"]["not_taken"]["cuda_graphs"] == "needs a CUDA device; this model is on cpu"
    from ray import serve

    try:
        with pytest.raises(RuntimeError, match=r"Failed to update the deployments \['generator'\]"):
            deploy({"device": "cpu", "deployments": {"generator": {
                "model": {"name": "no-gpu", "tasks": ["generate"], "source": "tiny:decoder",
                          "execution": {"decode": "cuda_graphs"}}, "num_cpus": 0}}}, "no-gpu", "/no-gpu")
        # what `serve status` shows the operator: the replica's start-up error, naming what it needs
        message = serve.status().applications["no-gpu"].deployments["generator"].message
        assert "PlanError: decode on cuda_graphs: needs a CUDA device; this model is on cpu" in message, message
    finally:
        serve.delete("no-gpu")


def test_speculative_decoding_gives_the_plain_answers_over_http(server: Cluster) -> None:
    """A deployment of the same tiny decoder that decodes speculatively (a draft model: the same
    weights, drafting every step: the adaptive rule would stop after the first drafts, as a draft this
    dear does not pay) answers concurrent greedy, seeded sampled and opted-out requests with the plain
    deployment's texts; its card shows the drafter (sharing the model's cache, its steps speculated by
    prompt lookup), and its counters move (exported from the start)."""
    args = {"device": "cpu", "deployments": {"generator": {
        "model": {"name": "tiny-decoder-spec", "tasks": ["generate"], "source": "tiny:decoder"},
        "num_cpus": 0, "torch_threads": 1,
        "engine": {"max_running": 16, "max_total_tokens": None, "max_new_tokens": 256,
                   "speculative": {"method": "draft", "max_draft_tokens": 4, "draft": {"source": "tiny:decoder"},
                                   "adaptive": False}}}}}
    bodies = [{"prompt": f"spec {i} " + "la " * i, "max_tokens": 40, "ignore_eos": True,
               **({"temperature": 0.9, "seed": i} if i % 3 == 1 else {}),
               **({"speculative": False} if i % 3 == 2 else {})} for i in range(9)]

    async def answers(prefix: str, model: str) -> list[str]:
        async with server.async_client() as c:
            replies = await asyncio.gather(*(c.post(f"{prefix}/v1/completions", json={**b, "model": model})
                                             for b in bodies))
        assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
        return [r.json()["choices"][0]["text"] for r in replies]

    with second_app(server, args, "spec", timeout_s=120):
        with server.client("/spec") as c:
            card = c.get("/v1/models").json()["data"][0]
            before = c.get("/metrics").text
        assert card["speculative"]["method"] == "draft" and card["speculative"]["draft"] == {"source": "tiny:decoder"}
        assert card["speculative"]["adaptive"] is False and card["speculative"]["draft_lookup"] is True
        assert card["speculative"]["draft_cache"] == "shared"  # the draft's config is the model's
        assert card["speculative"]["draft_plan"]["decode"]["backend"] == card["plan"]["decode"]["backend"]
        assert re.search(r'transformer_serve_generation_spec_draft_tokens_total\{[^}]*model="tiny-decoder-spec"', before)
        spec = asyncio.run(answers("/spec", "tiny-decoder-spec"))
        with server.client("/spec") as c:
            after = c.get("/metrics").text
    assert spec == asyncio.run(answers("", TINY))

    def counter(name: str) -> list[float]:
        return [float(line.rsplit(" ", 1)[1]) for line in after.splitlines()
                if line.startswith(f"transformer_serve_generation_spec_{name}_total{{")
                and 'model="tiny-decoder-spec"' in line and 'method="draft"' in line]

    # 6 requests draft (3 opted out); each greedy one keeps every draft: after the prefill's token, 7
    # steps of 4 drafts + 1 and one of 3 + 1 (the sampled ones keep some by chance)
    drafted, kept, steps = counter("draft_tokens"), counter("accepted_tokens"), counter("draft_steps")
    assert drafted and kept and drafted[0] >= kept[0] >= 3 * (7 * 4 + 3), (drafted, kept)
    assert steps and 0 < steps[0] < drafted[0], (steps, drafted)  # the draft's own lookup kept some guesses


# -- the default model ------------------------------------------------------------------------------

SHIPPED_CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "serve_config.yaml"


def shipped_generator() -> dict[str, Any]:
    """The shipped config's generator model settings (4-bit blocks, compiled, float32), its speculative
    decoding (prompt lookup) and its KV cache's dtype (bfloat16), as deployed."""
    import yaml

    (app,) = yaml.safe_load(SHIPPED_CONFIG.read_text())["applications"]
    gen = app["args"]["deployments"]["generator"]
    engine = {k: gen["engine"][k] for k in ("speculative", "kv_cache_dtype")}
    return {"model": gen["model"], "dtype": gen["dtype"], "engine": engine}


@pytest.fixture(scope="module")
def smollm2(cluster: Cluster) -> Iterator[Cluster]:
    deployment = {"num_cpus": 0, "torch_threads": 2, **shipped_generator()}
    with second_app(cluster, {"device": "cpu", "deployments": {"generator": deployment}}, "smollm2", timeout_s=300):
        yield cluster


@pytest.mark.slow
def test_smollm2_answers_the_capital_of_france(smollm2: Cluster) -> None:
    """As shipped: the GGUF's own Q4_1 blocks with 16-bit activations, compiled (8-bit activations, as
    llama.cpp computes, answer something else: docs/benchmarks.md)."""
    from models.kernels import native

    with smollm2.client() as c:
        (card,) = [m for m in c.get("/smollm2/v1/models").json()["data"] if m["deployment"] == "generator"]
    blocks = native.available()  # CI requires the kernels (REQUIRE_NATIVE_KERNELS)
    assert (card["quantize"], card["block_activation_bits"]) == (("q4_1", 16) if blocks else (None, None))
    assert card["compiled"] is True
    plan = card["plan"]  # prompts on the compiled blocks, decode steps on our kernels in one call a step
    assert plan["prefill"]["backend"] == "compiled"
    assert plan["decode"]["backend"] == ("native" if blocks else "compiled")
    if blocks:
        assert plan["decode"]["detail"].startswith(f"{native.isa()}, q4_1/q8_0 blocks, blocks + embedding + final norm")
    assert "bfloat16 KV" in plan["decode"]["detail"]  # the shipped cache: keys/values stored in bfloat16
    # prompt_weights: auto keeps a twin (float32, or bfloat16 where our bfloat16 panels run) only where it
    # measured faster at load, and the plan says what it measured
    assert card["prompt_weights"] in ((None, "float32", "bfloat16") if blocks else (None,))
    if blocks:
        assert "prompt_weights: auto -> " in plan["prefill"]["detail"]
        assert ("bfloat16" in plan["prefill"]["detail"]) is native.has_bf16()
        # prompts attend from the paged blocks (models/kernels/prompt_attention.cpp); a bfloat16 twin's
        # in bfloat16 products
        assert "attention: paged prompt kernel" in plan["prefill"]["detail"]
        assert plan["prefill"]["detail"].endswith(", bfloat16 products") is (card["prompt_weights"] == "bfloat16")
    client = smollm2.openai("/smollm2")
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    whole = client.chat.completions.create(model="smollm2-135m-instruct", messages=messages,  # type: ignore[arg-type]
                                           temperature=0, max_tokens=40)
    text = whole.choices[0].message.content or ""
    assert "Paris" in text, text
    stream = client.chat.completions.create(model="smollm2-135m-instruct", messages=messages,  # type: ignore[arg-type]
                                            temperature=0, max_tokens=40, stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) == text
    # as shipped it decodes with prompt lookup: an answer that copies its prompt is the one without drafts
    assert card["speculative"]["method"] == "ngram"
    copy = [{"role": "user", "content": "Repeat exactly: the library opens on Monday at nine, and members may "
                                        "borrow ten books for three weeks."}]
    answers = [client.chat.completions.create(model="smollm2-135m-instruct", messages=copy,  # type: ignore[arg-type]
                                              temperature=0, max_tokens=48, extra_body={"speculative": on})
               .choices[0].message.content for on in (True, False)]
    assert answers[0] == answers[1] and "library" in (answers[0] or "").lower(), answers
    with smollm2.client() as c:
        metrics = c.get("/smollm2/metrics").text
    kept = [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
            if line.startswith("transformer_serve_generation_spec_accepted_tokens_total{")
            and 'model="smollm2-135m-instruct"' in line]
    assert kept and kept[0] > 0, kept


@pytest.mark.slow
def test_smollm2_structured_outputs_tools_and_logprobs(smollm2: Cluster) -> None:
    """On the shipped generator: a JSON schema validates, a forced tool call validates, and asking for
    log-probabilities does not change a greedy answer."""
    import jsonschema

    client = smollm2.openai("/smollm2")
    model = "smollm2-135m-instruct"
    ask = [{"role": "user", "content": "Describe a person as JSON."}]
    out = client.chat.completions.create(model=model, messages=ask, max_tokens=120, temperature=0.8, seed=1,  # type: ignore[call-overload]
                                         n=3, response_format=JSON_SCHEMA)
    for choice in out.choices:
        jsonschema.validate(json.loads(choice.message.content or ""), PERSON)
    weather = [{"role": "user", "content": "What is the weather in Paris?"}]
    call = client.chat.completions.create(model=model, messages=weather, max_tokens=120, temperature=0,  # type: ignore[call-overload]
                                          tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (tool_call,) = call.choices[0].message.tool_calls
    jsonschema.validate(json.loads(tool_call.function.arguments), WEATHER_PARAMS)
    plain = client.chat.completions.create(model=model, messages=weather, max_tokens=24, temperature=0)  # type: ignore[call-overload]
    logged = client.chat.completions.create(model=model, messages=weather, max_tokens=24, temperature=0,  # type: ignore[call-overload]
                                            logprobs=True, top_logprobs=2)
    assert logged.choices[0].message.content == plain.choices[0].message.content
    entries = logged.choices[0].logprobs.content  # type: ignore[union-attr]
    assert b"".join(bytes(e.bytes or []) for e in entries).decode("utf-8", "replace") == plain.choices[0].message.content


@pytest.mark.slow
def test_smollm2_a_long_shared_system_prompt_is_chunked_then_cached(smollm2: Cluster) -> None:
    """On the shipped generator: a ~400-token system prompt seen for the first time is prefilled in
    chunks (shipped prefill_chunk 256); the same conversation again finds its blocks in the prefix
    cache (the card's cached_prompt_tokens grows by nearly the whole prompt) and answers the same,
    token for token (greedy); a second question under the same system prompt reuses them too, and
    a next turn also the blocks of the first answer."""
    client = smollm2.openai("/smollm2")
    model = "smollm2-135m-instruct"
    system = ("You are the help desk of the city library of Lyon. " * 3 +
              "Opening hours: Monday to Friday 9 to 18, Saturday 10 to 17, closed on Sunday. " * 12)
    first = [{"role": "system", "content": system}, {"role": "user", "content": "When are you open on Saturday?"}]
    second = [first[0], {"role": "user", "content": "Is the library open on Sunday?"}]

    def cached() -> int:
        with smollm2.client() as c:
            (card,) = [m for m in c.get("/smollm2/v1/models").json()["data"] if m["deployment"] == "generator"]
        return card["stats"]["cached_prompt_tokens"]

    def ask(messages: list[dict[str, str]]) -> tuple[str, int]:
        out = client.chat.completions.create(model=model, messages=messages, max_tokens=24, temperature=0)  # type: ignore[arg-type]
        return out.choices[0].message.content or "", out.usage.prompt_tokens  # type: ignore[union-attr]

    before = cached()
    miss, prompt_tokens = ask(first)
    assert prompt_tokens > 300 and cached() - before < 32  # the system prompt is new: nearly all computed
    again = cached()
    hit, _ = ask(first)
    assert hit == miss
    assert cached() - again >= prompt_tokens - 16  # all of its full blocks came from the cache
    third = cached()
    ask(second)
    assert cached() - third >= len(system) // 8  # the shared system prompt's blocks (~4 characters a token)
    fourth = cached()
    turn = [*first, {"role": "assistant", "content": miss}, {"role": "user", "content": "And on Monday?"}]
    ask(turn)  # the first turn's answer left its blocks: the block after the first prompt's comes too
    assert cached() - fourth >= prompt_tokens // 16 * 16 + 16
