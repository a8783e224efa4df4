"""Where the host was while the device waited: a reading of one ``torch.profiler`` Chrome
trace recorded with the CPU and CUDA activities and ``with_stack=True``.

Each ``generate`` call on the host (its ``python_function`` event) bounds one request's
window on the device: its first device op to its last. Inside that window every gap between
device ops longer than ``bound`` microseconds is a time the device waited for the host; for
each, the trace tells what the host was running at the gap's middle (``host_during``) and
which Python code launched the op that ended it (``launched_by``: the stack at the CUDA
runtime or driver call, a kernel launch, graph launch or copy, that shares the op's
correlation id).
Stacks are the chains of Python frames from the ``python_function`` events' parent ids,
kept to the frames of ``package`` (``tandem/`` by default). Per request the window also
gives the host's time before the first device op and after the last one (work the device
never saw: the request's setup and its outputs); over all requests, the CUDA runtime and
driver calls made inside them, by name (what launching costs, and any allocation or
synchronization among the launches).

``scripts/question_timeline.py`` records such a trace on a GPU and writes this reading.
"""

from __future__ import annotations

import bisect
from collections import defaultdict

DEVICE_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
# The host's calls that queue device work: the runtime's (cuBLAS, torch's kernels, graphs,
# copies) and the driver's (Triton launches through it).
LAUNCH_CATEGORIES = frozenset({"cuda_runtime", "cuda_driver"})


def thread_frames(events: list[dict]) -> tuple[dict, dict]:
    """Per thread (``tid``) its ``python_function`` events sorted by start with their starts,
    and id -> event. Stacks are read within one thread: another thread's frames (a server's
    or a library's, running meanwhile) start between the request's own."""
    by_thread: dict = defaultdict(list)
    for event in events:
        if event.get("cat") == "python_function" and "dur" in event:
            by_thread[event.get("tid")].append(event)
    threads = {}
    for tid, frames in by_thread.items():
        frames.sort(key=lambda e: e["ts"])
        threads[tid] = (frames, [e["ts"] for e in frames])
    by_id = {
        e["args"]["Python id"]: e
        for frames, _ in threads.values()
        for e in frames
        if "Python id" in e.get("args", {})
    }
    return threads, by_id


def stack_at(time_us: float, python: list[dict], starts: list[float], by_id: dict) -> list[str]:
    """The Python frames of one thread (``python``: its frames sorted by start, ``starts``
    their starts; from ``thread_frames``) running at ``time_us``, outermost first: the
    innermost is an ancestor of the frame that started last before it (frames nest), reached
    through the events' parent ids."""
    index = bisect.bisect_right(starts, time_us) - 1
    if index < 0:
        return []
    event = python[index]
    while event is not None and event["ts"] + event["dur"] <= time_us:
        event = by_id.get(event["args"].get("Python parent id"))
    chain = []
    while event is not None:
        chain.append(event["name"])
        event = by_id.get(event["args"].get("Python parent id"))
    return chain[::-1]


def own_frames(stack: list[str], package: str, keep: int = 4) -> list[str]:
    """The last ``keep`` frames of ``stack`` in ``package`` (a path fragment)."""
    return [frame for frame in stack if package in frame][-keep:]


def read_timeline(trace: dict, bound: float = 8.0, package: str = "tandem/", top: int = 20) -> dict:
    """The reading of a Chrome trace (module docstring): per request its host and device
    windows and its gaps; over all requests the gaps' microseconds grouped by the innermost
    ``package`` frame that launched the op ending them and by the one running during them,
    and the ``top`` longest gaps with both stacks."""
    events = trace["traceEvents"]
    threads, by_id = thread_frames(events)
    device = sorted(
        (e for e in events if e.get("cat") in DEVICE_CATEGORIES and e.get("dur", 0) > 0),
        key=lambda e: e["ts"],
    )
    calls = [e for e in events if e.get("cat") in LAUNCH_CATEGORIES]
    launches = {e["args"]["correlation"]: e for e in calls if "correlation" in e.get("args", {})}
    requests = sorted(
        (
            e
            for frames, _ in threads.values()
            for e in frames
            if e["name"].endswith(": generate") and package in e["name"]
        ),
        key=lambda e: e["ts"],
    )
    device_starts = [e["ts"] for e in device]
    per_request, gaps = [], []
    for request in requests:
        host_start, host_end = request["ts"], request["ts"] + request["dur"]
        lo = bisect.bisect_left(device_starts, host_start)
        hi = bisect.bisect_right(device_starts, host_end)
        ops = device[lo:hi]
        if not ops:
            continue
        reached, last_name, busy, request_gaps = ops[0]["ts"], None, 0.0, []
        for op in ops:
            end = op["ts"] + op["dur"]
            if op["ts"] - reached > bound:
                request_gaps.append((reached, op, last_name))
            busy += max(0.0, end - max(op["ts"], reached))
            if end > reached or last_name is None:
                reached, last_name = max(reached, end), op["name"]
        first, last = ops[0]["ts"], reached
        own = threads[request.get("tid")]
        for start, op, before in request_gaps:
            launch = launches.get(op.get("args", {}).get("correlation"))
            during = stack_at((start + op["ts"]) / 2, *own, by_id)
            launched = []
            if launch:  # its stack in the thread that made the call
                launched = stack_at(launch["ts"], *threads.get(launch.get("tid"), own), by_id)
            gaps.append(
                {
                    "request": len(per_request),
                    "offset_us": start - first,
                    "us": op["ts"] - start,
                    "before": before[:80],
                    "after": op["name"][:80],
                    "host_during": own_frames(during, package),
                    "launched_by": own_frames(launched, package),
                }
            )
        per_request.append(
            {
                "host_us": host_end - host_start,
                "device_window_us": last - first,
                "device_busy_us": busy,
                "host_before_first_op_us": first - host_start,
                "host_after_last_op_us": host_end - last,
                "gaps_us": sum(op["ts"] - start for start, op, _ in request_gaps),
                "gaps": len(request_gaps),
            }
        )
    windows = [(r["ts"], r["ts"] + r["dur"]) for r in requests]
    return {
        "bound_us": bound,
        "requests": per_request,
        "host_calls": _calls_within(calls, windows, top),
        "gap_us_by_launcher": _grouped(gaps, "launched_by"),
        "gap_us_by_host_frame": _grouped(gaps, "host_during"),
        "longest": sorted(gaps, key=lambda gap: -gap["us"])[:top],
    }


def _calls_within(calls, windows: list[tuple[float, float]], top: int) -> list[dict]:
    """The CUDA runtime and driver calls that start inside the ``windows`` (the requests'),
    by name: their count and total microseconds on the host, most first (a ``cudaMalloc``
    or a synchronizing call among the launches shows here)."""
    totals: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for call in calls:
        if any(lo <= call["ts"] < hi for lo, hi in windows):
            totals[call["name"]][0] += 1
            totals[call["name"]][1] += call.get("dur", 0.0)
    ranked = sorted(totals.items(), key=lambda item: -item[1][1])[:top]
    return [{"name": name, "calls": count, "us": us} for name, (count, us) in ranked]


def _grouped(gaps: list[dict], key: str) -> list[dict]:
    """The gaps' total microseconds and count by the innermost frame under ``key``, most
    first."""
    totals: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for gap in gaps:
        frame = gap[key][-1] if gap[key] else "(no frame)"
        totals[frame][0] += gap["us"]
        totals[frame][1] += 1
    ranked = sorted(totals.items(), key=lambda item: -item[1][0])
    return [{"frame": frame, "us": us, "count": count} for frame, (us, count) in ranked]
