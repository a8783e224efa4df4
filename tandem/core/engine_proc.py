"""The engine core in its own process, talking msgpack frames over ZeroMQ.

Requests in (PULL): ``["add", request_id, prompt_token_ids, sampling_params_dict]``,
``["abort", [request_id, ...]]``, ``["finish", request_id, stop_string]``, ``["shutdown"]``.
Results out (PUSH): ``["ready", info]`` once, then per step ``["updates", [update, ...], stats]``
where each update is a RequestUpdate as a list, and ``["error", request_id, message]`` for a
request the core refused.

With tensor parallelism (``tensor_parallel_size`` N > 1) the client starts N such processes,
one per rank, that join one torch.distributed group (``RankSetup``). Rank 0, the leader,
alone talks to the client: each loop turn it forwards what it took from its input socket, as
one ``["turn", [message, ...]]`` frame, to every follower before handling it; a follower
handles the same messages in the same order and takes the same steps, so all ranks'
schedulers stay in lockstep and meet in the same collectives. Only the leader sends results.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import traceback
from dataclasses import dataclass, replace

import msgpack
import zmq

from tandem.config import EngineConfig, ParallelConfig
from tandem.core.scheduler import RequestUpdate
from tandem.request import Request
from tandem.sampling_params import SamplingParams

logger = logging.getLogger("tandem.engine")

POLL_IDLE_MS = 100


def pack(message: list) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def unpack(frame: bytes) -> list:
    return msgpack.unpackb(frame, raw=False, strict_map_key=False)


def params_to_dict(params: SamplingParams) -> dict:
    data = dataclasses.asdict(params)
    data["eos_token_ids"] = sorted(params.eos_token_ids)
    return data


def params_from_dict(data: dict) -> SamplingParams:
    data = dict(data)
    data["eos_token_ids"] = frozenset(data.get("eos_token_ids") or ())
    return SamplingParams(**data)


def update_to_list(update: RequestUpdate) -> list:
    return [
        update.request_id,
        update.new_token_ids,
        [list(e) for e in update.new_logprobs],
        [list(e) for e in update.new_prompt_logprobs],
        update.finish_reason,
        update.stop_reason,
        update.num_cached_tokens,
        update.error,
    ]


def update_from_list(data: list) -> RequestUpdate:
    request_id, tokens, logprobs, prompt_logprobs, finish, stop, cached, error = data

    def as_entries(entries: list) -> list:
        return [(e[0], e[1], e[2], [tuple(t) for t in e[3]]) for e in entries]

    return RequestUpdate(
        request_id,
        tokens,
        as_entries(logprobs),
        as_entries(prompt_logprobs),
        finish,
        stop,
        cached,
        error,
    )


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
        self.running = True
        self._parent = os.getppid()  # the API process; if it dies, so does this one

    def info(self) -> dict:
        core = self.core
        return {
            "max_model_len": core.max_model_len,
            "vocab_size": core.arch.vocab_size,
            "num_kv_blocks": core.num_blocks,
            "block_size": core.block_manager.block_size,
            "model_path": core.model_path,
            "role": core.config.disagg.role,
            "control_address": core.control_address,
        }

    def _handle(self, message: list) -> None:
        kind = message[0]
        if kind == "add":
            _, request_id, prompt_ids, params, *rest = message
            try:
                request = Request(request_id, prompt_ids, params_from_dict(params))
                request.remote_prefill = rest[0] if rest else None
                self.core.add_request(request)
            except ValueError as e:
                self._send(["error", request_id, str(e)])
        elif kind == "abort":
            for request_id in message[1]:
                self.core.abort_request(request_id)
        elif kind == "finish":
            self.core.finish_request(message[1], message[2])
        elif kind == "shutdown":
            self.running = False

    def _pd_iteration(self) -> None:
        """One turn of a PD instance's loop: its peers' messages are polled inside
        ``step`` (which waits on them briefly when idle), so the inputs are not waited on."""
        busy = self.core.has_unfinished_requests()
        handled = self._drain_inputs(block=False)
        if not self.running:
            return
        updates = self.core.step()
        if updates or busy or handled:
            self._send(["updates", [update_to_list(u) for u in updates], self.core.metrics()])

    def _send(self, message: list) -> None:
        if self.outputs is not None:  # followers report nothing: the leader does
            self.outputs.send(pack(message))

    def _drain_inputs(self, block: bool) -> int:
        """Handle every waiting message (a follower: its leader's next turn, waiting for it
        however ``block`` says); returns how many there were."""
        if self.is_follower:
            return self._follow_turn()
        timeout = POLL_IDLE_MS if block else 0
        messages = []
        while self.inputs.poll(timeout):
            messages.append(unpack(self.inputs.recv()))
            timeout = 0
        if self.followers:  # every turn, so the followers take their steps in step with us
            turn = pack(["turn", messages])
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
        _, messages = unpack(self.inputs.recv())
        for message in messages:
            self._handle(message)
        return len(messages)

    def run(self) -> None:
        self._send(["ready", self.info()])
        while self.running:
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
                    self._send(["updates", [], self.core.metrics()])
                continue
            updates = self.core.step()
            self._send(["updates", [update_to_list(u) for u in updates], self.core.metrics()])
        self.core.shutdown()
        for sock in (self.inputs, self.outputs, *self.followers):
            if sock is not None:
                sock.close(linger=0)
        self.context.term()


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
        sock.send(pack(["failed", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"]))
        sock.close(linger=1000)
        context.term()
        return
    proc.run()
