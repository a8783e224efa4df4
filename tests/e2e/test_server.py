"""The OpenAI-compatible server, end to end, through the official ``openai`` client.

One server (with an API key) runs for the whole module, next to one offline ``LLM`` whose
greedy outputs and logprobs are the reference for what the server returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import httpx
import openai
import pytest

from tandem import LLM, SamplingParams
from tandem.engine_process import free_port

pytestmark = pytest.mark.slow  # a server process for the module

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


# ---- fixtures ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def offline(llm_cache) -> LLM:
    """The default model in this process (shared with other tests through ``llm_cache``)."""
    if () not in llm_cache:
        llm_cache[()] = LLM()
    return llm_cache[()]


@pytest.fixture(scope="module")
def server(request) -> str:
    """Start ``tandem serve --api-key`` once; yields its base URL (without /v1)."""
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
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def async_client(server: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=600)


# ---- helpers -----------------------------------------------------------------------------


def greedy(offline: LLM, prompt, max_tokens: int, **kwargs):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, **kwargs)
    return offline.generate(prompt, params)[0]


def greedy_chat(offline: LLM, messages, max_tokens: int, **kwargs):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, **kwargs)
    return offline.chat(messages, params)[0]


def metrics(server: str) -> dict[str, float]:
    """Every sample of /metrics, summed over labels, by name."""
    response = httpx.get(f"{server}/metrics", timeout=10)
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


# ---- endpoints ---------------------------------------------------------------------------


def test_health_models_and_metrics(server, client):
    assert httpx.get(f"{server}/health").json() == {"status": "ok"}
    assert [m.id for m in client.models.list().data] == [MODEL]

    client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, temperature=0)
    text = httpx.get(f"{server}/metrics").text
    for name in GAUGES:
        assert re.search(rf"^{re.escape(name)}\{{.*\}} \S+$", text, re.MULTILINE), name
    assert re.search(
        r'^tandem:request_success_total\{.*finished_reason="(length|stop)"', text, re.MULTILINE
    )
    m = metrics(server)
    assert m["tandem:num_kv_blocks"] > 0
    assert 0 <= m["tandem:kv_cache_usage_perc"] <= 1
    assert m["tandem:generation_tokens_total"] >= 2


# ---- greedy outputs against the offline API ----------------------------------------------


def test_completion_string_prompt_matches_offline(client, offline):
    expected = greedy(offline, PROMPT, 12)
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    choice = response.choices[0]
    assert response.model == MODEL and response.object == "text_completion"
    assert choice.text == expected.outputs[0].text
    assert choice.finish_reason == "length"
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert response.usage.completion_tokens == len(expected.outputs[0].token_ids) == 12
    assert response.usage.total_tokens == response.usage.prompt_tokens + 12


def test_completion_token_id_prompt_matches_offline(client, offline):
    ids = offline.tokenizer.encode("Once upon a time")
    expected = greedy(offline, {"prompt_token_ids": ids}, 10)
    response = client.completions.create(model=MODEL, prompt=ids, max_tokens=10, temperature=0)
    assert response.choices[0].text == expected.outputs[0].text
    assert response.usage.prompt_tokens == len(ids)
    assert response.usage.completion_tokens == 10
    assert response.usage.total_tokens == len(ids) + 10


@pytest.mark.parametrize(
    ("messages", "max_tokens", "finish_reason"),
    [(SHORT_ANSWER_CHAT, 32, "stop"), (LONG_ANSWER_CHAT, 6, "length")],
)
def test_chat_completion_matches_offline(client, offline, messages, max_tokens, finish_reason):
    expected = greedy_chat(offline, messages, max_tokens)
    assert expected.outputs[0].finish_reason == finish_reason  # the premise of the case
    response = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0
    )
    choice = response.choices[0]
    assert response.object == "chat.completion"
    assert choice.message.role == "assistant"
    assert choice.message.content == expected.outputs[0].text
    assert choice.finish_reason == finish_reason
    n_generated = len(expected.outputs[0].token_ids)
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert response.usage.completion_tokens == n_generated
    assert response.usage.total_tokens == len(expected.prompt_token_ids) + n_generated


def test_max_tokens_is_honoured(client):
    response = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    assert response.usage.completion_tokens == 5
    assert response.choices[0].finish_reason == "length"
    # Chat accepts max_completion_tokens (the newer name) too.
    response = client.chat.completions.create(
        model=MODEL, messages=LONG_ANSWER_CHAT, max_completion_tokens=3, temperature=0
    )
    assert response.usage.completion_tokens == 3
    assert response.choices[0].finish_reason == "length"


# ---- streaming ---------------------------------------------------------------------------


def test_streaming_completion_joins_to_the_whole_text(client):
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0)
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    with_choices = [c for c in chunks if c.choices]
    assert len(with_choices) >= 2
    assert "".join(c.choices[0].text for c in with_choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in with_choices[:-1]] == [None] * (
        len(with_choices) - 1
    )
    assert with_choices[-1].choices[0].finish_reason == "length"
    assert len({c.id for c in chunks}) == 1
    # The usage chunk comes last, with no choices.
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])


def test_streaming_chat_joins_to_the_whole_text(client, offline):
    whole = client.chat.completions.create(
        model=MODEL, messages=SHORT_ANSWER_CHAT, max_tokens=32, temperature=0
    )
    assert whole.choices[0].finish_reason == "stop"
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=SHORT_ANSWER_CHAT,
            max_tokens=32,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    with_choices = [c for c in chunks if c.choices]
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert with_choices[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in with_choices)
    assert text == whole.choices[0].message.content
    assert with_choices[-1].choices[0].finish_reason == "stop"
    assert all(c.choices[0].finish_reason is None for c in with_choices[:-1])
    assert chunks[-1].choices == []
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()
    # Without include_usage there is no usage chunk.
    plain = list(
        client.chat.completions.create(
            model=MODEL, messages=SHORT_ANSWER_CHAT, max_tokens=32, temperature=0, stream=True
        )
    )
    assert all(c.usage is None and c.choices for c in plain)
    assert "".join(c.choices[0].delta.content or "" for c in plain) == text


# ---- logprobs ----------------------------------------------------------------------------


def _check_top(top: list[float], chosen: float, reference: list[float]) -> None:
    assert len(top) == 3
    assert top == sorted(top, reverse=True)
    assert top[0] == pytest.approx(chosen, abs=1e-5)  # greedy picks the most likely token
    assert top == pytest.approx(reference, abs=1e-5)


def test_completion_logprobs_match_offline(client, offline):
    expected = greedy(offline, PROMPT, 8, logprobs=3).outputs[0]
    response = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3
    )
    lp = response.choices[0].logprobs
    assert response.choices[0].text == expected.text
    assert len(lp.token_logprobs) == len(expected.token_ids) == 8
    for i, (token, position) in enumerate(zip(expected.token_ids, expected.logprobs, strict=True)):
        assert lp.tokens[i] == position[token].decoded_token
        assert lp.token_logprobs[i] == pytest.approx(position[token].logprob, abs=1e-5)
        reference = sorted((p.logprob for p in position.values() if p.rank <= 3), reverse=True)
        _check_top(list(lp.top_logprobs[i].values()), lp.token_logprobs[i], reference)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]


def test_chat_logprobs_match_offline(client, offline):
    expected = greedy_chat(offline, LONG_ANSWER_CHAT, 8, logprobs=3).outputs[0]
    response = client.chat.completions.create(
        model=MODEL,
        messages=LONG_ANSWER_CHAT,
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = response.choices[0].logprobs.content
    assert response.choices[0].message.content == expected.text
    assert len(content) == len(expected.token_ids) == 8
    for entry, token, position in zip(content, expected.token_ids, expected.logprobs, strict=True):
        assert entry.token == position[token].decoded_token
        assert entry.logprob == pytest.approx(position[token].logprob, abs=1e-5)
        reference = sorted((p.logprob for p in position.values() if p.rank <= 3), reverse=True)
        _check_top([t.logprob for t in entry.top_logprobs], entry.logprob, reference)
    # logprobs without top_logprobs: the chosen token only.
    response = client.chat.completions.create(
        model=MODEL, messages=LONG_ANSWER_CHAT, max_tokens=3, temperature=0, logprobs=True
    )
    content = response.choices[0].logprobs.content
    assert len(content) == 3 and all(e.top_logprobs == [] for e in content)


# ---- stop strings and seeds --------------------------------------------------------------


def test_stop_strings_cut_the_text(server, client, offline):
    full = greedy(offline, PROMPT, 16).outputs[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    cut = full[: full.index(stop)]
    assert cut and len(cut) < len(full)
    response = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=["never appears", stop]
    )
    assert response.choices[0].text == cut
    assert response.choices[0].finish_reason == "stop"
    stopped = greedy(offline, PROMPT, 16, stop=stop).outputs[0]
    assert stopped.text == cut
    assert response.usage.completion_tokens == len(stopped.token_ids) < 16
    # Streamed, the stop string is cut the same way.
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=stop, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"
    # A request ended by a stop string releases everything it held.
    assert_idle(wait_until_idle(server, timeout=10))


def test_seed_makes_sampling_reproducible(client):
    def sample(seed: int) -> str:
        return (
            client.completions.create(
                model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=1.0, seed=seed
            )
            .choices[0]
            .text
        )

    first = sample(1234)
    assert sample(1234) == first
    assert len({first, sample(1), sample(2)}) > 1


# ---- errors ------------------------------------------------------------------------------

BAD_REQUESTS = [
    ("completions", {"prompt": PROMPT, "temperature": -1}, "temperature"),
    ("completions", {"prompt": PROMPT, "top_p": 2}, "top_p"),
    ("completions", {"prompt": PROMPT, "logprobs": 21}, "logprobs"),
    ("completions", {"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": PROMPT, "n": 2}, "n must be 1"),
    ("completions", {"prompt": [42] * 9000}, "context"),
    ("completions", {"prompt": ""}, "empty"),
    ("completions", {"prompt": []}, "empty"),
    ("completions", {"prompt": [10**9]}, "token ids"),
    ("completions", {"prompt": ["one", "two"]}, "one prompt"),
    ("completions", {"prompt": PROMPT, "stop": [""]}, "stop"),
    ("completions", {"prompt": PROMPT, "temperature": "hot"}, "temperature"),
    ("completions", {"max_tokens": 4}, "prompt"),
    (
        "chat/completions",
        {"messages": SHORT_ANSWER_CHAT, "logprobs": True, "top_logprobs": 21},
        "top_logprobs",
    ),
    ("chat/completions", {"messages": SHORT_ANSWER_CHAT, "top_logprobs": 2}, "top_logprobs"),
    ("chat/completions", {"messages": SHORT_ANSWER_CHAT, "temperature": -1}, "temperature"),
    ("chat/completions", {"messages": SHORT_ANSWER_CHAT, "max_tokens": 0}, "max_tokens"),
    ("chat/completions", {"messages": SHORT_ANSWER_CHAT, "n": 2}, "n must be 1"),
    ("chat/completions", {"max_tokens": 4}, "messages"),
    ("chat/completions", {"messages": []}, "messages"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "role"),
    (
        "chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        "image_url",
    ),
]


def _check_error(response: httpx.Response, status: int, words: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and isinstance(error["type"], str)
    assert words.lower() in error["message"].lower(), error
    return error


@pytest.mark.parametrize(
    ("path", "body", "words"),
    BAD_REQUESTS,
    ids=[f"{p}-{w}-{i}" for i, (p, _, w) in enumerate(BAD_REQUESTS)],
)
def test_bad_requests_get_400_with_an_openai_error_body(server, path, body, words):
    response = httpx.post(
        f"{server}/v1/{path}", json={"model": MODEL, **body}, headers=AUTH, timeout=30
    )
    error = _check_error(response, 400, words)
    assert error["type"] == "invalid_request_error"


def test_malformed_json_is_400_not_500(server):
    for path in ("completions", "chat/completions"):
        response = httpx.post(
            f"{server}/v1/{path}",
            content=b"{not json",
            timeout=30,
            headers={**AUTH, "Content-Type": "application/json"},
        )
        _check_error(response, 400, "json")


def test_errors_through_the_openai_client(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, temperature=-1)
    assert e.value.status_code == 400 and "temperature" in e.value.message
    assert e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL, messages=SHORT_ANSWER_CHAT, logprobs=True, top_logprobs=21
        )
    assert "top_logprobs" in e.value.message
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=2)
    assert e.value.status_code == 404 and "gpt-4" in e.value.message
    assert e.value.body["type"] == "not_found_error" and e.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=SHORT_ANSWER_CHAT, max_tokens=2)


def test_server_keeps_serving_through_bad_requests(server, client, offline):
    expected = greedy(offline, PROMPT, 12).outputs[0].text

    async def run() -> str:
        async with async_client(server) as aclient:
            stream = await aclient.completions.create(
                model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stream=True
            )
            async with httpx.AsyncClient(base_url=f"{server}/v1", headers=AUTH, timeout=30) as raw:
                responses = await asyncio.gather(
                    *[raw.post(f"/{p}", json={"model": MODEL, **b}) for p, b, _ in BAD_REQUESTS],
                    raw.post("/completions", content=b"{not json"),
                    raw.post("/completions", json={"model": "nope", "prompt": "x"}),
                )
            assert [r.status_code for r in responses] == [400] * (len(BAD_REQUESTS) + 1) + [404]
            return "".join([c.choices[0].text async for c in stream])

    # A request in flight while the bad ones arrive completes as if they never came...
    assert asyncio.run(run()) == expected
    # ...and so does one after them.
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    assert response.choices[0].text == expected


def test_api_key_is_required(server):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
    response = httpx.post(f"{server}/v1/completions", json=body, timeout=30)
    error = _check_error(response, 401, "api key")
    assert error["type"] == "authentication_error"
    response = httpx.get(f"{server}/v1/models", headers={"Authorization": "Bearer wrong"})
    _check_error(response, 401, "api key")
    wrong = openai.OpenAI(base_url=f"{server}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        wrong.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    assert e.value.status_code == 401
    # Health and metrics stay open; the right key works.
    assert httpx.get(f"{server}/health").status_code == 200
    assert httpx.get(f"{server}/metrics").status_code == 200
    response = httpx.post(f"{server}/v1/completions", json=body, headers=AUTH, timeout=60)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 2


# ---- load, disconnects and timeouts ------------------------------------------------------


def test_200_concurrent_streams_all_finish(server):
    before = successes(metrics(server))

    async def one(aclient: openai.AsyncOpenAI, i: int) -> tuple[str, str | None]:
        stream = await aclient.completions.create(
            model=MODEL, prompt=f"Fact {i}:", max_tokens=8, temperature=0, stream=True
        )
        text, finish_reason = [], None
        async for chunk in stream:
            text.append(chunk.choices[0].text)
            finish_reason = chunk.choices[0].finish_reason or finish_reason
        return "".join(text), finish_reason

    async def run():
        async with async_client(server) as aclient:
            return await asyncio.gather(*[one(aclient, i) for i in range(200)])

    results = asyncio.run(run())
    assert len(results) == 200
    assert all(reason in ("length", "stop") for _, reason in results), results
    assert all(text for text, reason in results if reason == "length")
    after = wait_until_idle(server)
    assert successes(after) - before == 200
    assert_idle(after)


def test_clients_that_disconnect_mid_stream_are_aborted(server, client):
    # Long enough (50 x 1000 tokens) that finishing them instead of aborting would take far
    # longer than the idle wait below.
    num = 50
    seen: dict[str, float] = {}

    async def run() -> list[int]:
        read_some = asyncio.Barrier(num + 1)
        close_now = asyncio.Event()

        async def one(aclient: openai.AsyncOpenAI, i: int) -> int:
            stream = await aclient.completions.create(
                model=MODEL,
                prompt=f"Story {i}:",
                max_tokens=1000,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            n = 0
            async for chunk in stream:
                assert chunk.choices[0].finish_reason is None
                n += 1
                if n == 1 + i % 2:
                    break
            await read_some.wait()
            await close_now.wait()
            await stream.close()
            return n

        async with async_client(server) as aclient:
            tasks = [asyncio.create_task(one(aclient, i)) for i in range(num)]
            await read_some.wait()
            seen.update(await asyncio.to_thread(metrics, server))
            close_now.set()
            return await asyncio.gather(*tasks)

    counts = asyncio.run(run())
    assert all(n in (1, 2) for n in counts)
    # While the streams were open, the engine held all of them.
    in_engine = seen["tandem:num_requests_running"] + seen["tandem:num_requests_waiting"]
    assert in_engine == num, seen
    assert_idle(wait_until_idle(server))
    # The server still answers.
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0)
    assert response.choices[0].finish_reason == "length"


def test_non_streaming_client_timeout_aborts_the_request(server, client):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2000, "ignore_eos": True}
    start = time.monotonic()
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{server}/v1/completions", json=body, headers=AUTH, timeout=1.0)
    assert time.monotonic() - start < 10
    # 2000 tokens would take minutes here; an aborted request frees everything at once.
    assert_idle(wait_until_idle(server))
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0)
    assert response.usage.completion_tokens == 2
