"""What the batcher and the generation engine report: observer hooks and a stats snapshot, free of
any metrics library and of torch. The Prometheus wiring (service/telemetry/observers.py) subclasses
the observers; the replicas and the engine call them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..engine.events import Finished

# on_admission's `refused`: no room in the queue, or the estimated wait outlasts the request's deadline
QUEUE_FULL, DEADLINE = "queue_full", "deadline"
REFUSALS = (QUEUE_FULL, DEADLINE)
# on_dropped's `reason`: refused at submit (queue full), the caller went away, its deadline passed
REJECTED, CANCELLED, EXPIRED = "rejected", "cancelled", "expired"
DROPS = (REJECTED, CANCELLED, EXPIRED)


class BatchObserver:
    """Metrics hooks of a DynamicBatcher; the defaults do nothing. Called on the replica's event loop;
    keep them cheap. An exception in a hook is logged and ignored."""

    def on_queue(self, queued: int) -> None:
        """The number of items waiting changed (after a submit, a batch was taken, items were dropped)."""

    def on_batch(self, items: int, real_tokens: int, computed_tokens: int, inference_s: float,
                 queue_waits_s: Sequence[float]) -> None:
        """A batch was computed: its rows, real and padded tokens, the seconds run_batch took, and how
        long each of its items waited in the queue."""

    def on_dropped(self, reason: str, items: int) -> None:
        """Items that never reached the model: reason is one of DROPS."""

    def on_admission(self, wait_s: float | None, refused: str | None) -> None:
        """A request was queued (refused None) or refused (one of REFUSALS); wait_s: the estimated
        wait before its first batch starts (None: not estimated)."""

    def on_adapter(self, adapter: str, task: str, inputs: int, tokens: int) -> None:
        """A request on a LoRA adapter was answered: its task, inputs and their tokens."""


@dataclass(frozen=True)
class EngineStats:
    """A snapshot taken after the last step (counters are totals since the engine was built)."""

    running: int  # rows decoding
    waiting: int  # queued, not yet prefilled
    rows: int  # cache rows (the most sequences that can run at once)
    cache_usage: float  # tokens held in the KV cache / its capacity (rows * max_total_tokens)
    cache_bytes: int
    prompt_tokens: int  # prompts admitted
    generated_tokens: int  # sampled
    steps: int
    finished: Mapping[str, int] = field(default_factory=dict)  # finish_reason -> requests
    cached_prompt_tokens: int = 0  # of prompt_tokens, not computed: prefix cache hits, siblings' shared rows
    prefix_cache_bytes: int = 0  # keys/values the prefix cache holds
    kv_blocks: int = 0  # paged cache: blocks sequences can hold (0: a row per sequence)
    kv_blocks_free: int = 0
    preempted: int = 0  # requests preempted when blocks ran out
    first_tokens: int = 0  # requests that got their first token
    ttft_ms: int = 0  # their times to first token, summed (milliseconds)
    inter_tokens: int = 0  # tokens after a request's first
    itl_ms: int = 0  # the gaps before them, summed (milliseconds)
    # speculative decoding (service/engine/speculation/): tokens drafted and verified, of them kept, verify
    # steps, the draft model's steps, their time (drafting included) and the time plain steps would have
    # taken for the same tokens
    spec_drafted: int = 0
    spec_accepted: int = 0
    spec_steps: int = 0
    spec_draft_steps: int = 0
    spec_step_ms: int = 0
    spec_plain_ms: int = 0


class EngineObserver:
    """Metrics hooks; the defaults do nothing. Called on the engine thread (a request cancelled while
    waiting is reported on the thread that cancelled it). Keep them cheap; an exception in a hook
    is logged and ignored."""

    def on_admitted(self, queued_s: float, prompt_tokens: int, cached_tokens: int = 0) -> None:
        """A request was prefilled after waiting `queued_s` seconds; `cached_tokens` of its prompt came
        from the prefix cache (or a sibling's row) instead of being computed."""

    def on_first_token(self, ttft_s: float) -> None:
        """Time from submit to a request's first token."""

    def on_inter_token(self, seconds: float) -> None:
        """Time between two consecutive tokens of one request."""

    def on_step(self, stats: EngineStats, generated: int, step_s: float) -> None:
        """After every scheduler step: gauges (running, waiting, cache usage), tokens it sampled."""

    def on_finished(self, event: Finished) -> None:
        """A request ended (any finish_reason); its usage and timing are in the event."""

    def on_admission(self, wait_s: float | None, refused: str | None) -> None:
        """A submission was admitted to the queue (refused None) or refused (one of REFUSALS);
        wait_s: the estimated wait for a row (None: not estimated). On the submitting thread."""
