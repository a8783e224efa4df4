"""Function calling without a model: ``tools`` / ``tool_choice`` checked and planned
(tandem/server/tool_choice.py), and replies split into content and tool calls
(tandem/server/tool_parsers.py), streamed at every split point exactly as whole."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from tandem.sampling_params import ParamError
from tandem.server.chat_messages import ChatMessage
from tandem.server.tool_choice import (
    ToolPlan,
    plan_tools,
    template_tool_calls,
    tool_constraint,
)
from tandem.server.tool_parsers import (
    ToolCallStream,
    merged_calls,
    tool_finish_reason,
    whole_reply,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
HERMES = ToolPlan("auto", parser="hermes")
LLAMA3 = ToolPlan("auto", parser="llama3_json")


def body(tools=None, tool_choice=None, parallel_tool_calls=None):
    return SimpleNamespace(
        tools=tools, tool_choice=tool_choice, parallel_tool_calls=parallel_tool_calls
    )


# ---- the request's side ------------------------------------------------------------------


def test_plan_defaults_as_vllm():
    assert plan_tools(body(), "hermes") == (None, None)
    assert plan_tools(body([WEATHER]), "hermes") == (HERMES, [WEATHER])
    plan, tools = plan_tools(body([WEATHER], "none"), None)
    assert plan is None and tools == [WEATHER]  # the template still sees them
    plan, _ = plan_tools(body([WEATHER, TIME], "required", parallel_tool_calls=False), None)
    assert plan == ToolPlan("required", parallel=False)
    named = {"type": "function", "function": {"name": "get_time"}}
    assert plan_tools(body([WEATHER, TIME], named), None)[0] == ToolPlan(
        "named", function="get_time", parallel=False
    )


@pytest.mark.parametrize(
    "tools, choice, parser, param, words",
    [
        ([WEATHER], None, None, "tool_choice", "--enable-auto-tool-choice"),
        ([WEATHER], "auto", None, "tool_choice", "--tool-call-parser"),
        (None, "required", None, "tool_choice", "needs tools"),
        ([WEATHER], "always", None, "tool_choice", '"required"'),
        ([WEATHER], {"type": "function"}, None, "tool_choice", '"function"'),
        (
            [WEATHER],
            {"type": "function", "function": {"name": "nope"}},
            None,
            "tool_choice",
            "nope",
        ),
        ([{"type": "retrieval"}], "none", None, "tools[0]", "function"),
        ([{"type": "function"}], "none", None, "tools[0].function", "object"),
        (
            [{"type": "function", "function": {"name": "a b"}}],
            "none",
            None,
            "tools[0].function.name",
            "1-64",
        ),
        ([WEATHER, WEATHER], "none", None, "tools[1].function.name", "twice"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": "x"}}],
            "none",
            None,
            "tools[0].function.parameters",
            "dict",
        ),
        ([TIME] * 129, "none", None, "tools", "at most 128"),
    ],
)
def test_plan_refuses(tools, choice, parser, param, words):
    with pytest.raises(ParamError) as caught:
        plan_tools(body(tools, choice), parser)
    assert caught.value.param == param
    assert words in str(caught.value)


def test_constraints():
    assert tool_constraint(None, None) is None
    assert tool_constraint(HERMES, [WEATHER]) is None
    named = ToolPlan("named", function="get_time", parallel=False)
    assert tool_constraint(named, [WEATHER, TIME]) == {"json": {"type": "object"}}
    array = tool_constraint(ToolPlan("required"), [WEATHER, TIME])["json"]
    assert array["type"] == "array" and array["minItems"] == 1 and "maxItems" not in array
    first = array["items"]["anyOf"][0]
    assert first["properties"]["name"] == {"type": "string", "enum": ["get_weather"]}
    assert first["properties"]["parameters"] == WEATHER["function"]["parameters"]
    single = tool_constraint(ToolPlan("required", parallel=False), [WEATHER])["json"]
    assert single["maxItems"] == 1


def test_messages_with_tool_calls_reach_the_template():
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    message = ChatMessage.model_validate({"role": "assistant", "tool_calls": [call]})
    fields = message.template_fields("messages[1]")
    assert fields["content"] == ""
    assert fields["tool_calls"][0]["function"] == {"name": "f", "arguments": {"a": 1}}
    reply = ChatMessage.model_validate({"role": "tool", "tool_call_id": "c1", "content": "2"})
    assert reply.template_fields("messages[2]")["tool_call_id"] == "c1"
    # Arguments that are not a JSON object stay the string they were.
    odd = {**call, "function": {"name": "f", "arguments": "[1"}}
    assert template_tool_calls([odd])[0]["function"]["arguments"] == "[1"
    with pytest.raises(ParamError) as caught:
        bad = {**call, "id": "\ud800"}
        ChatMessage.model_validate({"role": "assistant", "tool_calls": [bad]}).template_fields(
            "messages[0]"
        )
    assert caught.value.param == "messages[0].tool_calls[0]"


# ---- the reply's side --------------------------------------------------------------------


def streamed(plan: ToolPlan, pieces: list[str]) -> tuple[str | None, list[dict], int]:
    """The reply fed piece by piece, the deltas merged as a client merges them."""
    stream = ToolCallStream(plan)
    content, calls = [], []
    for piece in pieces:
        text, deltas = stream.feed(piece)
        content.append(text)
        calls += deltas
    text, deltas = stream.finish()
    content.append(text)
    return "".join(content).strip() or None, merged_calls(calls + deltas), stream.num_calls


def flat(calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


REPLIES = [
    # (plan, reply, content, calls)
    (HERMES, "Hello there.", "Hello there.", []),
    (
        HERMES,
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call>",
        "Let me look.",
        [("get_weather", {"city": "Paris"})],
    ),
    (
        HERMES,
        '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n'
        '<tool_call>{"name": "b", "arguments": {"x": [1, "<"]}}</tool_call>',
        None,
        [("a", {}), ("b", {"x": [1, "<"]})],
    ),
    # Unclosed at the end (the reply ran out): parsed as it stands.
    (HERMES, '<tool_call>{"name": "a", "arguments": {"k": 1}}', None, [("a", {"k": 1})]),
    # Not a call: kept as written.
    (HERMES, "<tool_call>{oops}</tool_call> ok", "<tool_call>{oops}</tool_call> ok", []),
    (HERMES, "a < b and <tool_ca", "a < b and <tool_ca", []),
    (
        LLAMA3,
        ' {"name": "get_weather", "parameters": {"city": "Rome"}}; {"name": "b", "parameters": {}}',
        None,
        [("get_weather", {"city": "Rome"}), ("b", {})],
    ),
    (LLAMA3, "It is sunny.", "It is sunny.", []),
    (
        LLAMA3,
        '{"name": "a", "parameters": {} trailing',
        '{"name": "a", "parameters": {} trailing',
        [],
    ),
    (LLAMA3, '{"no_name": 1}', '{"no_name": 1}', []),
    (
        ToolPlan("required"),
        '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, '
        '{"name": "get_time", "parameters": {}}]',
        None,
        [("get_weather", {"city": "Oslo"}), ("get_time", {})],
    ),
    (
        ToolPlan("required"),
        '[{"name": "get_weather", "param',
        '[{"name": "get_weather", "param',
        [],
    ),
    (
        ToolPlan("named", function="get_weather", parallel=False),
        '{"city": "Lima"}',
        None,
        [("get_weather", {"city": "Lima"})],
    ),
]


@pytest.mark.parametrize("plan, reply, content, calls", REPLIES)
def test_reply_split_whole_and_streamed(plan, reply, content, calls):
    whole_content, whole_calls = whole_reply(plan, reply)
    assert whole_content == content
    assert flat(whole_calls) == calls
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in whole_calls)
    # Every split into two pieces, and one character at a time, streams the same reply.
    splits = [[reply[:i], reply[i:]] for i in range(len(reply) + 1)] + [list(reply)]
    for pieces in splits:
        got_content, got_calls, num_calls = streamed(plan, pieces)
        assert got_content == content, pieces
        assert flat(got_calls) == calls, pieces
        assert num_calls == len(calls)


def test_hermes_streams_text_before_the_call_at_once():
    stream = ToolCallStream(HERMES)
    assert stream.feed("Sure, <tool") == ("Sure, ", [])  # the possible tag held back
    assert stream.feed('_call>{"name": "a", "arguments": {}}') == ("", [])
    content, deltas = stream.feed("</tool_call> done")
    assert content == " done" and deltas[0]["function"] == {"name": "a", "arguments": "{}"}


def test_one_call_unless_parallel():
    reply = '<tool_call>{"name": "a"}</tool_call><tool_call>{"name": "b"}</tool_call>'
    content, calls = whole_reply(ToolPlan("auto", parser="hermes", parallel=False), reply)
    assert content is None and flat(calls) == [("a", {})]


def test_finish_reason():
    assert tool_finish_reason(HERMES, 1, "stop") == "tool_calls"
    assert tool_finish_reason(HERMES, 0, "stop") == "stop"
    assert tool_finish_reason(HERMES, 1, "length") == "length"
    assert tool_finish_reason(ToolPlan("required"), 2, "stop") == "tool_calls"
    assert tool_finish_reason(ToolPlan("named", function="f"), 1, "stop") == "stop"
