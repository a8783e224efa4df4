"""A KV connector over ZeroMQ that listens only on the configured host and takes only frames
signed with the deployment's secret.

The receiving (decode) side binds one ROUTER socket on ``host`` (a free port) and serves it in
a daemon thread; its descriptor carries the host, the port, a random instance id and the
largest message it takes. The sending (prefill) side binds nothing: each write opens a DEALER
socket to the peer and sends its block runs as messages of at most the peer's
``message_bytes`` of chunks (the format is in :mod:`tandem.disagg.zmq_frames`), ``WINDOW``
unanswered at most. The receiver checks each message (signature, freshness, replay,
addressee, every chunk's layer, block ids and size) before it writes any of it, then
answers: ``write_blocks`` returns after the last answer. A message that fails is dropped
with a log line: an unsigned one unanswered, a signed one with a signed refusal. ZeroMQ
itself caps each frame at the largest chunk (MAXMSGSIZE) and queues at most ``2 * WINDOW``
messages per connection before anything is checked.

Bounds: a write ends within ``timeout_s``: a refused or dropped connection fails at once (a
socket monitor sees it), a stalled receiver at the deadline. CPU caches are sent from and
written into in place; CUDA caches are staged through host memory (correct, not fast).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque

import numpy as np
import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from tandem.disagg.control import FrameError, ReplayGuard
from tandem.disagg.kv_connector import KVConnector, KVTransferError, cache_device, cache_layout
from tandem.disagg.zmq_frames import (
    TAG_BYTES,
    checked_chunks,
    open_answer,
    open_write,
    plan_messages,
    sign_answer,
    sign_write,
)

logger = logging.getLogger("tandem.disagg")

MESSAGE_BYTES = 16 << 20  # chunk bytes per message (the receiver's choice, in its descriptor)
WINDOW = 2  # unanswered messages per write: hashing and copying overlap the wire
_POLL_S = 0.1  # how often the serving thread and a waiting writer look for close()
_CLOSE_S = 2.0  # close() waits this long at most for the threads
_HEADER_ROOM = 1 << 20  # a header frame's bytes beyond the largest chunk
# A connection that fails: refused (nothing listens), dropped, or not speaking ZeroMQ.
_FAILURES = {
    zmq.EVENT_CONNECT_RETRIED: "connection refused",
    zmq.EVENT_DISCONNECTED: "the connection dropped",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "the ZeroMQ handshake failed",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "the ZeroMQ handshake failed",
}


def endpoint(host: str, port: int | None = None) -> str:
    """The ZeroMQ TCP endpoint of ``host`` (IPv6 in brackets) and ``port``."""
    name = f"[{host}]" if ":" in host else host
    return f"tcp://{name}" if port is None else f"tcp://{name}:{port}"


class ZmqKVConnector(KVConnector):
    """Writes KV blocks into a peer's caches over ZeroMQ, every message signed.

    ``key`` signs and checks the messages (``derive_key(secret, "kv")``: the same on every
    instance of the deployment), ``host`` is the only address the receiving side listens on,
    ``timeout_s`` bounds every write, ``serve`` binds and accepts writes (the decode side; a
    prefill instance passes False and binds nothing), ``message_bytes`` is the largest message
    this side accepts.
    """

    kind = "zmq"

    def __init__(
        self,
        key: bytes,
        host: str = "127.0.0.1",
        timeout_s: float = 30.0,
        serve: bool = True,
        message_bytes: int = MESSAGE_BYTES,
    ):
        if not isinstance(key, bytes) or len(key) < 16:
            raise ValueError("key: expected at least 16 bytes")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s: expected a positive number, got {timeout_s!r}")
        if message_bytes <= 0:
            raise ValueError(f"message_bytes: expected a positive number, got {message_bytes!r}")
        self._key = key
        self.host, self.timeout_s, self.serve = host, timeout_s, serve
        self.message_bytes = message_bytes
        self.caches: list[torch.Tensor] = []
        self._descriptor: dict | None = None
        self._context = zmq.Context()
        self._inbox: zmq.Socket | None = None
        self._thread: threading.Thread | None = None
        self._closed = threading.Event()
        self._writers = 0  # writes in progress (their sockets must close before the context)
        self._writers_lock = threading.Condition()

    def register(self, caches: list[torch.Tensor]) -> None:
        """Remember ``caches`` (one CPU or CUDA device); with ``serve``, bind on the host and
        start the serving thread."""
        if self.caches:
            raise KVTransferError("register(): the caches are registered already")
        layout = cache_layout(caches)
        cache_device(caches)  # one CPU or CUDA device
        self.caches = list(caches)
        self._descriptor = {"kind": self.kind, **layout}
        if not self.serve:
            return
        largest_chunk = max(self.message_bytes, layout["block_bytes"])
        inbox = self._context.socket(zmq.ROUTER)
        inbox.setsockopt(zmq.LINGER, 0)
        inbox.setsockopt(zmq.MAXMSGSIZE, largest_chunk + _HEADER_ROOM)
        inbox.setsockopt(zmq.RCVHWM, 2 * WINDOW)
        inbox.setsockopt(zmq.IPV6, int(":" in self.host))
        port = inbox.bind_to_random_port(endpoint(self.host))
        self._inbox = inbox
        self._descriptor.update(
            host=self.host,
            port=port,
            instance=os.urandom(16).hex(),
            message_bytes=self.message_bytes,
        )
        self._thread = threading.Thread(target=self._serve, daemon=True, name="tandem-kv-zmq")
        self._thread.start()

    def descriptor(self) -> dict:
        """Kind and layout; with ``serve`` also host, port, instance id and message_bytes."""
        if self._descriptor is None:
            raise KVTransferError("register() the KV caches before descriptor()")
        return self._descriptor

    # ---- sending side --------------------------------------------------------------------

    def _write_runs(self, peer: dict, runs: list[tuple[int, int, int]]) -> None:
        host, port, instance = peer.get("host"), peer.get("port"), peer.get("instance")
        limit = peer.get("message_bytes")
        if not (isinstance(host, str) and isinstance(port, int) and isinstance(instance, str)):
            raise KVTransferError(
                "peer descriptor lacks 'host', 'port' and 'instance' (a connector built "
                "with serve=False receives nothing)"
            )
        if not isinstance(limit, int) or limit <= 0:
            raise KVTransferError(f"peer descriptor: bad 'message_bytes' {limit!r}")
        messages = plan_messages(runs, len(self.caches), peer["block_bytes"], limit)
        deadline = time.monotonic() + self.timeout_s
        name = f"decode peer {endpoint(host, port)}"
        with self._writers_lock:
            if self._closed.is_set():
                raise KVTransferError("the KV connector is closed")
            self._writers += 1
        socket = self._context.socket(zmq.DEALER)
        monitor = socket.get_monitor_socket(sum(_FAILURES))
        try:
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.IPV6, int(":" in host))
            socket.connect(endpoint(host, port))
            unanswered: deque[bytes] = deque()
            for chunks in messages:
                frames = [
                    self._chunk_bytes(layer, half, src, n) for layer, half, src, _, n in chunks
                ]
                listed = [[layer, half, dst, n] for layer, half, _, dst, n in chunks]
                body = {"to": instance, "chunks": listed}
                header = sign_write(self._key, body, frames)
                try:
                    socket.send_multipart([header, *frames], flags=zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    raise KVTransferError(f"KV write to {name}: cannot queue a message") from None
                unanswered.append(header[:TAG_BYTES])
                if len(unanswered) >= WINDOW:
                    self._await_answer(socket, monitor, unanswered.popleft(), deadline, name)
            while unanswered:
                self._await_answer(socket, monitor, unanswered.popleft(), deadline, name)
        finally:
            socket.disable_monitor()
            monitor.close(linger=0)
            socket.close(linger=0)
            with self._writers_lock:
                self._writers -= 1
                self._writers_lock.notify_all()

    def _chunk_bytes(self, layer: int, half: int, block: int, n: int) -> np.ndarray:
        """Blocks ``[block, block + n)`` of one layer's keys or values, as bytes (a view of a
        CPU cache; a host copy of a CUDA one)."""
        chunk = self.caches[layer][half, block : block + n].view(torch.uint8).reshape(-1)
        return (chunk.cpu() if chunk.is_cuda else chunk).numpy()

    def _await_answer(self, socket, monitor, tag: bytes, deadline: float, name: str) -> None:
        """Wait for the answer to the message tagged ``tag``; KVTransferError unless it is a
        signed ``ok`` that comes before ``deadline``."""
        poller = zmq.Poller()
        poller.register(socket, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise KVTransferError(
                    f"KV write to {name}: no answer within {self.timeout_s} s "
                    "(the receiver is stalled or unreachable)"
                )
            if self._closed.is_set():
                raise KVTransferError(f"KV write to {name}: the connector closed")
            ready = dict(poller.poll(min(left, _POLL_S) * 1000))
            if monitor in ready:
                event = recv_monitor_message(monitor)["event"]
                if event in _FAILURES:
                    raise KVTransferError(f"KV write to {name} failed: {_FAILURES[event]}")
            if socket in ready:
                try:
                    ok, error = open_answer(self._key, tag, socket.recv())
                except Exception as error:  # noqa: BLE001 (a bad answer fails the write)
                    raise KVTransferError(f"KV write to {name}: bad answer: {error}") from None
                if not ok:
                    raise KVTransferError(f"KV write to {name} refused: {error}")
                return

    # ---- receiving side ------------------------------------------------------------------

    def _serve(self) -> None:
        """Take write messages until close(); no message ends this thread."""
        inbox, name = self._inbox, endpoint(self.host, self._descriptor["port"])
        guard = ReplayGuard()
        stream = torch.cuda.Stream(self.caches[0].device) if self.caches[0].is_cuda else None
        try:
            while not self._closed.is_set():
                if not inbox.poll(_POLL_S * 1000):
                    continue
                frames = inbox.recv_multipart(copy=False)
                try:
                    answer = self._take(frames, guard, stream, name)
                except Exception as error:  # noqa: BLE001 (never end the thread)
                    logger.error("KV connector %s: dropped a message: %r", name, error)
                    continue
                if answer is not None:
                    try:
                        inbox.send_multipart([frames[0], answer], flags=zmq.NOBLOCK)
                    except zmq.ZMQError as error:  # the writer left, or queues too much
                        logger.warning("KV connector %s: an answer was lost: %s", name, error)
        finally:
            inbox.close(linger=0)

    def _take(self, frames, guard: ReplayGuard, stream, name: str) -> bytes | None:
        """Check and apply one write message; its signed answer, or None for a message that
        is not authentic (dropped unanswered)."""
        if len(frames) < 2:
            logger.warning("KV connector %s: dropped a message without a header", name)
            return None
        header, chunks = frames[1].bytes, [frame.buffer for frame in frames[2:]]
        try:
            body = open_write(self._key, header, chunks, guard)
        except FrameError as error:
            logger.warning("KV connector %s: dropped a message: %s", name, error)
            return None
        tag = header[:TAG_BYTES]
        try:
            checked = checked_chunks(
                body,
                [chunk.nbytes for chunk in chunks],
                self._descriptor["instance"],
                self._descriptor,
            )
        except ValueError as error:
            logger.warning("KV connector %s: refused a write: %s", name, error)
            return sign_answer(self._key, tag, False, str(error))
        try:
            self._apply(checked, chunks, stream)
        except Exception as error:  # noqa: BLE001 (reported to the writer)
            logger.error("KV connector %s: a checked write failed: %r", name, error)
            return sign_answer(self._key, tag, False, f"the write failed: {error!r}")
        return sign_answer(self._key, tag, True)

    def _apply(self, checked: list[tuple], chunks: list[memoryview], stream) -> None:
        """Copy each chunk into its blocks (the whole message was checked already)."""
        with torch.inference_mode():
            for (layer, half, block, n), chunk in zip(checked, chunks, strict=True):
                target = self.caches[layer][half, block : block + n].view(torch.uint8).reshape(-1)
                source = np.frombuffer(chunk, dtype=np.uint8)
                if stream is None:
                    target.numpy()[:] = source
                else:
                    with torch.cuda.stream(stream):
                        target.copy_(torch.from_numpy(source.copy()))
            if stream is not None:
                stream.synchronize()  # the blocks hold the data before the answer says so

    def close(self) -> None:
        """Stop the serving thread and wait (``_CLOSE_S`` at most) for writes in progress,
        which end early; then close the ZeroMQ context. Safe to call twice."""
        self._closed.set()
        end = time.monotonic() + _CLOSE_S
        if self._thread is not None:
            self._thread.join(timeout=_CLOSE_S)
        with self._writers_lock:
            while self._writers and time.monotonic() < end:
                self._writers_lock.wait(max(end - time.monotonic(), 0.0))
            idle = not self._writers and not (self._thread and self._thread.is_alive())
        if not idle:  # a thread still holds its socket (and the caches): leave both to it
            logger.warning("KV connector: closed with a thread or write still running")
            return
        if not self._context.closed:
            self._context.term()
        self._thread = self._inbox = None
        self.caches = []
        self._descriptor = None
