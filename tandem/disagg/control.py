"""The PD control channel: typed messages (``tandem.messages``) over ZeroMQ between engine cores.

Each engine core that takes part in disaggregation binds one PULL socket on the configured
host (its address is what peers send to) and keeps a PUSH socket per peer it sends to.
Sends never block: a message that cannot be queued is reported as not sent, and the caller
fails the request.

Every frame is signed: ``tag (32 bytes) | time in ms (8) | nonce (8) | msgpack body``, where
the tag is HMAC-SHA256 under the key both sides derive from the deployment's shared secret
(``tandem.disagg.trust``) over everything after it. The receiver checks the tag with a
constant-time compare before it decodes anything, refuses frames whose time is more than
``REPLAY_WINDOW_S`` away from its own clock, and refuses a tag it has already seen within
that window: a captured frame cannot be replayed. Limits: the instances' clocks must agree
to within the window (NTP), and frames are authenticated, not encrypted (prompt token ids
travel in the clear; run PD on a private network).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import struct
import time

import zmq

from tandem.messages import Message, MessageError, decode

logger = logging.getLogger("tandem.disagg")

# Messages queued per peer before sends fail (a dead peer must not grow memory forever).
SEND_HIGH_WATER_MARK = 10_000
# A frame older (or newer) than this by the receiver's clock is refused; a tag seen within it
# is a replay.
REPLAY_WINDOW_S = 60.0
# The largest frame a peer may send (a connection that sends more is dropped by ZeroMQ).
MAX_FRAME_BYTES = 64 << 20
TAG_BYTES = 32
_STAMP = struct.Struct(">Q8s")  # milliseconds since the epoch, nonce
HEADER_BYTES = TAG_BYTES + _STAMP.size


def sign_frame(key: bytes, body: bytes, now_s: float | None = None) -> bytes:
    """``body`` in a signed frame (the format above), stamped ``now_s`` (default: now)."""
    stamped = _STAMP.pack(int((time.time() if now_s is None else now_s) * 1000), os.urandom(8))
    stamped += body
    return hmac.new(key, stamped, hashlib.sha256).digest() + stamped


class FrameError(ValueError):
    """A frame that is not signed with the channel's key, is stale, or is a replay."""


class ReplayGuard:
    """The tags of the frames accepted within the replay window, with when they expire."""

    def __init__(self, window_s: float = REPLAY_WINDOW_S):
        self.window_s = window_s
        self._expiry: dict[bytes, float] = {}  # insertion order is expiry order

    def check(self, tag: bytes, sent_s: float, now_s: float) -> None:
        """FrameError if a frame sent at ``sent_s`` is outside the window or its tag was
        seen; otherwise remember the tag."""
        while self._expiry:
            oldest, expiry = next(iter(self._expiry.items()))
            if expiry > now_s:
                break
            del self._expiry[oldest]
        if abs(now_s - sent_s) > self.window_s:
            raise FrameError(
                f"stamped {now_s - sent_s:+.1f} s from now, outside the {self.window_s:g} s "
                "window (a replay, or clocks that disagree)"
            )
        if tag in self._expiry:
            raise FrameError("a replay of a frame already received")
        self._expiry[tag] = now_s + 2 * self.window_s


def open_frame(key: bytes, frame: bytes, guard: ReplayGuard, now_s: float | None = None) -> bytes:
    """The body of a signed frame; FrameError if its tag, time or freshness is wrong."""
    if len(frame) < HEADER_BYTES:
        raise FrameError(f"{len(frame)} bytes, shorter than a signed frame's header")
    tag, stamped = frame[:TAG_BYTES], frame[TAG_BYTES:]
    if not hmac.compare_digest(tag, hmac.new(key, stamped, hashlib.sha256).digest()):
        raise FrameError("bad signature (not signed with this deployment's secret)")
    sent_ms, _ = _STAMP.unpack_from(stamped)
    guard.check(tag, sent_ms / 1000, time.time() if now_s is None else now_s)
    return stamped[_STAMP.size :]


class ControlSender:
    """Signed sends to peers, one PUSH socket per peer address. A ZeroMQ socket is not
    thread-safe: a sender is used (and closed) by one thread only; another thread opens its
    own with ``ControlChannel.open_sender``."""

    def __init__(self, context: zmq.Context, key: bytes):
        self._context = context
        self._key = key
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
            socket.send(sign_frame(self._key, message.encode()), zmq.NOBLOCK)
        except zmq.ZMQError:
            return False
        return True

    def forget(self, address: str) -> None:
        """Close the socket to ``address`` (a peer that moved or died: nothing more goes
        there, and nothing queued for it is kept)."""
        socket = self._peers.pop(address, None)
        if socket is not None:
            socket.close(linger=0)

    def close(self) -> None:
        """Close every socket to a peer."""
        for socket in self._peers.values():
            socket.close(linger=0)
        self._peers.clear()


class ControlChannel:
    """Receives this engine's control messages and sends messages to peers, every frame
    signed with ``key`` (``tandem.disagg.trust.derive_key(secret, "control")``). Used by the
    engine loop's thread; other threads send through senders of their own
    (``open_sender``), closed before the channel."""

    def __init__(self, host: str, port: int, accepts: tuple[type[Message], ...], key: bytes):
        """Bind the inbox on ``host``:``port`` (0: a free port); ``accepts`` are the message
        types this side takes (others are dropped with a log line)."""
        if len(key) < 16:
            raise ValueError("key: expected at least 16 bytes")
        self._key = key
        self._accepts = accepts
        self._guard = ReplayGuard()
        self._context = zmq.Context()
        self._inbox = self._context.socket(zmq.PULL)
        self._inbox.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        if port:
            self._inbox.bind(f"tcp://{host}:{port}")
        else:
            port = self._inbox.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self._sender = ControlSender(self._context, key)

    def send(self, address: str, message: Message) -> bool:
        """Queue ``message`` for the peer at ``address``; False if it cannot be queued."""
        return self._sender.send(address, message)

    def forget(self, address: str) -> None:
        """Close the socket to ``address`` (a peer that moved or died: nothing more goes
        there, and nothing queued for it is kept)."""
        self._sender.forget(address)

    def open_sender(self) -> ControlSender:
        """A sender of its own for another thread, signing with this channel's key (the
        thread closes it before the channel is closed)."""
        return ControlSender(self._context, self._key)

    def receive(self, timeout_ms: int = 0) -> list[Message]:
        """Every authentic, well-formed message waiting, after waiting up to ``timeout_ms``
        for the first; any other frame is dropped with a warning."""
        messages = []
        while self._inbox.poll(timeout_ms):
            frame = self._inbox.recv()
            timeout_ms = 0
            try:
                messages.append(decode(open_frame(self._key, frame, self._guard), self._accepts))
            except (FrameError, MessageError) as e:
                logger.warning("control channel %s: dropped a message: %s", self.address, e)
        return messages

    def close(self) -> None:
        """Close every socket (senders opened for other threads must be closed already:
        the context waits for them)."""
        self._sender.close()
        self._inbox.close(linger=0)
        self._context.term()
