"""Hostile inputs against a live server (issue 19): well over a thousand requests generated
from the parameter table of the request models (hostile_cases.py), streamed and not. For
every one: no 5xx; every 4xx in OpenAI's error schema, ``param`` naming the field at fault,
no internal path or traceback in the message; every accepted request a well-formed
response; every stream ends with ``data: [DONE]``, an error in it being the last event
before that. Afterwards the server answers a greedy request with the same tokens as before
them, and every KV block is free.

The module's server runs with ``--max-model-len 128`` so that no accepted case runs long.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from hostile_cases import Case, all_cases
from hostile_table import CHAT, COMPLETIONS, MAX_MODEL_LEN, MODEL, VOCAB_SIZE
from server_helpers import AUTH, assert_idle, wait_until_idle

pytestmark = pytest.mark.slow  # a server process for the module

CASES = all_cases()
CONCURRENCY = 8  # requests in flight at once
# What no client may see: a source path, a traceback, an exception's class path.
LEAKS = re.compile(r"Traceback|File \"|\.py\b|/work/|/home/|/usr/|site-packages|0x[0-9a-f]{6,}")
FINISH_REASONS = {"stop", "length"}
REFERENCE_BODY = {
    "model": MODEL,
    "prompt": "The capital of France is",
    "max_tokens": 12,
    "temperature": 0,
    "return_token_ids": True,
}


@pytest.fixture(scope="module")
def server_args() -> list[str]:
    return ["--max-model-len", str(MAX_MODEL_LEN)]


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=f"{server}/v1", headers=AUTH, timeout=120) as client:
        yield client


def _greedy_tokens(http: httpx.Client) -> tuple[list[int], list[int]]:
    """A normal greedy request's token ids, whole and streamed."""
    response = http.post("/completions", json=REFERENCE_BODY)
    assert response.status_code == 200, response.text
    whole = response.json()["choices"][0]["token_ids"]
    events = _sse_events(http.post("/completions", json={**REFERENCE_BODY, "stream": True}))
    streamed = [t for e in events[:-1] for t in e["choices"][0]["token_ids"]]
    return whole, streamed


@pytest.fixture(scope="module")
def reference(http) -> tuple[list[int], list[int]]:
    """The greedy tokens before any hostile case."""
    whole, streamed = _greedy_tokens(http)
    assert len(whole) == REFERENCE_BODY["max_tokens"] and whole == streamed
    return whole, streamed


def test_the_case_table_knows_the_model(offline):
    assert offline.engine.limits.vocab_size == VOCAB_SIZE
    assert len(CASES) > 1000
    assert sum(c.expect == "ok" for c in CASES) > 100


def _sse_events(response: httpx.Response) -> list:
    """The JSON payloads of a stream's events, ``"[DONE]"`` last (asserting the framing)."""
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    events = []
    for block in response.text.split("\n\n"):
        if not block:
            continue
        assert block.startswith("data: "), block[:200]
        data = block[len("data: ") :]
        events.append("[DONE]" if data == "[DONE]" else json.loads(data))
    assert events and events[-1] == "[DONE]", "a stream must end with data: [DONE]"
    assert "[DONE]" not in events[:-1]
    return events


def check_error(body: dict, status: int, param: str | None) -> None:
    """OpenAI's error schema, with ``param`` naming ``param`` (or a part of it), no leaks."""
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"], error
    assert error["code"] == status, error
    assert not LEAKS.search(error["message"]), error["message"]
    if param is not None:
        named = error["param"]
        assert named == param or (named or "").startswith((param + "[", param + ".")), error


def _check_choice(path: str, choice: dict, chunk: bool) -> None:
    # Several prompts or samples (n) answer a choice each, by index (at most 2 here).
    assert choice["index"] in (0, 1)
    if path == COMPLETIONS:
        assert isinstance(choice["text"], str)
    elif chunk:
        assert isinstance(choice["delta"], dict)
    else:
        message = choice["message"]
        assert message["role"] == "assistant"
        # Content is text, or null beside the tool calls of a reply that made them.
        assert isinstance(message["content"], str) or message.get("tool_calls"), message


def check_response(case: Case, response: httpx.Response) -> str:
    """The common checks; returns what happened: "ok", "rejected" or "failed" (a stream
    that ended with an error event)."""
    assert response.status_code < 500, f"{response.status_code}: {response.text[:500]}"
    if response.status_code >= 400:
        check_error(response.json(), response.status_code, case.param)
        return "rejected"
    assert response.status_code == 200
    if case.stream:
        events = _sse_events(response)[:-1]
        errors = [i for i, e in enumerate(events) if "error" in e]
        if errors:
            assert errors == [len(events) - 1], "the error event must be the last before [DONE]"
            check_error(events[-1], events[-1]["error"]["code"], None)
            return "failed"
        chunks = [e for e in events if e["choices"]]
        assert chunks and chunks[-1]["choices"][0]["finish_reason"] in FINISH_REASONS
        for chunk in chunks:
            assert chunk["model"] == MODEL and chunk["id"] == chunks[0]["id"]
            _check_choice(case.path, chunk["choices"][0], chunk=True)
        return "ok"
    body = response.json()
    assert body["model"] == MODEL and isinstance(body["id"], str)
    assert body["object"] == ("text_completion" if case.path == COMPLETIONS else "chat.completion")
    choices = body["choices"]
    assert [c["index"] for c in choices] == list(range(len(choices)))
    for choice in choices:
        _check_choice(case.path, choice, chunk=False)
        assert choice["finish_reason"] in FINISH_REASONS
    usage = body["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert 1 <= usage["completion_tokens"] and usage["total_tokens"] <= MAX_MODEL_LEN
    return "ok"


def _unique_ids(cases: list[Case]) -> list[str]:
    seen: dict[str, int] = {}
    ids = []
    for case in cases:
        seen[case.id] = seen.get(case.id, 0) + 1
        ids.append(case.id if seen[case.id] == 1 else f"{case.id}#{seen[case.id]}")
    return ids


@pytest.fixture(scope="module")
def responses(http, reference) -> dict[int, httpx.Response]:
    """Every case's response, by its index in CASES (sent after the reference, so that it
    is taken before any hostile case), CONCURRENCY at a time: the server batches the
    accepted ones as it would any clients' requests."""
    headers = {"Content-Type": "application/json"}

    def send(case: Case) -> httpx.Response:
        return http.post(f"/{case.path}", content=case.content(), headers=headers)

    with ThreadPoolExecutor(CONCURRENCY) as pool:
        return dict(enumerate(pool.map(send, CASES)))


@pytest.mark.parametrize("index", range(len(CASES)), ids=_unique_ids(CASES))
def test_hostile_request(responses, index: int):
    case, response = CASES[index], responses[index]
    outcome = check_response(case, response)
    if case.expect == "ok":
        assert outcome == "ok", response.text[:500]
    elif case.expect == "reject":
        assert outcome == "rejected", response.text[:500]
        assert response.status_code == case.status, response.text[:500]


def test_other_content_types_and_methods_get_openai_errors(http):
    for path in (COMPLETIONS, CHAT):
        response = http.post(
            f"/{path}", content=b"prompt=Hi", headers={"Content-Type": "text/plain"}
        )
        assert 400 <= response.status_code < 500, response.text
        check_error(response.json(), response.status_code, None)
        response = http.get(f"/{path}")
        assert response.status_code == 405
        check_error(response.json(), 405, None)
    response = http.post("/no-such-route", json={})
    assert response.status_code == 404
    check_error(response.json(), 404, None)


def test_server_answers_identically_after_the_hostile_cases(server, http, reference):
    assert _greedy_tokens(http) == reference
    assert_idle(wait_until_idle(server))
