"""Where the device time of a profiled run went: the CUDA kernels, memcpys and memsets a
``torch.profiler`` run recorded, the share of a window their union covers (the GPU's busy
fraction), and the device operations ranked by total time. :func:`profile_generate` runs
``llm.generate`` once under the profiler and reports all three (``bench decode``,
``latency`` and ``throughput`` use it; ``bench.steps`` profiles windows of steps with the
same reading).
"""

from __future__ import annotations

import time
from typing import Any

from tandem.bench.timing import sync_device

# Kineto activity types that sit on a GPU lane but are not work done by the GPU.
_NOT_DEVICE_WORK = frozenset({"gpu_user_annotation", "user_annotation", "cuda_sync", "overhead"})
_PROFILER_META_NAMES = frozenset({"[memory]", "[OutOfMemory]"})


def busy_fraction(intervals: list[tuple[float, float]], window: tuple[float, float]) -> float:
    """The fraction of ``window`` covered by the union of the ``[start, end)`` intervals.

    Intervals may overlap, come in any order, or reach outside the window (they are clipped
    to it); empty or reversed intervals count for nothing. A window of zero length gives 0.
    """
    lo, hi = window
    if hi <= lo:
        return 0.0
    clipped = sorted((max(s, lo), min(e, hi)) for s, e in intervals if min(e, hi) > max(s, lo))
    covered = 0.0
    cur_start = cur_end = None
    for start, end in clipped:
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                covered += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        covered += cur_end - cur_start
    return covered / (hi - lo)


# Idle gaps by length (microseconds): up to the first bound, the spacing between kernels a
# CUDA graph or a queued stream launches back to back; past the second, the device waited
# for the host to launch more work.
GAP_BOUNDS_US = (1.5, 8.0)


def idle_by_gap(
    intervals: list[tuple[float, float]],
    window: tuple[float, float],
    bounds: tuple[float, float] = GAP_BOUNDS_US,
) -> dict[str, float]:
    """The idle share of ``window`` (what ``busy_fraction`` leaves) split by the length of
    each gap between the union's busy spans: ``launch_spacing`` (gaps up to ``bounds[0]``),
    ``short`` (up to ``bounds[1]``) and ``host`` (longer: the device waiting for launches).
    Idle time before the first span or after the last counts as ``host``; the three add up
    to 1 - busy_fraction."""
    lo, hi = window
    if hi <= lo:
        return {"launch_spacing": 0.0, "short": 0.0, "host": 0.0}
    spans = sorted((max(s, lo), min(e, hi)) for s, e in intervals if min(e, hi) > max(s, lo))
    shares = {"launch_spacing": 0.0, "short": 0.0, "host": 0.0}
    reached = lo
    for start, end in spans:
        gap = start - reached
        if gap > 0 and reached > lo:
            key = "launch_spacing" if gap <= bounds[0] else "short" if gap <= bounds[1] else "host"
            shares[key] += gap / (hi - lo)
        elif gap > 0:  # idle before the first span: count it as waiting for the host
            shares["host"] += gap / (hi - lo)
        reached = max(reached, end)
    if reached < hi:
        shares["host"] += (hi - reached) / (hi - lo)
    return shares


# The kernel ``torch.cuda._sleep`` launches, put between the waves of a profiled run to
# mark where one ``generate`` ended and the next began on the device's own clock.
WAVE_MARKER = "spin_kernel"
WAVE_MARKER_CYCLES = 1000


def wave_intervals(
    events: list[tuple[str, str, float, float]],
) -> list[list[tuple[float, float, str]]]:
    """The ``(start, end, name)`` of ``device_events`` split at the wave markers, in time
    order (the markers themselves dropped, and waves without device work)."""
    waves: list[list[tuple[float, float, str]]] = [[]]
    for name, _, start, end in sorted(events, key=lambda event: event[2]):
        if WAVE_MARKER in name:
            waves.append([])
        else:
            waves[-1].append((start, end, name))
    return [wave for wave in waves if wave]


def within_waves(waves: list[list[tuple]]) -> dict:
    """Busy and idle over each wave's own window (its first device op to its last), added
    up over the waves: the gaps between waves (the host between one ``generate`` and the
    next) are left out. A wave is a list of ``(start, end)`` spans, or ``(start, end,
    name)``. ``idle_fraction`` and its ``host_fraction`` (gaps past ``GAP_BOUNDS_US``) are
    shares of the summed windows; ``host_gaps`` says where in their waves those gaps fall
    (:func:`host_gaps`)."""
    window_us = busy_us = host_us = 0.0
    gaps = []
    for index, spans in enumerate(waves):
        intervals = [(span[0], span[1]) for span in spans]
        window = (min(s for s, _ in intervals), max(e for _, e in intervals))
        length = window[1] - window[0]
        window_us += length
        busy_us += busy_fraction(intervals, window) * length
        host_us += idle_by_gap(intervals, window)["host"] * length
        gaps += [{"wave": index, **gap} for gap in host_gaps(spans, window)]
    idle = 1.0 - busy_us / window_us if window_us > 0 else None
    host = host_us / window_us if window_us > 0 else None
    by_place = {place: 0.0 for place in GAP_PLACES}
    for gap in gaps:
        by_place[gap["place"]] += gap["us"]
    return {
        "waves": len(waves),
        "window_us": window_us,
        "busy_us": busy_us,
        "idle_fraction": idle,
        "host_fraction": host,
        "host_gaps": {
            "us_by_place": by_place,
            "count": len(gaps),
            "longest": sorted(gaps, key=lambda gap: -gap["us"])[:10],
        },
    }


# Where in its wave a gap falls: the first and last 2% of the wave's window (a request's
# start, its prefill, its end), or between (its decode steps).
GAP_PLACES = ("start", "middle", "end")
_EDGE_SHARE = 0.02


def host_gaps(
    intervals: list[tuple],
    window: tuple[float, float],
    bound: float = GAP_BOUNDS_US[1],
) -> list[dict]:
    """The gaps longer than ``bound`` microseconds between the union's busy spans inside
    ``window`` (the device waiting for the host), in time order: each its start
    ``offset_us`` from the window's start, its length ``us`` and its ``place``
    (``GAP_PLACES``, by where the gap starts). Spans given as ``(start, end, name)`` also
    name the device ops on either side of each gap: ``before`` (the op that ended last
    before it) and ``after`` (the op that ends it), which tell what the host was doing."""
    lo, hi = window
    spans = sorted(
        (
            (max(span[0], lo), min(span[1], hi), span[2] if len(span) > 2 else None)
            for span in intervals
            if min(span[1], hi) > max(span[0], lo)
        ),
        key=lambda span: span[:2],
    )
    gaps, reached, last_name = [], None, None
    for start, end, name in spans:
        if reached is not None and start - reached > bound:
            offset = reached - lo
            share = offset / (hi - lo)
            place = (
                "start" if share < _EDGE_SHARE else "end" if share > 1 - _EDGE_SHARE else "middle"
            )
            gap = {"offset_us": offset, "us": start - reached, "place": place}
            if name is not None:
                gap.update(before=_short_name(last_name), after=_short_name(name))
            gaps.append(gap)
        if reached is None or end > reached:
            reached, last_name = end, name
    return gaps


def _short_name(name: str | None, length: int = 80) -> str | None:
    """A device op's name cut to ``length`` characters (C++ kernel names run long)."""
    return None if name is None else name[:length]


def _method(obj: Any, name: str, default: Any = None) -> Any:
    """``obj.name()`` if ``obj`` has that method, else ``default``."""
    fn = getattr(obj, name, None)
    return fn() if callable(fn) else default


def _is_device_work(device_type: Any, activity: Any, name: str, annotation: bool) -> bool:
    """Whether a profiler event is a kernel, memcpy or memset on a CUDA device."""
    from torch.autograd import DeviceType

    if device_type != DeviceType.CUDA or annotation or name in _PROFILER_META_NAMES:
        return False
    return not (isinstance(activity, str) and activity in _NOT_DEVICE_WORK)


def device_events(prof: Any) -> list[tuple[str, str, float, float]]:
    """``(name, activity type, start_us, end_us)`` of every CUDA kernel, memcpy and memset a
    finished ``torch.profiler.profile`` recorded, times relative to the first event.

    Reads the raw Kineto events (``prof.profiler.kineto_results.events()``: integer
    nanoseconds, no event tree to build); falls back to ``prof.events()`` (FunctionEvents,
    ``time_range`` in microseconds) where the raw results are missing.
    """
    raw = getattr(getattr(prof, "profiler", None), "kineto_results", None)
    if raw is not None:
        spans: list[tuple[str, str, int, int]] = []
        for evt in raw.events():
            activity = _method(evt, "activity_type", "")
            annotation = bool(_method(evt, "is_user_annotation", False))
            if _method(evt, "is_hidden_event", False):
                continue
            if not _is_device_work(evt.device_type(), activity, evt.name(), annotation):
                continue
            start, end = evt.start_ns(), evt.end_ns()
            if end > start:
                spans.append((evt.name(), str(activity), start, end))
        # Subtract a base before going to float: absolute nanoseconds overflow its mantissa.
        base = min((s for _, _, s, _ in spans), default=0)
        return [(n, a, (s - base) / 1000, (e - base) / 1000) for n, a, s, e in spans]
    events = []
    for evt in prof.events():
        activity = getattr(evt, "activity_type", "")
        annotation = bool(getattr(evt, "is_user_annotation", False))
        if not _is_device_work(evt.device_type, activity, evt.name, annotation):
            continue
        start, end = evt.time_range.start, evt.time_range.end
        if end > start:
            events.append((evt.name, str(activity), start, end))
    return events


def device_intervals(prof: Any) -> tuple[list[tuple[float, float]], dict[str, int]]:
    """Intervals (microseconds) of the CUDA kernels, memcpys and memsets a finished
    ``torch.profiler.profile`` recorded, and the count of each activity type kept."""
    return _intervals_and_counts(device_events(prof))


def _intervals_and_counts(events: list[tuple[str, str, float, float]]):
    """The ``(start, end)`` of ``device_events``' events, and the count per activity type."""
    counts: dict[str, int] = {}
    for _, activity, _, _ in events:
        counts[activity] = counts.get(activity, 0) + 1
    return [(start, end) for _, _, start, end in events], counts


def kernel_totals(prof: Any, top: int = 30) -> list[dict]:
    """The ``top`` device operations by total time: name, count and microseconds."""
    totals: dict[str, list] = {}
    for name, _, start, end in device_events(prof):
        entry = totals.setdefault(name, [0, 0.0])
        entry[0] += 1
        entry[1] += end - start
    ranked = sorted(totals.items(), key=lambda item: -item[1][1])[:top]
    return [
        {"name": name[:160], "count": count, "total_us": round(us, 1)}
        for name, (count, us) in ranked
    ]


def profile_generate(
    llm: Any,
    prompts: list[dict],
    params: Any,
    device: str,
    top: int = 30,
    batch_size: int | None = None,
) -> dict:
    """``llm.generate`` under the CUDA profiler: once, or once per wave of ``batch_size``
    prompts, one after the other. Always: ``wall_s``, ``device_ops``
    (kernels, memcpys, memsets) and ``activity_counts``; when device ops were recorded, their
    window ``window_us``, ``busy_fraction`` and ``busy_us`` of it, the idle share split by
    gap length (``idle_by_gap``) and the ``top`` ops by total
    time; otherwise a ``note`` saying why not. With ``batch_size``, also the busy and idle
    shares within each wave's own window (``within_waves``: the host's time between one
    ``generate`` and the next left out; on CUDA a marker kernel separates the waves)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    sync_device(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        step = batch_size or max(len(prompts), 1)
        starts = range(0, max(len(prompts), 1), step)
        for i in starts:
            llm.generate(prompts[i : i + step], params, use_tqdm=False)
            if batch_size and device.startswith("cuda"):
                torch.cuda._sleep(WAVE_MARKER_CYCLES)
        sync_device(device)
        wall = time.perf_counter() - start
    try:
        events = device_events(prof)
    except (AttributeError, RuntimeError, TypeError) as e:
        events = []
        note = f"could not read the profiler's events: {type(e).__name__}: {e}"
    else:
        note = "the profiler recorded no CUDA kernel, memcpy or memset events"
    waves = wave_intervals(events)
    intervals, counts = _intervals_and_counts([e for e in events if WAVE_MARKER not in e[0]])
    result: dict = {"wall_s": wall, "device_ops": len(intervals), "activity_counts": counts}
    if not intervals:
        return {**result, "note": note}
    window = (min(s for s, _ in intervals), max(e for _, e in intervals))
    busy = busy_fraction(intervals, window)
    if batch_size and len(waves) == len(starts):
        result["within_waves"] = within_waves(waves)
    elif batch_size:  # a wave without device work, or markers the profiler did not name so
        result["within_waves_note"] = f"{len(waves)} waves of device work, {len(starts)} runs"
    return {
        **result,
        "window_us": window[1] - window[0],
        "busy_fraction": busy,
        "idle_by_gap": idle_by_gap(intervals, window),
        "busy_us": busy * (window[1] - window[0]),
        "top": kernel_totals(prof, top) if top else [],
    }
