"""Where a run's time went, step by step: the engine's step log (``EngineCore.step_log``)
summarized by step shape, so a throughput number can be explained (how much time went to
steps that carried prefill chunks, how full the decode steps were, how long the tail of a
few long requests ran)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from itertools import pairwise

from tandem.core.engine_core import EngineCore, StepRecord

# Upper ends of the row-count buckets of decode-only steps.
_ROW_BUCKETS = (8, 32, 64, 128, 256, 512, 1024)


@contextmanager
def recording_steps(engine: EngineCore) -> Iterator[list[StepRecord]]:
    """The engine logs every applied step into the yielded list while the block runs."""
    engine.step_log = []
    try:
        yield engine.step_log
    finally:
        engine.step_log = None


def summarize_steps(records: list[StepRecord]) -> dict:
    """Step counts and the wall time between consecutive applied steps, split by shape.

    A step's time is the interval since the previous step was applied (with overlap
    scheduling, when the device is the bottleneck, that is the step's device time); the
    first step has no interval and only counts. ``host_wait_s``: the part of those
    intervals the host spent waiting for device results (near zero where the host's own
    work, not the device, set the pace)."""
    intervals = [(later, later.time_s - earlier.time_s)
                 for earlier, later in pairwise(records)]
    mixed = [(r, dt) for r, dt in intervals if r.num_prompt_rows]
    decode = [(r, dt) for r, dt in intervals if not r.num_prompt_rows]
    buckets = []
    low = 1
    for high in (*_ROW_BUCKETS, None):
        chosen = [(r, dt) for r, dt in decode
                  if r.num_rows >= low and (high is None or r.num_rows <= high)]
        if chosen:
            buckets.append({
                "rows": f"{low}-{high}" if high is not None else f"{low}+",
                "steps": len(chosen),
                "time_s": sum(dt for _, dt in chosen),
                "mean_step_ms": 1e3 * sum(dt for _, dt in chosen) / len(chosen),
                "host_wait_s": sum(r.wait_s for r, _ in chosen),
            })
        if high is not None:
            low = high + 1
    decode_rows = sum(r.num_rows for r, _ in decode)
    return {
        "num_steps": len(records),
        "time_s": records[-1].time_s - records[0].time_s if records else 0.0,
        "steps_with_prefill": len(mixed),
        "time_in_steps_with_prefill_s": sum(dt for _, dt in mixed),
        "host_wait_in_steps_with_prefill_s": sum(r.wait_s for r, _ in mixed),
        "mean_tokens_in_steps_with_prefill": (
            sum(r.num_tokens for r, _ in mixed) / len(mixed) if mixed else 0.0),
        "decode_only_steps": len(decode),
        "time_in_decode_only_steps_s": sum(dt for _, dt in decode),
        "mean_rows_in_decode_only_steps": decode_rows / len(decode) if decode else 0.0,
        "decode_only_steps_by_rows": buckets,
    }
