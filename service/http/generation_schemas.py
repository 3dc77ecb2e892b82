"""Request and response models of the generation routes: our /v1/generate and OpenAI's
/v1/completions and /v1/chat/completions (the fields OpenAI's clients send).

Sampling fields left out take the model's defaults (`defaults` in /v1/models; greedy for the
default SmolLM2), not OpenAI's. OpenAI parameters that have no meaning here are accepted only at
their neutral value and otherwise answered with a 422 naming them (`check_supported`), never
silently ignored. Streamed answers are server-sent events; their chunks are built in
service/http/sse.py and described in docs/serving.md.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    Field,
    StrictBool,
    StrictStr,
    field_validator,
    model_validator,
)

from ..common.tool_calls import Tool, ToolCall
from ..errors import InvalidRequest
from ..messages import AnswerFinish, ChatMessage, GrammarSpec
from .logprobs import ChatLogprobs, CompletionLogprobs
from .schemas import Texts, _Body, _Request

MAX_TOKENS = 1_000_000  # a static bound; the engine's max_new_tokens / max_total_tokens decide (422 naming them)
MAX_STOPS = 8
MAX_LOGIT_BIAS = 300  # entries; OpenAI's bound
MAX_TOP_LOGPROBS = 20  # OpenAI's (models.decoding.MAX_TOP_LOGPROBS)
MAX_CHOICES = 16  # n and best_of; prompts x best_of is also bounded by the settings' max_inputs
MAX_GRAMMAR_CHARS = 32_768  # a JSON schema (as JSON), a regex or a grammar
# chat messages a request may carry: a template spends a few tokens on each, so more than this never
# fits a model's context, and rendering them would cost the replica time before the length check
MAX_MESSAGES = 2048


class TextFormat(_Request):
    type: Literal["text"]


class JsonObjectFormat(_Request):
    type: Literal["json_object"]


class JsonSchemaSpec(_Request):
    name: StrictStr = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: StrictStr | None = None
    schema_: dict[str, Any] = Field(alias="schema", description="A JSON Schema the output must validate against.")
    strict: StrictBool | None = Field(None, description="Accepted; the schema is always enforced.")

    model_config = {"extra": "forbid", "populate_by_name": True}


class JsonSchemaFormat(_Request):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")]


def grammar_of(response_format: Any, regex: str | None = None, grammar: str | None = None) -> GrammarSpec | None:
    """The structured-output constraint of a request (at most one of the three), bounded in size."""
    given = [name for name, v in (("response_format", response_format), ("regex", regex), ("grammar", grammar))
             if v is not None and not isinstance(v, TextFormat)]
    if len(given) > 1:
        raise InvalidRequest(f"send at most one of {given}", given[1])
    if isinstance(response_format, JsonObjectFormat):
        return GrammarSpec("json_object", field="response_format")
    if isinstance(response_format, JsonSchemaFormat):
        source = json.dumps(response_format.json_schema.schema_)
        if len(source) > MAX_GRAMMAR_CHARS:
            raise InvalidRequest(f"the JSON schema is {len(source)} characters; at most {MAX_GRAMMAR_CHARS}",
                                 "response_format")
        return GrammarSpec("json_schema", source, "response_format")
    if regex is not None:
        return GrammarSpec("regex", regex, "regex")
    if grammar is not None:
        return GrammarSpec("grammar", grammar, "grammar")
    return None


def _as_list(value: Any) -> Any:
    return [value] if isinstance(value, str) else value


StopString = Annotated[StrictStr, Field(min_length=1, max_length=256)]
Stops = Annotated[list[StopString], BeforeValidator(_as_list, json_schema_input_type=str | list[str]),
                  Field(max_length=MAX_STOPS, description="A stop string or a list of them; the text ends "
                                                          "before the first one found.")]


class Sampling(_Body):
    """Sampling fields shared by every generation route (None: the model's default)."""

    temperature: float | None = Field(None, ge=0, le=2, strict=True, allow_inf_nan=False,
                                      description="0 = greedy. Default: the model's.")
    top_p: float | None = Field(None, gt=0, le=1, strict=True, allow_inf_nan=False,
                                description="Nucleus sampling mass in (0, 1]; 1 = off.")
    top_k: int | None = Field(None, ge=0, strict=True, description="Sample among the k best tokens; 0 = off.")
    repetition_penalty: float | None = Field(None, gt=0, le=10, strict=True, allow_inf_nan=False,
                                             description="> 1 discourages tokens already in the text; 1 = off.")
    presence_penalty: float | None = Field(None, ge=-2, le=2, strict=True, allow_inf_nan=False,
                                           description="OpenAI's: minus this from the logit of every token "
                                                       "already in the output; 0 = off.")
    frequency_penalty: float | None = Field(None, ge=-2, le=2, strict=True, allow_inf_nan=False,
                                            description="OpenAI's: minus this times the token's count in the "
                                                        "output; 0 = off.")
    logit_bias: dict[str, Annotated[float, Field(strict=True, ge=-100, le=100, allow_inf_nan=False)]] | None = Field(
        None, max_length=MAX_LOGIT_BIAS, description="Token id (as a string) -> a value in [-100, 100] added "
                                                     "to its logit before sampling (OpenAI's).")
    seed: int | None = Field(None, ge=0, lt=2**63, strict=True,
                             description="Seeds this request's sampler: same seed and inputs, same text.")
    stop: Stops | None = None
    ignore_eos: StrictBool | None = Field(None, description="Keep generating past the end-of-sequence token "
                                                             "until max tokens (benchmarks; as vLLM's extra).")
    speculative: StrictBool | None = Field(None, description="false: this request does not draft where the model "
                                                              "decodes speculatively (its text is the same either "
                                                              "way). Default: the model's.")
    priority: int | None = Field(
        None, ge=-1000, le=1000, strict=True,
        description="vLLM's: lower is sooner. The engine admits a request before any waiting one of a larger "
                    "value and, short of KV-cache blocks, preempts the largest first. A tenant's requests "
                    "are never sooner than its own `priority` allows. Default: the tenant's, else 0.")
    cache_salt: StrictStr | None = Field(
        None, min_length=1, max_length=256,
        description="vLLM's: the prompt's cached prefix is reused only by requests with the same salt (and, "
                    "with tenants configured, of the same tenant), so another client cannot tell from the "
                    "speed whether a guessed prompt was cached.")
    stream: StrictBool = Field(False, description="Answer with server-sent events as the text is generated.")
    response_format: ResponseFormat | None = Field(
        None, description="Structured output (OpenAI's): `json_object` (any JSON object) or `json_schema`; the "
                          "text is generated under token masks, so it always matches (unless cut by max tokens).")

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        seen: set[int] = set()
        for key in value or {}:
            if not (key.isascii() and key.isdigit() and len(key) <= 10):
                raise ValueError(f"logit_bias keys are token ids (decimal strings), got {key[:20]!r}")
            if int(key) in seen:
                raise ValueError(f"logit_bias names token {int(key)} twice")
            seen.add(int(key))
        return value

    @model_validator(mode="after")
    def _stream_options(self) -> Sampling:
        if getattr(self, "stream_options", None) is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")
        return self

    def bias(self) -> tuple[tuple[int, float], ...]:
        return tuple((int(k), float(v)) for k, v in (self.logit_bias or {}).items())


class GenerateRequest(Sampling):
    prompt: StrictStr = Field(min_length=1, description="Text to continue (the model's special tokens added).")
    regex: StrictStr | None = Field(None, min_length=1, max_length=MAX_GRAMMAR_CHARS,
                                    description="The text must match this regular expression.")
    grammar: StrictStr | None = Field(None, min_length=1, max_length=MAX_GRAMMAR_CHARS,
                                      description="The text must match this Lark grammar (llguidance's dialect; "
                                                  "the start rule is `start`).")
    max_new_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS, strict=True,
                                       description="Default: the model's; at most the engine's limit.")
    model: StrictStr | None = Field(None, description="Model name (see /v1/models); default: the first.")


class CompletionUsage(BaseModel):
    """The usage object of every generation route (OpenAI's)."""

    prompt_tokens: int
    completion_tokens: int  # tokens sampled, a final end-of-sequence token included
    total_tokens: int


class GenerateResponse(BaseModel):
    model: str
    text: str
    finish_reason: AnswerFinish
    usage: CompletionUsage


# -- OpenAI ------------------------------------------------------------------------------------------

class StreamOptions(_Request):
    include_usage: StrictBool = Field(False, description="Add a last chunk with `usage` and no choices.")


class OpenAISampling(Sampling):
    """OpenAI's fields on top of ours (top_k and repetition_penalty are our extras)."""

    model: StrictStr | None = Field(None, description="Model name (see /v1/models); default: the first.")
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS, strict=True,
                                   description="Default: the model's max_new_tokens.")
    n: int | None = Field(None, ge=1, le=MAX_CHOICES, strict=True,
                          description="Choices per prompt; siblings share the prompt's prefill and sample with "
                                      "seeds seed, seed + 1, ... when a seed is given.")
    stream_options: StreamOptions | None = None
    user: StrictStr | None = Field(None, max_length=256, description="An end-user id: logged as given, and the "
                                   "routing session when no x-session-id header is sent (its requests go to one "
                                   "replica while load allows)")


class CompletionRequest(OpenAISampling):
    prompt: Texts = Field(description="A text, or a list of texts (each gets `n` choices).")
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, strict=True,
                                 description="Return the chosen token's log-probability and the `logprobs` most "
                                             "likely tokens' for every output token (docs/serving.md says which "
                                             "distribution).")
    echo: StrictBool | None = Field(None, description="Only false.")
    best_of: int | None = Field(None, ge=1, le=MAX_CHOICES, strict=True,
                                description="Generate this many per prompt and return the `n` with the highest "
                                            "mean log-probability per token (not with stream).")
    suffix: StrictStr | None = Field(None, description="Only null.")

    def prompt_texts(self) -> list[str]:
        if not self.prompt:
            raise InvalidRequest("prompt is an empty list", "prompt")
        for i, text in enumerate(self.prompt):
            if not text:
                raise InvalidRequest("prompt is an empty string", "prompt" if len(self.prompt) == 1 else f"prompt[{i}]")
        return list(self.prompt)

    def choices(self) -> tuple[int, int]:
        """(n, best_of), checked against each other and against streaming."""
        n = self.n or 1
        best_of = self.best_of or n
        if best_of < n:
            raise InvalidRequest(f"best_of ({best_of}) must be >= n ({n})", "best_of")
        if self.stream and best_of > n:
            raise InvalidRequest("best_of > n cannot be streamed (the best are known only at the end)", "best_of")
        return n, best_of


class TextPart(_Request):
    type: Literal["text"]
    text: StrictStr


def _as_parts(value: Any) -> Any:
    return [{"type": "text", "text": value}] if isinstance(value, str) else value


# A text or a list of text parts; always parts inside.
Content = Annotated[list[TextPart], BeforeValidator(_as_parts, json_schema_input_type=str | list[TextPart])]


MAX_TOOLS = 32
TOOL_NAME = r"^[A-Za-z0-9_-]{1,64}$"


class FunctionCallIn(_Request):
    name: StrictStr = Field(pattern=TOOL_NAME)
    arguments: StrictStr = Field(max_length=MAX_GRAMMAR_CHARS, description="A JSON object, as text (OpenAI's).")

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, value: str) -> str:
        try:
            parsed = json.loads(value or "{}")
        except ValueError:
            raise ValueError("arguments must be a JSON object (as text)") from None
        if not isinstance(parsed, dict):
            raise ValueError("arguments must be a JSON object (as text)")
        return value


class ToolCallIn(_Request):
    id: StrictStr = Field(min_length=1, max_length=128)
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessageIn(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"] = Field(
        description="`developer` is passed to the template as `system`; `tool` answers an assistant's tool call.")
    content: Content | None = Field(None, description="Required, except for an assistant message with tool_calls.")
    name: StrictStr | None = Field(None, description="Accepted; ignored.")
    tool_calls: list[ToolCallIn] | None = Field(None, max_length=MAX_TOOLS, description="assistant: the calls it made.")
    tool_call_id: StrictStr | None = Field(None, max_length=128, description="tool: the call this answers.")

    @model_validator(mode="after")
    def _shape(self) -> ChatMessageIn:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (only an assistant message with tool_calls may omit it)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id it answers")
        return self

    def text(self) -> str:
        return "".join(p.text for p in self.content or [])

    def message(self) -> ChatMessage:
        calls = tuple(ToolCall(c.id, c.function.name, c.function.arguments) for c in self.tool_calls or ())
        return ChatMessage(self.role, self.text(), calls, self.tool_call_id)


class FunctionDef(_Request):
    name: StrictStr = Field(pattern=TOOL_NAME)
    description: StrictStr | None = Field(None, max_length=4096)
    parameters: dict[str, Any] | None = Field(None, description="A JSON Schema of the arguments object.")
    strict: StrictBool | None = Field(None, description="Accepted; a forced call always validates.")


class ToolDef(_Request):
    type: Literal["function"]
    function: FunctionDef


def tools_of(defs: list[ToolDef] | None) -> tuple[Tool, ...]:
    """The tools as a chat prompt shows them (service/common/tool_calls.py); a 422 naming tools when two
    functions share a name."""
    tools = tuple(Tool(t.function.name, t.function.description or "",
                       json.dumps(t.function.parameters if t.function.parameters is not None else {"type": "object"}))
                  for t in defs or ())
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise InvalidRequest("tools have duplicate function names", "tools")
    return tools


class NamedFunction(_Request):
    name: StrictStr = Field(pattern=TOOL_NAME)


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(OpenAISampling):
    messages: list[ChatMessageIn] = Field(min_length=1, max_length=MAX_MESSAGES,
                                          description="Rendered with the model's chat template.")
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS, strict=True,
                                              description="OpenAI's newer name for max_tokens; wins over it.")
    logprobs: StrictBool | None = Field(None, description="Return each output token's log-probability.")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, strict=True,
                                     description="With logprobs: also the k most likely tokens' at each position.")
    tools: list[ToolDef] | None = Field(None, min_length=1, max_length=MAX_TOOLS,
                                        description="Functions the model may call (docs/serving.md: how they reach "
                                                    "a template without tools).")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="auto (default with tools): the model decides; required or a named function: the answer "
                          "is constrained to one call whose arguments validate; none: no calls.")
    parallel_tool_calls: StrictBool | None = Field(None, description="Accepted; an auto answer may hold several calls.")

    def tool_plan(self) -> tuple[tuple[Tool, ...], str | None, GrammarSpec | None]:
        """(the tools the prompt shows, the tool a call is forced to (or "" for any), the grammar forcing
        it); checks names are unique and a named choice exists."""
        tools = tools_of(self.tools)
        names = [t.name for t in tools]
        choice = self.tool_choice if self.tool_choice is not None else ("auto" if tools else "none")
        if choice != "none" and not tools:
            raise InvalidRequest(f"tool_choice={choice!r} needs tools", "tool_choice")
        if choice in ("none", "auto"):
            return (tools if choice == "auto" else ()), None, None
        only = None if choice == "required" else choice.function.name  # type: ignore[union-attr]
        if only is not None and only not in names:
            raise InvalidRequest(f"tool_choice names {only!r}, which is not among the tools", "tool_choice")
        if self.response_format is not None and not isinstance(self.response_format, TextFormat):
            raise InvalidRequest("response_format cannot be combined with a forced tool call", "response_format")
        grammar = GrammarSpec.tool_call(tools, only)
        return tools, only or "", grammar

    def logprobs_k(self) -> int | None:
        """The engine's logprobs field: None, or how many alternatives (a 422 for top_logprobs alone)."""
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs: true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionChoice(BaseModel):
    index: int = 0  # prompt index x n + choice
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: AnswerFinish


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: CompletionUsage


class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # a JSON object, as text


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: AnswerFinish | Literal["tool_calls"]


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: CompletionUsage


# field -> (is its value supported, what is supported); a registry, so a new field is one line
UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "echo": (lambda v: not v, "the prompt is not echoed"),
    "suffix": (lambda v: v is None, "suffixes are not supported"),
}


def check_supported(body: BaseModel) -> None:
    """A 422 naming the first OpenAI parameter set to a value this server does not implement."""
    for name, (supported, hint) in UNSUPPORTED.items():
        if name in type(body).model_fields and not supported(value := getattr(body, name)):
            raise InvalidRequest(f"{name}={value!r} is not supported: {hint}", name)
