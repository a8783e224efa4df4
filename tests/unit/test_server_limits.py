"""The server answers 503 (OpenAI error schema) when it is over its request limit or its
engine core is gone, without touching the engine."""

from __future__ import annotations

import asyncio

import httpx

from tandem.messages import EngineInfo
from tandem.server.app import build_app


class FakeClient:
    """Just enough of AsyncEngineClient for the capacity checks."""

    def __init__(self, active: int, dead: str | None = None):
        self.num_active_requests = active
        self.dead = dead
        self.info = EngineInfo(128, 1000, 64, 16, "fake")
        self.stats = {}

    async def start(self):  # pragma: no cover - lifespan is not run by these tests
        raise AssertionError("the engine must not start")


def _post(app, path: str, body: dict) -> httpx.Response:
    async def send():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post(path, json=body)

    return asyncio.run(send())


def test_over_the_request_limit_is_503():
    app = build_app(FakeClient(active=4), "m", max_pending_requests=4)
    for path, body in [
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ]:
        response = _post(app, path, body)
        assert response.status_code == 503
        error = response.json()["error"]
        assert error["code"] == 503 and "limit" in error["message"]


def test_dead_engine_is_503_and_unhealthy():
    app = build_app(FakeClient(active=0, dead="the engine core process exited"), "m")
    response = _post(app, "/v1/completions", {"prompt": "hi"})
    assert response.status_code == 503 and "exited" in response.json()["error"]["message"]

    async def health():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.get("/health")

    assert asyncio.run(health()).status_code == 503
