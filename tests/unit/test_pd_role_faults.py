"""Fault isolation in the PD roles (issue 19, hardening): a control message whose handling
raises is dropped with a log line and ends only its request (with an error, its blocks
freed); the engine core serves on."""

from __future__ import annotations

import logging
import threading
import time
from types import SimpleNamespace

from tandem.config import SchedulerConfig
from tandem.core.kv_cache import BlockManager
from tandem.core.scheduler import Scheduler
from tandem.disagg.decode_role import DecodeRole
from tandem.disagg.prefill_role import PrefillRole
from tandem.messages import KVFailed, KVReady, PrefillStarted, PrefillTask
from tandem.request import Request
from tandem.sampling_params import SamplingParams


class FakeSender:
    """A sender for another thread that records what it sends."""

    def __init__(self):
        self.sent: list = []
        self.closed = False

    def send(self, peer: str, message) -> bool:
        self.sent.append((peer, message))
        return True

    def close(self) -> None:
        self.closed = True


class FakeChannel:
    """A control channel that hands out queued messages (to any one thread) and records what
    is sent (by the engine loop in ``sent``, by the prefill inbox's thread in
    ``reporter.sent``)."""

    address = "tcp://decode"

    def __init__(self):
        self._lock = threading.Lock()
        self._inbox: list = []
        self.sent: list = []
        self.reporter = FakeSender()

    @property
    def inbox(self) -> list:
        return self._inbox

    @inbox.setter
    def inbox(self, messages: list) -> None:
        with self._lock:
            self._inbox = messages

    def receive(self, timeout_ms: int = 0) -> list:
        with self._lock:
            messages, self._inbox = self._inbox, []
        if not messages:
            time.sleep(timeout_ms / 1000)
        return messages

    def open_sender(self) -> FakeSender:
        return self.reporter

    def close(self) -> None:
        pass

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

    def close(self) -> None:
        pass


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


def _deliver(role: PrefillRole, channel: FakeChannel, *messages) -> list:
    """Hand ``messages`` to the prefill role's inbox thread, wait until it has received them,
    then run one turn of the role's loop; its updates."""
    received = role._inbox.num_received + len(messages)
    channel.inbox = list(messages)
    deadline = time.monotonic() + 10
    while role._inbox.num_received < received:
        assert time.monotonic() < deadline, "the inbox thread never took the messages"
        time.sleep(0.005)
    return role.poll(wait=False)


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
        with caplog.at_level(logging.ERROR):
            assert (
                _deliver(
                    role,
                    channel,
                    PrefillTask(
                        "tcp://decode/r", [1, 2, 3], SamplingParams(), reply_to="tcp://decode"
                    ),
                )
                == []
            )
        assert "dropped a prefill message" in caplog.text
        [(peer, answer)] = channel.sent
        assert peer == "tcp://decode" and isinstance(answer, KVFailed)
        assert "injected" in answer.error
        assert not core.scheduler.has_unfinished_requests() and not role.busy
        assert core.block_manager.all_blocks_free()
    finally:
        role.close()


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
        with caplog.at_level(logging.ERROR):
            _deliver(
                role,
                channel,
                PrefillTask("tcp://decode/r", [1, 2, 3], SamplingParams(), reply_to="tcp://decode"),
            )
        assert queued and "injected after queueing" in channel.sent[-1][1].error
        assert not core.scheduler.has_unfinished_requests() and not core.scheduler.held
        assert core.block_manager.all_blocks_free() and not role.busy
    finally:
        role.close()


def test_a_prefill_request_failed_by_a_fault_is_answered_with_its_error(monkeypatch):
    monkeypatch.setattr("tandem.disagg.prefill_role.check_compatible", lambda mine, theirs: None)
    core = _core()
    channel = FakeChannel()
    role = PrefillRole(core, channel, FakeConnector())
    try:
        _deliver(
            role,
            channel,
            PrefillTask("tcp://decode/r", [1, 2, 3], SamplingParams(), reply_to="tcp://decode"),
        )
        assert role.busy
        core.scheduler.schedule()  # it runs: its blocks are taken
        core.scheduler.fail_request("tcp://decode/r", "injected fault in its step")
        assert role.after_step(core.scheduler.take_failed_updates()) == []
        [(peer, answer)] = channel.sent
        assert isinstance(answer, KVFailed) and answer.error == "injected fault in its step"
        assert not role.busy and not core.scheduler.held
        assert core.block_manager.all_blocks_free()
    finally:
        role.close()


def test_a_held_prefill_request_is_reported_from_its_own_thread_until_answered(monkeypatch):
    """The decode side hears of a request on receipt and again every quarter of its timeout
    while it is held here, even while the engine loop does not come round (inside a long
    step); after the answer, no more; the thread ends and closes its sockets on close."""
    monkeypatch.setattr("tandem.disagg.prefill_role.check_compatible", lambda mine, theirs: None)
    core = _core()
    channel = FakeChannel()
    role = PrefillRole(core, channel, FakeConnector())
    try:
        task = PrefillTask(
            "tcp://decode/r", [1, 2, 3], SamplingParams(), reply_to="tcp://decode", timeout_s=0.4
        )
        _deliver(role, channel, task)
        time.sleep(0.55)  # the engine loop "in a step": no poll for longer than the timeout
        reports = list(channel.reporter.sent)
        assert reports[0] == ("tcp://decode", PrefillStarted("tcp://decode/r"))
        assert 3 <= len(reports) <= 7, reports  # on receipt, then every 0.1 s
        role._cancel("tcp://decode/r")  # answered (KVFailed) and dropped
        assert isinstance(channel.sent[-1][1], KVFailed)
        time.sleep(0.1)  # a report already taken before the answer may still land
        after_answer = len(channel.reporter.sent)
        time.sleep(0.3)
        assert len(channel.reporter.sent) == after_answer
    finally:
        role.close()
    assert not role._inbox.alive and channel.reporter.closed
