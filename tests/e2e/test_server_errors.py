"""The OpenAI-compatible server, end to end: bad requests get a 400 with an OpenAI error body
(raw HTTP and through the ``openai`` client), unknown models a 404, a missing or wrong API
key a 401 (on every route but /health), a body over the size limit a 413 at once, and the
server keeps serving, and answering /health, through them.

The module's server runs with an API key (fixtures: conftest.py).
"""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import openai
import pytest
from server_helpers import AUTH, MODEL, PROMPT, SHORT_ANSWER_CHAT, async_client, greedy

pytestmark = pytest.mark.slow  # a server process for the module


# ---- errors ------------------------------------------------------------------------------

BAD_REQUESTS = [
    ("completions", {"prompt": PROMPT, "temperature": -1}, "temperature"),
    ("completions", {"prompt": PROMPT, "top_p": 2}, "top_p"),
    ("completions", {"prompt": PROMPT, "logprobs": 21}, "logprobs"),
    ("completions", {"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": PROMPT, "n": 0}, "n"),
    ("completions", {"prompt": PROMPT, "n": 129}, "n"),
    ("completions", {"prompt": [PROMPT] * 9, "n": 128}, "limit of 1024"),
    ("completions", {"prompt": [42] * 9000}, "context"),
    ("completions", {"prompt": ""}, "empty"),
    ("completions", {"prompt": []}, "empty"),
    ("completions", {"prompt": [10**9]}, "token ids"),
    ("completions", {"prompt": ["one", ""]}, "prompt[1]"),
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
    ("chat/completions", {"messages": SHORT_ANSWER_CHAT, "n": 0}, "n"),
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
    """Not JSON, or not UTF-8: a 400 saying which, and where."""
    bodies = {
        b"{not json": "not valid JSON: Expecting property name enclosed in double quotes at "
        "character 1",
        b'{"model": "m", "prompt": "\xff"}': "not valid UTF-8: byte 26 (invalid start byte)",
    }
    for path in ("completions", "chat/completions"):
        for body, words in bodies.items():
            response = httpx.post(
                f"{server}/v1/{path}",
                content=body,
                timeout=30,
                headers={**AUTH, "Content-Type": "application/json"},
            )
            _check_error(response, 400, words)


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
    # Only health stays open; the right key opens the rest.
    assert httpx.get(f"{server}/health").status_code == 200
    for path in ("/metrics", "/docs", "/openapi.json", "/redoc", "/v1/disagg/info"):
        _check_error(httpx.get(f"{server}{path}"), 401, "api key")
        assert httpx.get(f"{server}{path}", headers=AUTH).status_code == 200, path
    response = httpx.post(f"{server}/v1/completions", json=body, headers=AUTH, timeout=60)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 2


# ---- limits ------------------------------------------------------------------------------


def _health_while(server: str, work) -> tuple[object, list[float]]:
    """Run ``work()`` in a thread while polling /health; its result and every health
    check's latency (each must be a 200)."""
    results: list = []
    thread = threading.Thread(target=lambda: results.append(work()), daemon=True)
    thread.start()
    latencies = []
    while thread.is_alive():
        started = time.monotonic()
        assert httpx.get(f"{server}/health", timeout=10).status_code == 200
        latencies.append(time.monotonic() - started)
        time.sleep(0.1)
    thread.join()
    return results[0], latencies


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_50_mb_body_is_413_at_once_and_health_answers_meanwhile(server, chunked):
    size = 50 << 20
    url = f"{server}/v1/completions"
    headers = {**AUTH, "content-type": "application/json"}

    def post():
        # The body is a prompt, so it would be read and tokenized if it were let in.
        body = b'{"prompt": "' + b"a" * (size - 14) + b'"}'
        content = (body[i : i + (1 << 20)] for i in range(0, size, 1 << 20)) if chunked else body
        started = time.monotonic()
        response = httpx.post(url, content=content, headers=headers, timeout=60)
        return response, time.monotonic() - started

    (response, took_s), latencies = _health_while(server, post)
    error = _check_error(response, 413, "limit")
    assert error["type"] == "invalid_request_error"
    assert took_s < 10, took_s
    assert max(latencies, default=0) < 2.0, latencies


def test_health_answers_while_a_long_prompt_is_tokenized(server):
    prompt = "The quick brown fox jumps over the lazy dog. " * 70_000  # 3 MB, under the limit

    def post():
        started = time.monotonic()
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
        response = httpx.post(f"{server}/v1/completions", json=body, headers=AUTH, timeout=300)
        return response, time.monotonic() - started

    (response, took_s), latencies = _health_while(server, post)
    _check_error(response, 400, "context")  # tokenized: far longer than the model's context
    assert took_s > 1.0 and len(latencies) >= 3, (took_s, latencies)  # it took a while...
    assert max(latencies) < 1.0, latencies  # ...during which /health answered at once
