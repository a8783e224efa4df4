"""Schema fuzzing (issue 19): schemathesis generates requests from the server's own
``/openapi.json`` (valid and invalid bodies for every operation) and sends them to a live
server. Every response must be below 500, and every 4xx must be in OpenAI's error schema.

In CI it sends ``TANDEM_FUZZ_EXAMPLES`` (default 40) examples per operation; ``make fuzz``
sends many more (docs/testing.md). Generated output lengths above 4 tokens are cut to 4 so
that an accepted request stays short (the hostile-input module covers the huge values).
"""

from __future__ import annotations

import os

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, settings
from schemathesis.checks import not_a_server_error
from server_helpers import AUTH

pytestmark = pytest.mark.slow  # a server process for the module

EXAMPLES = int(os.environ.get("TANDEM_FUZZ_EXAMPLES", "40"))
MAX_OUTPUT_TOKENS = 4
OUTPUT_LENGTH_FIELDS = ("max_tokens", "max_completion_tokens")


@pytest.fixture(scope="module")
def server_args() -> list[str]:
    return ["--max-model-len", "128"]


@pytest.fixture(scope="module")
def api_schema(server):
    return schemathesis.openapi.from_url(f"{server}/openapi.json", headers=AUTH)


schema = schemathesis.pytest.from_fixture("api_schema")


def openai_error_body(ctx, response, case) -> None:
    """A schemathesis check: a 4xx or 5xx body is ``{"error": {"message", "type", "param",
    "code"}}`` with the status as its code."""
    if response.status_code < 400:
        return
    body = response.json()
    assert isinstance(body, dict) and set(body) == {"error"}, f"not an OpenAI error: {body}"
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, f"not an OpenAI error: {body}"
    assert isinstance(error["message"], str) and error["code"] == response.status_code, body


def short_outputs(case) -> None:
    """Cut a generated output length above MAX_OUTPUT_TOKENS (and give one where none is
    set) so that accepted requests stay short on the CPU."""
    body = case.body
    if not isinstance(body, dict):
        return
    for name in OUTPUT_LENGTH_FIELDS:
        value = body.get(name)
        if type(value) is int and value > MAX_OUTPUT_TOKENS:
            body[name] = MAX_OUTPUT_TOKENS
    body.setdefault("max_tokens", MAX_OUTPUT_TOKENS)


@schema.parametrize()
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    phases=[Phase.explicit, Phase.generate],
    derandomize=True,
)
def test_fuzzed_requests_get_no_server_error_and_openai_errors(case, server):
    short_outputs(case)
    response = case.call(base_url=server, headers=AUTH, timeout=120)
    case.validate_response(response, checks=[not_a_server_error, openai_error_body])
