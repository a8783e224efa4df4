"""Liveness of ``tandem serve``: a stalled (SIGSTOP) or killed (SIGKILL) engine core turns
/health to 503 with the reason, fails the requests in flight within the stall bound (never
a hang), and the server exits non-zero for its supervisor to restart it, leaving no engine
process and no socket folder behind; a request past ``--request-timeout-s`` is aborted with
its KV blocks freed; a server stopped by SIGTERM removes its socket folder too.

Each test starts its own server, with ``TMPDIR`` set to a folder of its own, so the
``tandem-*`` socket folders it leaves (or not) can be counted.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from server_helpers import API_KEY, AUTH, MODEL, STARTUP_TIMEOUT_S, assert_idle, wait_until_idle

from tandem.engine_process import free_port

httpx = pytest.importorskip("httpx")
psutil = pytest.importorskip("psutil")

pytestmark = pytest.mark.slow  # a server process per test

STALL_TIMEOUT_S = 3.0
# Detection, the server's linger on a 503 and its shutdown, with room for a loaded machine.
EXIT_WITHIN_S = 30.0
# A request that runs for many seconds on the CPU (it never ends early on an end token).
LONG_REQUEST = {
    "model": MODEL,
    "prompt": "Count to one thousand:",
    "max_tokens": 1500,
    "ignore_eos": True,
    "temperature": 0,
}


@dataclass
class Server:
    proc: subprocess.Popen
    base: str
    tmpdir: Path
    log: Path

    def engine_core(self) -> psutil.Process:
        """The engine core process (the API process's spawned child)."""
        children = psutil.Process(self.proc.pid).children(recursive=True)
        cores = [p for p in children if "spawn_main" in " ".join(p.cmdline())]
        assert len(cores) == 1, [p.cmdline() for p in children]
        return cores[0]

    def socket_folders(self) -> list[str]:
        return sorted(p.name for p in self.tmpdir.iterdir() if p.name.startswith("tandem-"))

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


@contextlib.contextmanager
def serve(tmp_path: Path, *options: str) -> Iterator[Server]:
    """``tandem serve --api-key`` with ``options``, its temporary files under ``tmp_path``."""
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    log = tmp_path / "server.log"
    port = free_port()
    command = [sys.executable, "-m", "tandem.cli", "serve", "--port", str(port)]
    command += ["--api-key", API_KEY, "--log-level", "warning", *options]
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "TMPDIR": str(tmpdir)},
        )
    server = Server(proc, f"http://127.0.0.1:{port}", tmpdir, log)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{server.base}/health", timeout=2).status_code == 200:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"server did not start ({proc.poll()}):\n{server.log_tail()}")
            time.sleep(0.5)
        yield server
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the whole group: a stopped core included
        proc.wait(10)


class Streamer(threading.Thread):
    """Streams LONG_REQUEST; records when its first token came and how it ended."""

    def __init__(self, base: str):
        super().__init__(daemon=True)
        self.base = base
        self.started = threading.Event()
        self.events: list[str] = []
        self.ended_at: float | None = None

    def run(self) -> None:
        body = {**LONG_REQUEST, "stream": True}
        url = f"{self.base}/v1/completions"
        with httpx.stream("POST", url, json=body, headers=AUTH, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    self.events.append(line[len("data: ") :])
                    self.started.set()
        self.ended_at = time.monotonic()


def _post_later(base: str, results: list) -> threading.Thread:
    """A non-streaming LONG_REQUEST in a thread; its response goes to ``results``."""

    def post():
        response = httpx.post(
            f"{base}/v1/completions", json=LONG_REQUEST, headers=AUTH, timeout=120
        )
        results.append((time.monotonic(), response))

    thread = threading.Thread(target=post, daemon=True)
    thread.start()
    return thread


def _wait_for_health_503(base: str, within_s: float) -> dict:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            response = httpx.get(f"{base}/health", timeout=2)
            if response.status_code == 503:
                return response.json()
        time.sleep(0.05)
    pytest.fail(f"/health did not turn 503 within {within_s} s")


def _check_core_loss(server: Server, stop_core: signal.Signals, reason: str) -> None:
    """Stop the core with ``stop_core`` while a stream and a whole request run; check what
    the clients, /health, /metrics and the exit say."""
    core = server.engine_core()
    streamer = Streamer(server.base)
    streamer.start()
    assert streamer.started.wait(60), "the stream never started"
    results: list = []
    poster = _post_later(server.base, results)
    time.sleep(0.5)  # the whole request reaches the engine
    os.kill(core.pid, stop_core)
    stopped_at = time.monotonic()

    health = _wait_for_health_503(server.base, STALL_TIMEOUT_S + 10)
    assert health["status"] == "error" and reason in health["reason"], health
    scraped = httpx.get(f"{server.base}/metrics", headers=AUTH, timeout=5).text
    assert "tandem:engine_up{" in scraped and 'engine_up{model_name="' in scraped
    assert any(line.endswith(" 0.0") for line in scraped.splitlines() if "engine_up{" in line)
    assert "tandem:num_requests_running{" not in scraped  # no stale engine gauge

    # Both requests failed, within the bound, with the reason.
    bound = STALL_TIMEOUT_S + 5
    streamer.join(bound)
    poster.join(bound)
    assert streamer.ended_at is not None and streamer.ended_at - stopped_at < bound
    assert streamer.events[-1] == "[DONE]"
    error = json.loads(streamer.events[-2])["error"]
    assert reason in error["message"], error
    ((answered_at, response),) = results
    assert answered_at - stopped_at < bound
    assert response.status_code == 503, response.text
    assert reason in response.json()["error"]["message"]

    # The server exits non-zero, taking the core with it and removing its socket folder.
    assert server.proc.wait(EXIT_WITHIN_S) != 0, server.log_tail()
    assert not psutil.pid_exists(core.pid) or core.status() == psutil.STATUS_ZOMBIE
    assert server.socket_folders() == []
    assert "Traceback" not in server.log_tail(), server.log_tail()


def test_a_stalled_core_fails_requests_and_the_server_exits(tmp_path):
    with serve(tmp_path, "--engine-stall-timeout-s", str(STALL_TIMEOUT_S)) as server:
        assert len(server.socket_folders()) == 1  # what the exit must remove
        _check_core_loss(server, signal.SIGSTOP, "stalled")


def test_a_killed_core_fails_requests_and_the_server_exits(tmp_path):
    with serve(tmp_path, "--engine-stall-timeout-s", str(STALL_TIMEOUT_S)) as server:
        _check_core_loss(server, signal.SIGKILL, "exited")


def test_request_timeout_aborts_the_request_and_sigterm_removes_the_socket_folder(tmp_path):
    with serve(tmp_path, "--request-timeout-s", "2") as server:
        started = time.monotonic()
        response = httpx.post(
            f"{server.base}/v1/completions", json=LONG_REQUEST, headers=AUTH, timeout=60
        )
        assert time.monotonic() - started < 15
        assert response.status_code == 504, response.text
        error = response.json()["error"]
        assert error["type"] == "timeout_error" and "timed out" in error["message"]

        streamer = Streamer(server.base)
        streamer.start()
        streamer.join(15)
        assert streamer.events[-1] == "[DONE]"
        assert "timed out" in json.loads(streamer.events[-2])["error"]["message"]
        # Both aborted in the engine: every KV block is free, and the server still serves.
        assert_idle(wait_until_idle(server.base))
        short = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
        response = httpx.post(f"{server.base}/v1/completions", json=short, headers=AUTH)
        assert response.status_code == 200

        assert len(server.socket_folders()) == 1
        server.proc.send_signal(signal.SIGTERM)
        # A clean stop (uvicorn re-raises the signal once it has shut down).
        assert server.proc.wait(EXIT_WITHIN_S) in (0, -signal.SIGTERM), server.log_tail()
        assert "Traceback" not in server.log_tail()
        assert server.socket_folders() == []
