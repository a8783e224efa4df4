"""The server's guards, without an engine: with an API key every route but /health needs
it (the docs, /metrics and /v1/disagg/info included; /metrics may be left open by a flag),
on the router too (/router/instances included);
a body over the size limit is refused with a 413 in OpenAI's schema before it is read
(by its Content-Length, or chunk by chunk); tokenizing a prompt does not block the event
loop; a dead engine's gauges are not shown stale."""

from __future__ import annotations

import asyncio
import time

import httpx

from tandem.messages import EngineInfo
from tandem.server.app import build_app
from tandem.server.guards import MIN_BODY_BYTES, default_max_body_bytes
from tandem.server.router import build_router_app

KEY = "k3y"
AUTH = {"Authorization": f"Bearer {KEY}"}
GUARDED = [
    ("GET", "/docs"),
    ("GET", "/redoc"),
    ("GET", "/openapi.json"),
    ("GET", "/metrics"),
    ("GET", "/v1/disagg/info"),
    ("GET", "/v1/models"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("GET", "/version"),
    ("GET", "/no/such/route"),
]
GUARDED_OK_PATHS = ("/docs", "/openapi.json", "/metrics", "/v1/disagg/info")


class SlowTokenizer:
    """Takes ``seconds`` to encode, holding the thread (as a long prompt does)."""

    end_token_ids = frozenset({0})

    def __init__(self, seconds: float):
        self.seconds = seconds

    def encode(self, text: str) -> list[int]:
        time.sleep(self.seconds)
        return [1] * len(text)


class FakeClient:
    """Just enough of AsyncEngineClient for the guards; every prompt is too long."""

    def __init__(self, dead: str | None = None, tokenize_s: float = 0.0):
        self.num_active_requests = 0
        self.dead = dead
        self.info = EngineInfo(128, 1000, 64, 16, "fake")
        self.stats = {"num_running": 3, "num_kv_blocks": 64}
        self.tokenizer = SlowTokenizer(tokenize_s)

    def validate_prompt(self, prompt_token_ids, params=None):
        raise ValueError(f"prompt is {len(prompt_token_ids)} tokens, over the limit")


def _send(app, requests: list[tuple[str, str, dict]]) -> list[httpx.Response]:
    """Send ``(method, path, options)`` requests to ``app`` at once; their responses."""

    async def send():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await asyncio.gather(
                *(client.request(method, path, **options) for method, path, options in requests)
            )

    return asyncio.run(send())


def _check_error(response: httpx.Response, status: int, kind: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status and error["type"] == kind, error
    return error


def test_with_an_api_key_every_route_but_health_needs_it():
    app = build_app(FakeClient(), "m", api_key=KEY)
    without = _send(app, [(method, path, {}) for method, path in GUARDED])
    for (_, path), response in zip(GUARDED, without, strict=True):
        error = _check_error(response, 401, "authentication_error")
        assert "api key" in error["message"].lower(), path
    wrong = _send(app, [("GET", "/metrics", {"headers": {"Authorization": "Bearer nope"}})])
    _check_error(wrong[0], 401, "authentication_error")
    health, docs, schema, metrics, info = _send(
        app,
        [("GET", "/health", {})] + [("GET", path, {"headers": AUTH}) for path in GUARDED_OK_PATHS],
    )
    assert health.status_code == 200
    assert docs.status_code == 200 and "swagger" in docs.text.lower()
    assert schema.status_code == 200 and "/v1/completions" in schema.json()["paths"]
    assert metrics.status_code == 200 and "tandem:num_requests_running" in metrics.text
    assert info.status_code == 200 and info.json()["role"] == "mixed"


def test_metrics_can_be_left_open_alone():
    app = build_app(FakeClient(), "m", api_key=KEY, metrics_without_key=True)
    metrics, docs = _send(app, [("GET", "/metrics", {}), ("GET", "/docs", {})])
    assert metrics.status_code == 200
    _check_error(docs, 401, "authentication_error")


def test_without_an_api_key_everything_is_open():
    app = build_app(FakeClient(), "m")
    metrics, docs = _send(app, [("GET", "/metrics", {}), ("GET", "/docs", {})])
    assert metrics.status_code == docs.status_code == 200


def test_with_an_api_key_every_route_of_the_router_but_health_needs_it():
    instances = (["http://prefill:8000"], ["http://decode:8000"])
    app = build_router_app(*instances, api_key=KEY)
    refused = _send(
        app,
        [
            ("GET", "/router/instances", {}),
            ("GET", "/router/instances", {"headers": {"Authorization": "Bearer nope"}}),
            ("POST", "/v1/completions", {"json": {"prompt": "hi"}}),
            ("GET", "/v1/models", {}),
            ("GET", "/docs", {}),
        ],
    )
    for response in refused:
        _check_error(response, 401, "authentication_error")
    health, listed = _send(
        app, [("GET", "/health", {}), ("GET", "/router/instances", {"headers": AUTH})]
    )
    assert health.status_code == 200
    assert listed.status_code == 200
    assert [i["role"] for i in listed.json()] == ["prefill", "decode"]
    open_router = build_router_app(*instances)  # without a key: open, as before
    assert _send(open_router, [("GET", "/router/instances", {})])[0].status_code == 200


def test_default_body_limit_follows_max_model_len():
    assert default_max_body_bytes(128) == MIN_BODY_BYTES
    assert default_max_body_bytes(1 << 20) == 64 << 20


class Chunks:
    """A body of ``count`` chunks of ``size`` bytes that counts how many were read."""

    def __init__(self, count: int, size: int):
        self.count, self.size, self.sent = count, size, 0

    async def __aiter__(self):
        for _ in range(self.count):
            self.sent += 1
            yield b" " * self.size


def test_an_oversized_body_is_413_without_being_read():
    limit = 10_000
    app = build_app(FakeClient(), "m", api_key=KEY, max_request_body_bytes=limit)
    declared = Chunks(count=100, size=1000)
    headers = {**AUTH, "content-length": str(100 * 1000), "content-type": "application/json"}
    chunked = Chunks(count=100, size=1000)
    by_length, by_chunks, under = _send(
        app,
        [
            ("POST", "/v1/completions", {"content": declared, "headers": headers}),
            ("POST", "/v1/completions", {"content": chunked, "headers": AUTH}),
            ("POST", "/v1/completions", {"json": {"prompt": "x" * 100}, "headers": AUTH}),
        ],
    )
    error = _check_error(by_length, 413, "invalid_request_error")
    assert str(limit) in error["message"]
    assert declared.sent == 0  # refused by its Content-Length alone
    _check_error(by_chunks, 413, "invalid_request_error")
    assert chunked.sent <= limit // 1000 + 2  # read only until the limit passed
    _check_error(under, 400, "invalid_request_error")  # read: the (fake) prompt is too long


def test_tokenizing_a_prompt_leaves_the_event_loop_free():
    tokenize_s = 1.5
    app = build_app(FakeClient(tokenize_s=tokenize_s), "m")

    async def send():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            body = {"prompt": "a long prompt"}
            started = time.monotonic()
            completion = asyncio.create_task(client.post("/v1/completions", json=body))
            await asyncio.sleep(0.2)  # the completion is tokenizing now
            health = await client.get("/health")
            health_s = time.monotonic() - started
            return await completion, health, health_s

    # Blocking the loop, the tokenizer would hold /health back until it was done.
    completion, health, health_s = asyncio.run(send())
    assert health.status_code == 200
    assert health_s < tokenize_s / 2, f"/health took {health_s:.2f} s while a prompt tokenized"
    _check_error(completion, 400, "invalid_request_error")


def test_a_dead_engine_shows_no_stale_gauges():
    client = FakeClient()
    app = build_app(client, "m")
    (live,) = _send(app, [("GET", "/metrics", {})])
    client.dead = "engine core stalled: no heartbeat for 31.0 s"
    (dead,) = _send(app, [("GET", "/metrics", {})])
    for response, up, running in ((live, "1.0", [" 3.0"]), (dead, "0.0", [])):
        lines = response.text.splitlines()
        assert f'tandem:engine_up{{model_name="m"}} {up}' in lines
        values = [line[line.rindex(" ") :] for line in lines if "num_requests_running{" in line]
        assert values == running
