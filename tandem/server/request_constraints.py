"""Request fields that become constraints on the output: ``logit_bias``'s token ids, and
the structured-output constraint of ``response_format`` or vLLM's ``guided_*`` fields
(``SamplingParams.guided``)."""

from __future__ import annotations

from typing import Any

from tandem.sampling_params import ParamError

GUIDED_FIELDS = (
    ("guided_json", "json"),
    ("guided_regex", "regex"),
    ("guided_choice", "choice"),
    ("guided_grammar", "grammar"),
)


def guided_constraint(body: Any) -> tuple[str, dict | None]:
    """The constraint ``body`` asks for (None: none) and the field that asks ("guided" when
    none does); ParamError if more than one does, or for a bad ``response_format``."""
    asked = {}
    for name, kind in GUIDED_FIELDS:
        if getattr(body, name) is not None:
            asked[name] = {kind: getattr(body, name)}
    if body.response_format is not None:
        constraint = response_format_constraint(body.response_format)
        if constraint is not None:
            asked["response_format"] = constraint
    if len(asked) > 1:
        names = sorted(asked)
        raise ParamError(names[1], f"{names[1]} and {names[0]}: one constraint at most")
    return next(iter(asked.items()), ("guided", None))


def response_format_constraint(fmt: dict[str, Any]) -> dict | None:
    """OpenAI's ``response_format`` as a constraint: None for text, ``{"json_object": true}``
    or ``{"json": schema}`` (ParamError naming ``response_format`` otherwise)."""
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ParamError("response_format", "json_schema needs json_schema.schema (an object)")
        return {"json": schema}
    shown = repr(kind)[:40]
    raise ParamError(
        "response_format", f"response_format type {shown} is not text, json_object or json_schema"
    )


def token_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """``logit_bias``'s keys as token ids (ParamError unless each is a decimal integer)."""
    if not bias:
        return None
    ids = {}
    for key, value in bias.items():
        if not key.isascii() or not key.isdecimal():
            raise ParamError("logit_bias", f"logit_bias keys must be token ids, got {key[:20]!r}")
        ids[int(key)] = value
    return ids
