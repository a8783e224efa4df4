"""The zmq KV connector: chosen blocks of every layer reach the peer's chosen blocks exactly,
nothing else changes; only messages signed with the deployment's key are written, and only
after every chunk is checked against the cache; a dead or stalled peer fails a write within
its timeout; the receiving side listens only on its configured host."""

from __future__ import annotations

import logging
import threading
import time

import msgpack
import psutil
import pytest
import torch
import zmq

from tandem.disagg.kv_connector import KVTransferError, block_runs
from tandem.disagg.setup import make_kv_connector
from tandem.disagg.trust import derive_key
from tandem.disagg.zmq_connector import ZmqKVConnector, endpoint
from tandem.disagg.zmq_frames import TAG_BYTES, open_answer, plan_messages, sign_write

KEY = derive_key("test-zmq-connector-secret", "kv")
HOST = "127.0.0.1"
NUM_LAYERS = 3
NUM_BLOCKS = 16
BLOCK_BYTES = 4 * 2 * 8 * 4  # block_size 4, 2 heads of 8, fp32
SRC_BLOCKS = [3, 4, 5, 9]  # runs (3, 10, 3) and (9, 2, 1)
DST_BLOCKS = [10, 11, 12, 2]
TIMEOUT_S = 1.0


def make_caches(seed: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """Random per-layer caches shaped (2, NUM_BLOCKS, block_size, num_kv_heads, head_dim)."""
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randn((2, NUM_BLOCKS, 4, 2, 8), generator=generator).to(dtype)
        for _ in range(NUM_LAYERS)
    ]


def apply_writes(dst_seed: int, writes, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """The receiver's caches after each (src_seed, src_blocks, dst_blocks) write."""
    expected = make_caches(dst_seed, dtype)
    for src_seed, src_blocks, dst_blocks in writes:
        for src_cache, dst_cache in zip(make_caches(src_seed, dtype), expected, strict=True):
            dst_cache[:, dst_blocks] = src_cache[:, src_blocks]
    return expected


def assert_caches(connector: ZmqKVConnector, expected: list[torch.Tensor]) -> None:
    for layer, (got, want) in enumerate(zip(connector.caches, expected, strict=True)):
        assert torch.equal(got, want), f"layer {layer}"


@pytest.fixture
def pair():
    """A receiver (seed 1) and a sender (seed 0), closed afterwards."""
    receiver = ZmqKVConnector(KEY, HOST, TIMEOUT_S)
    sender = ZmqKVConnector(KEY, HOST, TIMEOUT_S, serve=False)
    receiver.register(make_caches(1))
    sender.register(make_caches(0))
    yield receiver, sender
    sender.close()
    receiver.close()


def send_raw(peer: dict, frames: list[bytes], wait_s: float = 1.0) -> bytes | None:
    """Send ``frames`` as one message to the receiver of ``peer``; its answer, or None."""
    with zmq.Context() as context, context.socket(zmq.DEALER) as socket:
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(endpoint(peer["host"], peer["port"]))
        socket.send_multipart(frames)
        return socket.recv() if socket.poll(wait_s * 1000) else None


def chunk_of(caches, layer: int, half: int, block: int, n: int = 1) -> bytes:
    return caches[layer][half, block : block + n].contiguous().view(torch.uint8).numpy().tobytes()


# ---- transfers ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("message_bytes", [1 << 20, BLOCK_BYTES, 2 * BLOCK_BYTES + 1])
def test_writes_chosen_blocks_exactly(dtype, message_bytes):
    receiver = ZmqKVConnector(KEY, HOST, TIMEOUT_S, message_bytes=message_bytes)
    sender = ZmqKVConnector(KEY, HOST, TIMEOUT_S, serve=False)
    receiver.register(make_caches(1, dtype))
    sender.register(make_caches(0, dtype))
    peer = msgpack.unpackb(msgpack.packb(receiver.descriptor()))  # as it travels
    sender.write_blocks(peer, SRC_BLOCKS, DST_BLOCKS)
    assert_caches(receiver, apply_writes(1, [(0, SRC_BLOCKS, DST_BLOCKS)], dtype))
    second = ([0, 1, 15], [5, 6, 0])  # a second write on the same connectors
    sender.write_blocks(peer, *second)
    assert_caches(receiver, apply_writes(1, [(0, SRC_BLOCKS, DST_BLOCKS), (0, *second)], dtype))
    sender.close()
    receiver.close()


def test_two_threads_write_into_one_receiver_at_once(pair):
    receiver, sender = pair
    other = ZmqKVConnector(KEY, HOST, TIMEOUT_S, serve=False)
    other.register(make_caches(2))
    writes = [(sender, 0, SRC_BLOCKS, DST_BLOCKS), (other, 2, [0, 1, 7], [4, 5, 14])]
    errors: list[Exception] = []

    def write(connector, src, dst):
        try:
            connector.write_blocks(receiver.descriptor(), src, dst)
        except Exception as error:  # noqa: BLE001 (asserted below)
            errors.append(error)

    threads = [threading.Thread(target=write, args=(c, s, d)) for c, _, s, d in writes]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert not errors
    assert_caches(receiver, apply_writes(1, [(seed, s, d) for _, seed, s, d in writes]))
    other.close()


def test_messages_hold_whole_runs_within_message_bytes():
    runs = block_runs([3, 4, 5, 6, 9], [10, 11, 12, 13, 2])
    messages = plan_messages(runs, NUM_LAYERS, BLOCK_BYTES, 3 * BLOCK_BYTES)
    chunks = [chunk for message in messages for chunk in message]
    assert all(sum(n for *_, n in m) * BLOCK_BYTES <= 3 * BLOCK_BYTES for m in messages)
    covered = sorted((layer, half, dst + i) for layer, half, _, dst, n in chunks for i in range(n))
    halves = [(layer, half) for layer in range(NUM_LAYERS) for half in (0, 1)]
    assert covered == sorted((*lh, b) for lh in halves for b in [10, 11, 12, 13, 2])
    assert (0, 0, 3, 10, 3) in chunks  # a run of 4 is cut into 3 + 1, never into single blocks
    # A block larger than a message goes alone.
    assert plan_messages([(0, 0, 2)], 1, BLOCK_BYTES, 1) == [
        [(0, 0, 0, 0, 1)],
        [(0, 0, 1, 1, 1)],
        [(0, 1, 0, 0, 1)],
        [(0, 1, 1, 1, 1)],
    ]


# ---- trust and checks --------------------------------------------------------------------


def test_a_forged_unsigned_or_replayed_message_writes_nothing(pair, caplog):
    receiver, sender = pair
    peer = receiver.descriptor()
    chunk = [b"\0" * BLOCK_BYTES]
    body = {"to": peer["instance"], "chunks": [[0, 0, 3, 1]]}
    forged = sign_write(derive_key("another-deployments-secret", "kv"), body, chunk)
    genuine = sign_write(KEY, body, chunk)
    tampered = sign_write(KEY, body, [b"\1" * BLOCK_BYTES])  # signed for other bytes
    with caplog.at_level(logging.WARNING, logger="tandem.disagg"):
        assert send_raw(peer, [b"not a header", *chunk]) is None
        assert send_raw(peer, [forged, *chunk]) is None
        assert send_raw(peer, [tampered, *chunk]) is None
        assert send_raw(peer, [b"x" * 100]) is None  # a header alone, of garbage
        assert_caches(receiver, make_caches(1))
        answer = send_raw(peer, [genuine, *chunk])
        assert open_answer(KEY, genuine[:TAG_BYTES], answer) == (True, "")
        receiver.caches[0][0, 3].fill_(7.0)
        assert send_raw(peer, [genuine, *chunk]) is None  # a replay
        assert bool((receiver.caches[0][0, 3] == 7.0).all())
    dropped = [r for r in caplog.records if "dropped a message" in r.getMessage()]
    assert len(dropped) == 5, [r.getMessage() for r in caplog.records]
    assert any("replay" in r.getMessage() for r in dropped)
    sender.write_blocks(peer, SRC_BLOCKS, DST_BLOCKS)  # the receiver serves on


@pytest.mark.parametrize(
    ("chunks", "frames", "why"),
    [
        ([[0, 0, NUM_BLOCKS - 1, 2]], [2 * BLOCK_BYTES], "outside"),
        ([[0, 0, -1, 1]], [BLOCK_BYTES], "outside"),
        ([[NUM_LAYERS, 0, 0, 1]], [BLOCK_BYTES], "no layer"),
        ([[0, 2, 0, 1]], [BLOCK_BYTES], "no layer"),
        ([[0, 0, 0, 1]], [BLOCK_BYTES - 4], "bytes"),
        ([[0, 0, 0, 1], [0, 1, 0, True]], [BLOCK_BYTES, BLOCK_BYTES], "expected"),
        ([[0, 0, 0, 1]], [BLOCK_BYTES, BLOCK_BYTES], "chunk frames"),
    ],
)
def test_a_signed_write_outside_the_cache_is_refused_whole(pair, chunks, frames, why):
    receiver, _ = pair
    peer = receiver.descriptor()
    payloads = [b"\0" * size for size in frames]
    header = sign_write(KEY, {"to": peer["instance"], "chunks": chunks}, payloads)
    ok, error = open_answer(KEY, header[:TAG_BYTES], send_raw(peer, [header, *payloads]))
    assert not ok and why in error
    assert_caches(receiver, make_caches(1))


def test_a_write_for_another_instance_is_refused(pair):
    receiver, _ = pair
    peer, payload = receiver.descriptor(), [b"\0" * BLOCK_BYTES]
    header = sign_write(KEY, {"to": "another-instance", "chunks": [[0, 0, 0, 1]]}, payload)
    ok, error = open_answer(KEY, header[:TAG_BYTES], send_raw(peer, [header, *payload]))
    assert not ok and "another instance" in error
    assert_caches(receiver, make_caches(1))


def test_a_refusal_fails_the_write(pair):
    receiver, sender = pair
    peer = {**receiver.descriptor(), "instance": "not-the-receivers-id"}
    with pytest.raises(KVTransferError, match="refused: addressed to another instance"):
        sender.write_blocks(peer, SRC_BLOCKS, DST_BLOCKS)
    with pytest.raises(KVTransferError, match="dst_blocks: block id 16"):
        sender.write_blocks(receiver.descriptor(), [1], [NUM_BLOCKS])
    assert_caches(receiver, make_caches(1))


# ---- bounds ------------------------------------------------------------------------------


def test_a_dead_receiver_fails_a_write_at_once(pair):
    receiver, sender = pair
    peer = receiver.descriptor()
    receiver.close()
    start = time.monotonic()
    with pytest.raises(KVTransferError, match="refused"):
        sender.write_blocks(peer, SRC_BLOCKS, DST_BLOCKS)
    assert time.monotonic() - start < TIMEOUT_S


def test_a_stalled_receiver_fails_a_write_within_the_timeout(pair):
    receiver, sender = pair
    with zmq.Context() as context, context.socket(zmq.ROUTER) as stalled:
        stalled.setsockopt(zmq.LINGER, 0)
        port = stalled.bind_to_random_port(endpoint(HOST))  # takes messages, answers nothing
        start = time.monotonic()
        with pytest.raises(KVTransferError, match="no answer within"):
            sender.write_blocks({**receiver.descriptor(), "port": port}, SRC_BLOCKS, DST_BLOCKS)
        assert TIMEOUT_S - 0.1 < time.monotonic() - start < TIMEOUT_S + 0.5
    sender.write_blocks(receiver.descriptor(), SRC_BLOCKS, DST_BLOCKS)  # another peer works


def test_close_ends_a_write_in_progress_early(pair):
    _, sender = pair
    sender.timeout_s = 30.0
    errors: list[Exception] = []
    with zmq.Context() as context, context.socket(zmq.ROUTER) as stalled:
        stalled.setsockopt(zmq.LINGER, 0)
        peer = {**pair[0].descriptor(), "port": stalled.bind_to_random_port(endpoint(HOST))}

        def write():
            try:
                sender.write_blocks(peer, SRC_BLOCKS, DST_BLOCKS)
            except KVTransferError as error:
                errors.append(error)

        writer = threading.Thread(target=write)
        writer.start()
        time.sleep(0.3)
        start = time.monotonic()
        sender.close()
        writer.join(5)
        assert time.monotonic() - start < 1.0 and not writer.is_alive()
    assert errors and "closed" in str(errors[0])


# ---- listening sockets -------------------------------------------------------------------


def _listeners() -> set[tuple[str, int]]:
    connections = psutil.Process().net_connections("inet")
    return {(c.laddr.ip, c.laddr.port) for c in connections if c.status == psutil.CONN_LISTEN}


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2"])
def test_only_the_receiver_listens_and_only_on_its_host(host):
    before = _listeners()
    sender = ZmqKVConnector(KEY, host, TIMEOUT_S, serve=False)
    sender.register(make_caches(0))
    assert _listeners() == before
    receiver = ZmqKVConnector(KEY, host, TIMEOUT_S)
    receiver.register(make_caches(1))
    assert _listeners() - before == {(host, receiver.descriptor()["port"])}
    sender.write_blocks(receiver.descriptor(), SRC_BLOCKS, DST_BLOCKS)
    assert _listeners() - before == {(host, receiver.descriptor()["port"])}
    sender.close()
    receiver.close()
    assert _listeners() == before


def test_checks_before_any_transfer():
    with pytest.raises(ValueError, match="key"):
        ZmqKVConnector(b"short")
    with pytest.raises(ValueError, match="timeout_s"):
        ZmqKVConnector(KEY, timeout_s=0)
    with pytest.raises(ValueError, match="message_bytes"):
        ZmqKVConnector(KEY, message_bytes=0)
    connector = make_kv_connector("zmq", key=KEY, host=HOST, timeout_s=TIMEOUT_S, serve=False)
    assert isinstance(connector, ZmqKVConnector) and connector.kind == "zmq"
    with pytest.raises(KVTransferError, match="register"):
        connector.descriptor()
    connector.register(make_caches(0))
    with pytest.raises(KVTransferError, match="already"):
        connector.register(make_caches(0))
    assert "port" not in connector.descriptor()
    with pytest.raises(KVTransferError, match="'host', 'port'"):
        connector.write_blocks(connector.descriptor(), SRC_BLOCKS, DST_BLOCKS)
    connector.close()
    connector.close()
