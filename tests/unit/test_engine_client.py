"""The server's engine client never waits forever on an engine core that has exited: a
ZeroMQ PUSH socket whose peer is gone blocks every send, so a send checks the processes
while it waits (the two-rank serving test kills a rank for the whole path). Its reader
takes a core that sends no heartbeat for the stall timeout, or one stuck in a step past the
step timeout, for dead: it fails every request and says so once (the server then exits)."""

import asyncio
import os
import time
from types import SimpleNamespace

import pytest
import zmq

from tandem.llm import engine_config
from tandem.messages import AbortRequests, Heartbeat
from tandem.server.engine_client import SEND_CHECK_S, AsyncEngineClient, EngineDeadError


def _process(alive: bool) -> SimpleNamespace:
    return SimpleNamespace(
        name="rank", is_alive=lambda: alive, join=lambda timeout=None: None, kill=lambda: None
    )


NO_TOKENIZER = SimpleNamespace(end_token_ids=frozenset())  # nothing here detokenizes


@pytest.fixture
def client():
    """A client whose core was never started: nothing reads what it sends."""
    client = AsyncEngineClient(
        engine_config(model="dummy:tiny", device="cpu"),
        NO_TOKENIZER,
        stall_timeout_s=1.0,
        step_timeout_s=2.0,
    )
    yield client
    client._to_core.close(linger=0)
    client._from_core.close(linger=0)
    client._context.term()
    client.remove_socket_dir()


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


def _watch(client, beats: list[float], interval_s: float):
    """Run the client's reader with one request waiting while a fake core sends a heartbeat
    of each turn age in ``beats``, then nothing; the request's first item, the seconds from
    the last beat to it, and what ``on_dead`` was told."""
    client._processes = [_process(alive=True)]
    deaths: list[str] = []
    client.on_dead = deaths.append
    context = zmq.Context()
    core = context.socket(zmq.PUSH)
    core.connect(client._output_address)

    async def run():
        queue: asyncio.Queue = asyncio.Queue()
        client._queues["req-0"] = queue
        client._last_heard = time.monotonic()
        reader = asyncio.create_task(client._read_results())
        for turn_age_s in beats:
            core.send(Heartbeat(turn_age_s).encode())
            await asyncio.sleep(interval_s)
            if client.dead is not None:
                break
            assert queue.empty(), "a live core's request failed"
        last_beat = time.monotonic() - interval_s
        item = await asyncio.wait_for(queue.get(), 10)
        await asyncio.wait_for(reader, 10)
        return item, time.monotonic() - last_beat

    try:
        item, waited_s = asyncio.run(run())
    finally:
        core.close(linger=0)
        context.term()
    return item, waited_s, deaths


def test_heartbeats_keep_a_quiet_core_live_and_silence_fails_its_requests(client):
    # Beats for three stall timeouts; then silence: dead within the bound.
    item, waited_s, deaths = _watch(client, [0.05] * 12, interval_s=0.25)
    assert isinstance(item, EngineDeadError) and "stalled" in str(item), item
    assert client.stall_timeout_s <= waited_s < client.stall_timeout_s + 1.0
    assert deaths == [client.dead] and "no heartbeat" in client.dead


def test_a_core_stuck_in_one_step_is_dead_while_it_still_beats(client):
    item, waited_s, deaths = _watch(client, [0.5, 1.0, 1.5, 2.5, 3.0], interval_s=0.25)
    assert isinstance(item, EngineDeadError) and "stuck" in str(item), item
    assert deaths == [client.dead] and "2.5 s" in client.dead


def test_stall_timeout_must_cover_two_heartbeats():
    with pytest.raises(ValueError, match="stall_timeout_s"):
        AsyncEngineClient(
            engine_config(model="dummy:tiny", device="cpu"), NO_TOKENIZER, stall_timeout_s=0.1
        )


def test_shutdown_removes_the_socket_folder(client):
    assert os.path.isdir(client._socket_dir)
    client._processes = [_process(alive=False)]
    asyncio.run(asyncio.wait_for(client.shutdown(), 10 * SEND_CHECK_S))
    assert not os.path.exists(client._socket_dir)
