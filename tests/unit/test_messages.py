"""The typed process messages: every message survives its wire form unchanged, and a
malformed frame is refused with a MessageError that names the problem (never a crash, never
a half-built message)."""

from __future__ import annotations

import re
import time

import msgpack
import pytest

from tandem.disagg.control import ControlChannel, sign_frame
from tandem.messages import (
    TO_CLIENT,
    TO_DECODE,
    TO_ENGINE,
    TO_PREFILL,
    AbortRequests,
    AddRejected,
    AddRequest,
    EngineFailed,
    EngineInfo,
    EngineReady,
    FinishRequest,
    Handoff,
    Heartbeat,
    KVFailed,
    KVReady,
    KVTransferring,
    MessageError,
    PrefillCancel,
    PrefillStarted,
    PrefillTask,
    Shutdown,
    StepUpdates,
    Turn,
    decode,
)
from tandem.request import PromptLimits
from tandem.sampling_params import SamplingParams
from tandem.step import RequestUpdate

PARAMS = SamplingParams(
    temperature=0.7, top_k=5, seed=3, stop=["\n"], logprobs=2, eos_token_ids=frozenset({2, 7})
)
LOGPROBS = [(5, -0.25, 1, [(5, -0.25), (9, -1.5)])]

EXAMPLES = [
    (AddRequest("cmpl-1", [1, 2, 3], PARAMS, None), TO_ENGINE),
    (AddRequest("cmpl-2", [4], PARAMS, "tcp://127.0.0.1:5555"), TO_ENGINE),
    (AbortRequests(["a", "b"]), TO_ENGINE),
    (FinishRequest("a", "STOP"), TO_ENGINE),
    (Shutdown(), TO_ENGINE),
    (Turn([AddRequest("x", [1], PARAMS), AbortRequests(["y"]), Shutdown()]), TO_ENGINE),
    (EngineReady(EngineInfo(128, 1000, 64, 16, "model.gguf", "decode", "tcp://h:1")), TO_CLIENT),
    (EngineFailed("ValueError: no weights"), TO_CLIENT),
    (
        StepUpdates([RequestUpdate("a", [5], LOGPROBS, LOGPROBS, "stop", 2, 16, None)], {"n": 1}),
        TO_CLIENT,
    ),
    (AddRejected("a", "prompt is empty"), TO_CLIENT),
    (Heartbeat(0.25), TO_CLIENT),
    (PrefillTask("d/a", [1, 2], PARAMS, {"kind": "local"}, [3, 4], "tcp://h:2", 5.0), TO_PREFILL),
    (PrefillCancel("d/a"), TO_PREFILL),
    (PrefillStarted("d/a"), TO_DECODE),
    (KVTransferring("d/a"), TO_DECODE),
    (
        KVReady("d/a", 5, LOGPROBS, [], 0, Handoff([1, 2], b"\x00" * 8, [2, 1], 2**63 - 1)),
        TO_DECODE,
    ),
    (KVReady("d/a", 5, [], [], 16), TO_DECODE),
    (KVFailed("d/a", "cancelled"), TO_DECODE),
]


@pytest.mark.parametrize(
    "message,channel", EXAMPLES, ids=[type(message).__name__ for message, _ in EXAMPLES]
)
def test_every_message_round_trips_through_its_wire_form(message, channel):
    assert decode(message.encode(), channel) == message


def _frame(kind, fields) -> bytes:
    return msgpack.packb([kind, fields], use_bin_type=True)


GOOD_ADD = {"request_id": "a", "prompt_token_ids": [1], "params": {}}
GOOD_READY = {"request_id": "a", "token_id": 5, "logprobs": [], "prompt_logprobs": []}


@pytest.mark.parametrize(
    "frame,expected,problem",
    [
        (b"\xc1", TO_ENGINE, "msgpack"),
        (msgpack.packb("add"), TO_ENGINE, "[type, {fields}]"),
        (msgpack.packb(["add"]), TO_ENGINE, "[type, {fields}]"),
        (_frame("prefill", {}), TO_ENGINE, "unexpected message type 'prefill'"),
        (_frame("add", GOOD_ADD), TO_PREFILL, "unexpected message type 'add'"),
        (_frame("add", {"request_id": "a", "params": {}}), TO_ENGINE, "prompt_token_ids"),
        (_frame("add", {**GOOD_ADD, "request_id": 7}), TO_ENGINE, "add.request_id"),
        (_frame("add", {**GOOD_ADD, "prompt_token_ids": "1"}), TO_ENGINE, "add.prompt_token_ids"),
        (_frame("add", {**GOOD_ADD, "params": {"temperature": -1}}), TO_ENGINE, "temperature"),
        (_frame("add", {**GOOD_ADD, "params": {"bogus": 1}}), TO_ENGINE, "add.params"),
        (_frame("add", {**GOOD_ADD, "params": 3}), TO_ENGINE, "add.params"),
        (_frame("add", {**GOOD_ADD, "extra": 1}), TO_ENGINE, "unknown fields ['extra']"),
        (_frame("abort", {"request_ids": None}), TO_ENGINE, "abort.request_ids"),
        (_frame("turn", {"messages": [["prefill", {}]]}), TO_ENGINE, "turn.messages"),
        (_frame("kv_ready", {**GOOD_READY, "token_id": "5"}), TO_DECODE, "kv_ready.token_id"),
        (
            _frame("kv_ready", {**GOOD_READY, "logprobs": [[1]]}),
            TO_DECODE,
            "kv_ready.logprobs",
        ),
        (
            _frame("kv_ready", {**GOOD_READY, "handoff": {"x": 1}}),
            TO_DECODE,
            "kv_ready.handoff",
        ),
        (_frame("kv_failed", {"request_id": "a"}), TO_DECODE, "missing field 'error'"),
    ],
)
def test_a_malformed_frame_is_refused_naming_the_problem(frame, expected, problem):
    with pytest.raises(MessageError, match=re.escape(problem)):
        decode(frame, expected)


def test_the_control_channel_drops_malformed_messages_and_keeps_the_good_ones():
    key = b"k" * 32
    receiver = ControlChannel("127.0.0.1", 0, TO_DECODE, key)
    sender = ControlChannel("127.0.0.1", 0, TO_PREFILL, key)
    try:
        assert sender.send(receiver.address, KVFailed("a", "x"))
        socket = sender._sender._peers[receiver.address]
        socket.send(sign_frame(key, b"not msgpack \xc1"))
        socket.send(sign_frame(key, _frame("prefill", {"request_id": "forged"})))  # not taken here
        assert sender.send(receiver.address, PrefillStarted("b"))
        received, deadline = [], time.monotonic() + 5
        while len(received) < 2 and time.monotonic() < deadline:
            received += receiver.receive(100)
        assert received == [KVFailed("a", "x"), PrefillStarted("b")]
    finally:
        sender.close()
        receiver.close()


def test_the_api_and_the_core_apply_one_prompt_validation():
    limits = PromptLimits(max_model_len=8, vocab_size=100, num_kv_blocks=4, block_size=2)
    limits.validate([1, 2, 3])
    for prompt, problem in [
        ([], "empty"),
        ([1, 100], r"outside \[0, 100\)"),
        ([1, -1], r"outside \[0, 100\)"),
        ([1, True], r"outside \[0, 100\)"),
        ([1] * 8, "context is 8"),
    ]:
        with pytest.raises(ValueError, match=problem):
            limits.validate(prompt)
    small = PromptLimits(max_model_len=100, vocab_size=100, num_kv_blocks=2, block_size=2)
    with pytest.raises(ValueError, match="KV cache holds"):
        small.validate([1] * 4)  # 5 slots: 3 blocks
    info = EngineInfo(8, 100, 4, 2, "m")
    assert info.limits == limits
