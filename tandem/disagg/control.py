"""The PD control channel: msgpack dicts over ZeroMQ between engine cores.

Each engine core that takes part in disaggregation binds one PULL socket (its address is
what peers send to) and keeps a PUSH socket per peer it sends to. Sends never block: a
message that cannot be queued is reported as not sent, and the caller fails the request.
"""

from __future__ import annotations

import msgpack
import zmq

# Messages queued per peer before sends fail (a dead peer must not grow memory forever).
SEND_HIGH_WATER_MARK = 10_000


class ControlChannel:
    """Receives this engine's control messages and sends messages to peers."""

    def __init__(self, host: str, port: int = 0):
        self._context = zmq.Context()
        self._inbox = self._context.socket(zmq.PULL)
        if port:
            self._inbox.bind(f"tcp://{host}:{port}")
        else:
            port = self._inbox.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self._peers: dict[str, zmq.Socket] = {}

    def send(self, address: str, message: dict) -> bool:
        """Queue ``message`` for the peer at ``address``; False if it cannot be queued."""
        socket = self._peers.get(address)
        if socket is None:
            socket = self._context.socket(zmq.PUSH)
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.SNDHWM, SEND_HIGH_WATER_MARK)
            try:
                socket.connect(address)
            except zmq.ZMQError:
                socket.close(linger=0)
                return False
            self._peers[address] = socket
        try:
            socket.send(msgpack.packb(message, use_bin_type=True), zmq.NOBLOCK)
        except zmq.ZMQError:
            return False
        return True

    def receive(self, timeout_ms: int = 0) -> list[dict]:
        """Every message waiting, after waiting up to ``timeout_ms`` for the first."""
        messages = []
        while self._inbox.poll(timeout_ms):
            messages.append(msgpack.unpackb(self._inbox.recv(), raw=False, strict_map_key=False))
            timeout_ms = 0
        return messages

    def close(self) -> None:
        """Close every socket."""
        for socket in self._peers.values():
            socket.close(linger=0)
        self._inbox.close(linger=0)
        self._context.term()
