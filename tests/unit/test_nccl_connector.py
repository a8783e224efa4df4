"""The nccl KV connector (torch.distributed point-to-point; gloo on the CPU): chosen blocks of
every layer reach the peer's chosen blocks exactly, nothing else changes, a dead or stalled
receiver makes a write fail within the timeout, and a dead sender ends only its own pair."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from contextlib import contextmanager

import msgpack
import pytest
import torch

from tandem.disagg.kv_connector import KVTransferError
from tandem.disagg.nccl_connector import NcclKVConnector
from tandem.disagg.nccl_transport import gather, layer_runs
from tandem.disagg.setup import make_kv_connector

NUM_LAYERS = 3
NUM_BLOCKS = 16
# Non-contiguous ids: runs (3, 10, 3) and (9, 2, 1).
SRC_BLOCKS = [3, 4, 5, 9]
DST_BLOCKS = [10, 11, 12, 2]
TIMEOUT_S = 2.0
# Seconds to wait for a child process's answer before failing instead of hanging.
CHILD_TIMEOUT_S = 30
DIED_EXITCODE = 17
# Where the sender's and the receiver's caches live: gloo on the CPU; NCCL from cuda:0 to
# cuda:1 (NCCL joins no two ranks on one GPU: that is the cuda_ipc connector's case).
PLACEMENTS = [
    pytest.param("cpu", id="cpu-gloo"),
    pytest.param("cuda", id="cuda-nccl", marks=pytest.mark.gpu),
]


def devices(placement: str) -> tuple[str, str, torch.dtype]:
    """(sender device, receiver device, dtype) of a placement."""
    if placement == "cpu":
        return "cpu", "cpu", torch.float32
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    return "cuda:0", "cuda:1", torch.bfloat16


def make_caches(
    seed: int, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> list[torch.Tensor]:
    """Random per-layer caches shaped (2, NUM_BLOCKS, block_size, num_kv_heads, head_dim)."""
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randn((2, NUM_BLOCKS, 4, 2, 8), generator=generator).to(dtype=dtype, device=device)
        for _ in range(NUM_LAYERS)
    ]


def layer_bytes(num_blocks: int, dtype: torch.dtype) -> int:
    """Bytes of K and V of ``num_blocks`` blocks of one layer of ``make_caches``."""
    return 2 * num_blocks * 4 * 2 * 8 * torch.empty((), dtype=dtype).element_size()


def apply_writes(
    dst_seed: int,
    writes: list[tuple[int, list[int], list[int]]],
    dtype: torch.dtype = torch.float32,
) -> list[torch.Tensor]:
    """The receiver's caches after each (src_seed, src_blocks, dst_blocks) write."""
    expected = make_caches(dst_seed, dtype)
    for src_seed, src_blocks, dst_blocks in writes:
        for src_cache, dst_cache in zip(make_caches(src_seed, dtype), expected, strict=True):
            dst_cache[:, dst_blocks] = src_cache[:, src_blocks]
    return expected


# ---- children (module-level so that spawned processes can import them) -------------------


def _receiver(conn, seed: int, device: str = "cpu", dtype: torch.dtype = torch.float32) -> None:
    """Register caches, publish the descriptor; answer "caches" with the caches, the number of
    pairs that joined and the number served now; close (twice) on "stop"."""
    connector = NcclKVConnector(timeout_s=TIMEOUT_S)
    caches = make_caches(seed, dtype, device)
    connector.register(caches)
    conn.send(msgpack.packb(connector.descriptor()))  # as it would travel over ZeroMQ
    while conn.recv() == "caches":
        if device != "cpu":
            torch.cuda.synchronize(device)
        conn.send(
            (
                [cache.cpu().float().numpy() for cache in caches],
                connector._server.add("pairs", 0),
                len(connector._receivers),
            )
        )
    connector.close()
    connector.close()
    conn.send("closed")


class _DiesMidTransfer(NcclKVConnector):
    """A sender whose process dies after announcing a transfer and sending its first layer."""

    def _send_layers(self, pair, src, per_message, deadline):
        cache = self.caches[0]
        index = torch.tensor(src, device=cache.device)
        first = gather(self.caches, layer_runs(len(self.caches), per_message)[0], index)
        pair.group.send([first], 1, 0).wait()
        if cache.is_cuda:  # the layer is through (NCCL's communicator is up on both sides)
            torch.cuda.synchronize(cache.device)
        os._exit(DIED_EXITCODE)


def _sender(
    conn,
    seed: int,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    dies: bool = False,
    message_bytes: int = 64 << 20,
) -> None:
    """For each (descriptor, src, dst) received, write and answer (status, message, seconds);
    close (twice) on "stop"."""
    connector_class = _DiesMidTransfer if dies else NcclKVConnector
    # The dying sender sends one layer per message (so it dies mid-transfer).
    connector = connector_class(
        timeout_s=TIMEOUT_S, serve=False, message_bytes=1 if dies else message_bytes
    )
    connector.register(make_caches(seed, dtype, device))
    if device != "cpu":  # write_blocks' precondition: the blocks' device work is complete
        torch.cuda.synchronize(device)
    while (message := conn.recv()) != "stop":
        peer, src_blocks, dst_blocks = message
        start = time.monotonic()
        try:
            connector.write_blocks(msgpack.unpackb(peer), src_blocks, dst_blocks)
            conn.send(("ok", "", time.monotonic() - start))
        except KVTransferError as error:
            conn.send(("error", str(error), time.monotonic() - start))
    connector.close()
    connector.close()
    conn.send("closed")


# ---- helpers -----------------------------------------------------------------------------


def _answer(conn, process):
    """The child's next message, failing (not hanging) when it is slow or has died."""
    if not conn.poll(CHILD_TIMEOUT_S):
        raise AssertionError(
            f"{process.name} sent nothing within {CHILD_TIMEOUT_S} s (exit code {process.exitcode})"
        )
    return conn.recv()


class Child:
    """A spawned child process and our end of its pipe."""

    def __init__(self, context, target, name: str, *args):
        self.conn, child_end = context.Pipe()
        self.process = context.Process(
            target=target, args=(child_end, *args), name=name, daemon=True
        )
        self.process.start()

    def ask(self, message):
        self.conn.send(message)
        return _answer(self.conn, self.process)

    def answer(self):
        return _answer(self.conn, self.process)

    def stop(self, exit_code: int | None = 0) -> None:
        """Ask for a clean close: the child answers "closed" and exits with ``exit_code``
        (None: any)."""
        assert self.ask("stop") == "closed"
        self.process.join(CHILD_TIMEOUT_S)
        assert not self.process.is_alive()
        assert exit_code is None or self.process.exitcode == exit_code

    def kill(self) -> None:
        if self.process.is_alive():
            os.kill(self.process.pid, signal.SIGCONT)
            self.process.kill()
        self.process.join(CHILD_TIMEOUT_S)


@contextmanager
def children(*specs):
    """Start (name, target, *args) children at once (imports overlap); kill what is left."""
    context = multiprocessing.get_context("spawn")
    started = [Child(context, target, name, *args) for name, target, *args in specs]
    try:
        yield started
    finally:
        for child in started:
            child.kill()


def _caches(receiver: Child) -> tuple[list[torch.Tensor], int, int]:
    """The receiver's caches (fp32), the pairs that joined it and those it serves now."""
    arrays, joined, served = receiver.ask("caches")
    return [torch.from_numpy(array) for array in arrays], joined, served


def _assert_caches(receiver: Child, expected: list[torch.Tensor], num_pairs: int) -> None:
    written, joined, _ = _caches(receiver)
    for layer, (got, want) in enumerate(zip(written, expected, strict=True)):
        assert torch.equal(got, want.float()), f"layer {layer}"
    assert joined == num_pairs


def _assert_a_fresh_receiver_works(sender: Child, fresh: Child, fresh_peer, dtype) -> None:
    """After a failed write, the same sender writes into another receiver (seed 3)."""
    status, message, _ = sender.ask((fresh_peer, SRC_BLOCKS, DST_BLOCKS))
    assert status == "ok", message
    _assert_caches(fresh, apply_writes(3, [(0, SRC_BLOCKS, DST_BLOCKS)], dtype), num_pairs=1)


# ---- tests -------------------------------------------------------------------------------


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_writes_chosen_blocks_exactly_twice_on_one_pair(placement):
    send_on, receive_on, dtype = devices(placement)
    with children(
        ("receiver", _receiver, 1, receive_on, dtype), ("sender", _sender, 0, send_on, dtype)
    ) as (receiver, sender):
        peer = receiver.answer()
        status, message, _ = sender.ask((peer, SRC_BLOCKS, DST_BLOCKS))
        assert status == "ok", message
        expected = apply_writes(1, [(0, SRC_BLOCKS, DST_BLOCKS)], dtype)
        _assert_caches(receiver, expected, num_pairs=1)
        # A second transfer reuses the pair: one contiguous run, another single block.
        second = ([0, 1, 15], [5, 6, 0])
        status, message, _ = sender.ask((peer, *second))
        assert status == "ok", message
        expected = apply_writes(1, [(0, SRC_BLOCKS, DST_BLOCKS), (0, *second)], dtype)
        _assert_caches(receiver, expected, num_pairs=1)
        sender.stop()
        receiver.stop()


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_two_senders_write_into_one_receiver(placement):
    send_on, receive_on, dtype = devices(placement)
    with children(
        ("receiver", _receiver, 1, receive_on, dtype),
        ("sender-a", _sender, 0, send_on, dtype),
        # B's 3 blocks go as two messages: layers 0-1, then layer 2 (A: one message).
        ("sender-b", _sender, 2, send_on, dtype, False, 2 * layer_bytes(3, dtype)),
    ) as (receiver, sender_a, sender_b):
        peer = receiver.answer()
        writes = {sender_a: (0, SRC_BLOCKS, DST_BLOCKS), sender_b: (2, [0, 1, 7], [4, 5, 14])}
        for sender, (_, src, dst) in writes.items():  # both in flight at once
            sender.conn.send((peer, src, dst))
        for sender in writes:
            status, message, _ = sender.answer()
            assert status == "ok", message
        _assert_caches(receiver, apply_writes(1, list(writes.values()), dtype), num_pairs=2)
        for child in (sender_a, sender_b, receiver):
            child.stop()


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_stalled_receiver_times_out_then_a_fresh_receiver_works(placement):
    send_on, receive_on, dtype = devices(placement)
    with children(
        ("stalled", _receiver, 1, receive_on, dtype),
        ("fresh", _receiver, 3, receive_on, dtype),
        ("sender", _sender, 0, send_on, dtype),
    ) as (stalled, fresh, sender):
        stalled_peer, fresh_peer = stalled.answer(), fresh.answer()
        assert sender.ask((stalled_peer, SRC_BLOCKS, DST_BLOCKS))[0] == "ok"  # the pair exists
        os.kill(stalled.process.pid, signal.SIGSTOP)  # alive, connected, answers nothing
        status, message, elapsed_s = sender.ask((stalled_peer, SRC_BLOCKS, DST_BLOCKS))
        assert status == "error"
        assert f"127.0.0.1:{msgpack.unpackb(stalled_peer)['port']}" in message
        assert TIMEOUT_S - 0.5 < elapsed_s < TIMEOUT_S + 1.5
        _assert_a_fresh_receiver_works(sender, fresh, fresh_peer, dtype)
        stalled.kill()
        sender.stop()


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_dead_receiver_fails_within_timeout_then_a_fresh_receiver_works(placement):
    send_on, receive_on, dtype = devices(placement)
    with children(
        ("dead", _receiver, 1, receive_on, dtype),
        ("fresh", _receiver, 3, receive_on, dtype),
        ("sender", _sender, 0, send_on, dtype),
    ) as (dead, fresh, sender):
        dead_peer, fresh_peer = dead.answer(), fresh.answer()
        assert sender.ask((dead_peer, SRC_BLOCKS, DST_BLOCKS))[0] == "ok"
        dead.kill()
        for _ in range(2):  # the broken pair, then a new one that cannot connect
            status, message, elapsed_s = sender.ask((dead_peer, SRC_BLOCKS, DST_BLOCKS))
            assert status == "error"
            assert f"127.0.0.1:{msgpack.unpackb(dead_peer)['port']}" in message
            assert elapsed_s < TIMEOUT_S
        _assert_a_fresh_receiver_works(sender, fresh, fresh_peer, dtype)
        sender.stop()
        fresh.stop()


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_receiver_keeps_serving_after_a_sender_dies_mid_transfer(placement):
    send_on, receive_on, dtype = devices(placement)
    with children(
        ("receiver", _receiver, 1, receive_on, dtype),
        ("dying", _sender, 2, send_on, dtype, True),
        ("sender", _sender, 0, send_on, dtype),
    ) as (receiver, dying, sender):
        peer = receiver.answer()
        dying.conn.send((peer, [0, 1], [0, 1]))
        dying.process.join(CHILD_TIMEOUT_S)
        assert dying.process.exitcode == DIED_EXITCODE
        # The receiver drops that pair: at once over gloo; over NCCL when the watchdog aborts
        # the receive, timeout_s after it was posted plus seconds of its own reporting.
        deadline = time.monotonic() + TIMEOUT_S + (1 if placement == "cpu" else 10)
        while _caches(receiver)[2] != 0:
            assert time.monotonic() < deadline, "the dead sender's pair was not dropped"
            time.sleep(0.1)
        status, message, _ = sender.ask((peer, SRC_BLOCKS, DST_BLOCKS))
        assert status == "ok", message
        written, joined, served = _caches(receiver)
        expected = [c.float() for c in apply_writes(1, [(0, SRC_BLOCKS, DST_BLOCKS)], dtype)]
        for layer in range(NUM_LAYERS):
            assert torch.equal(written[layer][:, DST_BLOCKS], expected[layer][:, DST_BLOCKS])
            # Blocks 0 and 1 may hold the dead sender's first layer; the rest is untouched.
            assert torch.equal(written[layer][:, 2:], expected[layer][:, 2:])
        assert (joined, served) == (2, 1)
        sender.stop()
        # torch 2.11 with NCCL 2.28 (H200): a process that aborted a communicator may crash
        # at interpreter exit, after close() returned.
        receiver.stop(0 if placement == "cpu" else None)


def test_checks_before_any_transfer():
    with pytest.raises(ValueError, match="timeout_s"):
        NcclKVConnector(timeout_s=0)
    with pytest.raises(ValueError, match="message_bytes"):
        NcclKVConnector(message_bytes=0)
    connector = make_kv_connector("nccl", host="127.0.0.1", timeout_s=TIMEOUT_S)
    assert isinstance(connector, NcclKVConnector) and connector.kind == "nccl"
    with pytest.raises(KVTransferError, match="register"):
        connector.descriptor()
    connector.close()  # before register, and twice
    connector.close()
    receiver, sender = NcclKVConnector(timeout_s=TIMEOUT_S), NcclKVConnector(serve=False)
    receiver.register(make_caches(1))
    sender.register(make_caches(0))
    with pytest.raises(KVTransferError, match="already"):
        sender.register(make_caches(0))
    peer = receiver.descriptor()
    assert (
        peer["device"] == "cpu"
        and isinstance(peer["port"], int)
        and "port" not in sender.descriptor()
    )
    with pytest.raises(KVTransferError, match="different processes"):
        sender.write_blocks(peer, SRC_BLOCKS, DST_BLOCKS)
    with pytest.raises(KVTransferError, match="'cuda'"):
        sender.write_blocks({**peer, "device": "cuda"}, SRC_BLOCKS, DST_BLOCKS)
    with pytest.raises(KVTransferError, match="'host' and 'port'"):
        receiver.write_blocks(sender.descriptor(), SRC_BLOCKS, DST_BLOCKS)
    for connector in (receiver, sender):
        connector.close()
        connector.close()


@pytest.mark.gpu
def test_refuses_two_ranks_on_one_gpu():
    receiver, sender = NcclKVConnector(timeout_s=TIMEOUT_S), NcclKVConnector(serve=False)
    receiver.register(make_caches(1, torch.bfloat16, "cuda:0"))
    sender.register(make_caches(0, torch.bfloat16, "cuda:0"))
    with pytest.raises(KVTransferError, match="one GPU"):
        sender.write_blocks(receiver.descriptor(), SRC_BLOCKS, DST_BLOCKS)
    receiver.close()
    sender.close()
