"""Schema fuzzing (issue 19): schemathesis generates requests from the server's own
``/openapi.json`` (valid and invalid bodies for every operation) and sends them to a live
server. Every response must be below 500 (``not_a_server_error``) and every 4xx/5xx body in
OpenAI's error schema (``openai_error_body``, fuzz_hooks.py). The run passes only with no
failure and no error.

In CI it sends ``TANDEM_FUZZ_EXAMPLES`` (default 30) examples per operation, four groups
of operations at once; ``make fuzz`` sends many more (docs/testing.md).
"""

from __future__ import annotations

import os
import re
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


# The operations in four groups, each a schemathesis process of one worker, run at once: the
# server batches them as it would any clients'. (Not schemathesis' own ``--workers``: its worker
# threads share hypothesis' ``ast.parse`` of lambdas, which CPython 3.11.7 does not make
# thread-safe: "AST constructor recursion depth mismatch".)
OPERATION_GROUPS = (
    ("--include-path", "/v1/completions"),
    ("--include-path", "/v1/chat/completions"),
    ("--include-method", "GET"),
    # vLLM's POST routes (schemathesis ORs its includes: GET /ping is left out by exclusion).
    ("--include-path-regex", "^/(tokenize|detokenize|ping)$", "--exclude-method", "GET"),
)


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
        *("-n", str(EXAMPLES), "--generation-deterministic", "-w", "1"),
        # A loaded 2-core machine can take seconds on one request: slow is not an error.
        *("--request-timeout", str(REQUEST_TIMEOUT_S)),
    ]
    runs = []
    for index, selection in enumerate(OPERATION_GROUPS):
        workdir = tmp_path / f"group{index}"
        workdir.mkdir()
        runs.append(
            subprocess.Popen(
                [*command, *selection],
                cwd=workdir,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    for selection, run in zip(OPERATION_GROUPS, runs, strict=True):
        output, _ = run.communicate()
        assert run.returncode == 0, f"{selection}: {output[-6000:]}"
        assert "passed" in output, f"{selection}: {output[-2000:]}"
        assert re.search(r"Tested: [1-9]", output), f"{selection} tested nothing: {output[-2000:]}"
