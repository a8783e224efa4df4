"""The engine core in its own process, talking msgpack frames over ZeroMQ.

Requests in (PULL): ``["add", request_id, prompt_token_ids, sampling_params_dict]``,
``["abort", [request_id, ...]]``, ``["finish", request_id, stop_string]``, ``["shutdown"]``.
Results out (PUSH): ``["ready", info]`` once, then per step ``["updates", [update, ...], stats]``
where each update is a RequestUpdate as a list, and ``["error", request_id, message]`` for a
request the core refused.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import traceback

import msgpack
import zmq

from tandem.config import EngineConfig
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
        request_id, tokens, as_entries(logprobs), as_entries(prompt_logprobs), finish, stop, cached,
        error,
    )


class EngineCoreProcess:
    """Runs an EngineCore loop fed by a ZeroMQ socket until told to shut down."""

    def __init__(self, config: EngineConfig, input_address: str, output_address: str):
        from tandem.core.engine_core import EngineCore

        self.context = zmq.Context()
        self.inputs = self.context.socket(zmq.PULL)
        self.inputs.connect(input_address)
        self.outputs = self.context.socket(zmq.PUSH)
        self.outputs.connect(output_address)
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
                self.outputs.send(pack(["error", request_id, str(e)]))
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
            self.outputs.send(pack(["updates", [update_to_list(u) for u in updates],
                                    self.core.metrics()]))

    def _drain_inputs(self, block: bool) -> int:
        """Handle every waiting message; returns how many there were."""
        timeout = POLL_IDLE_MS if block else 0
        handled = 0
        while self.inputs.poll(timeout):
            self._handle(unpack(self.inputs.recv()))
            handled += 1
            timeout = 0
        return handled

    def run(self) -> None:
        self.outputs.send(pack(["ready", self.info()]))
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
                    self.outputs.send(pack(["updates", [], self.core.metrics()]))
                continue
            updates = self.core.step()
            stats = self.core.metrics()
            self.outputs.send(pack(["updates", [update_to_list(u) for u in updates], stats]))
        self.core.shutdown()
        self.inputs.close(linger=0)
        self.outputs.close(linger=0)
        self.context.term()


def run_engine_core(config: EngineConfig, input_address: str, output_address: str) -> None:
    """Process entry point: start the core, report a startup failure, run until shutdown."""
    logging.basicConfig(level=logging.INFO)
    try:
        proc = EngineCoreProcess(config, input_address, output_address)
    except Exception as e:  # noqa: BLE001 (any startup failure is reported, then we exit)
        context = zmq.Context()
        sock = context.socket(zmq.PUSH)
        sock.connect(output_address)
        sock.send(pack(["failed", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"]))
        sock.close(linger=1000)
        context.term()
        return
    proc.run()
