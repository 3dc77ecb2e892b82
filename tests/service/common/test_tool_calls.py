"""Tool calls without a server: the prompt format for templates without tools, parsing answers back."""

from __future__ import annotations

import json

from service.common.tool_calls import (
    Tool,
    ToolCall,
    call_grammar,
    parse,
    render_in_prompt,
    template_knows_tools,
)

WEATHER = Tool("get_weather", "The weather in a city", json.dumps(
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}))


def test_answers_with_call_blocks_become_tool_calls() -> None:
    text = ('Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
            '<tool_call>{"name": "unknown", "arguments": {}}</tool_call> <tool_call>not json</tool_call>')
    content, calls = parse(text, ["get_weather"])
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert calls[0].id.startswith("call_")
    assert content == ('Let me check. \n<tool_call>{"name": "unknown", "arguments": {}}</tool_call> '
                       '<tool_call>not json</tool_call>')  # blocks that are no call stay text
    assert parse("just text", ["get_weather"]) == ("just text", [])
    assert parse('<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>', ["get_weather"])[0] is None


def test_tools_and_tool_messages_in_a_template_without_tools() -> None:
    call = ToolCall("call_1", "get_weather", '{"city": "Paris"}')
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "weather?"},
                {"role": "assistant", "content": "", "tool_calls": (call,)},
                {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "call_1"}]
    out = render_in_prompt(messages, [WEATHER])
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("be brief\n\nYou may call functions") and '"get_weather"' in out[0]["content"]
    assert out[2]["content"] == '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    assert out[3]["content"] == '<tool_response>{"temp": 21}</tool_response>'
    assert render_in_prompt([{"role": "user", "content": "hi"}], [WEATHER])[0]["role"] == "system"


def test_forced_call_grammar_and_template_detection() -> None:
    grammar = call_grammar([WEATHER, Tool("noop")], only="get_weather")
    assert grammar.startswith('start: "<tool_call>" call "</tool_call>"') and '"const": "get_weather"' in grammar
    assert '"noop"' not in grammar and '"noop"' in call_grammar([WEATHER, Tool("noop")])
    assert template_knows_tools("{% if tools %}{{ tools | tojson }}{% endif %}")
    assert not template_knows_tools("{% for m in messages %}{{ m['content'] }}{% endfor %}")


def test_parsing_survives_what_models_write() -> None:
    names = ["get_weather"]
    unclosed = 'ok <tool_call>{"name": "get_weather", "arguments": {"city": "Lima"}}'
    content, calls = parse(unclosed, names)
    assert content == "ok" and json.loads(calls[0].arguments) == {"city": "Lima"}
    as_string = '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}</tool_call>'
    assert json.loads(parse(as_string, names)[1][0].arguments) == {"city": "Oslo"}
    tag_inside = '<tool_call>{"name": "get_weather", "arguments": {"city": "a</tool_call>b"}}</tool_call>'
    assert json.loads(parse(tag_inside, names)[1][0].arguments) == {"city": "a</tool_call>b"}
    followed = '<tool_call>{"name": "get_weather", "arguments": {}} and then prose'
    assert parse(followed, names) == (followed, [])  # no closing tag and not at the end: not a call
