"""Fault isolation in the PD roles (issue 19, hardening): a control message whose handling
raises is dropped with a log line and ends only its request (with an error, its blocks
freed); the engine core serves on."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from tandem.config import SchedulerConfig
from tandem.core.kv_cache import BlockManager
from tandem.core.scheduler import Scheduler
from tandem.disagg.decode_role import DecodeRole
from tandem.disagg.prefill_role import PrefillRole
from tandem.messages import KVFailed, KVReady, PrefillStarted, PrefillTask
from tandem.request import Request
from tandem.sampling_params import SamplingParams


class FakeChannel:
    """A control channel that hands out queued messages and records what is sent."""

    address = "tcp://decode"

    def __init__(self):
        self.inbox: list = []
        self.sent: list = []

    def receive(self, timeout_ms: int = 0) -> list:
        messages, self.inbox = self.inbox, []
        return messages

    def send(self, peer: str, message) -> bool:
        self.sent.append((peer, message))
        return True


class FakeConnector:
    """A KV connector whose descriptor is empty, or raises ``error`` if given."""

    def __init__(self, error: Exception | None = None):
        self.error = error

    def descriptor(self) -> dict:
        if self.error is not None:
            raise self.error
        return {}


def _core() -> SimpleNamespace:
    """The parts of an engine core the roles use, with no model (pipeline None: a handoff's
    insertion raises)."""
    block_manager = BlockManager(16, 4, False)
    scheduler = Scheduler(SchedulerConfig(), block_manager, 64)
    return SimpleNamespace(
        scheduler=scheduler,
        block_manager=block_manager,
        pipeline=None,
        add_request=scheduler.add_request,
        abort_request=scheduler.abort_request,
    )


def test_a_kv_ready_whose_insertion_raises_fails_its_request_and_frees_its_blocks(caplog):
    core = _core()
    channel = FakeChannel()
    role = DecodeRole(core, channel, FakeConnector(), timeout_s=30)
    request = Request("r", [1, 2, 3, 4, 5], SamplingParams(max_tokens=4))
    request.remote_prefill = "tcp://prefill"
    core.scheduler.add_request(request)
    assert role.poll(wait=False) == []
    assert isinstance(channel.sent[0][1], PrefillTask)
    assert not core.block_manager.all_blocks_free()  # reserved for the KV
    channel.inbox = [
        KVFailed("tcp://decode/unknown", "ignored: no such request"),
        KVReady("tcp://decode/r", 7, [], []),
    ]
    with caplog.at_level(logging.ERROR):
        updates = role.poll(wait=False)
    assert [(u.request_id, u.finish_reason) for u in updates] == [("r", "error")]
    assert "bad answer from the prefill instance" in updates[0].error
    assert "dropped a kv_ready message" in caplog.text
    assert not core.scheduler.has_unfinished_requests()
    assert core.block_manager.all_blocks_free() and not role.busy


def test_a_prefill_task_whose_start_raises_is_answered_failed(caplog):
    core = _core()
    channel = FakeChannel()
    role = PrefillRole(core, channel, FakeConnector(RuntimeError("injected")))
    try:
        channel.inbox = [
            PrefillTask("tcp://decode/r", [1, 2, 3], SamplingParams(), reply_to="tcp://decode")
        ]
        with caplog.at_level(logging.ERROR):
            assert role.poll(wait=False) == []
        assert "dropped a prefill message" in caplog.text
        [(peer, answer)] = channel.sent
        assert peer == "tcp://decode" and isinstance(answer, KVFailed)
        assert "injected" in answer.error
        assert not core.scheduler.has_unfinished_requests() and not role.busy
        assert core.block_manager.all_blocks_free()
    finally:
        role._pool.shutdown(wait=True)


def test_a_prefill_task_that_raises_once_queued_leaves_no_request_nor_block(caplog, monkeypatch):
    monkeypatch.setattr("tandem.disagg.prefill_role.check_compatible", lambda mine, theirs: None)
    core = _core()
    queued = []

    def add_then_raise(request):
        core.scheduler.add_request(request)
        queued.append(request)
        raise RuntimeError("injected after queueing")

    core.add_request = add_then_raise
    channel = FakeChannel()
    role = PrefillRole(core, channel, FakeConnector())
    try:
        channel.inbox = [
            PrefillTask("tcp://decode/r", [1, 2, 3], SamplingParams(), reply_to="tcp://decode")
        ]
        with caplog.at_level(logging.ERROR):
            role.poll(wait=False)
        assert queued and "injected after queueing" in channel.sent[-1][1].error
        assert not core.scheduler.has_unfinished_requests() and not core.scheduler.held
        assert core.block_manager.all_blocks_free() and not role.busy
    finally:
        role._pool.shutdown(wait=True)


def test_a_prefill_request_failed_by_a_fault_is_answered_with_its_error(monkeypatch):
    monkeypatch.setattr("tandem.disagg.prefill_role.check_compatible", lambda mine, theirs: None)
    core = _core()
    channel = FakeChannel()
    role = PrefillRole(core, channel, FakeConnector())
    try:
        channel.inbox = [
            PrefillTask("tcp://decode/r", [1, 2, 3], SamplingParams(), reply_to="tcp://decode")
        ]
        role.poll(wait=False)
        assert role.busy
        core.scheduler.schedule()  # it runs: its blocks are taken
        core.scheduler.fail_request("tcp://decode/r", "injected fault in its step")
        assert role.after_step(core.scheduler.take_failed_updates()) == []
        (peer, held), (_, answer) = channel.sent
        assert isinstance(held, PrefillStarted)  # held here: the decode side's clock restarts
        assert isinstance(answer, KVFailed) and answer.error == "injected fault in its step"
        assert not role.busy and not core.scheduler.held
        assert core.block_manager.all_blocks_free()
    finally:
        role._pool.shutdown(wait=True)


def test_a_held_prefill_request_is_reported_until_its_write_is_queued(monkeypatch):
    """The decode side hears of a request on acceptance and again every quarter of its
    timeout while it waits here (a busy or cold prefill instance is not a dead one)."""
    monkeypatch.setattr("tandem.disagg.prefill_role.check_compatible", lambda mine, theirs: None)
    clock = [100.0]
    monkeypatch.setattr("tandem.disagg.prefill_role.time.monotonic", lambda: clock[0])
    core = _core()
    channel = FakeChannel()
    role = PrefillRole(core, channel, FakeConnector())
    try:
        task = PrefillTask(
            "tcp://decode/r", [1, 2, 3], SamplingParams(), reply_to="tcp://decode", timeout_s=4.0
        )
        channel.inbox = [task]
        role.poll(wait=False)
        role.poll(wait=False)  # within the interval: nothing new
        clock[0] += 1.01
        role.poll(wait=False)
        reports = [m for _, m in channel.sent if isinstance(m, PrefillStarted)]
        assert [m.request_id for m in reports] == ["tcp://decode/r"] * 2
    finally:
        role._pool.shutdown(wait=True)
