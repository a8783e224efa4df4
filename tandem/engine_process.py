"""The engine core in its own process, talking to the API process over ZeroMQ with the typed
messages of ``tandem.messages``.

Requests come in (PULL): ``AddRequest``, ``AbortRequests``, ``FinishRequest``, ``Shutdown``.
Results go out (PUSH): ``EngineReady`` once (or ``EngineFailed``), then per step
``StepUpdates`` (the step's request updates and the engine's counters), and ``AddRejected``
for a request the core refused. A PD role (prefill or decode) is attached to the core here
(``tandem.disagg.setup``), so its peers' messages are handled inside the core's steps.

A heartbeat thread sends ``Heartbeat`` every ``HEARTBEAT_INTERVAL_S``, idle or busy (a long
step releases the GIL in torch, or is preempted by the interpreter), with the age of the
loop's current turn: the client tells a stopped or frozen process (no heartbeat) from one
stuck in a step (heartbeats, but an old turn).

With tensor parallelism (``tensor_parallel_size`` N > 1) the client starts N such processes,
one per rank, that join one torch.distributed group (``RankSetup``). Rank 0, the leader,
alone talks to the client: each loop turn it forwards what it took from its input socket, as
one ``Turn``, to every follower before handling it; a follower handles the same messages in
the same order and takes the same steps, so all ranks' schedulers stay in lockstep and meet
in the same collectives. Only the leader sends results.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
import traceback
from dataclasses import dataclass, replace

import zmq

from tandem.config import EngineConfig, ParallelConfig
from tandem.messages import (
    TO_ENGINE,
    AbortRequests,
    AddRejected,
    AddRequest,
    EngineFailed,
    EngineInfo,
    EngineReady,
    FinishRequest,
    Heartbeat,
    Message,
    MessageError,
    Shutdown,
    StepUpdates,
    Turn,
    decode,
)
from tandem.request import Request

logger = logging.getLogger("tandem.engine")

POLL_IDLE_MS = 100
HEARTBEAT_INTERVAL_S = 0.5


@dataclass(frozen=True)
class RankSetup:
    """One rank's place in a tensor-parallel engine: its rank, where the group meets
    (torch.distributed's env:// rendezvous on ``master_port`` of 127.0.0.1) and the ZeroMQ
    addresses on which the leader sends each follower its turns (``follower_addresses[r-1]``
    is rank r's)."""

    rank: int
    world_size: int
    master_port: int
    follower_addresses: tuple[str, ...]


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now (for the ranks' rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def join_tensor_parallel_group(config: EngineConfig, setup: RankSetup) -> EngineConfig:
    """Join the ranks' process group (gloo on the CPU, nccl on CUDA; rank r takes GPU r) and
    return ``config`` with this rank's device and ParallelConfig."""
    from tandem.models.tensor_parallel import check_rank_devices, init_process_group

    check_rank_devices(config.device, setup.world_size)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(setup.master_port),
        RANK=str(setup.rank),
        WORLD_SIZE=str(setup.world_size),
        LOCAL_RANK=str(setup.rank),
    )
    device = init_process_group(config.device)
    return replace(config, device=device, parallel=ParallelConfig(setup.world_size, setup.rank))


class EngineCoreProcess:
    """Runs an EngineCore loop fed by a ZeroMQ socket until told to shut down.

    With a ``setup`` of rank 0 it also forwards its input to the followers; with one of a
    higher rank it reads its input from the leader instead of the client and sends nothing
    back (the leader reports for all ranks)."""

    def __init__(
        self,
        config: EngineConfig,
        input_address: str,
        output_address: str,
        setup: RankSetup | None = None,
    ):
        from tandem.core.engine_core import EngineCore
        from tandem.disagg.setup import start_pd_role

        if setup is not None:
            config = join_tensor_parallel_group(config, setup)
        self.is_follower = setup is not None and setup.rank > 0
        self.context = zmq.Context()
        self.inputs = self.context.socket(zmq.PULL)
        self.followers: list[zmq.Socket] = []
        self.outputs: zmq.Socket | None = None
        if self.is_follower:
            self.inputs.connect(setup.follower_addresses[setup.rank - 1])
        else:
            self.inputs.connect(input_address)
            self.outputs = self.context.socket(zmq.PUSH)
            self.outputs.connect(output_address)
            for address in setup.follower_addresses if setup is not None else ():
                follower = self.context.socket(zmq.PUSH)
                follower.bind(address)
                self.followers.append(follower)
        self.core = EngineCore(config)
        if config.disagg.role != "mixed":
            start_pd_role(self.core)
        self.running = True
        self._parent = os.getppid()  # the API process; if it dies, so does this one
        self._output_address = output_address
        self.turn_started = time.monotonic()  # read by the heartbeat thread
        self._reported_metrics: dict | None = None  # the last metrics a PD instance sent

    def info(self) -> EngineInfo:
        """This engine's limits and role, for the client."""
        core = self.core
        return EngineInfo(
            max_model_len=core.max_model_len,
            vocab_size=core.arch.vocab_size,
            num_kv_blocks=core.num_blocks,
            block_size=core.block_manager.block_size,
            model_path=core.model_path,
            role=core.config.disagg.role,
            control_address=core.control_address,
        )

    def _handle(self, message: Message) -> None:
        """Act on one client message. A fault while handling it ends only that message
        (an AddRequest is rejected); the core serves on."""
        try:
            self._act(message)
        except Exception as error:  # noqa: BLE001 (one message's fault never ends the core)
            logger.error("engine core: handling a %s failed", message.TYPE, exc_info=error)
            if isinstance(message, AddRequest):
                why = f"internal error: {type(error).__name__}: {error}"
                self._send(AddRejected(message.request_id, why))

    def _act(self, message: Message) -> None:
        if isinstance(message, AddRequest):
            try:
                request = Request(message.request_id, message.prompt_token_ids, message.params)
                request.remote_prefill = message.remote_prefill
                self.core.add_request(request)
            except ValueError as e:
                self._send(AddRejected(message.request_id, str(e)))
        elif isinstance(message, AbortRequests):
            for request_id in message.request_ids:
                self.core.abort_request(request_id)
        elif isinstance(message, FinishRequest):
            self.core.finish_request(message.request_id, message.stop_string)
        elif isinstance(message, Shutdown):
            self.running = False

    def _pd_iteration(self) -> None:
        """One turn of a PD instance's loop: its peers' messages are polled inside
        ``step`` (which waits on them briefly when idle), so the inputs are not waited on."""
        busy = self.core.has_unfinished_requests()
        handled = self._drain_inputs(block=False)
        if not self.running:
            return
        updates = self.core.step()
        metrics = self.core.metrics()
        # Work that ends while the instance is idle (a KV transfer reaped, its blocks freed)
        # changes only the metrics: they are reported too, or /metrics would lag behind.
        if updates or busy or handled or metrics != self._reported_metrics:
            self._send(StepUpdates(updates, metrics))
            self._reported_metrics = metrics

    def _send(self, message: Message) -> None:
        if self.outputs is not None:  # followers report nothing: the leader does
            self.outputs.send(message.encode())

    def _receive(self) -> Message | None:
        """The next input message; a malformed one is dropped with a log line (None)."""
        frame = self.inputs.recv()
        try:
            return decode(frame, TO_ENGINE)
        except MessageError as e:
            logger.warning("engine core: dropped an input message: %s", e)
        except Exception as error:  # noqa: BLE001 (a frame decode did not foresee)
            logger.error("engine core: dropped an input message", exc_info=error)
        return None

    def _drain_inputs(self, block: bool) -> int:
        """Handle every waiting message (a follower: its leader's next turn, waiting for it
        however ``block`` says); returns how many there were."""
        if self.is_follower:
            return self._follow_turn()
        timeout = POLL_IDLE_MS if block else 0
        messages = []
        while self.inputs.poll(timeout):
            message = self._receive()
            if message is not None:
                messages.append(message)
            timeout = 0
        if self.followers:  # every turn, so the followers take their steps in step with us
            turn = Turn(messages).encode()
            for follower in self.followers:
                follower.send(turn)
        for message in messages:
            self._handle(message)
        return len(messages)

    def _follow_turn(self) -> int:
        """Wait for the leader's next turn (checking that the client lives), handle it."""
        while not self.inputs.poll(POLL_IDLE_MS):
            if os.getppid() != self._parent:
                self.running = False
                return 0
        turn = self._receive()
        messages = turn.messages if isinstance(turn, Turn) else []
        for message in messages:
            self._handle(message)
        return len(messages)

    def _beat(self, stop: threading.Event) -> None:
        """The heartbeat thread's loop, on its own socket (ZeroMQ sockets are not
        thread-safe). A beat that cannot be queued (the client reads nothing) is dropped,
        never waited for."""
        sock = self.context.socket(zmq.PUSH)
        sock.connect(self._output_address)
        try:
            while not stop.wait(HEARTBEAT_INTERVAL_S):
                beat = Heartbeat(time.monotonic() - self.turn_started).encode()
                with contextlib.suppress(zmq.Again):
                    sock.send(beat, zmq.NOBLOCK)
        finally:
            sock.close(linger=0)

    def run(self) -> None:
        """Report ready, then serve until shutdown (or the API process is gone)."""
        stop_beating = threading.Event()
        heart = None
        if self.outputs is not None:  # the leader beats for all ranks
            heart = threading.Thread(
                target=self._beat, args=(stop_beating,), daemon=True, name="tandem-heartbeat"
            )
            heart.start()
        try:
            self._serve()
        finally:
            stop_beating.set()
            if heart is not None:
                heart.join()
        self.core.shutdown()
        for sock in (self.inputs, self.outputs, *self.followers):
            if sock is not None:
                sock.close(linger=0)
        self.context.term()

    def _serve(self) -> None:
        self._send(EngineReady(self.info()))
        while self.running:
            self.turn_started = time.monotonic()
            if os.getppid() != self._parent:
                logger.error("the API process exited; the engine core stops")
                break
            if self.core.pd is not None:
                self._pd_iteration()
                continue
            handled = self._drain_inputs(block=not self.core.has_unfinished_requests())
            if not self.running:
                break
            if not self.core.has_unfinished_requests():
                if handled:  # aborts or finishes emptied the engine: report the idle state
                    self.core.step()  # lets the runner drop finished requests' state
                    self._send(StepUpdates([], self.core.metrics()))
                continue
            updates = self.core.step()
            self._send(StepUpdates(updates, self.core.metrics()))


def run_engine_core(
    config: EngineConfig, input_address: str, output_address: str, setup: RankSetup | None = None
) -> None:
    """Process entry point: start the core (a tensor-parallel rank with ``setup``), report a
    startup failure, run until shutdown."""
    logging.basicConfig(level=logging.INFO)
    try:
        proc = EngineCoreProcess(config, input_address, output_address, setup)
    except Exception as e:  # noqa: BLE001 (any startup failure is reported, then we exit)
        context = zmq.Context()
        sock = context.socket(zmq.PUSH)
        sock.connect(output_address)
        sock.send(EngineFailed(f"{type(e).__name__}: {e}\n{traceback.format_exc()}").encode())
        sock.close(linger=1000)
        context.term()
        return
    proc.run()
