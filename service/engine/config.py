"""What an operator sets for the continuous-batching engine, free of torch: the settings embed it
as a generator deployment's `engine` (service/settings.py), and EngineLimits (service/engine/limits.py)
resolves it against one model, once, when the engine is built."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (service/engine/speculation/): rows propose tokens that the model verifies in
    one step, as extra entries of the decode step, keeping the tokens it would have chosen itself
    (greedy: the same output; sampling: the same distribution). Whether a step drafts, and how many
    tokens each row drafts, is decided per step from the measured step times and each request's
    acceptance so far (`adaptive`); large batches stop drafting by themselves."""

    __pydantic_config__ = {"extra": "forbid"}

    # "ngram": prompt lookup (the tokens that followed the latest earlier occurrence of the sequence's
    # last n tokens, in its prompt or output; no second model); "draft": a draft model of the same
    # tokenizer (`draft`) proposes its greedy tokens
    method: Literal["ngram", "draft"] = "ngram"
    max_draft_tokens: int = 8  # tokens a row proposes in a step, at most
    ngram_max: int = 4  # ngram: the longest suffix looked up (the longest match wins)
    ngram_min: int = 2  # ngram: the shortest
    # draft: the draft model, as changes to the deployment's model spec (e.g. {"quantize": "q4_1"}: the
    # same weights as 4-bit blocks; {"source": ...}: a smaller model of the family, same tokenizer)
    draft: Mapping[str, Any] = field(default_factory=dict)
    # draft: the draft model speculates its own steps by prompt lookup (ngram_min..ngram_max), so its k
    # drafts take fewer of its steps where the text repeats itself; the drafts are the same tokens
    draft_lookup: bool = True
    # a row's acceptance rate before any of its drafts was verified (the adaptive rule's prior)
    prior_acceptance: float = 0.6
    # false: every row that may draft drafts max_draft_tokens every step, whatever the measured times say
    # (vLLM's fixed num_speculative_tokens; for a draft known to pay, or to measure acceptance)
    adaptive: bool = True

    def __post_init__(self) -> None:
        problems = []
        if not 1 <= self.max_draft_tokens <= 32:
            problems.append(f"max_draft_tokens must be in [1, 32], got {self.max_draft_tokens!r}")
        if not 1 <= self.ngram_min <= self.ngram_max <= 16:
            problems.append(f"ngram_min and ngram_max must satisfy 1 <= ngram_min <= ngram_max <= 16, "
                            f"got {self.ngram_min!r} and {self.ngram_max!r}")
        if not 0.0 < self.prior_acceptance < 1.0:
            problems.append(f"prior_acceptance must be in (0, 1), got {self.prior_acceptance!r}")
        if self.method == "draft" and not self.draft:
            problems.append("method 'draft' needs `draft`: the draft model as changes to the model spec, "
                            "e.g. {quantize: q4_1}")
        if problems:
            raise ValueError("SpeculativeConfig: " + "; ".join(problems))


@dataclass(frozen=True)
class EngineConfig:
    """Scheduler limits. The defaults suit SmolLM2-135M on CPU: 8 sequences of up to 1024 tokens fit
    the 384 MiB KV cache in float32. Token limits are cut to the model's own (max_positions, its
    max_input_tokens)."""

    __pydantic_config__ = {"extra": "forbid"}  # in a config file (pydantic reads it), a misspelt field is an error

    max_running: int = 8  # sequences decoding at once (paged: as blocks allow; rows: if the budget holds the rows)
    kv_cache_mib: float = 384.0  # KV-cache budget: blocks of 16 tokens (paged), or rows of max_total_tokens
    # what the cache keeps keys and values in: "auto" the model's dtype, or "float32", "bfloat16",
    # "float16". bfloat16 on a float32 model: twice the tokens in the budget and half the bytes a decode
    # step's attention reads, each key and value rounded to 8 significant bits as it is stored (every
    # step attends the stored values, so chunked, cached and whole prompts agree); the CPU's decode kernel
    # reads float32 and bfloat16 pools
    kv_cache_dtype: str = "auto"
    # paged: the cache is a pool of 16-token blocks (models/cache/paged.py), a sequence holds the blocks its
    # tokens fill, and the engine preempts the newest sequence when they run out; false: one preallocated
    # row of max_total_tokens per sequence. Sliding-window models always keep rows (a ring of the window).
    paged: bool = True
    max_total_tokens: int | None = 1024  # prompt + output per request = tokens per cache row; None: max_positions
    max_prompt_tokens: int | None = None  # None: the model's max_input_tokens; always < max_total_tokens
    max_new_tokens: int | None = 512  # output tokens per request; None: max_total_tokens - 1
    max_queued: int = 64  # requests waiting for a row; one more is refused (503 + Retry-After)
    # the fraction of max_queued one tenant's waiting requests may hold (service/http/quotas.py; each
    # generation of a multi-choice request counts): past it that tenant is refused (503), the others not
    max_queued_share: float = 1.0
    prefill_tokens: int = 2048  # padded prompt tokens per admission step (one request is always admitted)
    # a prompt longer than this is prefilled this many tokens per step while the running requests keep
    # decoding (one such prompt at a time), so a long prompt does not stall every stream; None: whole
    prefill_chunk: int | None = 256
    # aim each admission step at about this long: its padded prompt tokens are cut to what the measured
    # prefill rate computes in this time (at least one request, at most prefill_tokens), so on a slow CPU
    # running streams do not wait seconds behind new prompts; None: prefill_tokens alone
    prefill_step_ms: float | None = None
    # full blocks' keys/values of prompts and finished answers kept by content (engine/prefix_cache.py): a
    # prompt that begins like an earlier one (a system prompt, a chat history) prefills only the rest; 0: off
    prefix_cache_mib: float = 256.0
    # decode steps as captured CUDA graphs, one per bucket of rows x key blocks (models/execution/graphs.py),
    # captured at warm-up; None: on CUDA with a paged cache. True on a CPU runs the same padded steps
    # eagerly (tests); false: eager steps of the exact size
    decode_graphs: bool | None = None
    # with decode graphs, launch each decode step before the previous one's tokens are handed out, so
    # the host's per-row work overlaps the device's next step (engine/lookahead.py); only while no
    # request waits for a row
    decode_ahead: bool = True
    # speculative decoding (SpeculativeConfig; None: off). Needs the paged cache; not with decode graphs
    speculative: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        if isinstance(self.speculative, Mapping):  # as a config file's mapping, read without pydantic
            object.__setattr__(self, "speculative", SpeculativeConfig(**self.speculative))
        problems = [f"{name} must be a positive integer, got {getattr(self, name)!r}"
                    for name in ("max_running", "max_queued", "prefill_tokens", "max_prompt_tokens",
                                 "max_new_tokens", "prefill_chunk")
                    if getattr(self, name) is not None and getattr(self, name) < 1]
        if self.max_total_tokens is not None and self.max_total_tokens < 2:
            problems.append(f"max_total_tokens must leave room for a prompt and one token, got {self.max_total_tokens}")
        if not 0 < self.max_queued_share <= 1:
            problems.append(f"max_queued_share must be in (0, 1], got {self.max_queued_share!r}")
        if self.kv_cache_dtype not in ("auto", "float32", "bfloat16", "float16"):
            problems.append(f"kv_cache_dtype must be 'auto', 'float32', 'bfloat16' or 'float16', got {self.kv_cache_dtype!r}")
        if not self.kv_cache_mib > 0:
            problems.append(f"kv_cache_mib must be > 0, got {self.kv_cache_mib!r}")
        if self.prefill_step_ms is not None and not self.prefill_step_ms > 0:
            problems.append(f"prefill_step_ms must be > 0, got {self.prefill_step_ms!r}")
        if not self.prefix_cache_mib >= 0:
            problems.append(f"prefix_cache_mib must be >= 0, got {self.prefix_cache_mib!r}")
        if self.speculative is not None and not self.paged:
            problems.append("speculative decoding verifies drafts on the paged cache: it needs paged: true")
        if self.speculative is not None and self.decode_graphs:
            problems.append("speculative decoding does not run on captured decode graphs: set decode_graphs: false")
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
