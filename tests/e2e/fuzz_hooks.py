"""Schemathesis hooks of the schema fuzz run (test_fuzz_openapi.py, ``make fuzz``), loaded
through ``SCHEMATHESIS_HOOKS=fuzz_hooks``: a check that every 4xx/5xx body is in OpenAI's
error schema, and generated output lengths cut to a few tokens so that accepted requests
stay short on the CPU (test_hostile_inputs.py covers the huge values)."""

from __future__ import annotations

import schemathesis

MAX_OUTPUT_TOKENS = 4
OUTPUT_LENGTH_FIELDS = ("max_tokens", "max_completion_tokens", "min_tokens")
GENERATING_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


@schemathesis.check
def openai_error_body(ctx, response, case) -> None:
    """A 4xx or 5xx body is ``{"error": {"message", "type", "param", "code"}}`` with the
    status as its code."""
    if response.status_code < 400:
        return None
    body = response.json()
    assert isinstance(body, dict) and set(body) == {"error"}, f"not an OpenAI error: {body}"
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, f"not an OpenAI error: {body}"
    assert isinstance(error["message"], str), body
    assert error["code"] == response.status_code, body
    return None


@schemathesis.hook
def map_body(ctx, body):
    """Cut a generated output length (or a minimum one) above MAX_OUTPUT_TOKENS, and give
    one where none is (absent or null: up to the context, seconds on a loaded CPU); only
    on the generating routes (a /tokenize body has no such field: one added is a 400)."""
    operation = getattr(ctx, "operation", None)
    if operation is not None and operation.path not in GENERATING_PATHS:
        return body
    if isinstance(body, dict):
        for name in OUTPUT_LENGTH_FIELDS:
            value = body.get(name)
            if type(value) is int and value > MAX_OUTPUT_TOKENS:
                body[name] = MAX_OUTPUT_TOKENS
        if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
            body["max_tokens"] = MAX_OUTPUT_TOKENS
    return body
