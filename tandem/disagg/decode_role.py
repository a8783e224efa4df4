"""The decode side of PD disaggregation, inside a decode instance's engine core.

A request that names a prefill instance waits until the scheduler can reserve its prompt's
blocks, then this side asks the prefill instance to run the prompt and write the KV into
those blocks. When ``kv_ready`` arrives (sent only after the write completed) the request
is inserted as running: its first token is reported with its logprobs (and the prompt
logprobs), stop conditions apply to it at once (EOS, a stop token, max_tokens = 1 end the
request here and free its blocks), and its next step verifies the handed-over drafts.

Failures end the request with an error, never a hang: ``kv_failed``, a request that could
not be sent, or no word within ``transfer_timeout_s`` (counted from the request, and again
from each of the prefill instance's ``started`` and ``transferring``: it reports the request
every quarter of the timeout from a thread of its own until it answers, so the timeout
measures a silent prefill instance, never a busy one). The blocks of a request that
ended while its KV might still be coming (an error, a timeout, a client abort) are held
until the prefill instance answers or a second timeout has passed, so a late write can
never land in blocks another request uses.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from tandem.disagg.control import ControlChannel
from tandem.disagg.handoff import insert_handoff
from tandem.disagg.kv_connector import KVConnector
from tandem.messages import (
    KVFailed,
    KVReady,
    KVTransferring,
    PrefillCancel,
    PrefillStarted,
    PrefillTask,
)
from tandem.request import RequestStatus
from tandem.step import RequestUpdate

logger = logging.getLogger("tandem.disagg")


@dataclass
class _Pending:
    """A request whose prompt's KV was asked for."""

    prefill: str
    sent_at: float
    answered: bool = False
    cancel_sent: bool = False
    transferring_at: float = 0.0  # when the prefill instance last said its write began


class DecodeRole:
    """Asks prefill instances for prompts' KV and inserts the requests when it arrives."""

    def __init__(self, core, channel: ControlChannel, connector: KVConnector, timeout_s: float):
        self.core = core
        self.channel = channel
        self.connector = connector
        self.timeout_s = timeout_s
        self._pending: dict[str, _Pending] = {}
        # Handoff latency: from the prefill instance's "transferring" to the KV and the first
        # token here.
        self.counters = {
            "pd_handoffs": 0,
            "pd_handoff_s_sum": 0.0,
            "pd_handoff_s_max": 0.0,
            "pd_failures": 0,
        }
        self._prefix = f"{channel.address}/"  # request ids are unique per decode instance

    @property
    def busy(self) -> bool:
        """A request is waiting for KV, or held blocks wait for their release."""
        return bool(self._pending)

    def poll(self, wait: bool) -> list[RequestUpdate]:
        """Apply the prefill instances' answers, time requests out, release held blocks
        and ask for the KV of requests whose blocks could be reserved."""
        updates: list[RequestUpdate] = []
        for message in self.channel.receive(10 if wait else 0):
            request_id = message.request_id.removeprefix(self._prefix)
            try:
                updates += self._on_answer(request_id, message)
            except Exception as error:  # noqa: BLE001 (a bad answer fails its request only)
                logger.error(
                    "dropped a %s message for %s", message.TYPE, request_id, exc_info=error
                )
                if request_id in self._pending and request_id in self.core.scheduler.requests:
                    updates += self._fail(
                        request_id, f"bad answer from the prefill instance: {error}"
                    )
        updates += self._expire()
        updates += self._ask()
        return updates

    def _on_answer(self, request_id: str, message) -> list[RequestUpdate]:
        """Apply one prefill instance's message about ``request_id``; its updates."""
        updates: list[RequestUpdate] = []
        pending = self._pending.get(request_id)
        if pending is None:
            return updates
        if isinstance(message, KVTransferring) and not pending.answered:
            # Its KV is being written (also into blocks held after a failure): the clock
            # restarts.
            pending.sent_at = pending.transferring_at = time.monotonic()
        elif isinstance(message, PrefillStarted):
            # Held there: the clock of a request still waiting restarts (a report can
            # overtake the answer, and one for a request that ended here changes nothing).
            if not pending.answered and request_id in self.core.scheduler.receiving:
                pending.sent_at = time.monotonic()
        if isinstance(message, (PrefillStarted, KVTransferring)):
            return updates
        pending.answered = True
        if isinstance(message, KVReady):
            latency = time.monotonic() - pending.transferring_at
            self.counters["pd_handoffs"] += 1
            self.counters["pd_handoff_s_sum"] += latency
            self.counters["pd_handoff_s_max"] = max(self.counters["pd_handoff_s_max"], latency)
            updates += self._insert(request_id, message)
        elif isinstance(message, KVFailed) and request_id in self.core.scheduler.receiving:
            updates += self._fail(
                request_id, f"prefill instance {pending.prefill} failed: {message.error}"
            )
        return updates

    def after_step(self, updates: list[RequestUpdate]) -> list[RequestUpdate]:
        """Every update of a decode instance goes to its clients."""
        return updates

    @property
    def control_address(self) -> str:
        return self.channel.address

    def close(self) -> None:
        """Close the connector and the channel (nothing runs in the background here)."""
        self.connector.close()
        self.channel.close()

    # ---- steps -----------------------------------------------------------------------------

    def _ask(self) -> list[RequestUpdate]:
        updates = []
        scheduler = self.core.scheduler
        for request in scheduler.admit_remote():
            request_id = request.request_id
            now = time.monotonic()
            self._pending[request_id] = _Pending(request.remote_prefill, now, transferring_at=now)
            sent = self.channel.send(
                request.remote_prefill,
                PrefillTask(
                    self._prefix + request_id,
                    request.prompt_token_ids,
                    request.sampling_params,
                    self.connector.descriptor(),
                    list(self.core.block_manager.block_ids(request_id)),
                    self.channel.address,
                    self.timeout_s,
                ),
            )
            if not sent:
                self._pending[request_id].answered = True  # nothing can come
                self.channel.forget(request.remote_prefill)
                updates += self._fail(
                    request_id, f"could not reach prefill instance {request.remote_prefill}"
                )
        return updates

    def _insert(self, request_id: str, ready: KVReady) -> list[RequestUpdate]:
        scheduler = self.core.scheduler
        request = scheduler.receiving.get(request_id)
        if request is None:
            return []  # it ended meanwhile; its held blocks are released by _expire
        _check_vocabulary(ready, self.core.arch.vocab_size)
        insert_handoff(
            self.core.pipeline,
            request_id,
            request.prompt_token_ids + [ready.token_id],
            request.num_prompt_tokens,
            ready.handoff,
            request.sampling_params.seed,
        )
        update = scheduler.insert_remote(
            request_id,
            ready.token_id,
            ready.logprobs,
            ready.prompt_logprobs,
            len(ready.handoff.drafts),
            ready.num_cached_tokens,
        )
        return [update] if update is not None else []

    def _expire(self) -> list[RequestUpdate]:
        updates = []
        now = time.monotonic()
        scheduler = self.core.scheduler
        for request_id, pending in list(self._pending.items()):
            if request_id in scheduler.receiving:
                if now - pending.sent_at > self.timeout_s:
                    # What is still queued for a silent peer must never reach it late (a
                    # restarted instance on the same port would run stale tasks).
                    self.channel.forget(pending.prefill)
                    updates += self._fail(
                        request_id,
                        "no KV from prefill instance "
                        f"{pending.prefill} within {self.timeout_s:g} s",
                    )
                continue
            if request_id in scheduler.held:
                if not pending.answered and not pending.cancel_sent:  # aborted meanwhile
                    self._cancel(request_id, pending)
                if pending.answered or now - pending.sent_at > 2 * self.timeout_s:
                    scheduler.release_held(request_id)
                    del self._pending[request_id]
                continue
            del self._pending[request_id]  # running or finished with its blocks freed
        return updates

    def _cancel(self, request_id: str, pending: _Pending) -> None:
        pending.cancel_sent = True
        self.channel.send(pending.prefill, PrefillCancel(self._prefix + request_id))

    def _fail(self, request_id: str, error: str) -> list[RequestUpdate]:
        self.counters["pd_failures"] += 1
        logger.warning("request %s failed: %s", request_id, error)
        pending = self._pending.get(request_id)
        if pending is not None and not pending.answered:
            self._cancel(request_id, pending)
        scheduler = self.core.scheduler
        scheduler.finish_request(request_id, RequestStatus.FINISHED_ERROR)
        return [
            RequestUpdate(request_id, [], [], [], RequestStatus.FINISHED_ERROR.value, error=error)
        ]


def _check_vocabulary(ready: KVReady, vocab_size: int) -> None:
    """ValueError if a token id that the prefill instance sent is not in the vocabulary."""
    ids = [ready.token_id, *ready.handoff.drafts]
    for entries in (ready.logprobs, ready.prompt_logprobs):
        for token, _, _, top in entries:
            ids += [token, *(top_token for top_token, _ in top)]
    bad = next((token for token in ids if token >= vocab_size), None)
    if bad is not None:
        raise ValueError(f"token id {bad} is outside the vocabulary (size {vocab_size})")
