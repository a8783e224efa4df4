"""A prefill instance's inbox and liveness reports, in a thread of their own.

A decode instance fails a request when it hears nothing of it within its transfer timeout.
That timeout must mean "the prefill instance went silent", never "the prefill instance is
inside a long step": one step of a cold prefill instance over 30 prompts (2,048 tokens) took
28.6 s on a loaded 2-core CPU, far past a 6 s timeout. Nothing the engine loop does between
steps can cover that: neither reports sent from it nor even receiving the tasks that arrive
meanwhile. So a background thread owns the control channel's inbox: it receives every
message (the engine loop takes them from a queue when it comes round), and tells each decode
instance, on receipt and then every quarter of its timeout, that its request is held here
(``PrefillStarted``), until the engine loop releases it with its answer (or a
``PrefillCancel`` comes: the decode side no longer waits for it). The thread runs
while the loop is in a forward (torch releases the GIL in its kernels) and sends through
ZeroMQ sockets of its own (a socket is never shared between threads), signed like every
control frame.

What still fails a request in time: a killed or stopped (SIGSTOP) process sends nothing, and
an engine loop that has not come round for ``STALLED_AFTER_TIMEOUTS`` timeouts is taken as
stuck, so the thread stops reporting for it (a step that long is a fault, not load).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

from tandem.disagg.control import ControlChannel, ControlSender
from tandem.messages import Message, PrefillCancel, PrefillStarted, PrefillTask

logger = logging.getLogger("tandem.disagg")

# A held request is reported this many times per decode-side timeout (one lost or late
# report does not fail it).
REPORTS_PER_TIMEOUT = 4
# An engine loop silent for this many of a request's timeouts is stuck: no more reports.
STALLED_AFTER_TIMEOUTS = 10
# The thread's longest wait for a message (how soon it sees ``close``).
RECEIVE_WAIT_S = 0.05
# How long ``close`` waits for the thread.
JOIN_TIMEOUT_S = 5.0


@dataclass
class _Held:
    """One request held here: whom to tell, how often, and when next."""

    reply_to: str
    interval_s: float
    stalled_after_s: float
    due: float


class PrefillInbox:
    """Receives a prefill instance's control messages and reports its held requests, from a
    background thread, until ``close``. The engine loop calls ``take`` once per loop turn
    (which also tells the thread that the loop is not stuck) and ``release`` when it has
    answered a request."""

    def __init__(self, channel: ControlChannel, sender: ControlSender):
        """Start the thread; from now on it alone uses ``channel``'s inbox, and it owns
        ``sender`` (closed when it ends). The engine loop still sends through ``channel``."""
        self._channel = channel
        self._sender = sender
        self._lock = threading.Lock()
        self._held: dict[str, _Held] = {}
        self._messages: queue.Queue[Message] = queue.Queue()
        self._beat = time.monotonic()
        self._stopping = threading.Event()
        self.num_received = 0  # messages queued for the engine loop so far
        self._thread = threading.Thread(target=self._run, name="tandem-pd-inbox", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        """The thread is running."""
        return self._thread.is_alive()

    def take(self, wait_s: float) -> list[Message]:
        """The messages received since the last call, after waiting up to ``wait_s`` for the
        first (the engine loop came round: it is not stuck)."""
        with self._lock:
            self._beat = time.monotonic()
        messages = []
        try:
            messages.append(self._messages.get(timeout=wait_s) if wait_s > 0 else None)
            while True:
                messages.append(self._messages.get_nowait())
        except queue.Empty:
            pass
        return [message for message in messages if message is not None]

    def hold(self, request_id: str, reply_to: str, timeout_s: float) -> None:
        """Report ``request_id`` to ``reply_to`` now and every quarter of ``timeout_s``
        (done for each ``PrefillTask`` on receipt)."""
        held = _Held(
            reply_to,
            timeout_s / REPORTS_PER_TIMEOUT,
            timeout_s * STALLED_AFTER_TIMEOUTS,
            time.monotonic(),
        )
        with self._lock:
            self._held[request_id] = held

    def release(self, request_id: str) -> None:
        """Stop reporting ``request_id`` (its answer is sent, or it is gone)."""
        with self._lock:
            self._held.pop(request_id, None)

    def close(self) -> None:
        """Stop the thread and wait for it (it closes its sockets as it ends)."""
        self._stopping.set()
        self._thread.join(JOIN_TIMEOUT_S)
        if self._thread.is_alive():
            logger.error("the PD inbox thread did not stop within %g s", JOIN_TIMEOUT_S)

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                try:
                    self._turn()
                except Exception:  # noqa: BLE001 (logged; the thread serves on)
                    logger.exception("the PD inbox thread: a turn failed")
                    self._stopping.wait(RECEIVE_WAIT_S)
        finally:
            self._sender.close()

    def _turn(self) -> None:
        """Receive what comes within the wait, then send the reports that are due."""
        with self._lock:
            now = time.monotonic()
            next_due = min((h.due for h in self._held.values()), default=now + RECEIVE_WAIT_S)
        wait_s = min(max(next_due - now, 0.0), RECEIVE_WAIT_S)
        for message in self._channel.receive(round(wait_s * 1000)):
            if isinstance(message, PrefillTask):
                self.hold(message.request_id, message.reply_to, message.timeout_s)
            elif isinstance(message, PrefillCancel):  # the decode side gave up on it
                self.release(message.request_id)
            self._messages.put(message)
            self.num_received += 1
        with self._lock:
            due = self._take_due(time.monotonic())
        for reply_to, request_id in due:
            self._sender.send(reply_to, PrefillStarted(request_id))

    def _take_due(self, now: float) -> list[tuple[str, str]]:
        """(reply_to, request id) of the requests due a report, rescheduled; none whose
        engine loop looks stuck. Called with the lock held."""
        silent_s = now - self._beat
        due = []
        for request_id, held in self._held.items():
            if held.due > now:
                continue
            held.due = now + held.interval_s
            if silent_s < held.stalled_after_s:
                due.append((held.reply_to, request_id))
        return due
