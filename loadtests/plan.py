"""What one benchmark run does: its plan (from the command line) and the request pools it sends.

The pools are built once, seeded, before any system starts, so every system gets the same requests
in the same order (clients cycle through a pool).
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from pathlib import Path

from . import workload
from .loadgen import Timing
from .protocol import RequestSpec, classify_request, embed_request, translate_request

log = logging.getLogger("loadtests.bench")
POOL_SIZE = 1024  # distinct requests per task (clients cycle through them)
GENERATE_POOL_SIZE = 512


@dataclass(frozen=True)
class Plan:
    tasks: tuple[str, ...]
    systems: tuple[str, ...]
    concurrency: tuple[int, ...]
    poisson_rates: tuple[float, ...]
    timing: Timing
    models: str
    threads: int
    device: str
    compare_at: int
    seed: int
    ignore_eos: str  # on | off | auto (see --ignore-eos)
    ready_timeout_s: float
    request_timeout_s: float
    settle_s: float
    progress_s: float
    dtype: str = "auto"  # auto: each system's own (ours: the shipped config; the others: float32 on cpu)

    def runs_per_system(self) -> int:
        return len(self.tasks) * len(self.concurrency) + (
            len(self.poisson_rates) if "generate" in self.tasks else 0
        )

    def estimate_s(self, startup_s: float = 50.0) -> float:
        t = self.timing
        per_run = t.warmup_s + t.duration_s + t.drain_s / 2 + 1.0  # saturated runs drain, light ones do not
        return len(self.systems) * (startup_s + self.runs_per_system() * per_run)


@dataclass
class Workloads:
    classify: list[RequestSpec]
    embed: list[RequestSpec]  # one sentence per request (an embedding service's common call)
    translate: list[RequestSpec]
    generate: list[workload.GenerateItem]
    notes: dict[str, str]


def build_workloads(plan: Plan, cache_dir: Path) -> Workloads:
    from .systems.modelsets import model_set, token_counter

    specs = model_set(plan.models)
    rng = random.Random(plan.seed)
    sentences = workload.load_sentences()
    notes: dict[str, str] = {}
    classify = [classify_request(t) for t in workload.sample_texts(sentences, POOL_SIZE, rng)]
    defaults = specs["translate"].defaults
    beam, max_new = int(defaults.get("beam_size", 4)), int(defaults.get("max_new_tokens", 128))
    translate = [
        translate_request(t, beam, max_new) for t in workload.sample_sentences(sentences, POOL_SIZE, rng)
    ]
    generate: list[workload.GenerateItem] = []
    if "generate" in plan.tasks:
        counter = token_counter(specs["generate"], cache_dir)
        if counter is None:
            notes["generate"] = "prompt lengths estimated from words (the model's tokenizer was not found)"
            log.warning("generate: %s", notes["generate"])
        generate = workload.sample_generation(
            sentences, GENERATE_POOL_SIZE, rng, counter or workload.words_as_tokens
        )
    # its own generator, so adding embed did not change the other tasks' requests
    embed = [embed_request(t) for t in workload.sample_sentences(sentences, POOL_SIZE, random.Random(plan.seed + 1))]
    return Workloads(classify, embed, translate, generate, notes)
