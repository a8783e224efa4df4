"""Function calling, the request's side: ``tools`` and ``tool_choice`` checked, and what they
ask of the engine (the tools handed to the chat template; for ``required`` or a named
function, the structured-output constraint that makes the reply a call).

As vLLM: ``tool_choice`` defaults to ``"auto"`` when tools are given; ``"auto"`` needs a
server started with ``--enable-auto-tool-choice --tool-call-parser NAME`` (the model's own
format is then parsed out of its reply); ``"required"`` and a named function need neither
(the grammar writes the calls as JSON); ``"none"`` hands the tools to the template only.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from tandem.sampling_params import ParamError

# The formats ``--tool-call-parser`` knows (tandem/server/tool_parsers.py): Hermes / Qwen
# ``<tool_call>{json}</tool_call>`` blocks, and Llama 3.1's bare JSON calls.
TOOL_CALL_PARSERS = ("hermes", "llama3_json")
MAX_TOOLS = 128
# OpenAI's rule for function names.
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


@dataclass(frozen=True)
class ToolPlan:
    """How a chat request's reply becomes tool calls.

    ``mode``: ``"auto"`` (``parser`` reads the model's own format), ``"required"`` (a JSON
    array of ``{"name", "parameters"}``, one call at least) or ``"named"`` (the reply is the
    arguments of ``function``). ``parallel``: more than one call may be returned.
    """

    mode: str
    parser: str | None = None
    function: str | None = None
    parallel: bool = True


def plan_tools(body: Any, parser: str | None) -> tuple[ToolPlan | None, list[dict] | None]:
    """The plan of a chat request (None: its reply is text only) and the tools for its chat
    template (None: none given); ParamError names ``tools`` or ``tool_choice``.

    ``parser``: the server's ``--tool-call-parser`` when ``--enable-auto-tool-choice`` is on,
    else None."""
    tools = checked_tools(body.tools)
    choice = body.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    parallel = body.parallel_tool_calls is not False
    if choice == "none":
        return None, tools
    if not tools:
        raise ParamError("tool_choice", "tool_choice other than 'none' needs tools")
    if choice == "auto":
        if parser is None:
            raise ParamError(
                "tool_choice",
                '"auto" tool choice needs a server started with --enable-auto-tool-choice and '
                "--tool-call-parser",
            )
        return ToolPlan("auto", parser=parser, parallel=parallel), tools
    if choice == "required":
        return ToolPlan("required", parallel=parallel), tools
    name = _named_function(choice)
    if name not in {tool["function"]["name"] for tool in tools}:
        raise ParamError("tool_choice", f"tool_choice names {name!r}, which is not in tools")
    return ToolPlan("named", function=name, parallel=False), tools


def tool_constraint(plan: ToolPlan | None, tools: list[dict] | None) -> dict | None:
    """The structured-output constraint (``SamplingParams.guided``) of a plan: the named
    function's parameters, or for ``required`` an array of calls to any of ``tools``; None
    for ``auto`` (the model writes its own format)."""
    if plan is None or plan.mode == "auto":
        return None
    by_name = {tool["function"]["name"]: _parameters(tool) for tool in tools or []}
    if plan.mode == "named":
        return {"json": by_name[plan.function]}
    calls = [
        {
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for name, schema in by_name.items()
    ]
    array: dict = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not plan.parallel:
        array["maxItems"] = 1
    return {"json": array}


def template_tool_calls(calls: list[dict]) -> list[dict]:
    """An assistant message's ``tool_calls`` as chat templates read them: each call's
    ``arguments`` (a JSON string in the API) as an object where it parses as one."""
    shaped = []
    for call in calls:
        function = dict(call["function"])
        try:
            arguments = json.loads(function["arguments"])
        except ValueError:
            arguments = None
        if isinstance(arguments, dict):
            function["arguments"] = arguments
        shaped.append({**call, "function": function})
    return shaped


def checked_tools(tools: list[Any] | None) -> list[dict] | None:
    """A request's ``tools`` (None when none are given), each checked to be a function with
    a valid, unique name (ParamError names the bad one)."""
    if not tools:
        return None
    if len(tools) > MAX_TOOLS:
        raise ParamError("tools", f"tools: at most {MAX_TOOLS} tools, got {len(tools)}")
    names = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ParamError(where, f'{where}: each tool must be {{"type": "function", ...}}')
        function = tool.get("function")
        if not isinstance(function, dict):
            raise ParamError(f"{where}.function", f"{where}.function must be an object")
        name = function.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
            raise ParamError(
                f"{where}.function.name",
                f"{where}.function.name must be 1-64 letters, digits, '_' or '-'",
            )
        if name in names:
            raise ParamError(f"{where}.function.name", f"{where}: function {name!r} given twice")
        names.add(name)
        for key, kind in (("parameters", dict), ("description", str), ("strict", bool)):
            if function.get(key) is not None and not isinstance(function[key], kind):
                raise ParamError(
                    f"{where}.function.{key}", f"{where}.function.{key} must be a {kind.__name__}"
                )
    return list(tools)


def _named_function(choice: Any) -> str:
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or choice.get("type") != "function":
        raise ParamError(
            "tool_choice",
            'tool_choice must be "none", "auto", "required" or '
            '{"type": "function", "function": {"name": ...}}',
        )
    return name


def _parameters(tool: dict) -> dict:
    """A function's parameter schema (an object of anything when it declares none)."""
    return tool["function"].get("parameters") or {"type": "object"}
