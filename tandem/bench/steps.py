"""Where a run's time went, step by step: the engine's step log (``EngineCore.step_log``)
summarized by step shape, so a throughput number can be explained (how much time went to
steps that carried prefill chunks, how full the decode steps were, how long the tail of a
few long requests ran)."""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from contextlib import contextmanager
from itertools import pairwise

from tandem.core.engine_core import EngineCore, StepRecord

# Upper ends of the row-count buckets of decode-only steps.
_ROW_BUCKETS = (8, 32, 64, 128, 256, 512, 1024)


@contextmanager
def recording_steps(engine: EngineCore) -> Iterator[list[StepRecord]]:
    """The engine logs every applied step into the yielded list while the block runs (on
    CUDA with each step's device time, from events around it)."""
    log = engine.start_step_log()
    try:
        yield log
    finally:
        engine.stop_step_log()


@contextmanager
def timing_full_collections() -> Iterator[list[float]]:
    """The seconds of each full (oldest-generation) garbage collection while the block runs,
    appended to the yielded list: pauses of the whole step loop, invisible in profiles of
    the device."""
    durations: list[float] = []
    started = 0.0

    def callback(phase: str, info: dict) -> None:
        nonlocal started
        if info["generation"] != 2:
            return
        if phase == "start":
            started = time.perf_counter()
        else:
            durations.append(time.perf_counter() - started)

    gc.callbacks.append(callback)
    try:
        yield durations
    finally:
        gc.callbacks.remove(callback)


def summarize_steps(records: list[StepRecord]) -> dict:
    """Step counts and the wall time between consecutive applied steps, split by shape.

    A step's time is the interval since the previous step was applied (with overlap
    scheduling, when the device is the bottleneck, that is the step's device time); the
    first step has no interval and only counts. ``host_wait_s``: the part of those
    intervals the host spent waiting for device results (near zero where the host's own
    work, not the device, set the pace). ``device_s``: the steps' own device time (CUDA;
    0 elsewhere), from the start of each step's launch to its results' copies; where it
    falls short of the interval, the device idled between steps. ``schedule_s`` and
    ``launch_s``: the host's time scheduling and launching steps (the rest of an interval
    is applying results and the caller's own work). ``series``: every interval's numbers."""
    intervals = [(later, later.time_s - earlier.time_s) for earlier, later in pairwise(records)]
    mixed = [(r, dt) for r, dt in intervals if r.num_prompt_rows]
    decode = [(r, dt) for r, dt in intervals if not r.num_prompt_rows]
    buckets = []
    low = 1
    for high in (*_ROW_BUCKETS, None):
        chosen = [
            (r, dt)
            for r, dt in decode
            if r.num_rows >= low and (high is None or r.num_rows <= high)
        ]
        if chosen:
            buckets.append(
                {
                    "rows": f"{low}-{high}" if high is not None else f"{low}+",
                    "steps": len(chosen),
                    "time_s": sum(dt for _, dt in chosen),
                    "mean_step_ms": 1e3 * sum(dt for _, dt in chosen) / len(chosen),
                    "host_wait_s": sum(r.wait_s for r, _ in chosen),
                    "device_s": sum(r.device_s for r, _ in chosen),
                    "schedule_s": sum(r.schedule_s for r, _ in chosen),
                    "launch_s": sum(r.launch_s for r, _ in chosen),
                }
            )
        if high is not None:
            low = high + 1
    decode_rows = sum(r.num_rows for r, _ in decode)
    return {
        "num_steps": len(records),
        "time_s": records[-1].time_s - records[0].time_s if records else 0.0,
        "steps_with_prefill": len(mixed),
        "time_in_steps_with_prefill_s": sum(dt for _, dt in mixed),
        "host_wait_in_steps_with_prefill_s": sum(r.wait_s for r, _ in mixed),
        "device_in_steps_with_prefill_s": sum(r.device_s for r, _ in mixed),
        "mean_tokens_in_steps_with_prefill": (
            sum(r.num_tokens for r, _ in mixed) / len(mixed) if mixed else 0.0
        ),
        "decode_only_steps": len(decode),
        "time_in_decode_only_steps_s": sum(dt for _, dt in decode),
        "mean_rows_in_decode_only_steps": decode_rows / len(decode) if decode else 0.0,
        "decode_only_steps_by_rows": buckets,
        # Every step after the first: rows, prompt rows, then milliseconds of the interval,
        # of the host's scheduling, launching and waiting in it, and of the device's step.
        "series_fields": [
            "rows",
            "prompt_rows",
            "interval_ms",
            "schedule_ms",
            "launch_ms",
            "wait_ms",
            "device_ms",
        ],
        "series": [
            [
                r.num_rows,
                r.num_prompt_rows,
                *(round(1e3 * x, 3) for x in (dt, r.schedule_s, r.launch_s, r.wait_s, r.device_s)),
            ]
            for r, dt in intervals
        ],
    }


def profile_step_window(
    llm, prompts: list, params: list, first: int, count: int, top: int = 25
) -> dict:
    """Where the device time of a run's steps ``first`` to ``first + count - 1`` goes.

    The requests run from the start as ``llm.generate`` would; after ``first`` steps the
    device is drained and ``count`` steps run under the CUDA profiler (the only steps whose
    device work it sees), then the remaining requests are aborted. Returns the window's
    GPU busy share, the device ops per step ranked by time (``top``), and the shapes of the
    steps applied in the window."""
    from torch.profiler import ProfilerActivity, profile

    from tandem.bench.device_profile import busy_fraction, device_intervals, kernel_totals
    from tandem.bench.timing import sync_device

    if first < 0 or count < 1:
        raise ValueError(f"need first >= 0 and count >= 1, got {first} and {count}")
    engine = llm.engine
    device = engine.config.device
    request_ids = [llm.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    # Elsewhere than CUDA the profiler sees host ops only, none of them device work.
    cuda = str(device).startswith("cuda")
    profiler = profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU])
    try:
        with recording_steps(engine) as log:
            for _ in range(first):
                llm.step(finished_only=True)
            sync_device(device)
            begin = len(log)
            profiler.start()
            for _ in range(count):
                llm.step(finished_only=True)
            sync_device(device)
            profiler.stop()
            window = log[begin:]
    finally:
        for request_id in request_ids:
            llm.abort_request(request_id)
        while engine.has_unfinished_requests():
            engine.step()
    intervals, _ = device_intervals(profiler)
    span = (min(s for s, _ in intervals), max(e for _, e in intervals)) if intervals else (0, 0)
    ops = kernel_totals(profiler, top)
    return {
        "first_step": first,
        "num_steps": count,
        "mean_rows": sum(r.num_rows for r in window) / max(len(window), 1),
        "prompt_rows": sum(r.num_prompt_rows for r in window),
        "window_ms_per_step": (span[1] - span[0]) / 1e3 / count,
        "gpu_busy_fraction": busy_fraction(intervals, span) if intervals else 0.0,
        "device_ops_per_step": len(intervals) / count,
        "device_op_ms_per_step": sum(e - s for s, e in intervals) / 1e3 / count,
        "top_ms_per_step": [
            {
                "name": op["name"],
                "calls_per_step": op["count"] / count,
                "ms_per_step": op["total_us"] / 1e3 / count,
            }
            for op in ops
        ],
    }
