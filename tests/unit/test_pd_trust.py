"""PD trust (issue 19): control frames are signed and checked before anything is decoded
(forged, tampered, stale and replayed frames are dropped, and the requests they name go
on); every control message field is type- and range-checked; a decode instance honours a
prefill URL only with the router's signature; a prefill address is asked again after a
failure or once it is old, so a restarted prefill instance is used again."""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time

import httpx
import msgpack
import pytest

from tandem.disagg.control import (
    REPLAY_WINDOW_S,
    ControlChannel,
    FrameError,
    ReplayGuard,
    open_frame,
    sign_frame,
)
from tandem.disagg.decode_role import DecodeRole
from tandem.disagg.trust import (
    PREFILL_SIGNATURE_HEADER,
    SECRET_ENV,
    TrustError,
    derive_key,
    prefill_url_signed,
    require_secret,
    resolve_secret,
    sign_prefill_url,
)
from tandem.messages import (
    TO_DECODE,
    TO_PREFILL,
    KVFailed,
    KVReady,
    MessageError,
    PrefillStarted,
    decode,
)
from tandem.request import Request
from tandem.sampling_params import SamplingParams
from tandem.server.app import PrefillAddresses, build_app
from tandem.server.protocol import PREFILL_URL_HEADER
from tests.unit.test_pd_role_faults import FakeChannel, FakeConnector, _core
from tests.unit.test_server_limits import FakeClient

KEY = derive_key("unit-test-shared-secret", "control")


def _receive(channel: ControlChannel, count: int, timeout_s: float = 5.0) -> list:
    received, deadline = [], time.monotonic() + timeout_s
    while len(received) < count and time.monotonic() < deadline:
        received += channel.receive(50)
    received += channel.receive(200)  # nothing more may come
    return received


# ---- the signed frame ----------------------------------------------------------------------


def test_forged_tampered_stale_and_replayed_frames_are_dropped_and_good_ones_pass(caplog):
    receiver = ControlChannel("127.0.0.1", 0, TO_DECODE, KEY)
    sender = ControlChannel("127.0.0.1", 0, TO_PREFILL, KEY)
    try:
        assert sender.send(receiver.address, PrefillStarted("first"))
        socket = sender._sender._peers[receiver.address]
        body = KVFailed("victim", "forged").encode()
        good = sign_frame(KEY, body)
        tampered = good[:-1] + bytes([good[-1] ^ 1])
        for frame in (
            body,  # unsigned
            sign_frame(derive_key("another-deployment-secret", "control"), body),
            tampered,
            good[:20],  # shorter than a header
            sign_frame(KEY, body, now_s=time.time() - 2 * REPLAY_WINDOW_S),  # stale
        ):
            socket.send(frame)
        socket.send(good)
        socket.send(good)  # a replay of a frame it took
        assert sender.send(receiver.address, PrefillStarted("last"))
        with caplog.at_level(logging.WARNING, logger="tandem.disagg"):
            received = _receive(receiver, 3)
        assert received == [
            PrefillStarted("first"),
            KVFailed("victim", "forged"),
            PrefillStarted("last"),
        ]
        log = caplog.text
        for reason in ("bad signature", "shorter than", "outside the", "replay"):
            assert reason in log, reason
        assert log.count("dropped a message") == 6
    finally:
        sender.close()
        receiver.close()


def test_the_replay_guard_forgets_tags_only_after_they_can_no_longer_pass():
    guard = ReplayGuard(window_s=10)
    guard.check(b"a", sent_s=100.0, now_s=100.0)
    with pytest.raises(FrameError, match="replay"):
        guard.check(b"a", sent_s=100.0, now_s=105.0)
    with pytest.raises(FrameError, match="outside"):
        guard.check(b"a", sent_s=100.0, now_s=111.0)
    guard.check(b"b", sent_s=130.0, now_s=130.0)  # prunes "a": it expired at 120
    assert list(guard._expiry) == [b"b"]


def test_open_frame_checks_the_tag_before_decoding_anything():
    frame = sign_frame(KEY, b"\xc1 not msgpack")
    assert open_frame(KEY, frame, ReplayGuard()) == b"\xc1 not msgpack"
    with pytest.raises(FrameError, match="bad signature"):
        open_frame(derive_key("unit-test-shared-secret", "other use"), frame, ReplayGuard())


# ---- every field checked ---------------------------------------------------------------------


def _frame(kind: str, fields: dict) -> bytes:
    return msgpack.packb([kind, fields], use_bin_type=True)


TASK = {"request_id": "d/a", "prompt_token_ids": [1, 2], "params": {}, "reply_to": "tcp://h:1"}
READY = {"request_id": "d/a", "token_id": 5, "logprobs": [], "prompt_logprobs": []}
HANDOFF = {"drafts": [1], "draft_probs": None, "draft_probs_shape": None, "seed": None}


@pytest.mark.parametrize(
    "frame,expected,problem",
    [
        (_frame("prefill", {**TASK, "prompt_token_ids": []}), TO_PREFILL, "empty"),
        (_frame("prefill", {**TASK, "prompt_token_ids": [1, -1]}), TO_PREFILL, "outside"),
        (_frame("prefill", {**TASK, "prompt_token_ids": [1, "2"]}), TO_PREFILL, "prompt_token_ids"),
        (_frame("prefill", {**TASK, "prompt_token_ids": [2**40]}), TO_PREFILL, "outside"),
        (_frame("prefill", {**TASK, "dst_blocks": [0, -3]}), TO_PREFILL, "dst_blocks"),
        (_frame("prefill", {**TASK, "dst_blocks": [True]}), TO_PREFILL, "dst_blocks"),
        (_frame("prefill", {**TASK, "kv": {1: 2}}), TO_PREFILL, "prefill.kv"),
        (_frame("prefill", {**TASK, "timeout_s": math.nan}), TO_PREFILL, "timeout_s"),
        (_frame("prefill", {**TASK, "timeout_s": -1.0}), TO_PREFILL, "timeout_s"),
        (_frame("prefill", {**TASK, "reply_to": "http://evil"}), TO_PREFILL, "reply_to"),
        (_frame("prefill", {**TASK, "request_id": "x" * 600}), TO_PREFILL, "request_id"),
        (_frame("cancel", {"request_id": ""}), TO_PREFILL, "cancel.request_id"),
        (_frame("started", {"request_id": 3}), TO_DECODE, "started.request_id"),
        (_frame("kv_ready", {**READY, "token_id": -1}), TO_DECODE, "kv_ready.token_id"),
        (_frame("kv_ready", {**READY, "num_cached_tokens": -5}), TO_DECODE, "num_cached"),
        (
            _frame("kv_ready", {**READY, "logprobs": [[5, math.nan, 1, []]]}),
            TO_DECODE,
            "kv_ready.logprobs",
        ),
        (
            _frame("kv_ready", {**READY, "logprobs": [[5, -0.1, 0, []]]}),
            TO_DECODE,
            "kv_ready.logprobs",
        ),
        (
            _frame("kv_ready", {**READY, "handoff": {**HANDOFF, "drafts": ["a"]}}),
            TO_DECODE,
            "kv_ready.handoff",
        ),
        (
            _frame("kv_ready", {**READY, "handoff": {**HANDOFF, "drafts": [1] * 65}}),
            TO_DECODE,
            "drafts",
        ),
        (
            _frame("kv_ready", {**READY, "handoff": {**HANDOFF, "seed": 2**63}}),
            TO_DECODE,
            "handoff.seed",
        ),
        (
            _frame(
                "kv_ready",
                {
                    **READY,
                    "handoff": {**HANDOFF, "draft_probs": b"\0" * 7, "draft_probs_shape": [2]},
                },
            ),
            TO_DECODE,
            "draft_probs",
        ),
        (
            _frame("kv_ready", {**READY, "handoff": {**HANDOFF, "draft_probs": b"\0" * 8}}),
            TO_DECODE,
            "come together",
        ),
        (_frame("kv_failed", {"request_id": "a", "error": "e" * 70_000}), TO_DECODE, "error"),
    ],
)
def test_a_control_message_with_a_field_out_of_type_or_range_is_refused(frame, expected, problem):
    with pytest.raises(MessageError, match=re.escape(problem)):
        decode(frame, expected)


# ---- forged messages harm nothing ------------------------------------------------------------


def _decode_role_with_requests(*ids: str) -> tuple[DecodeRole, FakeChannel, object]:
    core = _core()
    core.arch = type("Arch", (), {"vocab_size": 100})()
    channel = FakeChannel()
    role = DecodeRole(core, channel, FakeConnector(), timeout_s=30)
    for request_id in ids:
        request = Request(request_id, [1, 2, 3], SamplingParams(max_tokens=4))
        request.remote_prefill = "tcp://prefill"
        core.scheduler.add_request(request)
    role.poll(wait=False)
    return role, channel, core


def test_forged_frames_end_no_request_and_a_genuine_answer_still_does():
    receiver = ControlChannel("127.0.0.1", 0, TO_DECODE, KEY)
    role, fake, core = _decode_role_with_requests("r")
    role.channel = receiver
    role._prefix = fake.address + "/"  # the ids the PrefillTask named
    attacker = ControlChannel(
        "127.0.0.1", 0, TO_PREFILL, derive_key("guessed-secret-xx", "control")
    )
    try:
        attacker.send(receiver.address, KVFailed("tcp://decode/r", "forged failure"))
        time.sleep(0.3)
        assert role.poll(wait=True) == []
        assert "r" in core.scheduler.receiving  # still waiting for its KV
        genuine = ControlChannel("127.0.0.1", 0, TO_PREFILL, KEY)
        try:
            genuine.send(receiver.address, KVFailed("tcp://decode/r", "real failure"))
            deadline, updates = time.monotonic() + 5, []
            while not updates and time.monotonic() < deadline:
                updates = role.poll(wait=True)
        finally:
            genuine.close()
        assert [(u.request_id, u.finish_reason) for u in updates] == [("r", "error")]
        assert "real failure" in updates[0].error
    finally:
        attacker.close()
        receiver.close()


def test_a_kv_ready_with_a_token_beyond_the_vocabulary_fails_only_its_request():
    role, channel, core = _decode_role_with_requests("bad", "good")
    channel.inbox = [KVReady("tcp://decode/bad", 100, [], [])]
    updates = role.poll(wait=False)
    assert [(u.request_id, u.finish_reason) for u in updates] == [("bad", "error")]
    assert "outside the vocabulary" in updates[0].error
    assert "good" in core.scheduler.receiving  # the other request waits on


# ---- the prefill URL: only the router's ------------------------------------------------------


def test_a_prefill_url_signature_is_the_routers_for_that_url_only():
    secret = "unit-test-shared-secret"
    signature = sign_prefill_url(secret, "http://p:1")
    assert prefill_url_signed(secret, "http://p:1", signature)
    assert not prefill_url_signed(secret, "http://evil:1", signature)
    assert not prefill_url_signed("another-shared-secret", "http://p:1", signature)
    assert not prefill_url_signed(secret, "http://p:1", None)
    assert not prefill_url_signed(None, "http://p:1", signature)


def test_the_secret_comes_from_the_flag_or_the_environment_and_is_not_short(monkeypatch):
    monkeypatch.setenv(SECRET_ENV, "from-the-environment")
    assert resolve_secret(None) == "from-the-environment"
    assert resolve_secret("from-the-command-line") == "from-the-command-line"
    with pytest.raises(TrustError, match="at least 16"):
        resolve_secret("short")
    monkeypatch.delenv(SECRET_ENV)
    assert resolve_secret(None) is None
    with pytest.raises(TrustError, match=SECRET_ENV):
        require_secret(None, "a decode instance")


class DecodeClient(FakeClient):
    def __init__(self):
        super().__init__(active=0)
        self.info = type(self.info)(128, 1000, 64, 16, "fake", "decode", "tcp://127.0.0.1:1")


@pytest.mark.parametrize("signature", [None, "0" * 64, "signed for another URL"])
def test_a_clients_prefill_url_is_refused_and_never_called(monkeypatch, signature):
    asked = []

    async def ask(self, url):
        asked.append(url)
        return "tcp://127.0.0.1:2"

    monkeypatch.setattr(PrefillAddresses, "_ask", ask)
    secret = "unit-test-shared-secret"
    app = build_app(DecodeClient(), "m", disagg_secret=secret)
    headers = {PREFILL_URL_HEADER: "http://169.254.169.254/"}
    if signature == "signed for another URL":
        signature = sign_prefill_url(secret, "http://127.0.0.1:8001")
    if signature is not None:
        headers[PREFILL_SIGNATURE_HEADER] = signature

    async def send():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post("/v1/completions", json={"prompt": "hi"}, headers=headers)

    response = asyncio.run(send())
    assert response.status_code == 403
    error = response.json()["error"]
    assert error["type"] == "permission_error" and error["param"] == PREFILL_URL_HEADER
    assert "only from the router" in error["message"]
    assert asked == []


# ---- a restarted prefill instance --------------------------------------------------------------


def test_a_prefill_address_is_asked_again_after_a_failure_or_once_old(monkeypatch):
    answers = iter(["tcp://h:1", "tcp://h:2", "tcp://h:3"])
    asked = []

    async def ask(self, url):
        asked.append(url)
        await asyncio.sleep(0.01)
        return next(answers)

    monkeypatch.setattr(PrefillAddresses, "_ask", ask)
    addresses = PrefillAddresses(DecodeClient(), "unit-test-shared-secret", ttl_s=0.2)

    async def scenario():
        # Concurrent requests share one question.
        first = await asyncio.gather(*(addresses.resolve("http://p") for _ in range(5)))
        assert first == ["tcp://h:1"] * 5 and len(asked) == 1
        addresses.forget("http://p")  # a request through it failed
        assert await addresses.resolve("http://p") == "tcp://h:2"
        await asyncio.sleep(0.25)  # old now
        assert await addresses.resolve("http://p") == "tcp://h:3"

    asyncio.run(scenario())
    assert len(asked) == 3
