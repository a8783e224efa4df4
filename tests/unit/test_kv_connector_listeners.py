"""Where KV connectors listen (issue 19): the nccl connector's TCPStore and its gloo pairs
listen only on the configured host, on both sides of a transfer; Mooncake's ports listen on
every interface (a strict xfail, so that a Mooncake that binds shows up), and choosing it
with a specific host logs a warning. The zmq connector's own test is in
test_zmq_connector.py."""

from __future__ import annotations

import logging

import msgpack
import psutil
import pytest
import torch

from tandem.disagg.nccl_connector import NcclKVConnector
from tandem.disagg.nccl_transport import socket_interface
from tandem.disagg.setup import warn_if_listening_everywhere
from tests.unit.test_kv_connector import needs_mooncake
from tests.unit.test_nccl_connector import DST_BLOCKS, SRC_BLOCKS, TIMEOUT_S, children, make_caches

# Not the address of the machine's host name (127.0.0.1 here): a listener that ignores the
# configured host and takes the default shows up.
HOST = "127.0.0.2"


def listeners(pid: int | None = None) -> set[tuple[str, int]]:
    """The (ip, port) of every listening socket of process ``pid`` (default: this one)."""
    connections = psutil.Process(pid).net_connections("inet")
    return {(c.laddr.ip, c.laddr.port) for c in connections if c.status == psutil.CONN_LISTEN}


# ---- children (module-level so that spawned processes can import them) -------------------


def _receiver_on_host(conn, seed: int) -> None:
    """Serve on HOST: publish the descriptor, then wait for "stop"."""
    connector = NcclKVConnector(host=HOST, timeout_s=TIMEOUT_S)
    connector.register(make_caches(seed))
    conn.send(msgpack.packb(connector.descriptor()))
    conn.recv()
    connector.close()
    conn.send("closed")


def _sender_on_host(conn, seed: int) -> None:
    """Write the blocks into the peer received, answer "ok" (the pair stays up) or the
    error; close on "stop"."""
    connector = NcclKVConnector(host=HOST, timeout_s=TIMEOUT_S, serve=False)
    connector.register(make_caches(seed))
    peer = msgpack.unpackb(conn.recv())
    try:
        connector.write_blocks(peer, SRC_BLOCKS, DST_BLOCKS)
        conn.send("ok")
    except Exception as error:  # noqa: BLE001 (reported to the test)
        conn.send(repr(error))
    conn.recv()
    connector.close()
    conn.send("closed")


# ---- tests -------------------------------------------------------------------------------


def test_nccl_connector_store_and_gloo_pairs_listen_only_on_the_host():
    with children(("receiver", _receiver_on_host, 1), ("sender", _sender_on_host, 0)) as (
        receiver,
        sender,
    ):
        peer = receiver.answer()
        store = (HOST, msgpack.unpackb(peer)["port"])
        assert listeners(receiver.process.pid) == {store}  # the store, before any pair
        assert sender.ask(peer) == "ok"
        # A pair is up: each side's gloo device listens too, on HOST.
        on_receiver, on_sender = listeners(receiver.process.pid), listeners(sender.process.pid)
        assert store in on_receiver and len(on_receiver) == 2
        assert len(on_sender) == 1
        assert {ip for ip, _ in on_receiver | on_sender} == {HOST}
        assert sender.ask("stop") == "closed"
        assert receiver.ask("stop") == "closed"


def test_nccl_connector_store_closes_its_listener():
    before = listeners()
    connector = NcclKVConnector(host=HOST, timeout_s=TIMEOUT_S)
    connector.register(make_caches(1))
    assert listeners() - before == {(HOST, connector.descriptor()["port"])}
    connector.close()
    assert listeners() == before


def test_the_interface_of_a_host_is_found():
    assert socket_interface("127.0.0.1") == "lo"
    assert socket_interface("192.0.2.123") is None  # TEST-NET-1: on no interface


def test_choosing_mooncake_on_a_specific_host_warns_once(caplog):
    with caplog.at_level(logging.WARNING, logger="tandem.disagg"):
        assert warn_if_listening_everywhere("mooncake", "10.0.0.5")
        assert not warn_if_listening_everywhere("mooncake", "0.0.0.0")
        assert not warn_if_listening_everywhere("zmq", "10.0.0.5")
    (record,) = caplog.records
    assert "every interface" in record.getMessage() and "10.0.0.5" in record.getMessage()


@needs_mooncake
@pytest.mark.xfail(
    strict=True,
    reason="mooncake-transfer-engine 0.3.13 has no listen-address option: its handshake port "
    "listens on 0.0.0.0 and its TCP data port on [::] (docs/architecture.md, PD trust)",
)
def test_mooncake_listens_only_on_the_host():
    from tandem.disagg.mooncake_connector import MooncakeKVConnector

    before = listeners()
    connector = MooncakeKVConnector(hostname="127.0.0.1")
    try:
        connector.register([torch.zeros(2, 4, 4, 2, 8)])
        opened = listeners() - before
        assert opened and {ip for ip, _ in opened} == {"127.0.0.1"}, opened
    finally:
        connector.close()
