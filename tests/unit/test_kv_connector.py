"""KV connectors (DESIGN.md, "PD disaggregation"): chosen blocks of every layer's K and V reach
the peer's chosen blocks exactly, nothing else changes, and failures raise, never hang."""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import time
from contextlib import contextmanager

import msgpack
import pytest
import torch

from tandem.disagg.kv_connector import (
    KVTransferError,
    LocalKVConnector,
    block_runs,
    check_compatible,
)
from tandem.disagg.setup import make_kv_connector

try:
    import mooncake.engine  # noqa: F401

    MOONCAKE_IMPORT_ERROR = ""
except ImportError as error:
    MOONCAKE_IMPORT_ERROR = str(error)

needs_mooncake = pytest.mark.skipif(
    bool(MOONCAKE_IMPORT_ERROR), reason=f"mooncake cannot be imported: {MOONCAKE_IMPORT_ERROR}"
)

NUM_LAYERS = 3
NUM_BLOCKS = 16
SRC_BLOCKS = [3, 4, 5, 9]
DST_BLOCKS = [10, 11, 12, 2]
# Seconds to wait for a child process's answer before failing instead of hanging.
CHILD_TIMEOUT_S = 60
# The sender's timeout_s: Mooncake's smallest transfer deadline.
STALL_TIMEOUT_S = 5


def make_caches(
    seed: int, num_layers: int = NUM_LAYERS, block_size: int = 4, dtype: torch.dtype = torch.float32
) -> list[torch.Tensor]:
    """Random per-layer caches shaped (2, NUM_BLOCKS, block_size, num_kv_heads, head_dim)."""
    generator = torch.Generator().manual_seed(seed)
    shape = (2, NUM_BLOCKS, block_size, 2, 8)
    return [torch.randn(shape, generator=generator).to(dtype) for _ in range(num_layers)]


def expected_after_write(src_seed: int, dst_seed: int) -> list[torch.Tensor]:
    """The destination caches after SRC_BLOCKS were written into DST_BLOCKS."""
    expected = make_caches(dst_seed)
    for src_cache, dst_cache in zip(make_caches(src_seed), expected, strict=True):
        dst_cache[:, DST_BLOCKS] = src_cache[:, SRC_BLOCKS]
    return expected


def test_block_runs_merge_pairs_consecutive_on_both_sides():
    assert block_runs(SRC_BLOCKS, DST_BLOCKS) == [(3, 10, 3), (9, 2, 1)]
    assert block_runs([1, 2, 3], [5, 7, 8]) == [(1, 5, 1), (2, 7, 2)]
    assert block_runs([], []) == []


def test_local_connector_copies_chosen_blocks_and_leaves_others_untouched():
    registry: dict = {}
    sender = make_kv_connector("local", registry=registry, name="prefill")
    receiver = LocalKVConnector(registry=registry, name="decode")
    sender.register(make_caches(0))
    receiver.register(make_caches(1))
    peer = msgpack.unpackb(msgpack.packb(receiver.descriptor()))
    sender.write_blocks(peer, SRC_BLOCKS, DST_BLOCKS)
    for written, expected in zip(receiver.caches, expected_after_write(0, 1), strict=True):
        assert torch.equal(written, expected)
    receiver.close()
    assert "decode" not in registry


def test_write_blocks_rejects_bad_block_ids():
    registry: dict = {}
    sender = LocalKVConnector(registry, "prefill")
    receiver = LocalKVConnector(registry, "decode")
    sender.register(make_caches(0))
    receiver.register(make_caches(1))
    peer = receiver.descriptor()
    with pytest.raises(KVTransferError, match="differ in length"):
        sender.write_blocks(peer, [1, 2], [3])
    with pytest.raises(KVTransferError, match="dst_blocks: block id 16"):
        sender.write_blocks(peer, [1], [NUM_BLOCKS])
    with pytest.raises(KVTransferError, match="repeated"):
        sender.write_blocks(peer, [1, 2], [3, 3])
    for written, original in zip(receiver.caches, make_caches(1), strict=True):
        assert torch.equal(written, original)


@pytest.mark.parametrize(
    ("field", "peer_caches"),
    [
        ("num_layers", make_caches(1, num_layers=2)),
        ("dtype", make_caches(1, dtype=torch.bfloat16)),
        ("block_size", make_caches(1, block_size=8)),
    ],
)
def test_check_compatible_names_the_mismatched_field(field, peer_caches):
    registry: dict = {}
    sender = LocalKVConnector(registry, "prefill")
    receiver = LocalKVConnector(registry, "decode")
    sender.register(make_caches(0))
    receiver.register(peer_caches)
    check_compatible(sender.descriptor(), sender.descriptor())
    with pytest.raises(KVTransferError, match=f"'{field}'"):
        check_compatible(sender.descriptor(), receiver.descriptor())
    with pytest.raises(KVTransferError, match=f"'{field}'"):
        sender.write_blocks(receiver.descriptor(), SRC_BLOCKS, DST_BLOCKS)


def test_check_compatible_rejects_another_connector_kind():
    caches = make_caches(0)
    local = LocalKVConnector({}, "prefill")
    local.register(caches)
    with pytest.raises(KVTransferError, match="'kind'"):
        check_compatible(local.descriptor(), {**local.descriptor(), "kind": "mooncake"})


def test_make_kv_connector_rejects_unknown_kind():
    with pytest.raises(ValueError, match="'nixl'"):
        make_kv_connector("nixl")


# Children of the Mooncake tests: module-level so that spawned processes can import them.


def _try_write(connector, peer: dict) -> tuple[str, str, float]:
    start = time.monotonic()
    try:
        connector.write_blocks(peer, SRC_BLOCKS, DST_BLOCKS)
    except KVTransferError as error:
        return "error", str(error), time.monotonic() - start
    return "ok", "", time.monotonic() - start


def _mooncake_receiver(conn, seed: int) -> None:
    connector = make_kv_connector("mooncake")
    caches = make_caches(seed)
    connector.register(caches)
    conn.send(msgpack.packb(connector.descriptor()))  # as it would travel over ZeroMQ
    conn.recv()  # the sender has written
    conn.send([cache.numpy().copy() for cache in caches])
    conn.recv()  # stay alive (and registered) until the test stops this process


def _mooncake_sender(conn, seed: int) -> None:
    connector = make_kv_connector("mooncake", timeout_s=STALL_TIMEOUT_S)
    connector.register(make_caches(seed))
    peer = msgpack.unpackb(conn.recv())
    while conn.recv() == "write":
        conn.send(_try_write(connector, peer))
    connector.close()


def _mooncake_write_to_missing_peer(conn, port: int) -> None:
    connector = make_kv_connector("mooncake", timeout_s=STALL_TIMEOUT_S)
    connector.register(make_caches(0))
    conn.send(_try_write(connector, {**connector.descriptor(), "session": f"127.0.0.1:{port}"}))
    connector.close()


def _answer(conn, process):
    """The child's next message, failing (not hanging) when it is slow or has died."""
    if not conn.poll(CHILD_TIMEOUT_S):
        raise AssertionError(f"{process.name} sent nothing within {CHILD_TIMEOUT_S} s")
    return conn.recv()


def _stop(*processes) -> None:
    for process in processes:
        if process.is_alive():
            process.kill()
        process.join(CHILD_TIMEOUT_S)


@contextmanager
def mooncake_pair():
    """A receiver (seed 1 caches) and a sender (seed 0) in two spawned processes, the sender
    holding the receiver's descriptor: yields (to_receiver, receiver, to_sender, sender)."""
    context = multiprocessing.get_context("spawn")
    to_receiver, receiver_end = context.Pipe()
    to_sender, sender_end = context.Pipe()
    receiver = context.Process(
        target=_mooncake_receiver, args=(receiver_end, 1), name="receiver", daemon=True
    )
    sender = context.Process(
        target=_mooncake_sender, args=(sender_end, 0), name="sender", daemon=True
    )
    receiver.start()
    sender.start()
    try:
        to_sender.send(_answer(to_receiver, receiver))
        yield to_receiver, receiver, to_sender, sender
    finally:
        if sender.is_alive():
            to_sender.send("stop")
            sender.join(CHILD_TIMEOUT_S)
        _stop(receiver, sender)


@needs_mooncake
def test_mooncake_writes_blocks_between_two_processes_over_tcp():
    with mooncake_pair() as (to_receiver, receiver, to_sender, sender):
        to_sender.send("write")
        status, message, _ = _answer(to_sender, sender)
        assert status == "ok", message
        to_receiver.send("written")
        written = [torch.from_numpy(array) for array in _answer(to_receiver, receiver)]
        for layer, expected in enumerate(expected_after_write(0, 1)):
            assert torch.equal(written[layer], expected), f"layer {layer}"
        # The decode instance dies: the next write fails fast instead of hanging.
        _stop(receiver)
        to_sender.send("write")
        status, message, elapsed_s = _answer(to_sender, sender)
        assert status == "error" and "127.0.0.1:" in message
        assert elapsed_s < 10
    assert sender.exitcode == 0


@needs_mooncake
def test_mooncake_write_to_stalled_peer_times_out_after_timeout_s():
    with mooncake_pair() as (_, receiver, to_sender, sender):
        to_sender.send("write")  # connects the two engines
        assert _answer(to_sender, sender)[0] == "ok"
        os.kill(receiver.pid, signal.SIGSTOP)  # alive, connected, but never answers
        to_sender.send("write")
        status, message, elapsed_s = _answer(to_sender, sender)
        assert status == "error", message
        assert STALL_TIMEOUT_S - 1 < elapsed_s < STALL_TIMEOUT_S + 5


@needs_mooncake
def test_mooncake_write_to_missing_peer_raises_within_seconds():
    with socket.socket() as probe:  # a port that nothing listens on once closed
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = multiprocessing.get_context("spawn")
    parent_end, child_end = context.Pipe()
    child = context.Process(
        target=_mooncake_write_to_missing_peer, args=(child_end, port), name="sender", daemon=True
    )
    child.start()
    try:
        status, message, elapsed_s = _answer(parent_end, child)
        child.join(CHILD_TIMEOUT_S)
    finally:
        _stop(child)
    assert status == "error" and f"127.0.0.1:{port}" in message
    assert elapsed_s < 10
    assert child.exitcode == 0
