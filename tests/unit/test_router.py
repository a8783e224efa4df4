"""The PD router: round-robin routing, relaying of bodies and SSE streams, health tracking,
retry on a dead decode instance, and OpenAI-style errors. Instances are httpx.MockTransport
handlers; nothing touches the network."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import httpx
import pytest
from fastapi.testclient import TestClient

from tandem.server.protocol import PREFILL_URL_HEADER
from tandem.server.router import build_router_app

PREFILLS = ["http://prefill-0:8000", "http://prefill-1:8000"]
DECODES = ["http://decode-0:8000", "http://decode-1:8000"]
COMPLETION = {"model": "m", "prompt": "hi", "max_tokens": 4}
EVENTS = [
    b'data: {"choices": [{"text": "a"}]}\n\n',
    b'data: {"choices": [{"text": "b"}]}\n\n',
    b'data: {"choices": [{"text": "c"}]}\n\n',
    b"data: [DONE]\n\n",
]


def completion_json(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, json={"object": "text_completion", "served_by": request.url.host})


def refuse(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("connection refused", request=request)


class Fleet:
    """Fake instances behind one MockTransport: each host has its own handler for API paths."""

    def __init__(self, api: dict[str, Callable] | None = None):
        self.api = {url: completion_json for url in PREFILLS + DECODES} | (api or {})
        self.health = {url: 200 for url in PREFILLS + DECODES}
        self.requests: list[httpx.Request] = []

    def handle(self, request: httpx.Request) -> httpx.Response:
        url = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        if request.url.path == "/health":
            status = self.health[url]
            if status is None:
                raise httpx.ConnectError("connection refused", request=request)
            return httpx.Response(status, json={})
        self.requests.append(request)
        return self.api[url](request)

    def router(self, **kw) -> TestClient:
        app = build_router_app(
            PREFILLS,
            DECODES,
            health_interval_s=3600,
            transport=httpx.MockTransport(self.handle),
            **kw,
        )
        return TestClient(app)


def served_by(fleet: Fleet) -> list[str]:
    return [request.url.host for request in fleet.requests]


def test_round_robin_across_decodes_with_the_prefill_named_in_a_header():
    fleet = Fleet()
    raw = json.dumps(COMPLETION, separators=(",", ":")).encode()
    with fleet.router() as client:
        for _ in range(4):
            response = client.post(
                "/v1/completions", content=raw, headers={"authorization": "Bearer k"}
            )
            assert response.status_code == 200
    assert served_by(fleet) == ["decode-0", "decode-1", "decode-0", "decode-1"]
    assert [r.headers[PREFILL_URL_HEADER] for r in fleet.requests] == PREFILLS * 2
    for request in fleet.requests:
        assert request.content == raw  # forwarded unchanged
        assert request.headers["authorization"] == "Bearer k"
        assert request.url.path == "/v1/completions"


def test_non_streaming_relay_keeps_status_and_body():
    answers = iter(
        [
            httpx.Response(200, json={"id": "cmpl-1", "choices": [{"text": "yes"}]}),
            httpx.Response(400, json={"error": {"message": "bad", "code": 400}}),
        ]
    )
    fleet = Fleet({url: lambda _: next(answers) for url in DECODES})
    with fleet.router() as client:
        ok = client.post("/v1/chat/completions", json={"messages": []})
        bad = client.post("/v1/chat/completions", json={"messages": []})
    assert ok.status_code == 200 and ok.json() == {"id": "cmpl-1", "choices": [{"text": "yes"}]}
    assert bad.status_code == 400 and bad.json() == {"error": {"message": "bad", "code": 400}}
    assert fleet.requests[0].url.path == "/v1/chat/completions"


def sse(events: list[bytes], then: Exception | None = None) -> Callable:
    """A handler answering with ``events`` one chunk at a time, then raising ``then``."""

    def handler(_: httpx.Request) -> httpx.Response:
        async def chunks():
            for event in events:
                yield event
            if then is not None:
                raise then

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=chunks())

    return handler


def test_streaming_relays_every_chunk_in_order():
    fleet = Fleet({url: sse(EVENTS) for url in DECODES})
    stream_request = {"stream": True} | COMPLETION
    with (
        fleet.router() as client,
        client.stream("POST", "/v1/completions", json=stream_request) as response,
    ):
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        body = b"".join(response.iter_bytes())
    assert body == b"".join(EVENTS)


async def call_asgi(app, body: dict, receive_after_body: Callable, send: Callable) -> None:
    """POST ``body`` to /v1/completions straight through ASGI, with the lifespan running
    (TestClient and ASGITransport buffer whole responses, hiding how they are sent)."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.4"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json")],
        "client": ("test", 1),
        "server": ("router", 80),
    }
    body_sent = False

    async def receive():
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
        return await receive_after_body()

    async with app.router.lifespan_context(app):
        await app(scope, receive, send)


def test_streaming_relays_each_event_before_the_next_arrives():
    """No buffering: the decode sends its second event only after the client got the first."""
    first_relayed = asyncio.Event()

    def handler(_: httpx.Request) -> httpx.Response:
        async def chunks():
            yield EVENTS[0]
            await asyncio.wait_for(first_relayed.wait(), timeout=5)
            yield EVENTS[-1]

        return httpx.Response(200, content=chunks())

    app = build_router_app(
        PREFILLS,
        DECODES,
        health_interval_s=3600,
        transport=httpx.MockTransport(Fleet({DECODES[0]: handler}).handle),
    )
    bodies: list[bytes] = []

    async def send(message):
        if message["type"] == "http.response.body" and message.get("body"):
            bodies.append(message["body"])
            first_relayed.set()

    asyncio.run(call_asgi(app, COMPLETION | {"stream": True}, asyncio.Event().wait, send))
    assert bodies == [EVENTS[0], EVENTS[-1]]


def test_client_disconnect_cancels_the_decode_request():
    """The decode answers a non-streaming request only when done; a client that leaves first
    gets its request cancelled upstream."""
    decode_started, cancelled = asyncio.Event(), []

    async def slow(request: httpx.Request) -> httpx.Response:
        decode_started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(request.url.host)
            raise
        return httpx.Response(200, json={})

    async def disconnect_once_decode_started():
        await decode_started.wait()
        return {"type": "http.disconnect"}

    app = build_router_app(
        PREFILLS,
        DECODES,
        health_interval_s=3600,
        transport=httpx.MockTransport(Fleet({DECODES[0]: slow}).handle),
    )
    statuses: list[int] = []

    async def send(message):
        if message["type"] == "http.response.start":
            statuses.append(message["status"])

    asyncio.run(
        asyncio.wait_for(
            call_asgi(app, COMPLETION, disconnect_once_decode_started, send), timeout=5
        )
    )
    assert statuses == [499]
    assert cancelled == ["decode-0"]


def test_upstream_error_on_a_streaming_request_is_relayed_as_json():
    error = {
        "error": {
            "message": "prompt is empty",
            "type": "invalid_request_error",
            "param": None,
            "code": 400,
        }
    }
    fleet = Fleet({url: lambda _: httpx.Response(400, json=error) for url in DECODES})
    with fleet.router() as client:
        response = client.post("/v1/completions", json=COMPLETION | {"stream": True})
    assert response.status_code == 400
    assert response.headers["content-type"].startswith("application/json")
    assert response.json() == error


def test_dead_decode_is_retried_on_the_other_and_reported_unhealthy():
    # decode-0 passed its last health check, then died: its next request cannot connect.
    fleet = Fleet({DECODES[0]: refuse})
    with fleet.router() as client:
        first = client.post("/v1/completions", json=COMPLETION)
        second = client.post("/v1/completions", json=COMPLETION)
        instances = client.get("/router/instances").json()
        health = client.get("/health")
    assert first.status_code == second.status_code == 200
    assert first.json()["served_by"] == second.json()["served_by"] == "decode-1"
    assert served_by(fleet) == ["decode-0", "decode-1", "decode-1"]  # decode-0 tried once
    healthy = {(i["role"], i["url"]): i["healthy"] for i in instances}
    assert healthy == {
        ("prefill", PREFILLS[0]): True,
        ("prefill", PREFILLS[1]): True,
        ("decode", DECODES[0]): False,
        ("decode", DECODES[1]): True,
    }
    assert health.status_code == 200


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_no_healthy_instance_of_a_role_is_503_naming_it(role):
    fleet = Fleet()
    for url in PREFILLS if role == "prefill" else DECODES:
        fleet.health[url] = None  # unreachable at the startup health check
    with fleet.router() as client:
        response = client.post("/v1/completions", json=COMPLETION)
        health = client.get("/health")
    assert response.status_code == 503
    error = response.json()["error"]
    assert error["code"] == 503 and f"no healthy {role} instance" in error["message"]
    assert fleet.requests == []
    assert health.status_code == 503 and role in health.json()["reason"]


def test_every_decode_failing_to_connect_is_503_naming_decode():
    fleet = Fleet({url: refuse for url in DECODES})
    with fleet.router() as client:
        response = client.post("/v1/completions", json=COMPLETION)
    assert response.status_code == 503
    assert "no healthy decode instance" in response.json()["error"]["message"]
    assert served_by(fleet) == ["decode-0", "decode-1"]


def test_a_request_is_retried_only_once():
    decodes = [*DECODES, "http://decode-2:8000"]
    fleet = Fleet({DECODES[0]: refuse, DECODES[1]: refuse, decodes[2]: completion_json})
    fleet.health[decodes[2]] = 200
    app = build_router_app(
        PREFILLS, decodes, health_interval_s=3600, transport=httpx.MockTransport(fleet.handle)
    )
    with TestClient(app) as client:
        failed = client.post("/v1/completions", json=COMPLETION)
        retried_elsewhere = client.post("/v1/completions", json=COMPLETION)
    assert failed.status_code == 502
    assert all(url in failed.json()["error"]["message"] for url in DECODES)
    assert retried_elsewhere.json()["served_by"] == "decode-2"
    assert served_by(fleet) == ["decode-0", "decode-1", "decode-2"]


@pytest.mark.parametrize(
    "then", [httpx.ReadError("connection reset"), None], ids=["raises", "closes-early"]
)
def test_mid_stream_failure_ends_with_an_error_event_then_done(then):
    # The second event is cut off half-way: only whole events reach the client.
    fleet = Fleet({url: sse([EVENTS[0], b'data: {"choi'], then) for url in DECODES})
    with fleet.router() as client:
        response = client.post("/v1/completions", json=COMPLETION | {"stream": True})
    assert response.status_code == 200
    events = response.content.split(b"\n\n")
    assert events[0] + b"\n\n" == EVENTS[0]
    error = json.loads(events[1].removeprefix(b"data: "))["error"]
    assert error["code"] == 502 and DECODES[0] in error["message"]
    assert events[2:] == [b"data: [DONE]", b""]


def test_non_streaming_decode_failure_while_answering_is_502():
    def broken(_: httpx.Request) -> httpx.Response:
        async def chunks():
            yield b'{"id": '
            raise httpx.ReadError("connection reset")

        return httpx.Response(200, content=chunks())

    fleet = Fleet({url: broken for url in DECODES})
    with fleet.router() as client:
        response = client.post("/v1/completions", json=COMPLETION)
    assert response.status_code == 502
    error = response.json()["error"]
    assert error["code"] == 502 and DECODES[0] in error["message"]


def test_health_check_marks_an_instance_healthy_again_after_it_recovers():
    fleet = Fleet()
    fleet.health[DECODES[0]] = None
    fleet.health[DECODES[1]] = 503
    with fleet.router() as client:
        state = client.app.state.router
        assert client.get("/health").status_code == 503
        assert client.post("/v1/completions", json=COMPLETION).status_code == 503
        fleet.health[DECODES[1]] = 200
        client.portal.call(state.check_health_once)
        assert client.get("/health").status_code == 200
        response = client.post("/v1/completions", json=COMPLETION)
        instances = client.get("/router/instances").json()
    assert response.status_code == 200 and response.json()["served_by"] == "decode-1"
    assert [i["healthy"] for i in instances if i["role"] == "decode"] == [False, True]


@pytest.mark.parametrize("body", [b'{"prompt": "hi"', b"[1, 2]", b"\xff"])
def test_malformed_json_is_400_and_not_forwarded(body):
    fleet = Fleet()
    with fleet.router() as client:
        response = client.post(
            "/v1/completions", content=body, headers={"content-type": "application/json"}
        )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == 400 and error["type"] == "invalid_request_error"
    assert "JSON" in error["message"]
    assert fleet.requests == []


def test_models_are_proxied_from_a_decode_instance():
    models = {"object": "list", "data": [{"id": "m", "object": "model"}]}
    fleet = Fleet({url: lambda _: httpx.Response(200, json=models) for url in DECODES})
    with fleet.router() as client:
        response = client.get("/v1/models", headers={"authorization": "Bearer k"})
    assert response.status_code == 200 and response.json() == models
    assert fleet.requests[0].url.path == "/v1/models"
    assert fleet.requests[0].headers["authorization"] == "Bearer k"


def test_the_router_s_own_errors_are_in_openai_s_schema():
    fleet = Fleet()
    with fleet.router(max_request_body_bytes=1000) as client:
        missing = client.get("/v1/no-such-route")
        wrong_method = client.get("/v1/completions")
        oversized = client.post("/v1/completions", json={"prompt": "x" * 2000})
    for response, status in ((missing, 404), (wrong_method, 405), (oversized, 413)):
        assert response.status_code == status
        error = response.json()["error"]
        assert error["code"] == status and set(error) == {"message", "type", "param", "code"}
    assert "1000 bytes" in oversized.json()["error"]["message"]
    assert fleet.requests == []  # nothing was forwarded
