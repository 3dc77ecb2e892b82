"""The plain dataclasses that cross between the ingress and the model replicas (pickled by Ray),
and the types a generation shares from the engine to the HTTP edge (`Usage`, `FinishReason`).

No torch and no FastAPI here, so the ingress replica never imports torch and the replicas never
import FastAPI. The HTTP layer converts these to and from its pydantic models (service/http/).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from .common.tool_calls import Tool, ToolCall, call_grammar

AnswerFinish = Literal["stop", "length"]  # how an answer a client receives ended
# ... and how a request can end inside the engine: its client went away, or it failed
FinishReason = Literal[AnswerFinish, "cancelled", "error"]
FINISH_REASONS: tuple[FinishReason, ...] = get_args(FinishReason)  # every value, in order


@dataclass(frozen=True)
class Usage:
    """Tokens of one generation."""

    prompt_tokens: int
    completion_tokens: int  # tokens sampled, a final stop token included

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def as_dict(self) -> dict[str, int]:
        """OpenAI's usage object."""
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.total_tokens}


@dataclass(frozen=True)
class Classification:
    label: str
    score: float
    scores: dict[str, float]


@dataclass(frozen=True)
class Embeddings:
    vectors: list[list[float]]
    prompt_tokens: int


@dataclass(frozen=True)
class AdapterRef:
    """A LoRA adapter a request asks for: its name (the request's `model`) and its PEFT directory, from
    which a replica that does not hold it loads it (models/adapters/)."""

    name: str
    path: str


@dataclass(frozen=True)
class ModelInfo:
    """What /v1/models and /readyz report about a loaded model (one replica's view)."""

    name: str
    deployment: str
    tasks: tuple[str, ...]
    device: str
    dtype: str
    max_input_tokens: int
    labels: tuple[str, ...] = ()
    languages: tuple[str, str] | None = None
    defaults: dict[str, Any] = field(default_factory=dict)
    loaded_at: float = 0.0  # unix time
    load_seconds: float = 0.0
    stats: dict[str, Any] = field(default_factory=dict)
    limits: dict[str, Any] = field(default_factory=dict)  # generators: the engine's resolved limits
    quantize: str | None = None  # in effect: "int8", "q8_0", "q4_1" (models/projections/quant.py) or None
    kernels: dict[str, str] = field(default_factory=dict)  # float projections per weight shape (models/projections/dense.py)
    compiled: bool = False  # its blocks run compiled (models/execution/compiled.py)
    block_activation_bits: int | None = None  # q8_0 / q4_1: 16 or 8 (models/projections/panels.py)
    prompt_weights: str | None = None  # "float32" / "bfloat16": prompts on a copy in that type (ModelSpec.prompt_weights)
    # the execution plan (models/execution/): phase -> {backend, detail, not_taken: {backend: reason}}
    plan: dict[str, dict[str, Any]] = field(default_factory=dict)
    # generators: speculative decoding's drafter (service/engine/speculation/), None where it does not speculate
    speculative: dict[str, Any] | None = None
    adapters: dict[str, Any] | None = None  # its LoRA adapter slots: {slots, max_rank, resident: [names]}; None: none


@dataclass(frozen=True)
class TranslateOptions:
    beam_size: int | None = None  # None: the model's default
    max_new_tokens: int | None = None
    truncate: bool = False


@dataclass(frozen=True)
class ChatMessage:
    role: str  # system, developer, user, assistant or tool
    content: str
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant's calls (service/common/tool_calls.py)
    tool_call_id: str | None = None  # a tool message: the call it answers


GrammarKind = Literal["json_object", "json_schema", "regex", "grammar"]


@dataclass(frozen=True)
class GrammarSpec:
    """A structured-output constraint: the output must match it (token masks, service/engine/grammar.py).

    json_object: any JSON object; json_schema: `source` is the schema as JSON text; regex: a regular
    expression; grammar: a Lark grammar (llguidance's dialect, start rule `start`).
    `field`: the request field it came from, for the errors' `param`.
    """

    kind: GrammarKind
    source: str = ""
    field: str = "response_format"

    @classmethod
    def tool_call(cls, tools: tuple[Tool, ...], only: str | None = None) -> GrammarSpec:
        """One call block of one of `tools` (or of the tool named `only`), its arguments valid."""
        return cls("grammar", call_grammar(tools, only), "tools")


TEMPLATE_CHARS = 32  # what a chat message or a tool adds to a rendered prompt, about (render_chars)


@dataclass(frozen=True)
class GenerationRequest:
    """One generation, as the ingress sends it to a generator replica.

    Exactly one of `prompt` (tokenized with the model's special tokens) and `messages` (rendered
    with the model's chat template) is set. Sampling fields left at None take the model's defaults
    (ModelSpec.defaults), then models.decoding.SamplingParams'.
    """

    request_id: str
    prompt: str | None = None
    messages: tuple[ChatMessage, ...] | None = None
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias)
    logprobs: int | None = None  # None: none; k: the chosen token's and the k best tokens' log-probabilities
    grammar: GrammarSpec | None = None  # structured output: the text must match it
    tools: tuple[Tool, ...] = ()  # functions the chat prompt shows the model (service/common/tool_calls.py)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool | None = None
    speculative: bool | None = None  # False: this request does not draft (speculative decoding); None: the default
    session: str | None = None  # routing only: requests of one session go to one replica (service/fleet/router.py)
    # field of this request -> the name the client used (OpenAI's max_tokens for max_new_tokens)
    names: Mapping[str, str] = field(default_factory=dict)
    timeout_s: float | None = None  # seconds left of its deadline when the ingress sent it (admission)
    adapter: AdapterRef | None = None  # the LoRA adapter that answers (None: the base model)
    cache_salt: str | None = None  # prefix-cache reuse only among requests of the same salt (tenant, request's)
    priority: int | None = None  # lower is sooner (vLLM's): admitted before, preempted after larger ones; None: 0
    tenant: str | None = None  # its tenant (service/http/quotas.py): the engine bounds each tenant's share of its queue

    @property
    def prompt_chars(self) -> int:
        """Characters this request brings to its prompt: the prompt, or the chat's contents, tool calls
        and tools (service/common/text_limits.py caps them before anything is rendered or tokenized)."""
        if self.messages is None:
            return len(self.prompt or "")
        return (sum(len(m.content) + sum(len(c.arguments) + len(c.name) for c in m.tool_calls)
                    for m in self.messages)
                + sum(len(t.name) + len(t.description) + len(t.parameters) for t in self.tools))

    @property
    def render_chars(self) -> int:
        """What rendering and tokenizing its prompt costs, in characters: prompt_chars plus each chat
        message's and tool's share of the template (2048 empty messages are work too)."""
        if self.messages is None:
            return self.prompt_chars
        return self.prompt_chars + TEMPLATE_CHARS * (len(self.messages) + len(self.tools))

    @property
    def prompt_field(self) -> str:
        """The field the prompt came from: `prompt`, or `messages` for a chat."""
        return "prompt" if self.messages is None else "messages"

    def param(self, name: str | None) -> str | None:
        """The client's name for a field an error is about; the replica names every error's
        `param` with it, so the edge passes errors through unchanged. The engine calls the prompt
        `prompt` whichever field it came from."""
        if name == "prompt":
            name = self.prompt_field
        return None if name is None else self.names.get(name, name)


@dataclass(frozen=True)
class GenerationStarted:
    """First event of a stream: the engine admitted the request and sampled its first token."""

    request_id: str
    prompt_tokens: int


@dataclass(frozen=True)
class TokenLogprob:
    """One output token with its log-probability and the request's k most likely alternatives
    (token text, log-probability), best first; see models/decoding.py for which distribution."""

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()
    bytes: tuple[int, ...] = ()  # the token's own bytes (part of a character, for byte-level tokenizers)
    offset: int = 0  # where the token's text starts in the answer (characters)


@dataclass(frozen=True)
class TextDelta:
    """A piece of generated text, final (complete characters, never part of a stop string), and the
    log-probabilities of the tokens sampled since the last piece (when the request asked for them)."""

    text: str
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class TranslationDone:
    """The end of one input's translation in a stream: its whole text (= its TextDeltas joined)."""

    text: str


@dataclass(frozen=True)
class GenerationDone:
    """The end of a generation: the whole text (= the concatenated TextDeltas of a stream).

    finish_reason: "stop" (end of sequence, a stop string) or "length" (max_new_tokens); "error"
    only as the last event of a stream that failed after it started (`error` says why).
    """

    request_id: str
    text: str
    finish_reason: AnswerFinish | Literal["error"]
    usage: Usage
    error: str | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None  # every output token's, when the request asked
    error_type: str | None = None  # with `error`: the request's own fault (service/errors.py STATUS), else internal
    error_param: str | None = None


GenerationEvent = GenerationStarted | TextDelta | GenerationDone


@dataclass(frozen=True)
class Tokenized:
    """A prompt (or a chat rendered with the template) as the generator's model sees it."""

    tokens: tuple[int, ...]
    token_strs: tuple[str, ...]  # each token's own text (special tokens shown)
    max_model_len: int  # the engine's max_total_tokens
