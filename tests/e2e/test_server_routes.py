"""vLLM's routes beside the OpenAI ones, end to end: ``/tokenize`` (a text gives the
tokenizer's own ids; chat messages give the prompt the chat endpoint runs, its
``usage.prompt_tokens``), ``/detokenize`` (round trip; ids outside the vocabulary, negative
or not integers and a wrong model refused in OpenAI's error schema naming the field),
``/version``, ``/ping`` (GET and POST, open like /health), ``HEAD`` on every GET route, and the
API key on the new routes.

The module's server runs with an API key (fixtures: conftest.py); the offline ``LLM``'s
tokenizer is the reference.
"""

from __future__ import annotations

import httpx
import pytest
from server_helpers import AUTH, MODEL, PROMPT, SHORT_ANSWER_CHAT

import tandem

pytestmark = pytest.mark.slow  # a server process for the module

GET_ROUTES = ("/health", "/metrics", "/v1/models", "/version", "/ping", "/v1/disagg/info")
TEXT = "Grüße, 世界! " + PROMPT


def _post(server: str, path: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(f"{server}{path}", json=body, headers=AUTH if headers is None else headers)


def _check_error(response: httpx.Response, status: int, param: str | None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["code"] == status and error["param"] == param, error
    return error


# ---- tokenize and detokenize -------------------------------------------------------------


def test_tokenize_a_text_gives_the_tokenizer_s_ids(server, offline):
    tokenizer = offline.tokenizer
    max_model_len = httpx.get(f"{server}/v1/models", headers=AUTH).json()["data"][0]
    reply = _post(server, "/tokenize", {"model": MODEL, "prompt": TEXT}).json()
    ids = tokenizer.encode(TEXT, add_special_tokens=True)
    assert reply == {
        "count": len(ids),
        "max_model_len": max_model_len["max_model_len"],
        "tokens": ids,
        "token_strs": None,
    }
    reply = _post(
        server,
        "/tokenize",
        {"prompt": TEXT, "add_special_tokens": False, "return_token_strs": True},
    ).json()
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert reply["tokens"] == ids and reply["count"] == len(ids)
    assert reply["token_strs"] == tokenizer.hf.convert_ids_to_tokens(ids)


def test_tokenize_messages_gives_the_chat_endpoint_s_prompt(server, offline):
    reply = _post(server, "/tokenize", {"model": MODEL, "messages": SHORT_ANSWER_CHAT}).json()
    assert reply["tokens"] == offline.tokenizer.apply_chat_template(SHORT_ANSWER_CHAT)
    chat = _post(
        server,
        "/v1/chat/completions",
        {"model": MODEL, "messages": SHORT_ANSWER_CHAT, "max_tokens": 1},
    )
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["prompt_tokens"] == reply["count"] == len(reply["tokens"])
    # Without the generation prompt the assistant's header is left out.
    body = {"messages": SHORT_ANSWER_CHAT, "add_generation_prompt": False}
    bare = _post(server, "/tokenize", body).json()
    assert bare["tokens"] == reply["tokens"][: bare["count"]] and bare["count"] < reply["count"]


def test_detokenize_round_trips(server):
    ids = _post(server, "/tokenize", {"prompt": TEXT}).json()["tokens"]
    assert _post(server, "/detokenize", {"model": MODEL, "tokens": ids}).json() == {"prompt": TEXT}
    chat = _post(server, "/tokenize", {"messages": SHORT_ANSWER_CHAT}).json()["tokens"]
    text = _post(server, "/detokenize", {"tokens": chat}).json()["prompt"]
    assert SHORT_ANSWER_CHAT[0]["content"] in text and "<|im_start|>" in text  # special kept
    assert (
        _post(server, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()["tokens"]
        == chat
    )


BAD_BODIES = [
    ("/detokenize", {"tokens": [1, 10**6]}, 400, "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": [1 << 70]}, 400, "tokens"),
    ("/detokenize", {"tokens": ["1"]}, 400, "tokens[0]"),
    ("/detokenize", {"tokens": [1.5]}, 400, "tokens[0]"),
    ("/detokenize", {"tokens": []}, 400, "tokens"),
    ("/detokenize", {"tokens": [1], "model": "no-such-model"}, 404, "model"),
    ("/tokenize", {"prompt": PROMPT, "model": "no-such-model"}, 404, "model"),
    ("/tokenize", {"prompt": ""}, 400, "prompt"),
    ("/tokenize", {"prompt": 7}, 400, "prompt"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": PROMPT, "messages": SHORT_ANSWER_CHAT}, 400, "messages"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0].role"),
    ("/tokenize", {"prompt": PROMPT, "add_generation_prompt": True}, 400, "add_generation_prompt"),
    ("/tokenize", {"prompt": PROMPT, "chat_template": "x"}, 400, "chat_template"),
]


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    BAD_BODIES,
    ids=[f"{case[0][1:]}-{i}-{case[3]}" for i, case in enumerate(BAD_BODIES)],
)
def test_bad_bodies_get_an_openai_error_naming_the_field(server, path, body, status, param):
    error = _check_error(_post(server, path, body), status, param)
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    if status == 404:  # the completions route's own answer
        completions = _post(server, "/v1/completions", {"model": body["model"], "prompt": PROMPT})
        assert completions.json() == {"error": error}


def test_a_lone_surrogate_is_a_400_naming_the_field(server):
    headers = {**AUTH, "content-type": "application/json"}
    for raw, param in (
        (rb'{"prompt": "a\ud800"}', "prompt"),
        (rb'{"messages": [{"role": "user", "content": "\udc00"}]}', "messages[0].content"),
        (rb'{"prompt": "a", "model": "\ud800"}', "model"),
    ):
        _check_error(httpx.post(f"{server}/tokenize", content=raw, headers=headers), 400, param)


# ---- version, ping, HEAD and the API key -------------------------------------------------


def test_version_and_ping(server):
    assert httpx.get(f"{server}/version", headers=AUTH).json() == {"version": tandem.__version__}
    for method in ("GET", "POST"):  # open, like /health
        response = httpx.request(method, f"{server}/ping")
        assert response.status_code == 200 and response.json() == {"status": "ok"}, method


def test_head_on_every_get_route_is_a_200_without_a_body(server):
    for path in GET_ROUTES:
        response = httpx.head(f"{server}{path}", headers=AUTH)
        assert response.status_code == 200 and response.content == b"", path
    assert httpx.head(f"{server}/health").status_code == 200  # open, like its GET


def test_the_new_routes_need_the_api_key(server):
    for path, body in (("/tokenize", {"prompt": PROMPT}), ("/detokenize", {"tokens": [1]})):
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            error = _check_error(_post(server, path, body, headers), 401, None)
            assert error["type"] == "authentication_error", path
        assert _post(server, path, body).status_code == 200, path
    _check_error(httpx.get(f"{server}/version"), 401, None)
    assert httpx.head(f"{server}/metrics").status_code == 401
