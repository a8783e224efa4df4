"""The engine's table of requests and their lifecycle: admission into the waiting queue,
the running set, and every way a request ends (finished, aborted, failed with an error),
each of which frees its KV blocks (or holds them while a KV transfer uses them).

Plain Python (no torch). ``Scheduler`` builds on it; the engine core and the PD roles end
requests through it.
"""

from __future__ import annotations

import logging
from collections import deque

from tandem.core.kv_cache import BlockManager
from tandem.request import Request, RequestStatus
from tandem.step import RequestUpdate

logger = logging.getLogger(__name__)


class RequestTable:
    """The requests of one engine by state, and how each one ends."""

    def __init__(self, block_manager: BlockManager):
        self.block_manager = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        # PD, decode side: requests whose prompt's KV comes from a prefill instance, before
        # their blocks are reserved (waiting_remote) and after (receiving).
        self.waiting_remote: deque[Request] = deque()
        self.receiving: dict[str, Request] = {}
        # Finished requests whose blocks a KV transfer may still read or write; freed by
        # release_held.
        self.held: dict[str, Request] = {}
        self._finished_ids: list[str] = []
        # The error updates of requests failed by a fault, until the engine core takes them.
        self._failed_updates: list[RequestUpdate] = []

    # ---- admission and abort -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a new request (ValueError if its id is in use)."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        queue = self.waiting_remote if request.remote_prefill else self.waiting
        queue.append(request)
        self.requests[request.request_id] = request

    def abort_request(self, request_id: str) -> Request | None:
        """Finish a request as aborted and free its blocks; unknown ids are ignored."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        self._finish(request, RequestStatus.FINISHED_ABORTED)
        return request

    def has_unfinished_requests(self) -> bool:
        """A request is waiting, running or receiving its KV."""
        return bool(self.waiting or self.running or self.waiting_remote or self.receiving)

    def take_finished_ids(self) -> list[str]:
        """The requests finished since the last step was scheduled (which the next step
        would report), now; they are not reported again."""
        finished, self._finished_ids = self._finished_ids, []
        return finished

    @property
    def num_running(self) -> int:
        """Requests in the running set."""
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        """Requests waiting to run (PD: or for their KV)."""
        return len(self.waiting) + len(self.waiting_remote) + len(self.receiving)

    def finish_request(self, request_id: str, status: RequestStatus, stop_reason=None) -> None:
        """End a request from outside the step loop (a stop string matched, an error)."""
        request = self.requests.get(request_id)
        if request is not None:
            request.stop_reason = stop_reason
            self._finish(request, status)

    def fail_request(self, request_id: str, error: BaseException | str) -> None:
        """End a request with an error (a fault while handling it): its blocks are freed,
        a log line says why, and its error update waits for ``take_failed_updates``."""
        request = self.requests.get(request_id)
        if request is None:
            return
        if isinstance(error, BaseException):
            logger.error("request %s failed", request_id, exc_info=error)
            error = f"internal error: {type(error).__name__}: {error}"
        else:
            logger.error("request %s failed: %s", request_id, error)
        self._failed_updates.append(
            RequestUpdate(request_id, [], [], [], RequestStatus.FINISHED_ERROR.value, error=error)
        )
        self.finish_request(request_id, RequestStatus.FINISHED_ERROR)

    def take_failed_updates(self) -> list[RequestUpdate]:
        """The error updates of the requests failed since the last call."""
        failed, self._failed_updates = self._failed_updates, []
        return failed

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if request.is_finished:
            return
        request.status = status
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        elif request in self.waiting_remote:
            self.waiting_remote.remove(request)
        receiving = self.receiving.pop(request.request_id, None) is not None
        self._finished_ids.append(request.request_id)
        if request.hold_blocks or receiving:
            self.held[request.request_id] = request  # a transfer may still use the blocks
        else:
            self.block_manager.free(request)
        self.requests.pop(request.request_id, None)
