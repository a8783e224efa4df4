"""Chat messages as requests send them: text content parts, and the tool calls of earlier
assistant turns; each checked and shaped for the chat template."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from tandem.sampling_params import ParamError, check_text
from tandem.server.tool_choice import template_tool_calls

# Request bodies are strict (a string is not a number, 1 is not true) and closed (an unknown
# field is a 400 naming it): nothing a client sends is silently coerced or ignored.
STRICT = ConfigDict(extra="forbid", strict=True)


class ContentPart(BaseModel):
    """One part of a message's content; only ``{"type": "text", "text": ...}`` is supported
    (other types are refused by :meth:`ChatMessage.text`, naming the part)."""

    model_config = ConfigDict(extra="allow", strict=True)

    type: str
    text: str | None = None


class FunctionCall(BaseModel):
    """The function of a call an assistant message made: its name and arguments (JSON)."""

    model_config = STRICT

    name: str
    arguments: str


class ToolCall(BaseModel):
    """A tool call of an earlier assistant message (OpenAI's shape)."""

    model_config = STRICT

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """One chat message; ``name``, an assistant's ``tool_calls`` and a tool reply's
    ``tool_call_id`` are handed to the chat template with the rest."""

    model_config = STRICT

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def text(self, where: str = "messages") -> str:
        """The message's text; ParamError (``param`` is ``where`` and the part) for a part
        that is not text, has no text or extra fields, or whose text is not valid Unicode."""
        if self.name is not None:
            check_text(f"{where}.name", self.name)
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            check_text(f"{where}.content", self.content)
            return self.content
        parts = []
        for i, part in enumerate(self.content):
            name = f"{where}.content[{i}]"
            if part.type != "text":
                kind = part.type
                shown = repr(kind) if len(kind) < 40 else "not text"
                raise ParamError(f"{name}.type", f"{name}: content part type {shown} is not text")
            if part.model_extra:
                extra = sorted(part.model_extra)[0]
                raise ParamError(f"{name}.{extra}", f"{name}: unknown field in a text part")
            if part.text is None:
                raise ParamError(f"{name}.text", f"{name}.text is required")
            check_text(f"{name}.text", part.text)
            parts.append(part.text)
        return "".join(parts)

    def template_fields(self, where: str) -> dict[str, Any]:
        """The message as the chat template reads it (validated, see :meth:`text`)."""
        fields: dict[str, Any] = {"role": self.role, "content": self.text(where)}
        if self.name is not None:
            fields["name"] = self.name
        if self.tool_call_id is not None:
            check_text(f"{where}.tool_call_id", self.tool_call_id)
            fields["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            calls = [call.model_dump() for call in self.tool_calls]
            for i, call in enumerate(calls):
                check_text(f"{where}.tool_calls[{i}]", json.dumps(call, ensure_ascii=False))
            fields["tool_calls"] = template_tool_calls(calls)
        return fields
