"""Validation at one place with real bounds: SamplingParams and PromptLimits (what the engine
core and an offline LLM check) refuse every out-of-range value with a ValueError naming the
field, and the server turns the same checks into 400s in OpenAI's error schema with ``param``
set, for FastAPI's own errors (404, 405, bad JSON) too. No engine runs here."""

from __future__ import annotations

import asyncio
import json
import math

import httpx
import pytest

from tandem.messages import EngineInfo
from tandem.outputs import CompletionOutput, RequestOutput
from tandem.request import PromptLimits
from tandem.sampling_params import ParamError, SamplingParams
from tandem.server.app import build_app
from tandem.server.engine_client import AsyncEngineClient

VOCAB = 1000
HUGE_INTS = [2**63, 2**64, -(2**63) - 1]
SURROGATE = "\ud800"


class FakeTokenizer:
    end_token_ids = frozenset({2})

    def encode(self, text: str) -> list[int]:
        text.encode("utf-8")  # a real tokenizer fails on a lone surrogate too
        return [ord(c) % VOCAB for c in text] or [1]

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool, tools: list | None = None
    ) -> list[int]:
        return self.encode("".join(m["content"] for m in messages) or "x")


class FakeClient:
    """AsyncEngineClient's face, with its real prompt validation and a one-token engine."""

    validate_prompt = AsyncEngineClient.validate_prompt

    def __init__(self):
        self.num_active_requests = 0
        self.dead = None
        self.info = EngineInfo(128, VOCAB, 64, 16, "fake")
        self.tokenizer = FakeTokenizer()
        self.stats = {}
        self.requests = []

    async def generate(self, prompt, prompt_token_ids, params, remote_prefill, request_id):
        self.validate_prompt(prompt_token_ids, params)
        self.requests.append((prompt_token_ids, params))
        completion = CompletionOutput(0, "ok", [5], finish_reason="length")
        yield RequestOutput(request_id, prompt, prompt_token_ids, [completion], finished=True)


def _send(method: str, path: str, **kwargs) -> tuple[httpx.Response, FakeClient]:
    client = FakeClient()
    app = build_app(client, "m")
    if "json" in kwargs:  # as a client sends it: \ud800 escaped, NaN as the literal
        kwargs["content"] = json.dumps(kwargs.pop("json"))
        kwargs["headers"] = {"Content-Type": "application/json"}

    async def send():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            return await http.request(method, path, **kwargs)

    return asyncio.run(send()), client


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and isinstance(error["message"], str)
    assert ".py" not in error["message"] and "Traceback" not in error["message"]
    return error


# ---- SamplingParams and PromptLimits: the engine core's validation ----------------------

BAD_PARAMS = [
    *[("top_k", v) for v in HUGE_INTS],
    *[("seed", v) for v in HUGE_INTS],
    *[("max_tokens", v) for v in [*HUGE_INTS, 0, -1, 2**31]],
    *[("min_tokens", v) for v in [*HUGE_INTS, -1]],
    *[("logprobs", v) for v in [*HUGE_INTS, -1, 21]],
    *[("prompt_logprobs", v) for v in [*HUGE_INTS, -1, 21]],
    *[("stop_token_ids", [v]) for v in [*HUGE_INTS, -1]],
    *[("temperature", v) for v in [math.nan, math.inf, -math.inf, 1e-45, 5e-324, -1.0, 2**1100]],
    *[("top_p", v) for v in [math.nan, math.inf, 0.0, 1.5]],
    *[("min_p", v) for v in [math.nan, -0.1, 1.5]],
    ("temperature", "hot"),
    ("top_k", 1.5),
    ("top_k", True),
    ("max_tokens", "4"),
    ("stop_token_ids", 5),
    ("stop_token_ids", ["1"]),
    ("stop", [SURROGATE]),
    ("stop", [3]),
    ("ignore_eos", "yes"),
]


@pytest.mark.parametrize(("field", "value"), BAD_PARAMS, ids=[repr(c)[:40] for c in BAD_PARAMS])
def test_bad_sampling_params_raise_a_param_error_naming_the_field(field, value):
    with pytest.raises(ParamError, match=field) as e:
        SamplingParams(**{field: value})
    assert e.value.param == field


def test_good_sampling_params_pass_and_top_k_beyond_the_vocab_is_accepted():
    params = SamplingParams(temperature=1e-5, top_k=2**63 - 1, seed=-(2**63), stop_token_ids=[0])
    assert params.top_k == 2**63 - 1
    assert SamplingParams(temperature=0).greedy and SamplingParams(temperature=2).temperature == 2


LIMITS = PromptLimits(max_model_len=128, vocab_size=VOCAB, num_kv_blocks=64, block_size=16)


@pytest.mark.parametrize("token_id", [VOCAB, 10**9, *HUGE_INTS, -1])
def test_token_ids_outside_the_vocab_are_refused_in_every_field(token_id):
    with pytest.raises(ParamError, match="prompt") as e:
        LIMITS.validate([1, token_id])
    assert e.value.param == "prompt"
    for field in ("stop_token_ids", "eos_token_ids"):
        if token_id < 0 or token_id > 2**63 - 1:
            continue  # refused by SamplingParams itself (above)
        params = SamplingParams(max_tokens=4, min_tokens=2, **{field: [token_id]})
        with pytest.raises(ParamError, match=field) as e:
            LIMITS.validate([1, 2], params)
        assert e.value.param == field
    LIMITS.validate([1, VOCAB - 1], SamplingParams(stop_token_ids=[VOCAB - 1]))


# ---- the server: 400s in OpenAI's schema, param set -------------------------------------

COMPLETION_CASES = [
    ({"stop_token_ids": [10**9], "min_tokens": 2, "max_tokens": 4}, "stop_token_ids"),
    ({"temperature": 1, "top_k": 9223372036854775808}, "top_k"),
    *[({"top_k": v}, "top_k") for v in HUGE_INTS],
    *[({"seed": v}, "seed") for v in HUGE_INTS],
    *[({"max_tokens": v}, "max_tokens") for v in [*HUGE_INTS, 0, -1]],
    *[({"min_tokens": v}, "min_tokens") for v in [*HUGE_INTS, -1]],
    *[({"logprobs": v}, "logprobs") for v in [*HUGE_INTS, -1, 21]],
    *[({"n": v}, "n") for v in [*HUGE_INTS, 0, -1, 129]],
    *[({"stop_token_ids": [v]}, "stop_token_ids") for v in [*HUGE_INTS, -1, VOCAB]],
    *[({"temperature": v}, "temperature") for v in [1e-45, -1, "hot"]],
    ({"top_p": 0}, "top_p"),
    ({"min_p": 2}, "min_p"),
    ({"stop": [""]}, "stop"),
    ({"stop": SURROGATE}, "stop"),
    ({"user": SURROGATE}, "user"),
    ({"prompt": [1, VOCAB]}, "prompt"),
    ({"prompt": [2**64]}, "prompt"),
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": SURROGATE + "hi"}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": 5}, "prompt"),
]


@pytest.mark.parametrize(
    ("fields", "param"), COMPLETION_CASES, ids=[repr(c)[:50] for c in COMPLETION_CASES]
)
def test_bad_completion_fields_get_400_naming_the_param(fields, param):
    response, client = _send("POST", "/v1/completions", json={"prompt": "Hi", **fields})
    error = _error(response, 400)
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert not client.requests


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_json_numbers_get_400(literal):
    body = '{"prompt": "Hi", "temperature": ' + literal + "}"
    headers = {"Content-Type": "application/json"}
    response, _ = _send("POST", "/v1/completions", content=body, headers=headers)
    assert _error(response, 400)["param"] == "temperature"


def _chat(content, **fields) -> dict:
    return {"messages": [{"role": "user", "content": content}], **fields}


CHAT_CASES = [
    (_chat("hi", max_completion_tokens=0), "max_completion_tokens"),
    (_chat("hi", max_completion_tokens=2**64), "max_completion_tokens"),
    (_chat("hi", max_tokens=0), "max_tokens"),
    (_chat("hi", logprobs=True, top_logprobs=2**63), "top_logprobs"),
    (_chat("hi", logprobs=True, top_logprobs=-1), "top_logprobs"),
    (_chat("hi", top_logprobs=2), "top_logprobs"),
    (_chat([{"type": "text", "text": 5}]), "messages[0].content[0].text"),
    (_chat([{"type": "text", "text": ["a"]}]), "messages[0].content[0].text"),
    (_chat([{"type": "text", "text": SURROGATE}]), "messages[0].content[0].text"),
    (_chat([{"type": "image_url", "image_url": {}}]), "messages[0].content[0].type"),
    (_chat(SURROGATE), "messages[0].content"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"messages": []}, "messages"),
    ({"max_tokens": 4}, "messages"),
    (_chat("x" * 200), "messages"),
]


@pytest.mark.parametrize(("body", "param"), CHAT_CASES, ids=[repr(c)[:60] for c in CHAT_CASES])
def test_bad_chat_fields_get_400_naming_the_param(body, param):
    response, client = _send("POST", "/v1/chat/completions", json=body)
    error = _error(response, 400)
    assert error["param"] == param, error
    assert not client.requests


def test_fastapis_own_errors_are_in_the_openai_schema():
    response, _ = _send("GET", "/v1/nothing")
    assert _error(response, 404)["type"] == "not_found_error"
    response, _ = _send("GET", "/v1/completions")
    assert _error(response, 405)["type"] == "invalid_request_error"
    headers = {"Content-Type": "application/json"}
    for body in (b"{not json", b"", b"[1, 2]", b'"text"'):
        response, _ = _send("POST", "/v1/completions", content=body, headers=headers)
        assert _error(response, 400)["type"] == "invalid_request_error"
    response, _ = _send("POST", "/v1/completions", content=b"{not json", headers=headers)
    assert "json" in response.json()["error"]["message"].lower()


def test_an_internal_error_is_a_500_that_shows_no_code(monkeypatch):
    def broken(self, text):
        raise RuntimeError('File "/secret/tandem/x.py", line 3: boom')

    monkeypatch.setattr(FakeTokenizer, "encode", broken)
    response, _ = _send("POST", "/v1/completions", json={"prompt": "Hi"})
    error = _error(response, 500)
    assert error["type"] == "server_error" and "secret" not in error["message"]


def test_valid_requests_still_work():
    response, client = _send(
        "POST",
        "/v1/completions",
        json={
            "prompt": "Hi",
            "max_tokens": 4,
            "min_tokens": 2,
            "stop_token_ids": [VOCAB - 1],
            "top_k": 2**63 - 1,
            "seed": 2**63 - 1,
            "temperature": 1e-5,
        },
    )
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == "ok"
    [(_, params)] = client.requests
    assert params.stop_token_ids == [VOCAB - 1] and params.top_k == 2**63 - 1
    body = _chat([{"type": "text", "text": "hi"}], max_completion_tokens=3, max_tokens=9)
    response, client = _send("POST", "/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    assert client.requests[0][1].max_tokens == 3
