"""Realistic mixed traffic against our service with Locust (see loadtests/README.md):

    locust -f loadtests/locustfile.py --headless -u 32 -r 8 -t 60s --host http://127.0.0.1:8000

Each simulated user waits 0.1-1 s between requests and picks, by weight: classify 35 %, embeddings
20 %, translate 20 %, generate 12.5 % (plain) and 12.5 % (streamed) - only among the tasks the
server lists in /v1/models. Texts have the benchmark's skewed lengths (loadtests/workload.py):
mostly one sentence, sometimes a paragraph; embeddings requests carry 1-8 texts. Generation finds
its route in /openapi.json (loadtests/protocol.py) and asks for 16-128 tokens after 10-200-token
prompts. Streamed generation reports three entries: time to the response headers, time to the
first text (`TTFT`) and to the end of the stream (`total`).
"""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from locust import HttpUser, between, task

if str(Path(__file__).resolve().parent.parent) not in sys.path:  # locust puts only this file's folder on it
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loadtests import workload  # noqa: E402
from loadtests.protocol import (  # noqa: E402
    DONE,
    GenerateAPI,
    RequestSpec,
    classify_request,
    completion_text,
    discover_generate,
    parse_stream_line,
    translate_request,
)

WEIGHTS = {"classify": 35, "embed": 20, "translate": 20, "generate": 12.5, "generate_stream": 12.5}
_SENTENCES: list[str] = []


def sentences() -> list[str]:
    if not _SENTENCES:  # read once per Locust process, on the first user's start
        _SENTENCES.extend(workload.load_sentences())
    return _SENTENCES


class ServiceUser(HttpUser):
    wait_time = between(0.1, 1.0)

    def on_start(self) -> None:
        self.rng = random.Random()
        models = self.client.get("/v1/models", name="/v1/models").json()
        served = set((models.get("tasks") or {}).keys())
        self.generate_api: GenerateAPI | None = None
        if "generate" in served:
            names = models["tasks"]["generate"]
            self.generate_api, _ = discover_generate(
                self.client.get("/openapi.json", name="/openapi.json").json(), names[0] if names else None
            )
        actions: dict[str, Callable[[], None]] = {
            "classify": self.classify,
            "embed": self.embed,
            "translate": self.translate,
            "generate": lambda: self.generate(stream=False),
            "generate_stream": lambda: self.generate(stream=True),
        }
        available = {
            k: v
            for k, v in actions.items()
            if k.removesuffix("_stream") in served and (not k.startswith("generate") or self.generate_api)
        }
        if not available:
            raise RuntimeError(
                f"the server lists none of the tasks this locustfile sends ({sorted(WEIGHTS)})"
            )
        self.actions = list(available.values())
        self.weights = [WEIGHTS[k] for k in available]

    @task
    def one_request(self) -> None:
        self.rng.choices(self.actions, self.weights)[0]()

    def _post(self, spec: RequestSpec, name: str) -> None:
        self.client.post(spec.path, json=spec.body, name=name)

    def classify(self) -> None:
        self._post(classify_request(workload.sample_texts(sentences(), 1, self.rng)[0]), "classify")

    def embed(self) -> None:
        texts = workload.sample_texts(sentences(), self.rng.randint(1, 8), self.rng)
        self.client.post("/v1/embeddings", json={"input": texts, "truncate": True}, name="embeddings")

    def translate(self) -> None:
        self._post(
            translate_request(workload.sample_sentences(sentences(), 1, self.rng)[0], 4, 128), "translate"
        )

    def generate(self, stream: bool) -> None:
        assert self.generate_api is not None
        item = workload.sample_generation(sentences(), 1, self.rng)[0]
        spec = self.generate_api.request(item.prompt, item.max_tokens, stream=stream, exact=False)
        if not spec.stream:
            self._post(spec, "generate")
            return
        started = time.perf_counter()
        first: float | None = None
        error: Exception | None = None
        with self.client.post(
            spec.path, json=spec.body, stream=True, catch_response=True, name="generate (stream): headers"
        ) as resp:
            if resp.status_code != 200:
                resp.failure(f"{resp.status_code}: {resp.text[:200]}")
                return
            for line in resp.iter_lines(decode_unicode=True):
                event = parse_stream_line(line or "")
                if event is DONE:
                    break
                if isinstance(event, dict) and first is None and completion_text(event):
                    first = time.perf_counter()
            resp.success()
        if first is None:
            error = RuntimeError("the stream carried no text")
        end = time.perf_counter()
        self._report("generate (stream): TTFT", (first or end) - started, error)
        self._report("generate (stream): total", end - started, error)

    def _report(self, name: str, seconds: float, error: Exception | None) -> None:
        meta: dict[str, Any] = {
            "request_type": "POST",
            "name": name,
            "response_time": seconds * 1000.0,
            "response_length": 0,
            "exception": error,
            "context": {},
        }
        self.environment.events.request.fire(**meta)
