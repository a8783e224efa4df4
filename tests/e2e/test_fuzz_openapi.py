"""Schema fuzzing (issue 19): schemathesis generates requests from the server's own
``/openapi.json`` (valid and invalid bodies for every operation) and sends them to a live
server. Every response must be below 500 (``not_a_server_error``) and every 4xx/5xx body in
OpenAI's error schema (``openai_error_body``, fuzz_hooks.py). The run passes only with no
failure and no error.

In CI it sends ``TANDEM_FUZZ_EXAMPLES`` (default 30) examples per operation; ``make fuzz``
sends many more (docs/testing.md).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from server_helpers import API_KEY

pytestmark = pytest.mark.slow  # a server process for the module

EXAMPLES = int(os.environ.get("TANDEM_FUZZ_EXAMPLES", "30"))
REQUEST_TIMEOUT_S = 120
HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def server_args() -> list[str]:
    return ["--max-model-len", "128"]


def test_fuzzed_requests_get_no_server_error_and_openai_errors(server, tmp_path):
    env = {
        **os.environ,
        "SCHEMATHESIS_HOOKS": "fuzz_hooks",
        "PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]),
    }
    command = [
        *(sys.executable, "-m", "schemathesis.cli", "run", f"{server}/openapi.json"),
        *("-H", f"Authorization: Bearer {API_KEY}"),
        *("-c", "not_a_server_error,openai_error_body"),
        # Operations four at a time: the server batches them as it would any clients'.
        *("-n", str(EXAMPLES), "--generation-deterministic", "-w", "4"),
        # A loaded 2-core machine can take seconds on one request: slow is not an error.
        *("--request-timeout", str(REQUEST_TIMEOUT_S)),
    ]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert "passed" in result.stdout
