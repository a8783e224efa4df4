"""Function calling through the official ``openai`` client, on a server started with
``--enable-auto-tool-choice --tool-call-parser hermes``: a named function's arguments and
``required``'s calls validate against the tools' schemas, streamed as whole; ``auto`` parses
the Hermes blocks a reply writes (forced here with ``guided_regex``: the default model was
never taught the format) and leaves a reply without one as the offline engine's greedy text;
earlier turns' tool calls and tool replies reach the chat template. (Without the flags:
tests/e2e/hostile_cases.py's tool cases; parsers: tests/unit/test_tool_calls.py.)"""

from __future__ import annotations

import json

import jsonschema
import pytest
from server_helpers import MODEL, greedy

pytestmark = pytest.mark.slow  # a server process for the module

QUESTION = [{"role": "user", "content": "What is the weather like in Paris today?"}]
CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 16},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Weather in a city", "parameters": CITY},
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 12}},
            "required": ["zone"],
        },
    },
}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
# A Hermes block the reply is made to write in the auto tests.
HERMES_CALL = (
    r'Checking\. <tool_call>\{"name": "get_weather", "arguments": '
    r'\{"city": "[A-Z][a-z]{2,8}", "unit": "celsius"\}\}</tool_call>'
)


@pytest.fixture(scope="module")
def server_args() -> list[str]:
    return ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]


def ask(client, stream: bool, **fields):
    """The reply's content, tool calls (name, parsed arguments, id) and finish reason;
    streamed replies merged as a client merges their deltas."""
    fields = {"model": MODEL, "messages": QUESTION, "max_tokens": 80, "temperature": 0, **fields}
    if not stream:
        choice = client.chat.completions.create(**fields).choices[0]
        calls = [
            (c.function.name, json.loads(c.function.arguments), c.id)
            for c in choice.message.tool_calls or []
        ]
        return choice.message.content, calls, choice.finish_reason
    content, pieces, finish = [], {}, None
    for chunk in client.chat.completions.create(stream=True, **fields):
        delta = chunk.choices[0].delta
        content.append(delta.content or "")
        for call in delta.tool_calls or []:
            if call.index not in pieces:
                pieces[call.index] = [call.function.name, "", call.id]
            pieces[call.index][1] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    calls = [(name, json.loads(args), id_) for name, args, id_ in pieces.values()]
    return "".join(content).strip() or None, calls, finish


def without_ids(calls):
    return [(name, arguments) for name, arguments, _ in calls]


def test_named_function(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    whole = ask(client, False, tools=[WEATHER, TIME], tool_choice=named)
    content, calls, finish = whole
    assert content is None and finish == "stop"  # OpenAI's reason for a forced call
    assert len(calls) == 1 and calls[0][0] == "get_weather" and calls[0][2].startswith("call_")
    jsonschema.validate(calls[0][1], CITY)
    streamed = ask(client, True, tools=[WEATHER, TIME], tool_choice=named)
    assert without_ids(streamed[1]) == without_ids(calls) and streamed[2] == finish


@pytest.mark.parametrize("parallel", [True, False])
def test_required(client, parallel):
    fields = {"tools": [WEATHER, TIME], "tool_choice": "required"}
    if not parallel:
        fields["parallel_tool_calls"] = False
    content, calls, finish = ask(client, False, **fields)
    assert content is None and finish == "tool_calls"
    assert calls and (parallel or len(calls) == 1)
    for name, arguments, _ in calls:
        jsonschema.validate(arguments, SCHEMAS[name])
    streamed = ask(client, True, **fields)
    assert without_ids(streamed[1]) == without_ids(calls) and streamed[2] == finish


def test_auto_parses_a_hermes_block(client):
    fields = {"tools": [WEATHER], "extra_body": {"guided_regex": HERMES_CALL}}
    for stream in (False, True):
        content, calls, finish = ask(client, stream, **fields)
        assert content == "Checking." and finish == "tool_calls"
        assert len(calls) == 1 and calls[0][0] == "get_weather"
        jsonschema.validate(calls[0][1], CITY)


def test_auto_without_a_call_is_the_greedy_text(client, offline):
    """The tools reach the chat template (this model's shows none of them): a reply without a
    call is the offline greedy text of the same prompt, whole and streamed."""
    prompt = offline.tokenizer.apply_chat_template(QUESTION, True, [WEATHER])
    expected = greedy(offline, {"prompt_token_ids": prompt}, 24).outputs[0].text.strip()
    assert "<tool_call>" not in expected
    for stream in (False, True):
        content, calls, finish = ask(client, stream, tools=[WEATHER], max_tokens=24)
        assert (content, calls, finish) == (expected, [], "length")


def test_earlier_calls_and_tool_replies_reach_the_template(client, offline):
    arguments = {"city": "Paris", "unit": "celsius"}
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather"}}
    reply = {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"}
    sent = [
        *QUESTION,
        {
            "role": "assistant",
            "tool_calls": [
                {**call, "function": {**call["function"], "arguments": json.dumps(arguments)}}
            ],
        },
        reply,
    ]
    response = client.chat.completions.create(
        model=MODEL,
        messages=sent,
        tools=[WEATHER],
        tool_choice="none",
        max_tokens=12,
        temperature=0,
    )
    # As the template reads them: the arguments as an object.
    shaped = [
        *QUESTION,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{**call, "function": {**call["function"], "arguments": arguments}}],
        },
        reply,
    ]
    prompt = offline.tokenizer.apply_chat_template(shaped, True, [WEATHER])
    assert "18 degrees and sunny" in offline.tokenizer.decode(prompt, False)
    assert response.usage.prompt_tokens == len(prompt)
    expected = greedy(offline, {"prompt_token_ids": prompt}, 12).outputs[0].text
    assert response.choices[0].message.content == expected
    assert response.choices[0].message.tool_calls is None
