"""Security invariants without Ray: limits refuse a request before any model work, error bodies carry
no internals, checkpoints load without pickle code, /metrics carries no request content."""

from __future__ import annotations

import ast
import asyncio
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from models.catalog import LoadedModel, ModelSpec, load_model
from models.checkpoints.hf import read_hf_dir
from service.engine.config import EngineConfig
from service.errors import InvalidItem, InvalidRequest, RequestTooLarge
from service.messages import GenerationRequest, TranslateOptions
from service.replica.config import BatchLimits
from service.replica.encoder import EncoderRunner
from service.replica.generator import GeneratorRunner
from service.replica.translator import TranslatorRunner
from service.testing.fake_backend import EchoBackend, fake_app
from tests.service.http_checks import send

ROOT = Path(__file__).resolve().parents[2]
SECRET = "zq-secret-internals-7731"


# -- limits at the edge: refused before the backend is called ---------------------------------------

OVER_LIMITS = [
    ("/v1/classify", {"inputs": ["a"] * 9}, "inputs"),  # fake settings: max_inputs 8
    ("/v1/embeddings", {"input": ["a"] * 9}, "input"),
    ("/v1/translate", {"inputs": "a", "source_lang": "en", "target_lang": "es", "max_new_tokens": 4097}, "max_new_tokens"),
    ("/v1/translate", {"inputs": "a", "source_lang": "en", "target_lang": "es", "beam_size": 9}, "beam_size"),
    ("/v1/generate", {"prompt": "a", "max_new_tokens": 10**7}, "max_new_tokens"),
    ("/v1/generate", {"prompt": "a", "stop": ["s"] * 9}, "stop"),
    ("/v1/generate", {"prompt": "a", "stop": ["s" * 257]}, "stop[0]"),
    ("/v1/completions", {"prompt": ["a"] * 9}, "prompt"),  # a list of prompts: one per choice, max_inputs 8
    ("/v1/completions", {"prompt": "a", "n": 9}, "n"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "max_tokens": 10**7}, "max_tokens"),
    # texts over 16 characters per token of the model's limit (fake: 64 tokens, 1024 characters), never tokenized
    ("/v1/classify", {"inputs": ["ok", "x" * 1025]}, "inputs[1]"),
    ("/v1/embeddings", {"input": "x" * 5000}, "input[0]"),
    ("/v1/rerank", {"query": "q", "texts": ["x" * 1025]}, "texts[0]"),
    ("/v1/rerank", {"query": "q" * 1025, "texts": ["a"]}, "query"),
    ("/v1/translate", {"inputs": "x" * 1025, "source_lang": "en", "target_lang": "es"}, "inputs[0]"),
    ("/v1/generate", {"prompt": "x" * 5000}, "prompt"),
    ("/v1/completions", {"prompt": ["a", "x" * 1025]}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 600}] * 2}, "messages"),
    ("/tokenize", {"prompt": "x" * 1025}, "prompt"),
]


@pytest.mark.parametrize(("path", "body", "param"), OVER_LIMITS)
def test_limits_at_the_edge_are_checked_before_any_model_call(path: str, body: dict[str, Any], param: str) -> None:
    backend = EchoBackend()
    r = send(fake_app(backend=backend), "POST", path, json=body)
    assert r.status_code == 422 and r.json()["error"]["param"] == param
    assert backend.calls == {}


def test_truncate_cuts_an_oversized_text_at_the_edge() -> None:
    backend = EchoBackend()
    seen: list[list[str]] = []
    classify = backend._classify
    backend._classify = lambda texts, *rest: seen.append(texts) or classify(texts, *rest)  # type: ignore[method-assign]
    r = send(fake_app(backend=backend), "POST", "/v1/classify", json={"inputs": ["x" * 5000, "ok"], "truncate": True})
    assert r.status_code == 200, r.text
    assert [len(t) for t in seen[0]] == [1024, 2]  # the first 1024 characters


def test_a_body_over_the_limit_is_refused_unread() -> None:
    backend = EchoBackend()
    app = fake_app({"max_body_bytes": 1024}, backend)
    r = send(app, "POST", "/v1/generate", json={"prompt": "x" * 2000})
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
    assert backend.calls == {}


# -- limits in the replicas: refused before batching or the engine ----------------------------------

def _load(family: str, tasks: tuple[str, ...], **extra: Any) -> LoadedModel:
    spec = ModelSpec(name=f"tiny-{family}", tasks=tasks, source=f"tiny:{family}", max_input_tokens=32, **extra)
    return load_model(spec, Path("/nonexistent-cache"))


def test_encoder_and_translator_refuse_before_batching() -> None:
    encoder = EncoderRunner(_load("encoder", ("classify", "embed")), "encoder", BatchLimits(max_wait_ms=10))
    translator = TranslatorRunner(_load("seq2seq", ("translate",), languages=("en", "es")), "translator",
                                  BatchLimits(max_wait_ms=10))

    async def main() -> None:
        with pytest.raises(InvalidItem) as too_long:
            await encoder.classify(["fine", "x" * 100], truncate=False, timeout_s=5)
        assert too_long.value.index == 1
        with pytest.raises(InvalidRequest, match="max_new_tokens"):
            await translator.translate(["fine"], TranslateOptions(max_new_tokens=10**6), timeout_s=5)
        with pytest.raises(InvalidItem):
            await translator.translate(["x" * 100], TranslateOptions(), timeout_s=5)

    asyncio.run(main())
    for runner in (encoder, translator):
        assert runner.batcher.stats.batches == 0 and runner.batcher.stats.items == 0
        assert runner.batcher.queued == 0


def test_an_oversized_text_is_never_tokenized_by_a_replica() -> None:
    """Over 16 characters per token of the limit (32 tokens: 512 characters), a text is refused (or cut
    with truncate) for the cost of len(): the tokenizer never sees more than the cap."""
    encoder = EncoderRunner(_load("encoder", ("classify", "embed")), "encoder", BatchLimits(max_wait_ms=10))
    generator = GeneratorRunner(_load("decoder", ("generate",)), "generator", EngineConfig(max_total_tokens=None))
    for loaded in (encoder.loaded, generator.loaded):
        encode = loaded.tokenizer.encode

        def bounded(text: str, add_special_tokens: bool = True, encode: Any = encode) -> list[int]:
            assert len(text) <= 16 * 512, len(text)  # the generator's cap is by its prompt limit (511)
            return encode(text, add_special_tokens)

        loaded.tokenizer.encode = bounded  # type: ignore[method-assign]

    async def main() -> None:
        with pytest.raises(InvalidItem, match="characters") as too_long:
            await encoder.embed(["fine", "x" * 10**6], truncate=False, timeout_s=5)
        assert too_long.value.index == 1
        cut = await encoder.embed(["x" * 10**6], truncate=True, timeout_s=5)
        assert cut.prompt_tokens <= 32
        with pytest.raises(RequestTooLarge, match="characters") as prompt:
            await generator.submit(GenerationRequest("big", prompt="x" * 10**6))
        assert prompt.value.param == "prompt" and prompt.value.limit == "max_prompt_tokens"

    asyncio.run(main())
    generator.close()


def test_the_generator_refuses_before_the_engine() -> None:
    loaded = _load("decoder", ("generate",))
    runner = GeneratorRunner(loaded, "generator",
                             EngineConfig(max_running=2, max_total_tokens=40, max_new_tokens=16, kv_cache_mib=4))
    for request, limit in [(GenerationRequest("a", prompt="x" * 100), "max_prompt_tokens"),
                           (GenerationRequest("b", prompt="hi", max_new_tokens=17), "max_new_tokens"),
                           (GenerationRequest("c", prompt="x" * 30, max_new_tokens=16), "max_total_tokens")]:
        with pytest.raises(RequestTooLarge) as refused:
            asyncio.run(runner.submit(request))
        assert refused.value.limit == limit
    stats = runner.engine.stats()
    assert stats.waiting == 0 and stats.running == 0 and stats.prompt_tokens == 0 and stats.steps == 0


# -- error bodies -----------------------------------------------------------------------------------

class FailingBackend(EchoBackend):
    """Every call raises an exception whose text must never reach a client; streams fail midway."""

    async def call(self, deployment: str, method: str, *args: Any) -> Any:
        raise RuntimeError(f"{SECRET} in {method}")

    async def stream(self, deployment: str, method: str, request: GenerationRequest) -> Any:
        async for event in super().stream(deployment, method, request):
            yield event
            raise KeyError(SECRET)


class MalformedBackend(EchoBackend):
    """Answers of the wrong type: the route itself raises (TypeError, AttributeError)."""

    async def call(self, deployment: str, method: str, *args: Any) -> Any:
        return SECRET


@pytest.mark.parametrize("backend", [FailingBackend(), MalformedBackend()], ids=["raises", "malformed"])
def test_internal_errors_are_a_generic_500_without_internals(backend: EchoBackend) -> None:
    app = fake_app(backend=backend)
    for path, body in [("/v1/classify", {"inputs": "a"}), ("/v1/embeddings", {"input": "a"}),
                       ("/v1/translate", {"inputs": "a", "source_lang": "en", "target_lang": "es"}),
                       ("/v1/generate", {"prompt": "a"}), ("/v1/completions", {"prompt": "a"})]:
        r = send(app, "POST", path, json=body)
        assert r.status_code == 500, (path, r.text)
        assert r.json() == {"error": {"type": "internal_error", "message": "internal error; see the server log"}}
        assert SECRET not in r.text and "Traceback" not in r.text and "File " not in r.text


def test_a_stream_that_fails_midway_ends_with_a_generic_error_event() -> None:
    r = send(fake_app(backend=FailingBackend()), "POST", "/v1/generate", json={"prompt": "a", "stream": True})
    assert r.status_code == 200
    events = [json.loads(block[6:]) for block in r.text.strip().split("\n\n")]
    assert events[-1] == {"error": {"type": "internal_error", "message": "internal error; see the server log"}}
    assert SECRET not in r.text and "Traceback" not in r.text


# -- checkpoints ------------------------------------------------------------------------------------

UNSAFE_IMPORTS = {"pickle", "cPickle", "dill", "cloudpickle", "joblib", "shelve", "marshal"}


def _unsafe_loads(path: Path) -> list[str]:
    """torch.load without weights_only=True, np.load with allow_pickle, imports of pickle modules."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{where} imports {n}" for n in names if n and n.split(".")[0] in UNSAFE_IMPORTS]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "load":
            owner = ast.unparse(node.func.value)
            kwargs = {k.arg: ast.unparse(k.value) for k in node.keywords}
            if owner == "torch" and kwargs.get("weights_only") != "True":
                found.append(f"{where} torch.load without weights_only=True")
            if owner in ("np", "numpy") and kwargs.get("allow_pickle", "False") != "False":
                found.append(f"{where} np.load with allow_pickle")
    return found


def test_no_code_loads_pickles() -> None:
    files = [p for d in ("models", "service", "loadtests") for p in sorted((ROOT / d).rglob("*.py"))]
    assert len(files) > 30
    assert [f for p in files for f in _unsafe_loads(p)] == []


class _Exploit:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def test_a_pickled_checkpoint_cannot_run_code(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    (tmp_path / "config.json").write_text("{}")
    torch.save({"weight": torch.zeros(2), "payload": _Exploit(marker)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(Exception, match="[Ww]eights only load failed"):
        read_hf_dir(tmp_path)
    assert not marker.exists()


# -- metrics ----------------------------------------------------------------------------------------

def test_metrics_never_carry_request_content() -> None:
    app = fake_app()
    marker = "zq-distinctive-payload-4242"
    bodies = [("/v1/classify", {"inputs": [marker]}), ("/v1/generate", {"prompt": marker}),
              ("/v1/generate", {"prompt": marker, "stream": True, "stop": [marker]}),
              ("/v1/completions", {"prompt": marker, "model": marker}),
              ("/v1/translate", {"inputs": marker, "source_lang": marker, "target_lang": "es"})]
    for path, body in bodies:
        send(app, "POST", path, json=body, headers={"X-Request-Timeout": "5", "User-Agent": marker})
    send(app, "GET", f"/{marker}")  # an unknown path: never a label value
    metrics = send(app, "GET", "/metrics")
    assert metrics.status_code == 200 and "# TYPE" in metrics.text
    assert marker not in metrics.text and "zq-distinctive" not in metrics.text


@pytest.mark.parametrize(("path", "body", "words"), [
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "x"}]}, "exactly one of prompt and messages"),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, "needs the tool_call_id"),
    ("/v1/completions", {"prompt": "a", "logit_bias": {"x": 1}}, "logit_bias keys are token ids"),
])
def test_422_bodies_carry_our_messages_not_the_librarys_wrapping(path: str, body: dict[str, Any], words: str) -> None:
    r = send(fake_app(), "POST", path, json=body)
    message = r.json()["error"]["message"]
    assert r.status_code == 422 and words in message and "Value error" not in message, message
