"""The PD control channel: typed messages (``tandem.messages``) over ZeroMQ between engine cores.

Each engine core that takes part in disaggregation binds one PULL socket (its address is
what peers send to) and keeps a PUSH socket per peer it sends to. Sends never block: a
message that cannot be queued is reported as not sent, and the caller fails the request.
"""

from __future__ import annotations

import logging

import zmq

from tandem.messages import Message, MessageError, decode

logger = logging.getLogger("tandem.disagg")

# Messages queued per peer before sends fail (a dead peer must not grow memory forever).
SEND_HIGH_WATER_MARK = 10_000


class ControlChannel:
    """Receives this engine's control messages and sends messages to peers."""

    def __init__(self, host: str, port: int, accepts: tuple[type[Message], ...]):
        """Bind the inbox on ``host``:``port`` (0: a free port); ``accepts`` are the message
        types this side takes (others are dropped with a log line)."""
        self._accepts = accepts
        self._context = zmq.Context()
        self._inbox = self._context.socket(zmq.PULL)
        if port:
            self._inbox.bind(f"tcp://{host}:{port}")
        else:
            port = self._inbox.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self._peers: dict[str, zmq.Socket] = {}

    def send(self, address: str, message: Message) -> bool:
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
            socket.send(message.encode(), zmq.NOBLOCK)
        except zmq.ZMQError:
            return False
        return True

    def receive(self, timeout_ms: int = 0) -> list[Message]:
        """Every well-formed message waiting, after waiting up to ``timeout_ms`` for the
        first; a malformed one is dropped with a warning."""
        messages = []
        while self._inbox.poll(timeout_ms):
            frame = self._inbox.recv()
            timeout_ms = 0
            try:
                messages.append(decode(frame, self._accepts))
            except MessageError as e:
                logger.warning("control channel %s: dropped a message: %s", self.address, e)
        return messages

    def close(self) -> None:
        """Close every socket."""
        for socket in self._peers.values():
            socket.close(linger=0)
        self._inbox.close(linger=0)
        self._context.term()
