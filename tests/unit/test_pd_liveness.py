"""The prefill instance's inbox thread (``tandem.disagg.liveness``): a task that arrives
while the engine loop's thread is busy in torch kernels is received and reported over
signed frames at once and then every quarter of its timeout, and handed to the loop when it
comes round; an engine loop that has not come round for many timeouts is no longer reported;
the thread ends (closing its sockets) on close."""

from __future__ import annotations

import time

import torch

from tandem.disagg.control import ControlChannel
from tandem.disagg.liveness import STALLED_AFTER_TIMEOUTS, PrefillInbox
from tandem.disagg.trust import derive_key
from tandem.messages import TO_DECODE, TO_PREFILL, PrefillCancel, PrefillStarted, PrefillTask
from tandem.sampling_params import SamplingParams
from tests.unit.test_pd_role_faults import FakeChannel

KEY = derive_key("test-pd-liveness-shared-secret", "control")


def _received(channel: ControlChannel, for_s: float) -> list:
    messages, deadline = [], time.monotonic() + for_s
    while time.monotonic() < deadline:
        messages += channel.receive(20)
    return messages


def test_a_task_that_comes_during_a_long_step_is_reported_until_released():
    decode = ControlChannel("127.0.0.1", 0, TO_DECODE, KEY)
    prefill = ControlChannel("127.0.0.1", 0, TO_PREFILL, KEY)
    inbox = PrefillInbox(prefill, prefill.open_sender())
    try:
        task = PrefillTask(
            "d/r", [1, 2, 3], SamplingParams(), reply_to=decode.address, timeout_s=0.4
        )
        assert decode.send(prefill.address, task)
        start, x = time.monotonic(), torch.randn(256, 256)
        while time.monotonic() - start < 1.0:  # the engine loop in a long forward
            x = torch.tanh(x @ x)
        messages = _received(decode, 0.05)  # signed frames, all queued meanwhile
        assert set(messages) == {PrefillStarted("d/r")}
        assert len(messages) >= 4, len(messages)  # on receipt, then every 0.1 s
        [taken] = inbox.take(0.5)  # the loop comes round: the task is there
        assert taken.request_id == "d/r" and taken.timeout_s == 0.4
        inbox.release("d/r")  # answered
        _received(decode, 0.1)
        assert _received(decode, 0.3) == []
    finally:
        inbox.close()
        assert not inbox.alive
        prefill.close()  # returns: the thread closed its sockets
        decode.close()


def test_an_engine_loop_silent_for_many_timeouts_is_no_longer_reported():
    channel = FakeChannel()
    inbox = PrefillInbox(channel, channel.reporter)
    sent = channel.reporter.sent
    try:
        timeout_s = 0.05
        stalled_s = timeout_s * STALLED_AFTER_TIMEOUTS
        inbox.hold("r", "tcp://decode", timeout_s)
        time.sleep(stalled_s / 2)
        assert len(sent) >= 3  # silent for under the limit: a busy loop, still reported
        time.sleep(stalled_s / 2 + 0.1)
        stalled_at = len(sent)
        time.sleep(0.3)
        assert len(sent) == stalled_at  # silent past the limit: stuck, not reported
        assert inbox.take(0) == []  # the loop comes round
        time.sleep(0.1)
        assert len(sent) > stalled_at  # reported again
    finally:
        inbox.close()
    assert not inbox.alive and channel.reporter.closed


def test_a_cancelled_request_is_no_longer_reported():
    """The decode side gave up on it: the reports stop at once (its clock for the held
    blocks runs out), even before the engine loop comes round to the cancel."""
    channel = FakeChannel()
    inbox = PrefillInbox(channel, channel.reporter)
    sent = channel.reporter.sent
    try:
        channel.inbox = [PrefillTask("r", [1, 2], SamplingParams(), reply_to="d", timeout_s=0.2)]
        time.sleep(0.2)
        assert len(sent) >= 2
        channel.inbox = [PrefillCancel("r")]
        time.sleep(0.1)
        cancelled_at = len(sent)
        time.sleep(0.3)
        assert len(sent) == cancelled_at
        assert [type(m) for m in inbox.take(0)] == [PrefillTask, PrefillCancel]
    finally:
        inbox.close()
