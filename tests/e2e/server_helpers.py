"""The server tests' constants and helpers (test_server_*.py; their fixtures are in
conftest.py): the prompts, greedy references from the offline ``LLM``, an async ``openai``
client, and /metrics read back to check that the server ends up idle with every KV block
free."""

from __future__ import annotations

import re
import time

from tandem import LLM, SamplingParams

MODEL = "SmolLM2-135M-Instruct"
API_KEY = "secret"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
STARTUP_TIMEOUT_S = 180
IDLE_TIMEOUT_S = 30

PROMPT = "The capital of France is"
# The model answers this one in a few tokens, then emits its end token.
SHORT_ANSWER_CHAT = [{"role": "user", "content": "Reply with one word: yes or no?"}]
LONG_ANSWER_CHAT = [{"role": "user", "content": "Say hi."}]
GAUGES = (
    "tandem:num_requests_running",
    "tandem:num_requests_waiting",
    "tandem:num_free_kv_blocks",
    "tandem:num_kv_blocks",
    "tandem:kv_cache_usage_perc",
)


# ---- helpers -----------------------------------------------------------------------------


# httpx and openai are imported where used: conftest imports this module, and GPU hosts
# run the other e2e tests without them.


def async_client(server: str) -> openai.AsyncOpenAI:  # noqa: F821
    import openai

    return openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=600)


def greedy(offline: LLM, prompt, max_tokens: int, **kwargs):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, **kwargs)
    return offline.generate(prompt, params)[0]


def greedy_chat(offline: LLM, messages, max_tokens: int, **kwargs):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, **kwargs)
    return offline.chat(messages, params)[0]


def metrics(server: str) -> dict[str, float]:
    """Every sample of /metrics, summed over labels, by name."""
    import httpx

    response = httpx.get(f"{server}/metrics", headers=AUTH, timeout=10)
    assert response.status_code == 200
    values: dict[str, float] = {}
    for line in response.text.splitlines():
        match = re.match(r"^([\w:]+)(?:\{[^}]*\})? (\S+)$", line)
        if match:
            values[match[1]] = values.get(match[1], 0.0) + float(match[2])
    return values


def wait_until_idle(server: str, timeout: float = IDLE_TIMEOUT_S) -> dict[str, float]:
    """Poll /metrics until nothing runs or waits and every KV block is free."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server)
        idle = (
            m.get("tandem:num_requests_running") == 0
            and m.get("tandem:num_requests_waiting") == 0
            and m.get("tandem:num_free_kv_blocks") == m.get("tandem:num_kv_blocks")
        )
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.25)


def assert_idle(m: dict[str, float]) -> None:
    gauges = {name: m.get(name) for name in GAUGES}
    assert m["tandem:num_requests_running"] == 0, gauges
    assert m["tandem:num_requests_waiting"] == 0, gauges
    assert m["tandem:num_kv_blocks"] > 0, gauges
    assert m["tandem:num_free_kv_blocks"] == m["tandem:num_kv_blocks"], gauges


def successes(m: dict[str, float]) -> float:
    return m.get("tandem:request_success_total", 0.0)
