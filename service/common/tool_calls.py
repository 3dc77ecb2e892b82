"""Tool calls in chat, torch-free and FastAPI-free (the ingress parses, the replica renders).

A chat template that reads `tools` (Qwen2.5's: `template_knows_tools`) gets them through the
template, with messages in Hugging Face's shape (`hf_messages`). Any other template (SmolLM2's) gets
them in the format Hermes and Qwen models are trained on (`render_in_prompt`): the JSON Schemas in the
system message (`tools_prompt`), each assistant call as <tool_call>{"name": ..., "arguments": {...}}
</tool_call>, each `tool` message as a user <tool_response>...</tool_response>. `parse` turns every
<tool_call> block naming a requested tool into an OpenAI tool call and the rest into the content
(another form, such as Llama 3.1's bare JSON, stays text); `call_grammar` constrains a forced call
(`tool_choice` "required" or a named function) to one block valid against the tool's parameters.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class Tool:
    name: str
    description: str = ""
    parameters: str = '{"type": "object"}'  # a JSON Schema, as JSON text

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name}
        if self.description:
            out["description"] = self.description
        out["parameters"] = json.loads(self.parameters)
        return out


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as JSON text (OpenAI's shape)


def tools_prompt(tools: Sequence[Tool]) -> str:
    listed = "\n".join(json.dumps(t.as_dict(), ensure_ascii=False) for t in tools)
    return ("You may call functions. Their JSON Schemas:\n<tools>\n" + listed + "\n</tools>\n"
            f'To call one, answer with\n{OPEN}{{"name": <name>, "arguments": <JSON object>}}{CLOSE}\n'
            "(one block per call) and nothing else.")


def call_text(call: ToolCall) -> str:
    return OPEN + json.dumps({"name": call.name, "arguments": json.loads(call.arguments or "{}")},
                             ensure_ascii=False) + CLOSE


def render_in_prompt(messages: Sequence[dict[str, Any]], tools: Sequence[Tool]) -> list[dict[str, Any]]:
    """Messages (role, content, tool_calls?, tool_call_id?) as plain system/user/assistant messages,
    the tools in the system message (`tools_prompt`), for templates that know no tools."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>{m.get('content') or ''}</tool_response>"})
        elif m.get("tool_calls"):
            text = "\n".join(call_text(c) for c in m["tool_calls"])
            out.append({"role": "assistant", "content": ((m.get("content") or "") + "\n" + text).lstrip()})
        else:
            out.append({"role": m["role"], "content": m.get("content") or ""})
    if tools:
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + tools_prompt(tools)}
        else:
            out.insert(0, {"role": "system", "content": tools_prompt(tools)})
    return out


def hf_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages in Hugging Face's tool-calling shape, for templates that know tools."""
    out = []
    for m in messages:
        entry: dict[str, Any] = {"role": m["role"], "content": m.get("content") or ""}
        if m.get("tool_calls"):
            entry["tool_calls"] = [{"id": c.id, "type": "function",
                                    "function": {"name": c.name, "arguments": json.loads(c.arguments or "{}")}}
                                   for c in m["tool_calls"]]
        if m.get("tool_call_id"):
            entry["tool_call_id"] = m["tool_call_id"]
        out.append(entry)
    return out


def template_knows_tools(template: str | None) -> bool:
    return bool(template) and re.search(r"\btools\b", template or "") is not None


def parse(text: str, names: Sequence[str]) -> tuple[str | None, list[ToolCall]]:
    """(content, tool calls) of an answer: each <tool_call> followed by a JSON object {"name": a
    requested tool, "arguments": an object (or a JSON string of one)} is a call, its closing tag
    optional at the end of the text; the rest of the text (stripped; None when empty) is the content."""
    decoder = json.JSONDecoder()
    calls: list[ToolCall] = []
    kept: list[str] = []
    last = search = 0
    while (at := text.find(OPEN, search)) >= 0:
        search = at + len(OPEN)
        body = len(text[search:]) - len(text[search:].lstrip())
        try:
            data, used = decoder.raw_decode(text, search + body)
        except ValueError:
            continue
        arguments = data.get("arguments", data.get("parameters", {})) if isinstance(data, dict) else None
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                arguments = None
        if not isinstance(data, dict) or data.get("name") not in names or not isinstance(arguments, dict):
            continue
        rest = text[used:]
        end = used + (len(rest) - len(rest.lstrip()))
        if text.startswith(CLOSE, end):
            end += len(CLOSE)
        elif text[end:].strip():
            continue  # neither a closing tag nor the end of the text: not a call block
        kept.append(text[last:at])
        last = search = end
        calls.append(ToolCall(f"call_{uuid.uuid4().hex[:24]}", data["name"], json.dumps(arguments, ensure_ascii=False)))
    kept.append(text[last:])
    content = "".join(kept).strip()
    return (content or None), calls


def call_grammar(tools: Sequence[Tool], only: str | None = None) -> str:
    """A Lark grammar (llguidance's, structured outputs) for exactly one tool-call block of one of
    `tools` (or of the tool named `only`), its arguments valid against the tool's parameters."""
    chosen = [t for t in tools if only is None or t.name == only]
    options = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                "properties": {"name": {"const": t.name}, "arguments": json.loads(t.parameters)}} for t in chosen]
    schema: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
    schema = {**schema, "x-guidance": {"whitespace_flexible": False}}
    return f"start: {json.dumps(OPEN)} call {json.dumps(CLOSE)}\ncall: %json {json.dumps(schema)}"

