"""The server's engine client never waits forever on an engine core that has exited: a
ZeroMQ PUSH socket whose peer is gone blocks every send, so a send checks the processes
while it waits (the two-rank serving test kills a rank for the whole path)."""

import asyncio
from types import SimpleNamespace

import pytest

from tandem.llm import engine_config
from tandem.messages import AbortRequests
from tandem.server.engine_client import SEND_CHECK_S, AsyncEngineClient, EngineDeadError


def _process(alive: bool) -> SimpleNamespace:
    return SimpleNamespace(
        name="rank", is_alive=lambda: alive, join=lambda timeout=None: None, kill=lambda: None
    )


@pytest.fixture
def client():
    """A client whose core was never started: nothing reads what it sends."""
    client = AsyncEngineClient(engine_config(model="dummy:tiny", device="cpu"))
    yield client
    client._to_core.close(linger=0)
    client._from_core.close(linger=0)
    client._context.term()


def test_a_send_to_an_exited_core_fails_instead_of_waiting(client):
    client._processes = [_process(alive=True), _process(alive=False)]

    async def send():
        await client._send(AbortRequests(["req-0"]))

    with pytest.raises(EngineDeadError, match="exited"):
        asyncio.run(asyncio.wait_for(send(), 10 * SEND_CHECK_S))


def test_a_send_keeps_waiting_while_the_core_runs(client):
    client._processes = [_process(alive=True)]

    async def send():
        await client._send(AbortRequests(["req-0"]))

    with pytest.raises(TimeoutError):  # still waiting for a reader after three checks
        asyncio.run(asyncio.wait_for(send(), 3 * SEND_CHECK_S))


def test_shutdown_returns_when_the_leader_exits_before_reading(client):
    """The hang seen once: a process alive at the check, gone before it read "shutdown"."""
    client._processes = [_process(alive=True), _process(alive=False)]
    asyncio.run(asyncio.wait_for(client.shutdown(), 10 * SEND_CHECK_S))
