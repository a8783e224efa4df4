"""The engine core: scheduler + worker in one loop. ``step()`` is the whole story:

    step = scheduler.schedule()
    results = pipeline.execute(step)          # worker/step_pipeline.py
    updates = scheduler.update_from_output(step, results)

With overlap scheduling (the default) the worker works one step ahead: ``step()`` schedules
step n+1, has the step pipeline queue its device work and then read step n, and applies
step n while the device computes step n+1. The device's queue is what overlaps the host's
work with the device's; no second host thread is needed (on the CPU, where every op runs
as it is issued, the same code runs and simply overlaps nothing).
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass
from typing import Protocol

import torch

from tandem.config import EngineConfig
from tandem.core.kv_cache import BlockManager
from tandem.core.scheduler import Scheduler
from tandem.models.loader import ModelFiles
from tandem.models.mtp import resolve_auto_speculation
from tandem.models.tensor_parallel import min_over_ranks
from tandem.request import PromptLimits, Request, RequestStatus
from tandem.step import ModelRunnerOutput, RequestUpdate, SchedulerOutput
from tandem.worker.model_runner import ModelRunner, kv_cache_bytes_per_block
from tandem.worker.step_pipeline import StepPipeline

logger = logging.getLogger(__name__)
# Memory kept out of the KV cache for CUDA graphs' pools and cuBLAS workspaces.
_CUDA_GRAPH_RESERVE = 1 << 30


@dataclass
class StepRecord:
    """One applied step, for benchmarks that break a run's time down by step shape."""

    time_s: float  # perf_counter() when the step's results were applied
    num_rows: int
    num_prompt_rows: int  # rows computing prompt tokens (prefill chunks)
    num_tokens: int  # tokens scheduled (with overlap, follow-up rows count their room)
    wait_s: float  # the host's wait for device results since the previous record
    device_s: float = 0.0  # the device time of the steps read since the previous record
    schedule_s: float = 0.0  # the host's time in the scheduler's schedule() since then
    launch_s: float = 0.0  # the host's time preparing and queueing steps since then


class DisaggRole(Protocol):
    """A PD instance's side (``tandem.disagg``: prefill or decode), as the loop uses it."""

    counters: dict[str, float]

    @property
    def busy(self) -> bool:
        """A handover is under way (the engine is not idle)."""

    @property
    def control_address(self) -> str:
        """Where peers send this instance's control messages."""

    def poll(self, wait: bool) -> list[RequestUpdate]:
        """Take the peers' messages (waiting briefly if ``wait``); updates they caused."""

    def after_step(self, updates: list[RequestUpdate]) -> list[RequestUpdate]:
        """The step's updates that go to this instance's clients."""

    def close(self) -> None:
        """Stop the role's threads and close its connector and channel."""


class EngineCore:
    """Owns the scheduler, block manager, model runner and step pipeline of one engine
    instance. A PD instance's role is attached after construction
    (``tandem.disagg.setup.start_pd_role``)."""

    def __init__(self, config: EngineConfig):
        files = ModelFiles(config.model)
        self.config = config = resolve_auto_speculation(config, files)
        self.model_path = files.path
        self.arch = files.arch
        max_len = config.scheduler.max_model_len or self.arch.max_position_embeddings
        self.max_model_len = max_len
        dtype = getattr(torch, config.resolved_dtype_name())
        block_size = config.cache.block_size
        spec = config.speculative
        use_mtp = spec.method == "mtp"
        self.runner = ModelRunner(
            config, files, max_len, mtp_source=spec.model if use_mtp else None, use_mtp=use_mtp
        )
        num_mtp_layers = self.runner.mtp_head.num_layers if use_mtp else 0
        # The runner's arch: with tensor parallelism a rank caches only its own KV heads.
        per_block = kv_cache_bytes_per_block(self.runner.arch, block_size, dtype, num_mtp_layers)
        num_blocks = config.cache.num_blocks or self._num_kv_blocks(per_block)
        if config.parallel.tensor_parallel_size > 1:
            # Ranks' free memory differs; their schedulers stay in lockstep only on equal caches.
            num_blocks = min_over_ranks(num_blocks, self.runner.device)
        self.num_blocks = num_blocks
        # One request alone must always fit, or it would preempt itself forever.
        max_len = min(max_len, num_blocks * block_size)
        self.max_model_len = max_len
        self.runner.allocate_kv_cache(num_blocks, max_len)
        self.pipeline = StepPipeline(self.runner)
        self.limits = PromptLimits(max_len, self.arch.vocab_size, num_blocks, block_size)
        self.block_manager = BlockManager(
            num_blocks, block_size, config.cache.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            config.scheduler,
            self.block_manager,
            max_len,
            spec.num_speculative_tokens if spec.method else 0,
        )
        # Overlap scheduling: the step launched but not applied yet.
        self._overlap = config.overlap
        self._in_flight: SchedulerOutput | None = None
        # PD disaggregation: this instance's prefill or decode side (None when mixed).
        self.pd: DisaggRole | None = None
        self.counters = {
            "num_requests_added": 0,
            "num_requests_finished": 0,
            "num_requests_aborted": 0,
            "num_prompt_tokens": 0,
            "num_generation_tokens": 0,
            "num_steps": 0,
            "num_preemptions": 0,
        }
        # Opt-in (start_step_log): one StepRecord per applied step.
        self.step_log: list[StepRecord] | None = None
        self._schedule_seconds = 0.0
        self._logged_clocks = self._clocks()
        self.freeze_heap()

    def start_step_log(self) -> list[StepRecord]:
        """Log every step applied from now on (on CUDA with each step's device time) into
        the returned list, until ``stop_step_log``; the first record counts only the host's
        and the device's time since this call."""
        self.pipeline.reader.time_steps = True
        self._logged_clocks = self._clocks()
        self.step_log = []
        return self.step_log

    def stop_step_log(self) -> None:
        """End the step log (and the timing of steps on the device)."""
        self.step_log = None
        self.pipeline.reader.time_steps = False

    def freeze_heap(self) -> None:
        """On CUDA: move every object alive now out of the garbage collector's reach.

        A full collection walks every tracked object not frozen, and one comes every few
        dozen steps of a large batch: over what start-up builds (the model, the graphs,
        the tokenizer and the modules it imports: 100k+ objects) each took 140-230 ms on
        the H200's host, 21 of them in one ShareGPT run. Frozen, they are skipped;
        ``shutdown()`` thaws them. Whoever builds more for the long run after this engine
        (``LLM`` its tokenizer) calls it again. Only on CUDA: CPU engines (tests) come and
        go freely."""
        if self.runner.device.type == "cuda":
            gc.collect()
            gc.freeze()

    def attach_pd_role(self, role: DisaggRole) -> None:
        """Make this instance the prefill or decode side that ``role`` runs."""
        if self.config.disagg.role == "mixed":
            raise ValueError("a mixed instance takes no PD role")
        self.pd = role

    def _num_kv_blocks(self, bytes_per_block: int) -> int:
        """Blocks that fit in kv_cache_memory_gb, or on CUDA in the memory left under
        gpu_memory_utilization after the weights and the largest step's activations."""
        cache = self.config.cache
        if cache.kv_cache_memory_gb is not None:
            budget = cache.kv_cache_memory_gb * 2**30
        elif self.runner.device.type == "cuda":
            peak = self.runner.profile_peak_bytes()
            free, total = torch.cuda.mem_get_info(self.runner.device)
            # What this process holds counts even where the driver reports it late.
            used = max(total - free, torch.cuda.memory_reserved(self.runner.device))
            reserve = _CUDA_GRAPH_RESERVE if self.runner.uses_cuda_graphs else 0
            budget = total * cache.gpu_memory_utilization - used - peak - reserve
            logger.info(
                "KV cache budget %.2f GiB: GPU %.1f GiB x %.2f, in use %.2f GiB, "
                "largest step %.2f GiB, CUDA graphs %.2f GiB",
                budget / 2**30,
                total / 2**30,
                cache.gpu_memory_utilization,
                used / 2**30,
                peak / 2**30,
                reserve / 2**30,
            )
            if budget < bytes_per_block:
                raise ValueError(
                    f"no GPU memory left for the KV cache: {free / 2**30:.1f} GiB free of "
                    f"{total / 2**30:.1f}, the largest step needs {peak / 2**30:.2f}; raise "
                    "--gpu-memory-utilization or lower --max-num-batched-tokens"
                )
        else:
            budget = cache.CPU_DEFAULT_GB * 2**30
        return max(1, int(budget // bytes_per_block))

    # ---- requests ------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request (ValueError if it can never run here). One that names a
        ``remote_prefill`` needs the decode role: its prompt's KV comes from there."""
        if request.remote_prefill and self.config.disagg.role != "decode":
            raise ValueError(
                "this instance's role is "
                f"{self.config.disagg.role!r}; only a decode instance takes "
                "requests prefilled elsewhere"
            )
        self.limits.validate(request.prompt_token_ids, request.sampling_params)
        self.pipeline.grammars.check(request.sampling_params)  # its constraint compiles
        self.scheduler.add_request(request)  # last: a request that raises is not queued
        self.counters["num_requests_added"] += 1
        self.counters["num_prompt_tokens"] += request.num_prompt_tokens

    def abort_request(self, request_id: str) -> bool:
        """Abort a request wherever it is; returns False for unknown or finished ids."""
        request = self.scheduler.abort_request(request_id)
        if request is not None:
            self.counters["num_requests_aborted"] += 1
        return request is not None

    def finish_request(self, request_id: str, stop_reason: str) -> None:
        """End a request whose stop string matched outside the core."""
        self.scheduler.finish_request(request_id, RequestStatus.FINISHED_STOPPED, stop_reason)

    def has_unfinished_requests(self) -> bool:
        """True while a request is waiting or running, a step is still in flight, or (PD)
        a handover is under way."""
        return (
            self.scheduler.has_unfinished_requests()
            or self._in_flight is not None
            or (self.pd is not None and self.pd.busy)
        )

    @property
    def control_address(self) -> str | None:
        """PD roles: where peers send this instance's control messages."""
        return self.pd.control_address if self.pd is not None else None

    # ---- the loop ------------------------------------------------------------------------

    def step(self) -> list[RequestUpdate]:
        """Schedule, run and post-process one step (with overlap: the runner queues the new
        step's device work, then reads the one before it, which is applied here). PD roles
        first take their peers' messages (waiting briefly when nothing else is to do)."""
        if self.pd is None:
            updates = self._contained_step()
        else:
            scheduler = self.scheduler
            idle = not (scheduler.running or scheduler.waiting or self._in_flight is not None)
            updates = self.pd.poll(wait=idle)  # nothing to compute: wait for peers, briefly
            updates += self.pd.after_step(self._contained_step())
        if self._in_flight is None:
            # No step holds the requests that just ended: the worker forgets them now
            # rather than at the next step, which may never come.
            self.pipeline.drop_requests(self.scheduler.take_finished_ids())
        return updates

    def _contained_step(self) -> list[RequestUpdate]:
        """``_step`` with faults contained: one that a request causes fails it (caught per
        request by the scheduler), one in the device work fails the requests of the steps
        involved, any other the running ones; the engine serves on. The failed requests'
        error updates are among those returned."""
        try:
            updates = self._step()
        except Exception as error:  # noqa: BLE001 (contained: the requests fail, not the core)
            self._in_flight = None
            running = [request.request_id for request in self.scheduler.running]
            self._fail_requests(running, "the engine's step", error)
            updates = []
        return updates + self.scheduler.take_failed_updates()

    def _run_steps(self, steps: list[SchedulerOutput | None], run) -> tuple[bool, object]:
        """(True, ``run()``): the pipeline's device work for ``steps``; if it raises,
        (False, None) after the requests of ``steps`` fail and the pipeline forgets its
        launched step."""
        try:
            return True, run()
        except Exception as error:  # noqa: BLE001 (contained: the requests fail, not the core)
            ids = [row.request.request_id for step in steps if step for row in step.scheduled]
            self._fail_requests(ids, "a batched step", error)
            return False, None

    def _fail_requests(self, request_ids: list[str], where: str, error: Exception) -> None:
        """Fail ``request_ids`` after a fault in ``where`` that no one request is known to
        have caused; the pipeline forgets its launched step and their worker state."""
        logger.error("fault in %s: its requests fail, the engine goes on", where, exc_info=error)
        message = f"internal error in {where}: {type(error).__name__}: {error}"
        for request_id in dict.fromkeys(request_ids):
            self.scheduler.fail_request(request_id, message)
        self.pipeline.discard_launched()
        self.pipeline.drop_requests(self.scheduler.take_finished_ids())

    def _clocks(self) -> tuple[float, float, float, float]:
        """Cumulative seconds: waiting for the device, the device's own step time (when
        timed), scheduling, launching."""
        reader = self.pipeline.reader
        return (
            reader.wait_seconds,
            reader.device_seconds,
            self._schedule_seconds,
            self.pipeline.launch_seconds,
        )

    def _step(self) -> list[RequestUpdate]:
        started = time.perf_counter()
        step = self.scheduler.schedule()
        self._schedule_seconds += time.perf_counter() - started
        if not self._overlap:
            if step.is_empty:
                if step.finished_request_ids:
                    self.pipeline.execute(step)  # drop per-request state of finished requests
                return []
            ran, results = self._run_steps([step], lambda: self.pipeline.execute(step))
            return self._apply(step, results) if ran else []
        previous, self._in_flight = self._in_flight, None
        if previous is None and step.is_empty and not step.finished_request_ids:
            return []
        ran, output = self._run_steps([step, previous], lambda: self.pipeline.step_ahead(step))
        if not ran:
            return []  # the fault failed both steps' requests
        if not step.is_empty:
            self._in_flight = step
        if previous is None:
            return []
        return self._apply(previous, output)

    def _apply(self, step: SchedulerOutput, results: ModelRunnerOutput) -> list[RequestUpdate]:
        if self.step_log is not None:
            clocks = self._clocks()
            wait, device, schedule, launch = (
                now - then for now, then in zip(clocks, self._logged_clocks, strict=True)
            )
            self._logged_clocks = clocks
            self.step_log.append(
                StepRecord(
                    time.perf_counter(),
                    len(step.scheduled),
                    sum(s.start < s.request.num_prompt_tokens for s in step.scheduled),
                    step.num_batched_tokens,
                    wait,
                    device,
                    schedule,
                    launch,
                )
            )
        updates = self.scheduler.update_from_output(step, results)
        self.counters["num_steps"] += 1
        self.counters["num_preemptions"] = self.scheduler.num_preemptions
        for update in updates:
            self.counters["num_generation_tokens"] += len(update.new_token_ids)
            if update.finish_reason is not None:
                self.counters["num_requests_finished"] += 1
        return updates

    def read_in_flight(self) -> list[RequestUpdate]:
        """Wait for the step in flight, if any, and apply it (updates for its live rows)."""
        if self._in_flight is None:
            return []
        step, self._in_flight = self._in_flight, None
        ran, results = self._run_steps([step], self.pipeline.read_in_flight)
        return self._apply(step, results) if ran else []

    def shutdown(self) -> None:
        """Finish the step in flight and give the device memory (KV cache, CUDA graphs)
        back; the engine cannot run afterwards."""
        self.read_in_flight()
        if self.pd is not None:
            self.pd.close()
        self.pipeline.batch.states.clear()
        self.runner.release()
        gc.unfreeze()  # collectable again (thaws other engines' objects too: harmless)

    def metrics(self) -> dict[str, float]:
        """Counters and gauges of this engine (a flat dict)."""
        return {
            **self.counters,
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting,
            "num_cuda_graph_steps": self.runner.graphs.num_replays if self.runner.graphs else 0,
            "kv_cache_usage": self.block_manager.usage,
            "num_kv_blocks": self.num_blocks,
            "num_free_kv_blocks": self.block_manager.num_free_blocks,
            "prefix_cache_queries": self.block_manager.prefix_queries,
            "prefix_cache_hits": self.block_manager.prefix_hits,
            "spec_decode_num_drafts": self.scheduler.spec_num_drafts,
            "spec_decode_num_draft_tokens": self.scheduler.spec_num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.scheduler.spec_num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(self.scheduler.spec_accepted_per_pos),
            **(self.pd.counters if self.pd is not None else {}),
        }
