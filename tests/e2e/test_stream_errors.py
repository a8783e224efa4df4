"""A stream that fails after its 200 ends with an error event in OpenAI's error schema and
then ``data: [DONE]`` (issue 19): a request failed by a fault while its outputs are
processed, an unexpected exception while shaping a chunk, and an engine core that dies
mid-stream. The app runs in this process (``build_app`` over a real engine client and core
process), so a test can inject the fault where it wants it; nothing in the server exists
for the tests."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tandem.llm import engine_config
from tandem.server.app import build_app
from tandem.server.engine_client import AsyncEngineClient
from tandem.server.openai_serving import RequestRun

pytestmark = pytest.mark.slow  # an engine core process for the module

MODEL = "tandem-test"
# A fault whose message holds a source path: the client must never see it.
FAULT = "injected fault in /work/secret/tandem/thing.py, line 12"
BODIES = {
    "completions": {"model": MODEL, "prompt": "Count: one, two,", "max_tokens": 8},
    "chat/completions": {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Count to ten."}],
        "max_tokens": 8,
    },
}
GREEDY = {"temperature": 0, "ignore_eos": True}


class Served:
    """An in-process app over a real engine client, driven on one event loop."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.client = AsyncEngineClient(engine_config(None, max_model_len=128))
        self.loop.run_until_complete(self.client.start())
        self.app = build_app(self.client, MODEL)

    def post(self, path: str, body: dict) -> httpx.Response:
        async def send() -> httpx.Response:
            transport = httpx.ASGITransport(app=self.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://tandem") as http:
                return await http.post(f"/v1/{path}", json=body, timeout=120)

        return self.loop.run_until_complete(send())

    def close(self) -> None:
        self.loop.run_until_complete(self.client.shutdown())
        self.loop.close()


@pytest.fixture(scope="module")
def served():
    served = Served()
    yield served
    served.close()


def fail_updates_of(served: Served, monkeypatch, prompt_token_count: int, action) -> None:
    """Make the API process's output processor call ``action`` (which may raise) on each
    update of the request whose prompt has ``prompt_token_count`` tokens, from its second
    update on (so that its stream has begun)."""
    processor = served.client.processor
    apply_update = processor._apply_update
    seen: dict[str, int] = {}

    def faulty(state, update, *args):
        if len(state.prompt_token_ids) == prompt_token_count:
            seen[state.request_id] = seen.get(state.request_id, 0) + 1
            if seen[state.request_id] >= 2:
                action()
        return apply_update(state, update, *args)

    monkeypatch.setattr(processor, "_apply_update", faulty)


def raise_fault() -> None:
    raise RuntimeError(FAULT)


def stream_events(response: httpx.Response) -> list:
    """The stream's event payloads (``"[DONE]"`` as is), checking the framing."""
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    blocks = [b for b in response.text.split("\n\n") if b]
    assert all(b.startswith("data: ") for b in blocks), blocks
    return [b[6:] if b[6:] == "[DONE]" else json.loads(b[6:]) for b in blocks]


def assert_error_then_done(events: list, kind: str, code: int) -> dict:
    """The stream ends with one error event (OpenAI's schema, no internal path) and
    [DONE]; the chunks before it are ordinary ones."""
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1], events
    error_event = events[-2]
    assert set(error_event) == {"error"}, events
    error = error_event["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == kind and error["code"] == code, error
    assert "/work" not in error["message"] and "thing.py" not in error["message"], error
    assert all("choices" in e for e in events[:-2]), events
    return error


def prompt_length(served: Served, path: str) -> int:
    """The prompt token count of BODIES[path], as the server counts it (from usage)."""
    body = {**BODIES[path], **GREEDY, "max_tokens": 1}
    response = served.post(path, body)
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens"]


@pytest.mark.parametrize("path", list(BODIES))
def test_a_request_failed_mid_stream_ends_with_an_error_event_then_done(served, monkeypatch, path):
    expected = served.post(path, {**BODIES[path], **GREEDY}).json()
    fail_updates_of(served, monkeypatch, prompt_length(served, path), raise_fault)
    events = stream_events(served.post(path, {**BODIES[path], **GREEDY, "stream": True}))
    error = assert_error_then_done(events, "server_error", 502)
    assert "injected fault" in error["message"]
    assert any(e["choices"] for e in events[:-2]), "the fault came after the stream began"
    # Without streaming the same fault is a 502 in the same schema...
    response = served.post(path, {**BODIES[path], **GREEDY})
    assert response.status_code == 502
    assert response.json()["error"]["code"] == 502
    assert "/work" not in response.json()["error"]["message"]
    # ...and the server serves the next request as before.
    monkeypatch.undo()
    again = served.post(path, {**BODIES[path], **GREEDY}).json()
    assert again["choices"][0] == expected["choices"][0]


def test_an_unexpected_error_while_shaping_a_chunk_ends_the_stream_with_an_error(
    served, monkeypatch
):
    choice = RequestRun._choice
    calls = []

    def failing_choice(self, *args, **kwargs):
        calls.append(1)
        if len(calls) >= 2:
            raise KeyError(FAULT)
        return choice(self, *args, **kwargs)

    monkeypatch.setattr(RequestRun, "_choice", failing_choice)
    body = {**BODIES["completions"], **GREEDY, "stream": True}
    events = stream_events(served.post("completions", body))
    error = assert_error_then_done(events, "server_error", 500)
    assert error["message"] == "internal server error"
    assert len(events) == 3  # one chunk, the error, [DONE]


def test_a_core_that_dies_mid_stream_ends_the_stream_with_an_error(served, monkeypatch):
    """Last in the module: it leaves the engine dead."""
    path = "chat/completions"
    length = prompt_length(served, path)
    processes = served.client._processes
    fail_updates_of(served, monkeypatch, length, lambda: [p.kill() for p in processes])
    body = {**BODIES[path], **GREEDY, "max_tokens": 100, "stream": True}
    events = stream_events(served.post(path, body))
    error = assert_error_then_done(events, "service_unavailable", 503)
    assert "exited" in error["message"]
    transport = httpx.ASGITransport(app=served.app)

    async def health() -> int:
        async with httpx.AsyncClient(transport=transport, base_url="http://tandem") as http:
            return (await http.get("/health")).status_code

    assert served.loop.run_until_complete(health()) == 503
