"""What an operator sets for the continuous-batching engine, free of torch: the settings embed it
as a generator deployment's `engine` (service/settings.py), and EngineLimits (service/engine/limits.py)
resolves it against one model, once, when the engine is built."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineConfig:
    """Scheduler limits. The defaults suit SmolLM2-135M on CPU: 8 sequences of up to 1024 tokens fit
    the 384 MiB KV cache in float32. Token limits are cut to the model's own (max_positions, its
    max_input_tokens)."""

    __pydantic_config__ = {"extra": "forbid"}  # in a config file (pydantic reads it), a misspelt field is an error

    max_running: int = 8  # sequences decoding at once (paged: as blocks allow; rows: if the budget holds the rows)
    kv_cache_mib: float = 384.0  # KV-cache budget: blocks of 16 tokens (paged), or rows of max_total_tokens
    # paged: the cache is a pool of 16-token blocks (models/cache/paged.py), a sequence holds the blocks its
    # tokens fill, and the engine preempts the newest sequence when they run out; false: one preallocated
    # row of max_total_tokens per sequence. Sliding-window models always keep rows (a ring of the window).
    paged: bool = True
    max_total_tokens: int | None = 1024  # prompt + output per request = tokens per cache row; None: max_positions
    max_prompt_tokens: int | None = None  # None: the model's max_input_tokens; always < max_total_tokens
    max_new_tokens: int | None = 512  # output tokens per request; None: max_total_tokens - 1
    max_queued: int = 64  # requests waiting for a row; one more is refused (503 + Retry-After)
    prefill_tokens: int = 2048  # padded prompt tokens per admission step (one request is always admitted)
    # a prompt longer than this is prefilled this many tokens per step while the running requests keep
    # decoding (one such prompt at a time), so a long prompt does not stall every stream; None: whole
    prefill_chunk: int | None = 256
    # aim each admission step at about this long: its padded prompt tokens are cut to what the measured
    # prefill rate computes in this time (at least one request, at most prefill_tokens), so on a slow CPU
    # running streams do not wait seconds behind new prompts; None: prefill_tokens alone
    prefill_step_ms: float | None = None
    # prompt blocks' keys/values kept by content (engine/prefix_cache.py): a prompt that begins like an
    # earlier one (a system prompt, a chat history) prefills only the rest; 0: off
    prefix_cache_mib: float = 256.0
    # decode steps as captured CUDA graphs, one per bucket of rows x key blocks (models/execution/graphs.py),
    # captured at warm-up; None: on CUDA with a paged cache. True on a CPU runs the same padded steps
    # eagerly (tests); false: eager steps of the exact size
    decode_graphs: bool | None = None
    # with decode graphs, launch each decode step before the previous one's tokens are handed out, so
    # the host's per-row work overlaps the device's next step (engine/lookahead.py); only while no
    # request waits for a row
    decode_ahead: bool = True

    def __post_init__(self) -> None:
        problems = [f"{name} must be a positive integer, got {getattr(self, name)!r}"
                    for name in ("max_running", "max_queued", "prefill_tokens", "max_prompt_tokens",
                                 "max_new_tokens", "prefill_chunk")
                    if getattr(self, name) is not None and getattr(self, name) < 1]
        if self.max_total_tokens is not None and self.max_total_tokens < 2:
            problems.append(f"max_total_tokens must leave room for a prompt and one token, got {self.max_total_tokens}")
        if not self.kv_cache_mib > 0:
            problems.append(f"kv_cache_mib must be > 0, got {self.kv_cache_mib!r}")
        if self.prefill_step_ms is not None and not self.prefill_step_ms > 0:
            problems.append(f"prefill_step_ms must be > 0, got {self.prefill_step_ms!r}")
        if not self.prefix_cache_mib >= 0:
            problems.append(f"prefix_cache_mib must be >= 0, got {self.prefix_cache_mib!r}")
        if problems:
            raise ValueError("EngineConfig: " + "; ".join(problems))

    @property
    def kv_cache_bytes(self) -> int:
        return int(self.kv_cache_mib * 2**20)


@dataclass(frozen=True)
class TranslationConfig:
    """How a translator deployment schedules its beam searches (its `translation` settings)."""

    __pydantic_config__ = {"extra": "forbid"}

    # "steps": the translation engine (engine/translation.py): requests join and leave the search at
    # every decoder step; "batches": request-level dynamic batches (the deployment's `batching`), each
    # beam search run to its end before the next batch starts
    scheduler: str = "steps"
    max_rows: int = 64  # beams decoding at once (each request reserves its beam size); 101 MiB of cache for the default translator
    max_queued: int = 512  # sources waiting for rows; one more is refused (503 + Retry-After)
    encode_tokens: int = 4096  # padded source tokens encoded per admission step (one source always)

    def __post_init__(self) -> None:
        problems = [f"{name} must be a positive integer, got {getattr(self, name)!r}"
                    for name in ("max_rows", "max_queued", "encode_tokens") if getattr(self, name) < 1]
        if self.scheduler not in ("steps", "batches"):
            problems.append(f"scheduler must be 'steps' or 'batches', got {self.scheduler!r}")
        if problems:
            raise ValueError("TranslationConfig: " + "; ".join(problems))
