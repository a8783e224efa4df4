"""Fixtures of the server tests (test_server_*.py): each module starts one server, with an
API key, next to one offline ``LLM`` whose greedy outputs and logprobs are the reference for
what the server returns."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest
from server_helpers import API_KEY, STARTUP_TIMEOUT_S

from tandem import LLM
from tandem.engine_process import free_port

# ---- fixtures ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def offline(llm_cache) -> LLM:
    """The default model in this process (shared with other tests through ``llm_cache``)."""
    if () not in llm_cache:
        llm_cache[()] = LLM()
    return llm_cache[()]


@pytest.fixture(scope="session")
def hf_default_model():
    """Hugging Face transformers' model of the default weights (fp32, CPU), loaded once: its
    GGUF conversion takes half a minute here, and several modules take references from it."""
    import torch

    from tandem.bench.hf_reference import load_hf_model
    from tandem.models.loader import default_model_path

    return load_hf_model(default_model_path(), torch.float32)


@pytest.fixture(scope="module")
def server_args() -> list[str]:
    """Extra ``tandem serve`` arguments of the module's server (a module overrides this)."""
    return []


@pytest.fixture(scope="module")
def server(request, server_args) -> str:
    """Start ``tandem serve --api-key`` once; yields its base URL (without /v1)."""
    import httpx  # here, not at the top: GPU hosts run other e2e tests without it

    port = free_port()
    log_dir = tempfile.TemporaryDirectory(prefix="tandem-server-")
    log_path = os.path.join(log_dir.name, "server.log")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tandem.cli",
                "serve",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--api-key",
                API_KEY,
                "--log-level",
                "warning",
                *server_args,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        request.getfixturevalue("offline")  # load the reference model while the server boots
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                with open(log_path, errors="replace") as f:
                    tail = f.read()[-3000:]
                pytest.fail(f"server did not start (exit code {proc.poll()}):\n{tail}")
            time.sleep(0.5)
        yield base
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
        log_dir.cleanup()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:  # noqa: F821
    import openai  # here, not at the top: GPU hosts run other e2e tests without it

    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=120)
