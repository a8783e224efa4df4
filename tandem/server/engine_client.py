"""The API process's handle on the engine core process: submit, stream, abort.

One asyncio task reads result frames and routes each request's outputs to its own queue.
Detokenization and stop strings happen here (OutputProcessor); a matched stop string is
sent back to the core, which finishes the request and frees its blocks.

Liveness: the core sends a heartbeat every ``HEARTBEAT_INTERVAL_S``. A core process that
exited, sent nothing for ``stall_timeout_s`` (stopped, frozen) or stayed in one loop turn for
``step_timeout_s`` makes the client dead: every request fails with ``EngineDeadError``, no
new one is taken, and ``on_dead`` is called (the server exits so that a supervisor restarts
it).
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

import zmq
import zmq.asyncio

from tandem.config import EngineConfig
from tandem.engine_process import HEARTBEAT_INTERVAL_S, RankSetup, free_port, run_engine_core
from tandem.messages import (
    TO_CLIENT,
    AbortRequests,
    AddRejected,
    AddRequest,
    EngineFailed,
    EngineInfo,
    EngineReady,
    FinishRequest,
    Heartbeat,
    Message,
    Shutdown,
    StepUpdates,
    decode,
)
from tandem.models.loader import resolve_model
from tandem.output_processor import OutputProcessor
from tandem.outputs import RequestOutput
from tandem.sampling_params import SamplingParams
from tandem.tokenizer import Tokenizer
from tandem.worker.grammars import GrammarBook

STARTUP_TIMEOUT_S = 600
# How long a send to the engine core may wait before the client checks that it still runs
# (a PUSH socket whose peer has exited waits forever).
SEND_CHECK_S = 1.0
# How long the result reader waits for a frame before it checks the core's liveness.
READ_CHECK_MS = 200
DEFAULT_STALL_TIMEOUT_S = 30.0
DEFAULT_STEP_TIMEOUT_S = 600.0


class EngineDeadError(RuntimeError):
    """The engine core process exited, stalled or got stuck (the message says which)."""


class RequestRejected(ValueError):
    """The engine core refused a request (the message says why)."""


class RequestFailed(RuntimeError):
    """A request ended with an error inside the engine (PD: its KV never arrived)."""


class RequestTimedOut(RequestFailed):
    """A request ran past the server's request timeout; it was aborted in the core."""


class AsyncEngineClient:
    """Starts the engine core process and multiplexes requests over ZeroMQ.

    ``stall_timeout_s``: the core is dead when no heartbeat came for this long.
    ``step_timeout_s``: ... or when its loop stayed in one turn this long (None: no bound).
    ``request_timeout_s``: a request still running this long after it was submitted is
    aborted and fails with ``RequestTimedOut`` (None: no deadline)."""

    def __init__(
        self,
        config: EngineConfig,
        tokenizer: Tokenizer | None = None,
        *,
        stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S,
        step_timeout_s: float | None = DEFAULT_STEP_TIMEOUT_S,
        request_timeout_s: float | None = None,
    ):
        if stall_timeout_s < 2 * HEARTBEAT_INTERVAL_S:
            raise ValueError(
                f"stall_timeout_s must be at least {2 * HEARTBEAT_INTERVAL_S} s "
                f"(two heartbeats), got {stall_timeout_s}"
            )
        for name, value in (
            ("step_timeout_s", step_timeout_s),
            ("request_timeout_s", request_timeout_s),
        ):
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be positive, got {value}")
        self.stall_timeout_s = stall_timeout_s
        self.step_timeout_s = step_timeout_s
        self.request_timeout_s = request_timeout_s
        self.config = config
        model_path = resolve_model(config.model)
        if tokenizer is None:
            source = resolve_model(None) if model_path.startswith("dummy:") else model_path
            tokenizer = Tokenizer.from_model_path(source)
        self.tokenizer = tokenizer
        self.processor = OutputProcessor(tokenizer)
        self.info: EngineInfo | None = None  # once the core is ready
        self._grammars: GrammarBook | None = None  # structured output, at its first use
        self.stats: dict = {}
        self._queues: dict[str, asyncio.Queue] = {}
        self._socket_dir = tempfile.mkdtemp(prefix="tandem-")
        self._input_address = f"ipc://{os.path.join(self._socket_dir, 'in')}"
        self._output_address = f"ipc://{os.path.join(self._socket_dir, 'out')}"
        self._context = zmq.asyncio.Context()
        self._to_core = self._context.socket(zmq.PUSH)
        self._to_core.bind(self._input_address)
        self._from_core = self._context.socket(zmq.PULL)
        self._from_core.bind(self._output_address)
        self._processes: list[multiprocessing.Process] = []  # rank 0's first
        self._reader: asyncio.Task | None = None
        self.dead: str | None = None
        # Called once, with the reason, when the core is found dead (the server exits).
        self.on_dead: Callable[[str], None] | None = None
        self._last_heard = time.monotonic()  # when the core last sent anything
        self._turn_age_s = 0.0  # the core's loop turn's age at its last heartbeat

    # ---- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        """Spawn the core process (one per rank with tensor parallelism) and wait until its
        model is loaded."""
        context = multiprocessing.get_context("spawn")
        world_size = self.config.parallel.tensor_parallel_size
        setups: list[RankSetup | None] = [None]
        if world_size > 1:
            followers = tuple(
                f"ipc://{os.path.join(self._socket_dir, f'rank{rank}')}"
                for rank in range(1, world_size)
            )
            port = free_port()
            setups = [RankSetup(rank, world_size, port, followers) for rank in range(world_size)]
        self._processes = [
            context.Process(
                target=run_engine_core,
                args=(self.config, self._input_address, self._output_address, setup),
                daemon=True,
                name="tandem-engine-core" + (f"-rank{setup.rank}" if setup else ""),
            )
            for setup in setups
        ]
        for process in self._processes:
            process.start()
        try:
            while True:
                if await self._from_core.poll(1000):
                    message = decode(await self._from_core.recv(), TO_CLIENT)
                    if isinstance(message, EngineReady):
                        self.info = message.info
                        break
                    if isinstance(message, EngineFailed):
                        raise RuntimeError(f"engine core failed to start: {message.error}")
                elif self._exited() is not None:
                    raise RuntimeError(f"{self._exited()} exited during startup")
        except BaseException:
            self._kill_processes()  # the other ranks would wait for the failed one forever
            self.remove_socket_dir()
            raise
        self._last_heard = time.monotonic()
        self._reader = asyncio.create_task(self._read_results())

    def _exited(self) -> str | None:
        """The name of an engine core process that is no longer running, if any."""
        for process in self._processes:
            if not process.is_alive():
                return f"engine core process {process.name}"
        return None

    def _kill_processes(self) -> None:
        for process in self._processes:
            if process.is_alive():
                process.kill()  # SIGKILL ends a stopped (SIGSTOP) process too
            process.join()

    def liveness_problem(self) -> str | None:
        """Why the core is not live (exited, silent past the stall timeout, stuck in one
        turn past the step timeout), or None while it is."""
        exited = self._exited()
        if exited is not None:
            return f"{exited} exited"
        silent_s = time.monotonic() - self._last_heard
        if silent_s > self.stall_timeout_s:
            return (
                f"engine core stalled: no heartbeat for {silent_s:.1f} s "
                f"(--engine-stall-timeout-s {self.stall_timeout_s:g})"
            )
        if self.step_timeout_s is not None and self._turn_age_s > self.step_timeout_s:
            return (
                f"engine core stuck: one step has run for {self._turn_age_s:.1f} s "
                f"(--engine-step-timeout-s {self.step_timeout_s:g})"
            )
        return None

    async def shutdown(self) -> None:
        """Stop the core (killed at once when it is dead or stalled), close the sockets and
        remove their folder."""
        if self.dead is None and any(process.is_alive() for process in self._processes):
            with contextlib.suppress(EngineDeadError):
                await self._send(Shutdown())  # the leader forwards it
            for process in self._processes:
                await asyncio.to_thread(process.join, 10)
        self._kill_processes()
        if self._reader is not None:
            self._reader.cancel()
        self._to_core.close(linger=0)
        self._from_core.close(linger=0)
        self._context.term()
        self.remove_socket_dir()

    def remove_socket_dir(self) -> None:
        """Remove the folder of this client's ZeroMQ ipc sockets (idempotent)."""
        shutil.rmtree(self._socket_dir, ignore_errors=True)

    async def _send(self, message: Message) -> None:
        """Send ``message`` to the leader core. Raises EngineDeadError, rather than waiting
        forever, when the send cannot complete and the core is dead (or a process exited)."""
        data = message.encode()
        while True:
            if self.dead is not None:
                raise EngineDeadError(self.dead)
            try:
                await asyncio.wait_for(self._to_core.send(data), SEND_CHECK_S)
                return
            except TimeoutError:
                exited = self._exited()
                if exited is not None:
                    raise EngineDeadError(f"{exited} exited") from None

    async def _read_results(self) -> None:
        try:
            await self._read_loop()
        except EngineDeadError as e:  # a send found the core gone
            self._fail_all(str(e))

    async def _read_loop(self) -> None:
        while True:
            if not await self._from_core.poll(READ_CHECK_MS):
                problem = self.liveness_problem()
                if problem is not None:
                    self._fail_all(problem)
                    return
                continue
            message = decode(await self._from_core.recv(), TO_CLIENT)
            self._last_heard = time.monotonic()
            if isinstance(message, Heartbeat):
                self._turn_age_s = message.turn_age_s
                problem = self.liveness_problem()  # results may flow while a rank is gone
                if problem is not None:
                    self._fail_all(problem)
                    return
            elif isinstance(message, StepUpdates):
                await self._deliver(message)
            elif isinstance(message, AddRejected):
                queue = self._queues.get(message.request_id)
                self.processor.abort(message.request_id)
                if queue is not None:
                    queue.put_nowait(RequestRejected(message.error))

    async def _deliver(self, message: StepUpdates) -> None:
        """Route one step's updates: detokenize, match stop strings (finishing matched
        requests in the core), hand each request's output to its queue."""
        self.stats = message.stats
        updates = []
        for update in message.updates:
            if update.error is None:
                updates.append(update)
                continue
            self.processor.abort(update.request_id)
            queue = self._queues.get(update.request_id)
            if queue is not None:
                queue.put_nowait(RequestFailed(update.error))
        outputs, stopped, failed = self.processor.process(updates, delta=True)
        for request_id, stop_string in stopped:
            await self._send(FinishRequest(request_id, stop_string))
        if failed:  # detokenizing (or a stop string) raised: the core ends them too
            await self._send(AbortRequests([request_id for request_id, _ in failed]))
        for request_id, error in failed:
            queue = self._queues.get(request_id)
            if queue is not None:
                queue.put_nowait(RequestFailed(error))
        failed_ids = {request_id for request_id, _ in failed}
        for output in outputs:
            if output.request_id in failed_ids:
                continue
            queue = self._queues.get(output.request_id)
            if queue is not None:
                queue.put_nowait(output)

    def _fail_all(self, why: str) -> None:
        if self.dead is not None:
            return
        self.dead = why
        self.stats = {}  # the core's last counters are not its state any more
        for queue in self._queues.values():
            queue.put_nowait(EngineDeadError(why))
        if self.on_dead is not None:
            self.on_dead(why)

    # ---- requests ------------------------------------------------------------------------

    def validate_prompt(
        self, prompt_token_ids: list[int], params: SamplingParams | None = None
    ) -> None:
        """Reject what the core would reject, before it is sent (ValueError): the core's own
        validation, with the limits it reported (end tokens as the core will see them)."""
        if params is not None:
            params = replace(params, eos_token_ids=self.tokenizer.end_token_ids)
        self.info.limits.validate(prompt_token_ids, params)
        if params is not None and params.guided is not None:  # compiles for this tokenizer
            if self._grammars is None:
                self._grammars = GrammarBook.of(self.tokenizer, self.info.limits.vocab_size)
            self._grammars.compile(params.guided)

    async def generate(
        self,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        remote_prefill: str | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its delta outputs; aborts it if the caller stops early.
        ``remote_prefill`` (decode instances): the control address of the prefill instance
        that computes the prompt's KV. ``request_id`` (the HTTP response's id, so a log line
        traces to what the client saw) must be unique among running requests; one is made
        when None."""
        if self.dead:
            raise EngineDeadError(self.dead)
        self.validate_prompt(prompt_token_ids, params)
        deadline = None
        if self.request_timeout_s is not None:
            deadline = time.monotonic() + self.request_timeout_s
        request_id = request_id or f"req-{uuid.uuid4().hex}"
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already running")
        params = replace(params, eos_token_ids=self.tokenizer.end_token_ids)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        self.processor.add_request(request_id, prompt, prompt_token_ids, params)
        finished = False
        try:
            await self._send(AddRequest(request_id, prompt_token_ids, params, remote_prefill))
            while not finished:
                item = await self._next(queue, deadline)
                if isinstance(item, Exception):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self.processor.abort(request_id)
                if not self.dead:
                    with contextlib.suppress(EngineDeadError):  # nothing left to abort
                        await self._send(AbortRequests([request_id]))

    async def _next(self, queue: asyncio.Queue, deadline: float | None):
        """The request's next item, or RequestTimedOut once ``deadline`` passes."""
        if deadline is None:
            return await queue.get()
        try:
            return await asyncio.wait_for(queue.get(), max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            raise RequestTimedOut(
                f"request timed out after {self.request_timeout_s:g} s "
                "(the server's --request-timeout-s)"
            ) from None

    @property
    def num_active_requests(self) -> int:
        return len(self._queues)
