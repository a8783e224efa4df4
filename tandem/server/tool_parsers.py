"""Function calling, the reply's side: a run's generated text split into content and tool
calls as it streams, in the format its plan names (tandem/server/tool_choice.py).

The whole reply is the stream fed at once, so streamed and whole responses always agree. A
call the model wrote but that does not parse (not JSON, no name) stays in the content as it
was written, never dropped.
"""

from __future__ import annotations

import json
import uuid

from tandem.server.tool_choice import ToolPlan

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


def new_call_id() -> str:
    """A tool call's id, in OpenAI's shape."""
    return "call_" + uuid.uuid4().hex[:24]


class ToolCallStream:
    """Feeds on a run's text deltas; each step returns the content to show and the tool-call
    deltas (OpenAI's streamed ``tool_calls`` entries, ``index`` numbering the calls)."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.num_calls = 0
        self._buffer = ""
        self._inside = False  # hermes: inside a <tool_call> block
        self._decided: bool | None = None  # llama3_json: None undecided, True calls, False text

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """The content and tool-call deltas that ``text`` (the next delta) lets out."""
        if self.plan.mode == "named":
            return "", self._named_delta(text)
        self._buffer += text
        if self.plan.mode == "required":
            return "", []
        if self.plan.parser == "hermes":
            return self._hermes(final=False)
        return self._llama3(final=False)

    def finish(self) -> tuple[str, list[dict]]:
        """What the end of the reply lets out (a call left unclosed is parsed as it stands)."""
        if self.plan.mode == "named":
            return "", []
        if self.plan.mode == "required":
            return self._required()
        if self.plan.parser == "hermes":
            return self._hermes(final=True)
        return self._llama3(final=True)

    # ---- formats -----------------------------------------------------------------------

    def _named_delta(self, text: str) -> list[dict]:
        if self.num_calls == 0:
            self.num_calls = 1
            function = {"name": self.plan.function, "arguments": text}
            return [{"index": 0, "id": new_call_id(), "type": "function", "function": function}]
        return [{"index": 0, "function": {"arguments": text}}] if text else []

    def _hermes(self, final: bool) -> tuple[str, list[dict]]:
        content, calls = [], []
        while True:
            if self._inside:
                end = self._buffer.find(HERMES_CLOSE)
                if end < 0 and not final:
                    break
                block = self._buffer if end < 0 else self._buffer[:end]
                self._buffer = "" if end < 0 else self._buffer[end + len(HERMES_CLOSE) :]
                self._inside = False
                call = self._call(_json_object(block), "arguments")
                if call is None:
                    content.append(HERMES_OPEN + block + ("" if end < 0 else HERMES_CLOSE))
                calls += call or []
                continue
            start = self._buffer.find(HERMES_OPEN)
            if start >= 0:
                content.append(self._buffer[:start])
                self._buffer = self._buffer[start + len(HERMES_OPEN) :]
                self._inside = True
                continue
            keep = 0 if final else _partial_suffix(self._buffer, HERMES_OPEN)
            content.append(self._buffer[: len(self._buffer) - keep])
            self._buffer = self._buffer[len(self._buffer) - keep :]
            break
        return "".join(content), calls

    def _llama3(self, final: bool) -> tuple[str, list[dict]]:
        if self._decided is None:
            head = self._buffer.lstrip()
            if head.startswith(PYTHON_TAG) or head.startswith("{"):
                self._decided = True
            elif head and not PYTHON_TAG.startswith(head):
                self._decided = False
        if self._decided is False or (final and self._decided is None):
            text, self._buffer = self._buffer, ""
            return text, []
        if not final:
            return "", []
        text = self._buffer.lstrip().removeprefix(PYTHON_TAG)
        objects = _json_objects(text, separator=";")
        calls = []
        for obj in objects or []:
            key = "parameters" if "parameters" in obj else "arguments"
            made = self._call(obj, key)
            if made is None:
                calls = None
                break
            calls += made
        if not calls:  # not calls, or one that does not parse: the text as it was written
            return self._buffer, []
        return "", calls

    def _required(self) -> tuple[str, list[dict]]:
        try:
            array = json.loads(self._buffer)
        except ValueError:
            array = None
        calls = []
        for obj in array if isinstance(array, list) else [None]:
            made = self._call(obj, "parameters")
            if made is None:
                return self._buffer, []
            calls += made
        return "", calls

    def _call(self, obj: object, key: str) -> list[dict] | None:
        """The delta of one parsed call (``[]`` past the first when calls may not be
        parallel); None if ``obj`` is not ``{"name": str, key: object}``."""
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        arguments = obj.get(key, {})
        if not isinstance(arguments, dict):
            return None
        if self.num_calls and not self.plan.parallel:
            return []
        index, self.num_calls = self.num_calls, self.num_calls + 1
        function = {"name": obj["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}
        return [{"index": index, "id": new_call_id(), "type": "function", "function": function}]


def whole_reply(plan: ToolPlan, text: str) -> tuple[str | None, list[dict]]:
    """A whole reply's content (None when empty) and its tool calls (the message's
    ``tool_calls`` entries), as the stream would give them."""
    stream = ToolCallStream(plan)
    content, deltas = stream.feed(text)
    more_content, more_deltas = stream.finish()
    content = (content + more_content).strip()
    return content or None, merged_calls(deltas + more_deltas)


def merged_calls(deltas: list[dict]) -> list[dict]:
    """Streamed tool-call deltas merged as a client merges them: a call per ``index``, its
    argument pieces joined (the message's ``tool_calls`` entries)."""
    calls: list[dict] = []
    for delta in deltas:
        if delta["index"] == len(calls):
            calls.append({key: value for key, value in delta.items() if key != "index"})
            calls[-1]["function"] = dict(delta["function"])
        else:
            calls[delta["index"]]["function"]["arguments"] += delta["function"]["arguments"]
    return calls


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker`` (held back until
    the next delta shows whether the marker follows)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def _json_object(text: str) -> object:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _json_objects(text: str, separator: str) -> list[object] | None:
    """JSON values one after another, ``separator`` between them (None unless all parse)."""
    decoder, objects, at = json.JSONDecoder(), [], 0
    while True:
        while at < len(text) and text[at].isspace():
            at += 1
        try:
            obj, at = decoder.raw_decode(text, at)
        except ValueError:
            return None
        objects.append(obj)
        while at < len(text) and text[at].isspace():
            at += 1
        if at == len(text):
            return objects
        if text[at] != separator:
            return None
        at += 1


def tool_finish_reason(plan: ToolPlan, num_calls: int, reason: str | None) -> str | None:
    """The finish reason to report: ``"tool_calls"`` for a reply that ended by itself with
    calls in it, unless the request named the function (OpenAI's ``"stop"`` then)."""
    if reason == "stop" and num_calls and plan.mode != "named":
        return "tool_calls"
    return reason
