"""The requests the benchmark sends and how it reads the answers, for every system alike.

Classify and translate use our API's bodies (the baselines accept the same). Generation is found in
the server's OpenAPI document, because each system (and our service while its generation routes are
being built) may spell it differently: the first of GENERATE_PATHS that exists, its prompt and
length fields, and whether it accepts `stream`, `ignore_eos` (or `min_tokens`), `temperature` and
`stream_options`. Streaming answers are Server-Sent Events (`data: {json}` lines, `data: [DONE]`)
or JSON lines. Pure Python: the locustfile uses this module too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

GENERATE_PATHS = ("/v1/completions", "/v1/generate", "/v1/chat/completions")
PROMPT_FIELDS = ("prompt", "inputs", "input", "text")
MAX_FIELDS = ("max_tokens", "max_new_tokens", "max_completion_tokens")
MIN_FIELDS = ("min_tokens", "min_new_tokens")


@dataclass(frozen=True)
class RequestSpec:
    path: str
    body: dict[str, Any]
    stream: bool = False
    asked_tokens: int | None = None  # generate: max tokens asked (exact when `exact_length`)
    exact_length: bool = False  # ignore_eos / min_tokens was sent: the output has asked_tokens tokens


def classify_request(text: str) -> RequestSpec:
    return RequestSpec("/v1/classify", {"inputs": text, "truncate": True})


def embed_request(text: str) -> RequestSpec:
    return RequestSpec("/v1/embeddings", {"input": text, "truncate": True})


def translate_request(
    text: str, beam_size: int, max_new_tokens: int, source: str = "en", target: str = "es"
) -> RequestSpec:
    return RequestSpec(
        "/v1/translate",
        {
            "inputs": text,
            "source_lang": source,
            "target_lang": target,
            "beam_size": beam_size,
            "max_new_tokens": max_new_tokens,
            "truncate": True,
        },
    )


@dataclass(frozen=True)
class GenerateAPI:
    """How one server spells generation (from its OpenAPI document)."""

    path: str
    prompt_field: str  # "messages" for chat
    max_field: str
    can_stream: bool
    exact_field: str | None = None  # ignore_eos, or a min-tokens field set to the max
    extra: dict[str, Any] = field(default_factory=dict)  # temperature 0, stream_options, model

    @property
    def chat(self) -> bool:
        return self.prompt_field == "messages"

    def request(self, prompt: str, max_tokens: int, stream: bool, exact: bool) -> RequestSpec:
        """exact: ask for exactly max_tokens (ignore EOS) where the API can; else greedy until EOS or max."""
        body: dict[str, Any] = dict(self.extra)
        body[self.prompt_field] = [{"role": "user", "content": prompt}] if self.chat else prompt
        body[self.max_field] = max_tokens
        exact = exact and self.exact_field is not None
        if exact and self.exact_field == "ignore_eos":
            body["ignore_eos"] = True
        elif exact and self.exact_field is not None:
            body[self.exact_field] = max_tokens
        stream = stream and self.can_stream
        if stream:
            body["stream"] = True
        elif "stream_options" in body:
            del body["stream_options"]
        return RequestSpec(self.path, body, stream, max_tokens, exact)


def _resolve(schema: dict[str, Any], doc: dict[str, Any]) -> dict[str, Any]:
    """Follow $ref (and a single-member anyOf/allOf) inside an OpenAPI document."""
    for _ in range(10):
        if "$ref" in schema:
            node: Any = doc
            for part in schema["$ref"].lstrip("#/").split("/"):
                node = node[part]
            schema = node
        elif len(schema.get("allOf", [])) == 1:
            schema = schema["allOf"][0]
        else:
            return schema
    return schema


def request_schema(doc: dict[str, Any], path: str) -> dict[str, Any] | None:
    """The JSON request-body schema of POST `path`, or None when the route does not exist."""
    op = doc.get("paths", {}).get(path, {}).get("post")
    if op is None:
        return None
    content = op.get("requestBody", {}).get("content", {}).get("application/json", {})
    return _resolve(content.get("schema", {}), doc)


def discover_generate(doc: dict[str, Any], model: str | None = None) -> tuple[GenerateAPI | None, str]:
    """(the server's generation API, how it was found or why none was) from its OpenAPI document."""
    for path in GENERATE_PATHS:
        schema = request_schema(doc, path)
        if schema is None:
            continue
        props, required = schema.get("properties", {}), set(schema.get("required", []))
        prompt = (
            "messages"
            if path.endswith("/chat/completions")
            else next((f for f in PROMPT_FIELDS if f in props), None)
        )
        max_field = next((f for f in MAX_FIELDS if f in props), None)
        if prompt is None or max_field is None:
            continue
        exact = "ignore_eos" if "ignore_eos" in props else next((f for f in MIN_FIELDS if f in props), None)
        extra: dict[str, Any] = {}
        if "temperature" in props:
            extra["temperature"] = 0.0
        if "stream_options" in props:
            extra["stream_options"] = {"include_usage": True}
        if "model" in required:
            if model is None:
                continue
            extra["model"] = model
        api = GenerateAPI(path, prompt, max_field, "stream" in props, exact, extra)
        note = (
            f"POST {path} ({prompt}, {max_field}; streaming {'yes' if api.can_stream else 'no'}; exact "
            f"output length via {exact or 'nothing: greedy until EOS or the maximum'})"
        )
        return api, note
    return None, f"no generation route with a prompt and a length field among {list(GENERATE_PATHS)}"


def completion_tokens(payload: dict[str, Any]) -> int | None:
    usage = payload.get("usage") or {}
    value = usage.get("completion_tokens", usage.get("generated_tokens"))
    return int(value) if isinstance(value, int) else None


def completion_text(payload: dict[str, Any]) -> str:
    """The text of a (non-streamed) completion or of one streamed event, in the usual spellings."""
    choices = payload.get("choices")
    if choices:
        c = choices[0]
        return (
            c.get("text")
            or (c.get("delta") or {}).get("content")
            or (c.get("message") or {}).get("content")
            or ""
        )
    token = payload.get("token")
    if isinstance(token, dict):
        return token.get("text") or ""
    for key in ("text", "generated_text", "output"):
        if isinstance(payload.get(key), str):
            return payload[key]
    return ""


DONE = object()


def parse_stream_line(line: str) -> dict[str, Any] | object | None:
    """One line of a streamed answer -> its JSON event, DONE at the end marker, None for anything else."""
    line = line.strip()
    if line.startswith("data:"):
        line = line[len("data:") :].strip()
    elif line.startswith(("event:", "id:", "retry:", ":")) or not line:
        return None
    if line == "[DONE]":
        return DONE
    try:
        event = json.loads(line)
    except json.JSONDecodeError:
        return None
    return event if isinstance(event, dict) else None
