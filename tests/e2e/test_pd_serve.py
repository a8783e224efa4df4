"""PD disaggregation end to end: a prefill instance, a decode instance and a router, each its
own ``tandem`` process on loopback, next to a mixed instance; KV over the default connector
(zmq), and, in the MTP fleet, over the Mooncake Transfer Engine (TCP). Through the router a
client gets what the mixed instance gives (text, token ids, logprobs, finish reasons;
streaming and not; with and without MTP); a first token that ends the request ends it on the
decode side at once; a decode instance killed mid-stream, a prefill instance killed while it
works, and one that stalls past the transfer timeout end each affected request with an error
within the timeout, and leave no KV block held on the instances that survive.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tandem.bench.datasets import load_mtbench
from tandem.disagg.trust import PREFILL_SIGNATURE_HEADER, SECRET_ENV, sign_prefill_url
from tandem.engine_process import free_port
from tandem.server.protocol import PREFILL_URL_HEADER
from tests.unit.test_kv_connector import needs_mooncake

pytestmark = pytest.mark.slow  # a prefill, a decode and a mixed server and the router, as processes

STARTUP_TIMEOUT_S = 300
MAX_TOKENS = 16
TRANSFER_TIMEOUT_S = 6.0
LOGPROB_TOLERANCE = 1e-4
ENGINE_ARGS = ["--kv-cache-memory-gb", "0.25", "--log-level", "warning"]
SECRET = "test-pd-serve-shared-secret"


class Fleet:
    """Processes started together, each with a log file; stopped (killed) together."""

    def __init__(self):
        self.logs = tempfile.TemporaryDirectory(prefix="tandem-pd-")
        self.procs: dict[str, subprocess.Popen] = {}
        self.urls: dict[str, str] = {}
        self.args: dict[str, list[str]] = {}

    def start(self, name: str, args: list[str], port: int | None = None) -> str:
        """Start ``tandem args`` as ``name`` on ``port`` (default: a free one); its URL."""
        port = port or free_port()
        self.args[name] = args
        with open(os.path.join(self.logs.name, f"{name}.log"), "wb") as log:
            self.procs[name] = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tandem.cli",
                    *args,
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, SECRET_ENV: SECRET},
            )
        self.urls[name] = f"http://127.0.0.1:{port}"
        return self.urls[name]

    def wait_healthy(self, *names: str) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        for name in names:
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{self.urls[name]}/health", timeout=2).status_code == 200:
                        break
                if self.procs[name].poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"{name} did not start:\n{self.log(name)}")
                time.sleep(0.3)

    def log(self, name: str) -> str:
        with open(os.path.join(self.logs.name, f"{name}.log"), errors="replace") as f:
            return f.read()[-3000:]

    def signal(self, name: str, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.procs[name].pid, sig)

    def stop(self) -> None:
        for name in self.procs:
            self.signal(name, signal.SIGCONT)
            self.signal(name, signal.SIGKILL)
        for proc in self.procs.values():
            proc.wait(10)
        self.logs.cleanup()


def start_pd(fleet: Fleet, mtp: bool, mixed: bool = True, connector: str | None = None) -> None:
    """A prefill and a decode instance (KV over ``connector``; None: the default), the
    router, and with ``mixed`` a mixed instance, all healthy."""
    spec = ["--speculative", "mtp", "--num-speculative-tokens", "3"] if mtp else []
    timeout = ["--transfer-timeout-s", str(TRANSFER_TIMEOUT_S)]
    if connector is not None:
        timeout += ["--kv-connector", connector]
    if mixed:
        fleet.start("mixed", ["serve", *ENGINE_ARGS, *spec])
    prefill = fleet.start("prefill", ["serve", "--role", "prefill", *ENGINE_ARGS, *spec, *timeout])
    decode = fleet.start("decode", ["serve", "--role", "decode", *ENGINE_ARGS, *spec, *timeout])
    fleet.start(
        "router",
        [
            "router",
            "--prefill",
            prefill,
            "--decode",
            decode,
            "--health-interval-s",
            "0.5",
            "--log-level",
            "warning",
        ],
    )
    fleet.wait_healthy(*(["mixed"] if mixed else []), "prefill", "decode", "router")


@contextlib.contextmanager
def running_fleet(mtp: bool, mixed: bool = True, connector: str | None = None):
    """A started fleet (``start_pd``), stopped on the way out."""
    fleet = Fleet()
    try:
        start_pd(fleet, mtp=mtp, mixed=mixed, connector=connector)
        yield fleet
    finally:
        fleet.stop()


def chat_prompt_ids(questions: list[dict]) -> list[list[int]]:
    """The first turns of MT-Bench ``questions`` in the default model's chat template."""
    from tandem.models.loader import resolve_model
    from tandem.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_model_path(resolve_model(None))
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": q["turns"][0]}])
        for q in questions
    ]


@pytest.fixture(
    scope="module",
    params=[
        pytest.param((False, None), id="plain-zmq"),
        pytest.param((True, "mooncake"), id="mtp-mooncake", marks=needs_mooncake),
    ],
)
def fleet(request):
    """Plain decoding with the default connector; MTP with Mooncake (both connectors
    covered, one fleet each)."""
    mtp, connector = request.param
    with running_fleet(mtp=mtp, connector=connector) as fleet:
        yield fleet


@pytest.fixture
def broken_fleet():
    """A fresh prefill, decode and router (no mixed instance) for tests that kill one."""
    with running_fleet(mtp=False, mixed=False) as fleet:
        yield fleet


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """16 MT-Bench questions in the chat template, as token ids."""
    return chat_prompt_ids(load_mtbench()[3::5][:16])


# ---- helpers -----------------------------------------------------------------------------


def complete(
    base: str, prompt: list[int], stream: bool, headers: dict | None = None, **fields
) -> dict:
    """A completion's text, token ids, logprobs and finish reason (streams are joined)."""
    body = {
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "logprobs": 3,
        "return_token_ids": True,
        "stream": stream,
        **fields,
    }
    result = {
        "text": "",
        "token_ids": [],
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "finish_reason": None,
        "error": None,
    }
    if not stream:
        reply = httpx.post(f"{base}/v1/completions", json=body, headers=headers, timeout=120)
        if reply.status_code != 200:
            return {**result, "error": reply.json()["error"]["message"]}
        choices = [reply.json()["choices"][0]]
    else:
        choices = []
        with httpx.stream(
            "POST", f"{base}/v1/completions", json=body, headers=headers, timeout=120
        ) as reply:
            if reply.status_code != 200:  # refused or failed before the stream began
                reply.read()
                return {**result, "error": reply.json()["error"]["message"]}
            for line in reply.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line.removeprefix("data: "))
                if "error" in event:
                    return {**result, "error": event["error"]["message"]}
                choices.append(event["choices"][0])
    for choice in choices:
        result["text"] += choice["text"]
        result["token_ids"] += choice["token_ids"]
        result["finish_reason"] = choice["finish_reason"] or result["finish_reason"]
        for key in ("tokens", "token_logprobs", "top_logprobs"):
            result[key] += (choice["logprobs"] or {}).get(key, [])
    return result


def assert_same(got: dict, want: dict) -> bool:
    """``got`` gives what ``want`` gives: text, tokens, finish reason, logprobs within the
    tolerance. Requests that ran in different batches may part at a numerical tie (the two
    best logprobs of ``want`` within the tolerance): then the tokens before it must agree and
    True is returned."""
    assert got["error"] is None, got["error"]
    parted = next(
        (
            i
            for i, (g, w) in enumerate(zip(got["token_ids"], want["token_ids"], strict=False))
            if g != w
        ),
        None,
    )
    if parted is not None:
        best, second = sorted(want["top_logprobs"][parted].values(), reverse=True)[:2]
        assert best - second < LOGPROB_TOLERANCE, (parted, got["token_ids"], want["token_ids"])
    end = len(want["token_ids"]) if parted is None else parted
    for key in ("token_ids", "tokens"):
        assert got[key][:end] == want[key][:end], key
    for got_lp, want_lp in zip(
        got["token_logprobs"][:end], want["token_logprobs"][:end], strict=True
    ):
        assert abs(got_lp - want_lp) <= LOGPROB_TOLERANCE
    for got_top, want_top in zip(
        got["top_logprobs"][:end], want["top_logprobs"][:end], strict=True
    ):
        assert set(got_top) == set(want_top)
    if parted is None:
        assert len(got["token_logprobs"]) == len(want["token_logprobs"])
        for key in ("text", "token_ids", "finish_reason"):
            assert got[key] == want[key], key
    return parted is not None


def complete_all(base: str, prompts: list[list[int]], stream: bool) -> list[dict]:
    """``complete`` for every prompt at once (each on its own thread), in prompt order."""
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda prompt: complete(base, prompt, stream), prompts))


def metrics(base: str) -> dict[str, float]:
    values: dict[str, float] = {}
    for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines():
        match = re.match(r"^([\w:]+)(?:\{[^}]*\})? (\S+)$", line)
        if match:
            values[match[1]] = values.get(match[1], 0.0) + float(match[2])
    return values


def assert_no_block_held(base: str, within_s: float) -> None:
    """Every KV block of the instance is free again within ``within_s``."""
    deadline = time.monotonic() + within_s
    while True:
        m = metrics(base)
        if (
            m.get("tandem:num_free_kv_blocks") == m.get("tandem:num_kv_blocks")
            and m.get("tandem:num_requests_running") == 0
            and m.get("tandem:num_requests_waiting") == 0
        ):
            return
        assert time.monotonic() < deadline, {k: v for k, v in m.items() if "kv" in k}
        time.sleep(0.25)


# ---- tests ---------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_router_gives_what_a_mixed_instance_gives(fleet, prompts, stream):
    # All prompts at once on both sides: the instances batch them (CPU decoding reads the
    # weights once per step), and the router relays concurrent requests.
    before = metrics(fleet.urls["prefill"]), metrics(fleet.urls["decode"])
    wants = complete_all(fleet.urls["mixed"], prompts, stream)
    gots = complete_all(fleet.urls["router"], prompts, stream)
    ties = sum(assert_same(got, want) for got, want in zip(gots, wants, strict=True))
    assert ties <= 1
    for got in gots:
        assert len(got["token_ids"]) == len(got["token_logprobs"]) >= 1
    # Every prompt really went through the prefill instance and over the connector (the
    # counters reach the API process with the engines' next stats frames).
    deadline = time.monotonic() + 10
    while True:
        after = metrics(fleet.urls["prefill"]), metrics(fleet.urls["decode"])
        counts = [
            after[side].get(key, 0) - before[side].get(key, 0)
            for side, key in ((0, "tandem:pd_kv_transfers"), (1, "tandem:pd_handoffs"))
        ]
        if counts == [len(prompts)] * 2 or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    assert counts == [len(prompts)] * 2, counts
    assert after[0].get("tandem:pd_kv_bytes", 0) > before[0].get("tandem:pd_kv_bytes", 0)
    assert after[1].get("tandem:pd_failures") == 0
    assert_no_block_held(fleet.urls["decode"], 10)
    assert_no_block_held(fleet.urls["prefill"], 10)


def test_first_token_that_ends_the_request(fleet, prompts):
    """EOS as the first token (stop_token_ids holding the token the model produces first),
    max_tokens = 1 and a stop string in the first token end the request on the decode side;
    the first token's logprobs are there."""
    first = complete(fleet.urls["mixed"], prompts[0], False, max_tokens=1)
    first_id, first_text = first["token_ids"][0], first["tokens"][0]
    eos = complete(fleet.urls["router"], prompts[0], False, stop_token_ids=[first_id])
    assert eos["finish_reason"] == "stop" and eos["token_ids"] == [first_id]
    assert eos["token_logprobs"] == pytest.approx(first["token_logprobs"], abs=LOGPROB_TOLERANCE)
    one = complete(fleet.urls["router"], prompts[0], True, max_tokens=1)
    assert one["finish_reason"] == "length" and one["token_ids"] == [first_id]
    assert len(one["token_logprobs"]) == 1
    stop = first_text.strip() or first_text
    stopped = complete(fleet.urls["router"], prompts[0], False, stop=[stop])
    assert stopped["error"] is None and stopped["finish_reason"] == "stop"
    assert stop not in stopped["text"]
    assert_no_block_held(fleet.urls["decode"], 10)
    assert_no_block_held(fleet.urls["prefill"], 10)


def test_decode_killed_mid_stream(broken_fleet, prompts):
    urls = broken_fleet.urls
    body = {
        "prompt": prompts[0],
        "max_tokens": 400,
        "temperature": 0.0,
        "stream": True,
        "ignore_eos": True,
    }
    events = []
    start = time.monotonic()
    with httpx.stream("POST", f"{urls['router']}/v1/completions", json=body, timeout=60) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: "):
                events.append(line)
                if len(events) == 3:
                    broken_fleet.signal("decode", signal.SIGKILL)
    assert time.monotonic() - start < 30
    assert '"error"' in events[-2] and events[-1] == "data: [DONE]"
    assert_no_block_held(urls["prefill"], 10)


def test_prefill_killed_while_it_works(broken_fleet, prompts):
    """Killed while it computes the prompt (or writes its KV): the decode instance hears
    nothing more and ends the request with an error at its timeout."""
    urls = broken_fleet.urls
    long_prompt = [t for p in prompts for t in p] * 2  # ~3,600 tokens: seconds on the CPU
    replies: list[httpx.Response] = []

    def send() -> None:
        replies.append(
            httpx.post(
                f"{urls['router']}/v1/completions",
                timeout=60,
                json={"prompt": long_prompt, "max_tokens": 8, "temperature": 0.0},
            )
        )

    start = time.monotonic()
    sender = threading.Thread(target=send)
    sender.start()
    time.sleep(1.0)  # the decode instance has asked; the prefill instance is at work
    broken_fleet.signal("prefill", signal.SIGKILL)
    sender.join(60)
    elapsed = time.monotonic() - start
    assert replies and replies[0].status_code == 502, replies and replies[0].text
    assert "prefill" in replies[0].json()["error"]["message"]
    assert elapsed < TRANSFER_TIMEOUT_S + 5
    assert_no_block_held(urls["decode"], 2 * TRANSFER_TIMEOUT_S + 5)


def test_stalled_prefill_times_out_and_recovers(broken_fleet, prompts):
    """Stopped (SIGSTOP) while it computes the prompt: its liveness reports stop with it, so
    the decode instance ends the stream with an error at its timeout (counted from the last
    report: at most a quarter of the timeout before the stop). Sent to the decode instance as
    the router sends it (the router itself would soon route around the stalled instance)."""
    urls = broken_fleet.urls
    header = {
        PREFILL_URL_HEADER: urls["prefill"],
        PREFILL_SIGNATURE_HEADER: sign_prefill_url(SECRET, urls["prefill"]),
    }
    assert complete(urls["decode"], prompts[1], False, headers=header)["error"] is None
    long_prompt = [t for p in prompts for t in p] * 2  # ~3,600 tokens: seconds on the CPU
    results: list[dict] = []
    sender = threading.Thread(
        target=lambda: results.append(complete(urls["decode"], long_prompt, True, headers=header))
    )
    sender.start()
    time.sleep(1.0)  # the decode instance has asked; the prefill instance is at work
    broken_fleet.signal("prefill", signal.SIGSTOP)
    stopped = time.monotonic()
    sender.join(60)
    elapsed = time.monotonic() - stopped
    assert results and results[0]["error"] is not None, results
    assert "within" in results[0]["error"], results[0]["error"]
    assert TRANSFER_TIMEOUT_S * 3 / 4 - 0.5 <= elapsed < TRANSFER_TIMEOUT_S + 5
    broken_fleet.signal("prefill", signal.SIGCONT)
    assert_no_block_held(urls["decode"], 2 * TRANSFER_TIMEOUT_S + 5)
    assert_no_block_held(urls["prefill"], 10)
    # Both instances serve on afterwards.
    assert complete(urls["router"], prompts[1], False)["error"] is None
