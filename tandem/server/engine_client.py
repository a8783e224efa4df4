"""The API process's handle on the engine core process: submit, stream, abort.

One asyncio task reads result frames and routes each request's outputs to its own queue.
Detokenization and stop strings happen here (OutputProcessor); a matched stop string is
sent back to the core, which finishes the request and frees its blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import tempfile
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace

import zmq
import zmq.asyncio

from tandem.config import EngineConfig
from tandem.engine_process import RankSetup, free_port, run_engine_core
from tandem.messages import (
    TO_CLIENT,
    AbortRequests,
    AddRejected,
    AddRequest,
    EngineFailed,
    EngineInfo,
    EngineReady,
    FinishRequest,
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

STARTUP_TIMEOUT_S = 600
# How long a send to the engine core may wait before the client checks that it still runs
# (a PUSH socket whose peer has exited waits forever).
SEND_CHECK_S = 1.0


class EngineDeadError(RuntimeError):
    """The engine core process exited."""


class RequestRejected(ValueError):
    """The engine core refused a request (the message says why)."""


class RequestFailed(RuntimeError):
    """A request ended with an error inside the engine (PD: its KV never arrived)."""


class AsyncEngineClient:
    """Starts the engine core process and multiplexes requests over ZeroMQ."""

    def __init__(self, config: EngineConfig, tokenizer: Tokenizer | None = None):
        self.config = config
        model_path = resolve_model(config.model)
        if tokenizer is None:
            source = resolve_model(None) if model_path.startswith("dummy:") else model_path
            tokenizer = Tokenizer.from_model_path(source)
        self.tokenizer = tokenizer
        self.processor = OutputProcessor(tokenizer)
        self.info: EngineInfo | None = None  # once the core is ready
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
            raise
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
                process.kill()
            process.join()

    async def shutdown(self) -> None:
        if any(process.is_alive() for process in self._processes):
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

    async def _send(self, message: Message) -> None:
        """Send ``message`` to the leader core. Raises EngineDeadError, rather than waiting
        forever, when the send cannot complete and a core process has exited."""
        data = message.encode()
        while True:
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
            if not await self._from_core.poll(1000):
                exited = self._exited()
                if exited is not None:
                    self._fail_all(f"{exited} exited")
                    return
                continue
            message = decode(await self._from_core.recv(), TO_CLIENT)
            if isinstance(message, StepUpdates):
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
        self.dead = why
        for queue in self._queues.values():
            queue.put_nowait(EngineDeadError(why))

    # ---- requests ------------------------------------------------------------------------

    def validate_prompt(
        self, prompt_token_ids: list[int], params: SamplingParams | None = None
    ) -> None:
        """Reject what the core would reject, before it is sent (ValueError): the core's own
        validation, with the limits it reported (end tokens as the core will see them)."""
        if params is not None:
            params = replace(params, eos_token_ids=self.tokenizer.end_token_ids)
        self.info.limits.validate(prompt_token_ids, params)

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
                item = await queue.get()
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

    @property
    def num_active_requests(self) -> int:
        return len(self._queues)
