"""Hostile request cases for the OpenAI endpoints (test_hostile_inputs.py), generated from a
parameter table: every field of the request models (read from their JSON schema, so a new
field gets cases without an edit here) gets values of every JSON type it does not accept,
NaN / Infinity / overflowing numbers and integers beyond int64; the explicit bounds below add
values just inside and just outside each field's range, token ids outside the vocabulary in
every field that carries them, invalid Unicode, and malformed chat messages and content
parts. Raw bodies add what JSON cannot say (invalid UTF-8, NaN literals, deep nesting)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from hostile_table import (
    BASE,
    BOUNDS,
    BOUNDS_CHAT,
    BOUNDS_COMPLETION,
    CHAT,
    COMPLETIONS,
    HUGE_INTS,
    I64,
    MAX_MODEL_LEN,
    NON_FINITE,
    READABLE,
)

from tandem.sampling_params import MAX_COUNT
from tandem.server.protocol import (
    UNSUPPORTED_CHAT,
    UNSUPPORTED_COMPLETION,
    ChatCompletionRequest,
    CompletionRequest,
)

SCHEMAS = {COMPLETIONS: CompletionRequest, CHAT: ChatCompletionRequest}


@dataclass(frozen=True)
class Case:
    """One request: its body (JSON, or ``raw`` bytes), what must happen (``expect``: "ok"
    is a 200, "reject" a 4xx whose ``param`` names ``param`` (None: any or none), "either"
    only the common checks) and a readable id."""

    id: str
    path: str
    body: dict | None
    expect: str
    param: str | None = None
    raw: bytes | None = None
    status: int = 400

    def content(self) -> bytes:
        """The request body as sent."""
        if self.raw is not None:
            return self.raw
        return json.dumps(self.body, allow_nan=True).encode()

    @property
    def stream(self) -> bool:
        return bool(self.body and self.body.get("stream") is True)


def _short(value) -> str:
    if isinstance(value, RawToken):
        return value.text
    text = json.dumps(value, allow_nan=True, ensure_ascii=True)
    return text if len(text) <= 30 else text[:27] + "..."


def _with(path: str, **fields) -> dict:
    return {**BASE[path], **fields}


def _accepted_types(schema: dict, defs: dict) -> set[str]:
    """The JSON types a (pydantic-generated) property schema accepts."""
    if "$ref" in schema:
        return _accepted_types(defs[schema["$ref"].rsplit("/", 1)[1]], defs)
    if "anyOf" in schema:
        return set().union(*(_accepted_types(s, defs) for s in schema["anyOf"]))
    if "enum" in schema or "const" in schema:
        return {"string"}
    kind = schema.get("type")
    if kind is None:  # Any
        return {"string", "integer", "number", "boolean", "null", "array", "object"}
    return {kind}


def _json_type(value) -> str:
    names = {str: "string", bool: "boolean", int: "integer", float: "number", list: "array"}
    return "null" if value is None else names.get(type(value), "object")


def _accepts(accepted: set[str], value) -> bool:
    kind = _json_type(value)
    return kind in accepted or (kind == "integer" and "number" in accepted)


def field_type_cases(path: str, schema: dict, defs: dict, where: str, make) -> list[Case]:
    """For every property of ``schema``: each JSON type it does not accept, non-finite and
    overflowing numbers for numeric ones, integers beyond int64 for integer ones; all refused
    naming ``where`` + the property. ``make(name, value)`` builds the body; a raw-JSON value
    is a ``RawToken``."""
    cases = []
    for name, prop in schema["properties"].items():
        accepted = _accepted_types(prop, defs)
        field = f"{where}{name}"
        values = [v for v in SAMPLE_VALUES if not _accepts(accepted, v)]
        if accepted & {"integer", "number"}:
            values += [RawToken(t) for t in NON_FINITE]
        if "integer" in accepted:
            values += list(HUGE_INTS)
        for value in values:
            body = make(name, value)
            raw = body.pop(RAW, None) if isinstance(body, dict) else None
            case_id = f"{path}-{field}-{_short(value)}"
            cases.append(Case(case_id, path, None if raw else body, "reject", field, raw))
    return cases


def type_cases(path: str) -> list[Case]:
    """Wrong types and numbers for every field of the request model, of a chat message and
    of ``stream_options``."""
    schema = SCHEMAS[path].model_json_schema()
    defs = schema.get("$defs", {})
    cases = field_type_cases(path, schema, defs, "", lambda n, v: _body_with(path, {n: v}))
    stream_options = defs["StreamOptions"]
    cases += field_type_cases(
        path,
        stream_options,
        defs,
        "stream_options.",
        lambda n, v: _body_with(path, {"stream": True, "stream_options": {n: v}}),
    )
    if path == CHAT:
        message = defs["ChatMessage"]
        cases += field_type_cases(
            path,
            message,
            defs,
            "messages[0].",
            lambda n, v: _body_with(path, {"messages": [{"role": "user", "content": "Hi", n: v}]}),
        )
    return cases


@dataclass(frozen=True)
class RawToken:
    """A JSON value only raw text can carry (``NaN``, ``Infinity``, ``1e309``)."""

    text: str


RAW = "__raw__"
SAMPLE_VALUES = ("1", 1, 1.5, True, None, [], {})


def _body_with(path: str, fields: dict) -> dict:
    """The base body with ``fields`` set; a RawToken anywhere makes it raw (under RAW)."""
    body = {**BASE[path], **fields}
    text = json.dumps(body, allow_nan=True, default=_raw_marker)
    if _MARK not in text:
        return body
    for token in NON_FINITE:
        text = text.replace(json.dumps(_MARK + token), token)
    return {RAW: text.encode()}


_MARK = "<raw>"


def _raw_marker(value):
    if isinstance(value, RawToken):
        return _MARK + value.text
    raise TypeError(type(value).__name__)


def unknown_field_cases(path: str) -> list[Case]:
    """Fields no model declares: OpenAI's and vLLM's that Tandem does not implement are
    refused naming them, made-up ones ignored (as vLLM does), a name that is not valid
    Unicode refused."""
    refused = ("length_penalty", "guided_json", "add_special_tokens")
    refused += ("verbosity",) if path == CHAT else ()
    cases = [Case(f"{path}-unknown-{n}", path, _with(path, **{n: 1}), "reject", n) for n in refused]
    cases += [
        Case(f"{path}-unknown-{_short(n)}", path, _with(path, **{n: 1}), "ok")
        for n in ("foo", "max_tokens ")
    ]
    cases.append(Case(f"{path}-unknown-surrogate", path, _with(path, **{"\ud800": 1}), "reject"))
    return cases


def unsupported_cases(path: str) -> list[Case]:
    """OpenAI features Tandem does not have: neutral values accepted, others refused."""
    table = dict(UNSUPPORTED_COMPLETION if path == COMPLETIONS else {})
    if path == CHAT:
        table.update(UNSUPPORTED_CHAT)
    asked = {
        "echo": (True,),
        "best_of": (2, 0),
        "suffix": (" end",),
        "functions": ([{"name": "f"}],),
        "function_call": ("auto",),
        "modalities": (["text", "audio"],),
        "audio": ({"voice": "x"},),
        "prediction": ({"type": "content", "content": "x"},),
    }
    cases = []
    for name, neutral in table.items():
        for value in neutral:
            cases.append(
                Case(
                    f"{path}-{name}-neutral-{_short(value)}",
                    path,
                    _with(path, **{name: value}),
                    "ok",
                )
            )
        for value in asked[name]:
            cases.append(
                Case(
                    f"{path}-{name}-asked-{_short(value)}",
                    path,
                    _with(path, **{name: value}),
                    "reject",
                    name,
                )
            )
    return cases


def tool_cases(path: str) -> list[Case]:
    """Function calling on a server without automatic tool choice: ``required`` and a named
    function work with any model (the grammar writes the calls), ``auto`` is refused, as are
    malformed tools, a parameter schema that does not compile, and a second constraint."""
    if path != CHAT:
        return []
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    broken = {"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/no"}}}
    named = {"type": "function", "function": {"name": "f"}}
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    table = [
        ("required", {"tools": [tool], "tool_choice": "required"}, "ok", None),
        (
            "named",
            {"tools": [tool], "tool_choice": named, "parallel_tool_calls": False},
            "ok",
            None,
        ),
        ("none", {"tools": [tool], "tool_choice": "none"}, "ok", None),
        ("default-auto", {"tools": [tool]}, "reject", "tool_choice"),
        ("auto", {"tools": [tool], "tool_choice": "auto"}, "reject", "tool_choice"),
        ("no-tools", {"tool_choice": "required"}, "reject", "tool_choice"),
        ("not-a-tool", {"tools": [1], "tool_choice": "none"}, "reject", "tools[0]"),
        ("bad-schema", {"tools": [broken], "tool_choice": "required"}, "reject", "tools"),
        (
            "two-constraints",
            {"tools": [tool], "tool_choice": named, "response_format": {"type": "json_object"}},
            "reject",
            "response_format",
        ),
        (
            "past-calls",
            {"messages": [{"role": "assistant", "tool_calls": [call]}, BASE[CHAT]["messages"][0]]},
            "ok",
            None,
        ),
        (
            "call-arguments-not-text",
            {"messages": [{"role": "assistant", "tool_calls": [{**call, "function": {}}]}]},
            "reject",
            None,
        ),
    ]
    return [
        Case(f"{path}-tools-{name}", path, _with(path, **fields), expect, param)
        for name, fields, expect, param in table
    ]


def bounds_cases(path: str) -> list[Case]:
    """Values just inside each field's bounds (accepted) and just outside (refused naming
    the field)."""
    table = {**BOUNDS, **(BOUNDS_COMPLETION if path == COMPLETIONS else BOUNDS_CHAT)}
    cases = []
    for name, (inside, outside) in table.items():
        for expect, values in (("ok", inside), ("reject", outside)):
            for value in values:
                body = _with(path, **{name: value})
                case_id = f"{path}-{name}-{expect}-{_short(value)}"
                cases.append(Case(case_id, path, body, expect, name))
    cases.append(
        Case(
            f"{path}-model-unknown", path, _with(path, model="gpt-4"), "reject", "model", status=404
        )
    )
    return cases


def combination_cases(path: str) -> list[Case]:
    """Fields that are fine alone but not together, and features that are."""
    logprobs = {"logprobs": 2} if path == COMPLETIONS else {"logprobs": True, "top_logprobs": 2}
    long_text = [{"role": "user", "content": "Hi " * (MAX_MODEL_LEN - 40)}]
    near_full = (
        {"prompt": [1] * (MAX_MODEL_LEN - 6)} if path == COMPLETIONS else {"messages": long_text}
    )
    return [
        Case(
            f"{path}-stream_options-without-stream",
            path,
            _with(path, stream_options={"include_usage": True}),
            "reject",
            "stream_options",
        ),
        Case(
            f"{path}-min_tokens-over-max_tokens",
            path,
            _with(path, min_tokens=5, max_tokens=4),
            "reject",
            "min_tokens",
        ),
        Case(
            f"{path}-min_tokens-oov-stop",
            path,
            _with(path, min_tokens=2, max_tokens=4, stop_token_ids=[10**9]),
            "reject",
            "stop_token_ids",
        ),
        Case(f"{path}-logprobs", path, _with(path, **logprobs), "ok"),
        # The largest max_tokens, with a prompt that leaves the context a few tokens.
        Case(
            f"{path}-max_tokens-largest", path, _with(path, max_tokens=MAX_COUNT, **near_full), "ok"
        ),
        Case(
            f"{path}-sampled-seeded",
            path,
            _with(path, temperature=1, top_k=I64 - 1, top_p=0.9, min_p=0.1, seed=I64 - 1),
            "ok",
        ),
        Case(
            f"{path}-usage",
            path,
            _with(path, stream=True, stream_options={"include_usage": True}),
            "ok",
        ),
        Case(
            f"{path}-return_token_ids",
            path,
            _with(path, return_token_ids=True, ignore_eos=True, skip_special_tokens=False),
            "ok",
        ),
    ]


def raw_cases(path: str) -> list[Case]:
    """Bodies that are not a JSON object of valid UTF-8."""
    valid = json.dumps(BASE[path]).encode()
    field = b'"prompt"' if path == COMPLETIONS else b'"model"'
    bodies = {
        "empty": b"",
        "truncated": valid[:-1],
        "array": b"[]",
        "number": b"1",
        "string": b'"Hi"',
        "null": b"null",
        "nan": b"NaN",
        "invalid-utf8": valid.replace(field, field[:-1] + b'\\xff"', 1).replace(b"\\xff", b"\xff"),
        "invalid-utf8-value": valid[:-1] + b', "user": "\xc3\x28"}',
        "latin1-key": valid[:-1] + b', "\xe9": 1}',
        "utf16": json.dumps(BASE[path]).encode("utf-16"),
        "bom": b"\xef\xbb\xbf" + valid,
        "deep-nesting": b'{"stop": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        "duplicate-keys": valid[:-1] + b', "max_tokens": 0}',
        "trailing-garbage": valid + b"}",
        "control-in-string": valid[:-1] + b', "user": "a\x01b"}',
    }
    return [
        Case(
            f"{path}-raw-{name}", path, None, "either" if name in READABLE else "reject", None, raw
        )
        for name, raw in bodies.items()
    ]


def all_cases() -> list[Case]:
    """Every case, for both endpoints; each refused body also streamed, accepted ones
    every other (their tokens cost the most time)."""
    cases = []
    for path in (COMPLETIONS, CHAT):
        cases += type_cases(path) + unknown_field_cases(path) + unsupported_cases(path)
        cases += tool_cases(path)
        cases += bounds_cases(path) + combination_cases(path) + raw_cases(path)
    streamed = [
        Case(
            c.id + "-stream", c.path, {**c.body, "stream": True}, c.expect, c.param, status=c.status
        )
        for i, c in enumerate(cases)
        if c.body is not None
        and "stream" not in c.body
        and "stream_options" not in c.body
        and (c.expect != "ok" or i % 2)
    ]
    return cases + streamed
