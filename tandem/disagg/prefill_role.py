"""The prefill side of PD disaggregation, inside a prefill instance's engine core.

A decode instance sends a ``PrefillTask`` (``tandem.messages``). The request runs here like
any other but stops after its first token (which is sampled, with its logprobs, and drafted
from by the MTP head with the request's own sampling parameters) and keeps its blocks. From
receipt until its answer is sent the decode instance hears ``PrefillStarted`` every quarter
of its timeout, from a thread that also receives the tasks (``tandem.disagg.liveness``: a
step can last longer than the timeout, and a busy instance is not a dead one); when the token is
done, this side tells it ``KVTransferring`` and, in a background thread, the connector
writes the prompt's KV blocks (target and MTP layers) into the decode instance's
``dst_blocks``; only after the write has completed the decode instance gets ``KVReady`` with
the first token, its logprobs, the prompt logprobs, the drafts and the key seed of its
random numbers; or ``KVFailed`` with the reason. Either way the blocks are freed here. A
``PrefillCancel`` that comes before the write starts ends the request here; one that comes
later lets the write finish (the decode instance holds those blocks until it hears back, or
for a second timeout).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace

from tandem.disagg.control import ControlChannel
from tandem.disagg.handoff import HandoffExport, finish_handoff_export, start_handoff_export
from tandem.disagg.kv_connector import KVConnector, KVTransferError, check_compatible
from tandem.disagg.liveness import PrefillInbox
from tandem.messages import (
    KVFailed,
    KVReady,
    KVTransferring,
    PrefillCancel,
    PrefillTask,
)
from tandem.request import Request
from tandem.step import RequestUpdate

logger = logging.getLogger("tandem.disagg")


@dataclass
class _Job:
    """One request being prefilled for a decode instance."""

    request_id: str
    reply_to: str
    kv: dict
    dst_blocks: list[int]
    num_prompt_tokens: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    prompt_logprobs: list = field(default_factory=list)
    num_cached_tokens: int = 0
    handoff: HandoffExport | None = None  # its drafts on their way to the host
    num_bytes: int = 0  # KV bytes written (all layers, keys and values)
    future: Future | None = None
    writing: bool = False  # the decode instance heard that its KV write has begun
    cancelled: bool = False
    error: str | None = None  # why the request failed here (a fault while it ran)


class PrefillRole:
    """Runs prompts for decode instances and hands their first token and KV over."""

    def __init__(self, core, channel: ControlChannel, connector: KVConnector):
        self.core = core
        self.channel = channel
        self.connector = connector
        self._jobs: dict[str, _Job] = {}
        self.counters = {
            "pd_kv_transfers": 0,
            "pd_kv_bytes": 0,
            "pd_kv_transfer_s": 0.0,
            "pd_failures": 0,
        }
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tandem-kv-write")
        # Receives tasks and reports the held requests while the engine loop is in a step.
        self._inbox = PrefillInbox(channel, channel.open_sender())

    @property
    def busy(self) -> bool:
        """A handed-over request still holds blocks here."""
        return bool(self._jobs)

    def poll(self, wait: bool) -> list[RequestUpdate]:
        """Take new prefill requests and cancels; report finished transfers."""
        # Idle: wait for work (briefly while transfers run, to see them end soon).
        for message in self._inbox.take(((1 if self._jobs else 10) if wait else 0) / 1000):
            try:
                if isinstance(message, PrefillTask):
                    self._start(message)
                elif isinstance(message, PrefillCancel):
                    self._cancel(message.request_id)
            except Exception as error:  # noqa: BLE001 (a bad message never ends the core)
                logger.error("dropped a %s message", message.TYPE, exc_info=error)
                if isinstance(message, PrefillTask) and message.request_id not in self._jobs:
                    self.core.abort_request(message.request_id)  # if it got in
                    self.core.scheduler.release_held(message.request_id)
                    self._reply_failed(message.reply_to, message.request_id, f"bad task: {error}")
        self._report_writing()
        self._reap()
        return []

    def _report_writing(self) -> None:
        """Tell decode instances whose KV write a writer thread has begun (their timeout
        restarts from the write itself, not from its place in the queue)."""
        for job in self._jobs.values():
            if job.future is not None and not job.writing and not job.cancelled:
                if job.future.running() or job.future.done():
                    job.writing = True
                    self.channel.send(job.reply_to, KVTransferring(job.request_id))

    def after_step(self, updates: list[RequestUpdate]) -> list[RequestUpdate]:
        """Keep the updates of requests run for decode instances (they are not this
        instance's clients'); start the KV write of those that just finished."""
        mine = []
        for update in updates:
            job = self._jobs.get(update.request_id)
            if job is None:
                mine.append(update)
                continue
            job.token_ids += update.new_token_ids
            job.logprobs += update.new_logprobs
            job.prompt_logprobs += update.new_prompt_logprobs
            job.num_cached_tokens = update.num_cached_tokens
            job.error = update.error
            if update.finish_reason is not None:
                self._submit(job)
        return mine

    @property
    def control_address(self) -> str:
        return self.channel.address

    def close(self) -> None:
        """Stop the inbox thread and the transfer threads (waiting for the ones
        running), then close the connector and the channel."""
        self._inbox.close()
        self._pool.shutdown(wait=True)
        self.connector.close()
        self.channel.close()

    # ---- one request ----------------------------------------------------------------------

    def _start(self, task: PrefillTask) -> None:
        request_id, reply_to = task.request_id, task.reply_to
        try:
            check_compatible(self.connector.descriptor(), task.kv)
            # One token here; min_tokens still bans end tokens for it if it is >= 1.
            params = replace(task.params, max_tokens=1, min_tokens=min(task.params.min_tokens, 1))
            request = Request(request_id, list(task.prompt_token_ids), params)
            request.hold_blocks = True
            self.core.add_request(request)
        except (KVTransferError, ValueError, TypeError, KeyError) as e:
            self._reply_failed(reply_to, request_id, f"{type(e).__name__}: {e}")
            return
        self._jobs[request_id] = _Job(
            request_id, reply_to, task.kv, list(task.dst_blocks), request.num_prompt_tokens
        )

    def _submit(self, job: _Job) -> None:
        """The request finished its first token: write its prompt's blocks in the
        background (the step's device work is complete: its outputs were read)."""
        if job.cancelled or job.error is not None or not job.token_ids:
            why = "cancelled" if job.cancelled else job.error or "no token was produced"
            self._reply_failed(job.reply_to, job.request_id, why)
            self._drop(job)
            return
        block_size = self.core.block_manager.block_size
        num_blocks = -(-job.num_prompt_tokens // block_size)
        src_blocks = list(self.core.block_manager.block_ids(job.request_id))[:num_blocks]
        try:
            job.handoff = start_handoff_export(self.core.pipeline, job.request_id)
        except RuntimeError as e:
            self._reply_failed(job.reply_to, job.request_id, str(e))
            self._drop(job)
            return
        # The decode side hears that the first token is done, and again when the write
        # leaves the queue (``_report_writing``); the liveness reports go on until the answer.
        self.channel.send(job.reply_to, KVTransferring(job.request_id))
        layout = self.connector.descriptor()
        job.num_bytes = 2 * layout["num_layers"] * layout["block_bytes"] * len(src_blocks)
        job.future = self._pool.submit(self._timed_write, job.kv, src_blocks, job.dst_blocks)

    def _timed_write(self, kv: dict, src_blocks: list[int], dst_blocks: list[int]) -> float:
        start = time.perf_counter()
        self.connector.write_blocks(kv, src_blocks, dst_blocks)
        return time.perf_counter() - start

    def _reap(self) -> None:
        for job in [j for j in self._jobs.values() if j.future is not None and j.future.done()]:
            error = job.future.exception()
            handoff = None
            if not job.cancelled and error is None:
                handoff = finish_handoff_export(job.handoff)
                if handoff is None:  # the drafts' copies are still queued: next round
                    continue
            if job.cancelled:  # the decode side holds the blocks until it hears back
                self._reply_failed(job.reply_to, job.request_id, "cancelled")
            elif error is not None:
                self._reply_failed(
                    job.reply_to,
                    job.request_id,
                    f"KV transfer failed: {type(error).__name__}: {error}",
                )
            else:
                self.counters["pd_kv_transfers"] += 1
                self.counters["pd_kv_bytes"] += job.num_bytes
                self.counters["pd_kv_transfer_s"] += job.future.result()
                ready = KVReady(
                    job.request_id,
                    job.token_ids[0],
                    job.logprobs[:1],
                    job.prompt_logprobs,
                    job.num_cached_tokens,
                    handoff,
                )
                self.channel.send(job.reply_to, ready)
            self._drop(job)

    def _cancel(self, request_id: str) -> None:
        job = self._jobs.get(request_id)
        if job is None:
            return
        job.cancelled = True
        if job.future is None:  # not transferring: end it now
            self.core.abort_request(request_id)
            self._reply_failed(job.reply_to, request_id, "cancelled")
            self._drop(job)

    def _drop(self, job: _Job) -> None:
        self._inbox.release(job.request_id)
        self._jobs.pop(job.request_id, None)
        self.core.scheduler.release_held(job.request_id)

    def _reply_failed(self, reply_to: str, request_id: str, error: str) -> None:
        self.counters["pd_failures"] += 1
        logger.warning("prefill for %s failed: %s", request_id, error)
        self.channel.send(reply_to, KVFailed(request_id, error))
        self._inbox.release(request_id)
