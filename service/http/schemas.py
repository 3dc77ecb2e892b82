"""Request and response models of the HTTP API (pydantic at the edge; dataclasses inside).

Static limits live on the fields; limits from the settings (how many inputs a request may carry)
are checked by `check_texts` in the route. Unknown fields are rejected (a typo such as `beam`
for `beam_size` is a 422, not a silently ignored option), except where OpenAI's API has fields
we accept and ignore (`user`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictStr, model_validator

from ..errors import InvalidRequest


def _as_list(value: Any) -> Any:
    return [value] if isinstance(value, str) else value


# One text or a list of texts; always a list inside.
Texts = Annotated[list[StrictStr], BeforeValidator(_as_list, json_schema_input_type=str | list[str])]


def lone_surrogate(value: Any) -> tuple[str | None, str] | None:
    """Where a parsed JSON body (dicts, lists, strings) holds a string that is not Unicode text: JSON's
    escapes can spell a lone surrogate ("\\ud800"), which no tokenizer or encoder takes. The first
    one's field, as errors name fields ("messages[1].content"; a bad key names its object; None: the
    body itself), and its code point ("U+D800"); None where every string is text. Iterative: a deeply
    nested body cannot exhaust the stack."""
    stack: list[tuple[str | None, Any]] = [(None, value)]
    while stack:
        field, item = stack.pop()
        if isinstance(item, str):
            if not item.isascii():
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError as e:
                    return field, f"U+{ord(item[e.start]):04X}"
        elif isinstance(item, dict):
            stack.extend((field, key) for key in item)
            stack.extend((f"{field}.{key}" if field else str(key), child) for key, child in item.items())
        elif isinstance(item, list):
            stack.extend((f"{field}[{i}]" if field else f"[{i}]", child) for i, child in enumerate(item))
    return None


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Body(_Request):
    """A request's whole body (its parts are _Request models): checked once for text that is not Unicode."""

    @model_validator(mode="before")
    @classmethod
    def _unicode_text(cls, data: Any) -> Any:
        """A string that is not Unicode text is a 422 here, before any tokenizer meets it."""
        found = lone_surrogate(data)
        if found is not None:  # not a ValueError: pydantic lets it through to the handler, naming the field
            field, code = found
            raise InvalidRequest(f"{field or 'request body'}: not Unicode text (a lone surrogate, {code})", field)
        return data


class ClassifyRequest(_Body):
    inputs: Texts = Field(description="A text or a list of texts; one result per text, in order.")
    model: StrictStr | None = Field(None, description="Model name (see /v1/models); default: the first.")
    truncate: StrictBool = Field(False, description="Cut texts longer than the model's limit instead of a 422.")


class Classification(BaseModel):
    label: str
    score: float
    scores: dict[str, float]


class ClassifyResponse(BaseModel):
    model: str
    results: list[Classification]


class EmbeddingsRequest(_Body):
    """OpenAI's embeddings request (texts only)."""

    input: Texts = Field(description="A text or a list of texts.")
    model: StrictStr | None = None
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="base64: little-endian float32 bytes, as OpenAI's clients expect.")
    user: StrictStr | None = Field(None, max_length=256, description="An end-user id; logged as given, never used.")
    truncate: StrictBool = False
    dimensions: int | None = Field(None, ge=1, le=65_536, strict=True,
                                   description="Keep the first `dimensions` components (renormalised); only for "
                                               "models whose spec lists the sizes they were trained to be cut to "
                                               "(`defaults.dimensions`, Matryoshka embeddings).")


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    """OpenAI's usage of an embeddings request (no completion)."""

    prompt_tokens: int
    total_tokens: int


class EmbeddingsResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


class RerankRequest(_Body):
    """Text Embeddings Inference's rerank request: score each text's relevance to the query."""

    query: StrictStr = Field(description="The text every text is scored against.")
    texts: list[StrictStr] = Field(description="The texts to score; one result per text.")
    raw_scores: StrictBool = Field(False, description="The cross-encoder's logits instead of their sigmoid.")
    return_text: StrictBool = Field(False, description="Echo each text in its result.")
    truncate: StrictBool = Field(False, description="Cut (query, text) pairs longer than the model's limit "
                                                    "(longest first) instead of a 422.")
    truncation_direction: Literal["right", "Right"] = Field(
        "right", description="Accepted for TEI compatibility: pairs are cut at their end.")
    model: StrictStr | None = Field(None, description="Model name (see /v1/models); default: the first.")


class Rank(BaseModel):
    index: int = Field(description="The text's position in the request.")
    score: float
    text: str | None = Field(None, description="The text, when return_text is true (absent otherwise).")


class TranslateRequest(_Body):
    inputs: Texts = Field(description="A text or a list of texts; one translation per text, in order.")
    source_lang: StrictStr = Field(examples=["en"])
    target_lang: StrictStr = Field(examples=["es"])
    beam_size: int | None = Field(None, ge=1, le=8, strict=True, description="1 = greedy; default: the model's.")
    max_new_tokens: int | None = Field(None, ge=1, le=4096, strict=True,
                                       description="Default: the model's; at most its max_positions - 1.")
    model: StrictStr | None = None
    truncate: StrictBool = False
    split_sentences: StrictBool = Field(
        True, description="Cut each text into sentences (a line break always ends one), translate them, and "
                          "put them back with the text's own spaces, line breaks and paragraphs: documents up to "
                          "the server's max_document_chars. false: each text is one input of the model.")
    stream: StrictBool = Field(
        False, description="Server-sent events: `{\"index\", \"text\"}` pieces of each text's translation in "
                           "order (a greedy search's as its tokens are chosen, a beam search's a sentence at a "
                           "time), then `{\"model\", \"translations\", \"sentences\"}`.")


class TranslateResponse(BaseModel):
    model: str
    translations: list[str]
    sentences: list[int] = Field(description="Sentences translated in each text (1 per text without "
                                             "split_sentences; 0 for a text of whitespace only).")


class PhaseCard(BaseModel):
    """One phase of a model's execution plan."""

    backend: str = Field(description="What computes it: torch (the model's own forward), compiled (its blocks "
                                     "through torch.compile), native (our C++ stack step), cuda_graphs.")
    detail: str = Field("", description="What it runs on: ISA, weight format, attention kernel, prompt weights.")
    not_taken: dict[str, str] = Field(default_factory=dict, description="Every other backend: why not.")


class ModelCard(BaseModel):
    """OpenAI's model object plus what this server knows about the model."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "transformer-serve"
    deployment: str
    tasks: list[str]
    ready: bool
    device: str | None = None
    dtype: str | None = None
    max_input_tokens: int | None = None
    labels: list[str] | None = None
    languages: list[str] | None = None
    defaults: dict[str, Any] = Field(default_factory=dict)
    stats: dict[str, Any] | None = Field(None, description="Batching (or, for a generator, engine) counters of "
                                                              "the replica that answered.")
    limits: dict[str, Any] | None = Field(None, description="Generators: the engine's limits (rows, tokens, queue).")
    quantize: str | None = Field(None, description="Quantization in effect (int8, q8_0, q4_1), or null for the "
                                                   "float dtype (also where a block format's CPU kernels cannot run).")
    block_activation_bits: int | None = Field(None, description="q8_0 / q4_1: the activations' width inside the "
                                                                "kernels, 16 (two 8-bit parts) or 8.")
    prompt_weights: str | None = Field(None, description="`float32` / `bfloat16`: a quantized generator computes "
                                                         "prompts on a copy of its weights in that type and "
                                                         "decodes on the blocks; null: all on the blocks.")
    compiled: bool | None = Field(None, description="Whether its transformer blocks run compiled (torch.compile); "
                                                    "null until loaded.")
    kernels: dict[str, str] | None = Field(None, description="Float projections: the kernel chosen per weight shape "
                                                             "at load (`onednn 1.6x`: oneDNN, 1.6x faster than "
                                                             "MKL as measured), when `dense_kernel` packed any.")
    plan: dict[str, PhaseCard] | None = Field(None, description="The execution plan chosen at load: phase (encode, "
                                                                "prefill, decode) -> its backend and why not the "
                                                                "others; null until loaded.")
    speculative: dict[str, Any] | None = Field(None, description="Generators: speculative decoding's drafter "
                                                                "(`method` ngram: prompt lookup, or draft: a draft "
                                                                "model, its spec changes and plan) and its limits; "
                                                                "null where it does not speculate.")
    parent: str | None = Field(None, description="A LoRA adapter: the model it adapts (null: a model of its own).")
    root: str | None = Field(None, description="A LoRA adapter: its directory.")
    adapters: dict[str, Any] | None = Field(None, description="A model serving LoRA adapters: its replica's slots, "
                                                             "their largest rank and the adapters in them now.")


class LoadAdapterRequest(_Body):
    """vLLM's body for POST /v1/load_lora_adapter."""

    lora_name: StrictStr = Field(description="The adapter's name: requests choose it by `model`.")
    lora_path: StrictStr = Field(description="Its PEFT directory (adapter_config.json, adapter_model.safetensors).")
    base_model: StrictStr | None = Field(None, description="The model it adapts; default: the first generator "
                                                           "serving adapters.")


class UnloadAdapterRequest(_Body):
    lora_name: StrictStr


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
    tasks: dict[str, list[str]] = Field(description="task -> model names; the first is the default.")


class Health(BaseModel):
    status: Literal["ok"] = "ok"


class Readiness(BaseModel):
    status: Literal["ready", "not_ready"]
    deployments: dict[str, str] = Field(description="deployment -> 'ready' or why it is not.")


class ErrorDetail(BaseModel):
    type: str
    message: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


def check_texts(texts: list[str], field: str, max_inputs: int) -> list[str]:
    """The limits that depend on the settings: 1..max_inputs texts, none empty."""
    if not texts:
        raise InvalidRequest(f"{field} is empty; send at least one text", field)
    if len(texts) > max_inputs:
        raise InvalidRequest(f"{field} has {len(texts)} texts; at most {max_inputs} per request", field)
    for i, text in enumerate(texts):
        if not text:
            raise InvalidRequest(f"{field}[{i}] is an empty string", f"{field}[{i}]")
    return texts
