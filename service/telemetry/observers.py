"""The hooks of the batcher and the engine (service/telemetry/hooks.py) -> the Prometheus metrics of
one model (service/telemetry/metrics.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..messages import FINISH_REASONS
from .hooks import DROPS, REFUSALS, BatchObserver, EngineObserver, EngineStats
from .memory import resident_bytes
from .metrics import ServiceMetrics

if TYPE_CHECKING:
    from ..engine.events import Finished


class AdmissionMetrics:
    """on_admission of both observers: the wait estimate, and the refusals by reason (each of
    REFUSALS exported at 0 from the start)."""

    def __init__(self, metrics: ServiceMetrics, model: str) -> None:
        self.metrics, self.model = metrics, model
        for reason in REFUSALS:
            metrics["admission_refused_total"].labels(model, reason)

    def on_admission(self, wait_s: float | None, refused: str | None) -> None:
        if wait_s is not None:
            self.metrics["admission_wait_estimate_seconds"].labels(self.model).observe(wait_s)
        if refused is not None:
            self.metrics["admission_refused_total"].labels(self.model, refused).inc()


class RecompileMetrics:
    """The model's compiled blocks passing torch's recompile limit while it serves (its new shapes run
    eager from then on: the plan no longer holds): polled after each batch or step, counted from when
    the observer was made (a hit while warming up already made the plan eager). One model a process."""

    def __init__(self, metrics: ServiceMetrics, model: str) -> None:
        # imported here, in a replica: the ingress imports this module too, and never torch (test_layout.py)
        from models.execution.compiled import recompile_limit_hits

        self._count = recompile_limit_hits
        self._hits = metrics["compiled_recompile_limit_hits_total"].labels(model)
        self._hits_seen = recompile_limit_hits()

    def poll_recompiles(self) -> None:
        hits = self._count()
        if hits > self._hits_seen:
            self._hits.inc(hits - self._hits_seen)
            self._hits_seen = hits


class PrometheusBatchObserver(AdmissionMetrics, RecompileMetrics, BatchObserver):
    """A DynamicBatcher's hooks -> the batch and queue metrics of one model (each drop reason of
    DROPS exported at 0 from the start)."""

    def __init__(self, metrics: ServiceMetrics, model: str, adapters: Sequence[str] = (),
                 tasks: Sequence[str] = ()) -> None:
        AdmissionMetrics.__init__(self, metrics, model)
        RecompileMetrics.__init__(self, metrics, model)
        for reason in DROPS:
            metrics["batch_dropped_items_total"].labels(model, reason)
        for adapter in adapters:  # the configured adapters' counters from the first scrape
            metrics["encoder_adapter_tokens_total"].labels(model, adapter)
            for task in tasks:
                metrics["encoder_adapter_inputs_total"].labels(model, adapter, task)
        self.depth = metrics["queue_depth"].labels(model)
        self.wait = metrics["queue_wait_seconds"].labels(model)
        self.size = metrics["batch_size"].labels(model)
        self.tokens = metrics["batch_tokens"].labels(model)
        self.real = metrics["batch_real_tokens_total"].labels(model)
        self.computed = metrics["batch_computed_tokens_total"].labels(model)
        self.efficiency = metrics["batch_padding_efficiency_ratio"].labels(model)
        self.inference = metrics["batch_inference_seconds"].labels(model)
        self.rss = metrics["replica_resident_memory_bytes"].labels(model)

    def on_queue(self, queued: int) -> None:
        self.depth.set(queued)

    def on_adapter(self, adapter: str, task: str, inputs: int, tokens: int) -> None:
        self.metrics["encoder_adapter_inputs_total"].labels(self.model, adapter, task).inc(inputs)
        self.metrics["encoder_adapter_tokens_total"].labels(self.model, adapter).inc(tokens)

    def on_batch(self, items: int, real_tokens: int, computed_tokens: int, inference_s: float,
                 queue_waits_s: Sequence[float]) -> None:
        self.size.observe(items)
        self.tokens.observe(computed_tokens)
        self.real.inc(real_tokens)
        self.computed.inc(computed_tokens)
        self.efficiency.observe(real_tokens / computed_tokens if computed_tokens else 1.0)
        self.inference.observe(inference_s)
        self.rss.set(resident_bytes())
        self.poll_recompiles()
        for wait in queue_waits_s:
            self.wait.observe(wait)

    def on_dropped(self, reason: str, items: int) -> None:
        self.metrics["batch_dropped_items_total"].labels(self.model, reason).inc(items)


# EngineStats field -> its counter (generation_spec_<name>); milliseconds are exported as seconds
SPEC_COUNTERS = {"spec_drafted": "draft_tokens_total", "spec_accepted": "accepted_tokens_total",
                 "spec_steps": "verify_steps_total", "spec_draft_steps": "draft_steps_total", "spec_step_ms": "step_seconds_total",
                 "spec_plain_ms": "plain_seconds_total"}


class PrometheusEngineObserver(AdmissionMetrics, RecompileMetrics, EngineObserver):
    """A GenerationEngine's hooks -> the generation metrics of one model (and its queue and steps
    in the shared queue/batch metrics)."""

    def __init__(self, metrics: ServiceMetrics, model: str, speculative: str | None = None,
                 adapters: Sequence[str] = ()) -> None:
        """`speculative`: the engine's speculative method (its counters are exported from the start,
        as are the finished requests of each of FINISH_REASONS, and the counters of each configured
        adapter in `adapters`)."""
        AdmissionMetrics.__init__(self, metrics, model)
        RecompileMetrics.__init__(self, metrics, model)
        for reason in FINISH_REASONS:
            metrics["generation_requests_finished_total"].labels(model, reason)
            for adapter in adapters:
                metrics["generation_adapter_requests_total"].labels(model, adapter, reason)
        for adapter in adapters:
            metrics["generation_adapter_prompt_tokens_total"].labels(model, adapter)
            metrics["generation_adapter_generated_tokens_total"].labels(model, adapter)
        self.spec = {f: metrics[f"generation_spec_{name}"].labels(model, speculative)
                     for f, name in SPEC_COUNTERS.items()} if speculative else {}
        self._spec_seen = dict.fromkeys(self.spec, 0)  # the engine's counts at the last step
        self.wait = metrics["queue_wait_seconds"].labels(model)
        self.depth = metrics["queue_depth"].labels(model)
        self.size = metrics["batch_size"].labels(model)
        self.inference = metrics["batch_inference_seconds"].labels(model)
        self.ttft = metrics["generation_time_to_first_token_seconds"].labels(model)
        self.itl = metrics["generation_inter_token_latency_seconds"].labels(model)
        self.prompt = metrics["generation_prompt_tokens_total"].labels(model, metrics.replica)
        self.cached = metrics["generation_prompt_cached_tokens_total"].labels(model, metrics.replica)
        self.prefix_bytes = metrics["generation_prefix_cache_bytes"].labels(model)
        self.generated = metrics["generation_generated_tokens_total"].labels(model)
        self.running = metrics["generation_running_requests"].labels(model)
        self.waiting = metrics["generation_waiting_requests"].labels(model)
        self.cache = metrics["generation_kv_cache_usage_ratio"].labels(model)
        self.blocks_used = metrics["generation_kv_blocks"].labels(model, "used")
        self.blocks_free = metrics["generation_kv_blocks"].labels(model, "free")
        self.preempted = metrics["generation_preempted_total"].labels(model)
        self._preempted = 0  # the engine's count at the last step
        self.rss = metrics["replica_resident_memory_bytes"].labels(model)

    def on_admitted(self, queued_s: float, prompt_tokens: int, cached_tokens: int = 0) -> None:
        self.wait.observe(queued_s)
        self.prompt.inc(prompt_tokens)
        if cached_tokens:
            self.cached.inc(cached_tokens)

    def on_first_token(self, ttft_s: float) -> None:
        self.ttft.observe(ttft_s)

    def on_inter_token(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def on_step(self, stats: EngineStats, generated: int, step_s: float) -> None:
        self.running.set(stats.running)
        self.waiting.set(stats.waiting)
        self.depth.set(stats.waiting)
        self.cache.set(stats.cache_usage)
        self.prefix_bytes.set(stats.prefix_cache_bytes)
        if stats.kv_blocks:
            self.blocks_used.set(stats.kv_blocks - stats.kv_blocks_free)
            self.blocks_free.set(stats.kv_blocks_free)
        if stats.preempted > self._preempted:
            self.preempted.inc(stats.preempted - self._preempted)
            self._preempted = stats.preempted
        for field, counter in self.spec.items():
            now = getattr(stats, field)
            if now > self._spec_seen[field]:
                scale = 1000 if field.endswith("_ms") else 1
                counter.inc((now - self._spec_seen[field]) / scale)
                self._spec_seen[field] = now
        self.rss.set(resident_bytes())
        self.poll_recompiles()
        if generated:
            self.generated.inc(generated)
            self.size.observe(generated)
            self.inference.observe(step_s)

    def on_finished(self, event: Finished) -> None:
        self.metrics["generation_requests_finished_total"].labels(self.model, event.finish_reason).inc()
        if event.adapter is not None:
            m, labels = self.metrics, (self.model, event.adapter)
            m["generation_adapter_requests_total"].labels(*labels, event.finish_reason).inc()
            m["generation_adapter_prompt_tokens_total"].labels(*labels).inc(event.usage.prompt_tokens)
            m["generation_adapter_generated_tokens_total"].labels(*labels).inc(event.usage.completion_tokens)
            if event.timing.first_token_s is not None:
                m["generation_adapter_time_to_first_token_seconds"].labels(*labels).observe(event.timing.first_token_s)
