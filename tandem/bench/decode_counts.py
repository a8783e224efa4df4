"""The engine counters ``tandem bench decode``'s rows report: a snapshot of an engine's
metrics and its step pipeline's counts and clocks, and what changed between two."""

from __future__ import annotations

from typing import Any

from tandem.bench.spec import acceptance


def counter_delta(before: dict, after: dict, name: str) -> int:
    """How much the engine metric ``name`` grew between two snapshots (0 if it has none)."""
    return after.get(name, 0) - before.get(name, 0)


def spec_fields(before: dict, after: dict, k: int | None) -> dict:
    """The acceptance numbers and the step pipeline's counts (``snapshot``) between two
    snapshots (none without speculation)."""
    if not k:
        return {}
    counts = after["pipeline"]
    return {
        **acceptance(before, after, k),
        **{name: counts[name] - before["pipeline"][name] for name in counts},
    }


# The host's clocks in ``snapshot``: launching steps, of it MTP ragged parts, and waiting.
HOST_CLOCKS = ("host_launch_s", "host_ragged_launch_s", "host_wait_s")


def snapshot(llm: Any) -> dict:
    """The engine's metrics and, under ``pipeline``, how many MTP steps so far launched rows
    before the read of the step in front (resolved rows; joining prompts) or had a part that
    waited for it, how many resolved parts ran, and of those how many replayed a CUDA graph
    (the rest ran eagerly: no graph for their size, or the slots' storage grew since the
    capture) or shared one forward with prompt chunks (``steps_mixed``), how many ragged
    parts drafted through the prompt draft graphs (``prompt_draft_graphs``), and the host's
    seconds in launches (and of those, in ragged parts) and in waits for the device."""
    pipeline = llm.engine.pipeline
    graphs = pipeline.mtp.step_graphs if pipeline.mtp is not None else None
    proposer = llm.engine.runner.proposer
    prompt_graphs = getattr(proposer, "prompt_graphs", None)
    counts = {
        "steps_launched_ahead": pipeline.num_launched_ahead,
        "steps_prompts_ahead": pipeline.num_prompts_ahead,
        "steps_parts_after_read": pipeline.num_parts_after_read,
        "steps_resolved": pipeline.num_resolved_steps,
        "steps_resolved_in_graphs": graphs.num_replays if graphs is not None else 0,
        "steps_mixed": pipeline.num_mixed_steps,
        "ragged_drafts_in_graphs": prompt_graphs.num_replays if prompt_graphs else 0,
        "host_launch_s": pipeline.launch_seconds,  # preparing and queueing steps
        "host_ragged_launch_s": pipeline.ragged_launch_seconds,  # of it, MTP ragged parts
        "host_wait_s": pipeline.reader.wait_seconds,  # waiting for the device at reads
    }
    return {**llm.get_metrics(), "pipeline": counts}
