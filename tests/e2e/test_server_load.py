"""The OpenAI-compatible server, end to end, under load: 200 concurrent streams, clients that
disconnect mid-stream and a non-streaming client that times out (each aborted request frees
everything, read back from /metrics).

One server runs for the module (fixtures: conftest.py; /metrics helpers: server_helpers.py).
"""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
from server_helpers import (
    AUTH,
    MODEL,
    PROMPT,
    assert_idle,
    async_client,
    metrics,
    successes,
    wait_until_idle,
)

pytestmark = pytest.mark.slow  # a server process for the module


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
