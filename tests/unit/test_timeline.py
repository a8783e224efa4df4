"""``tandem.bench.timeline``: the host's stacks at the device's gaps, read from a Chrome trace
(a synthetic one with known answers, and the profiler's own format on the CPU)."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import threading

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from tandem.bench.timeline import read_timeline, stack_at, thread_frames


def _frame(pid: int, parent: int | None, name: str, ts: float, dur: float, tid: int = 1) -> dict:
    args = {"Python id": pid, "Python parent id": parent}
    event = {"ph": "X", "cat": "python_function", "name": name, "ts": ts, "dur": dur}
    return event | {"tid": tid, "args": args}


def _op(cat: str, name: str, ts: float, dur: float, correlation: int) -> dict:
    return {
        "ph": "X",
        "cat": cat,
        "name": name,
        "ts": ts,
        "dur": dur,
        "args": {"correlation": correlation},
    }


def _trace() -> dict:
    # One request on the host [100, 1100): it launches kernel A at 110 (runs 120-300), then
    # prepares a step from 300 to 600 (the device waits 300-700), launches graph B at 600
    # (runs 700-1000), reads. A second generate with no device op is skipped.
    frames = [
        _frame(1, None, "tandem/llm.py(153): generate", 100, 1000),
        _frame(2, 1, "tandem/worker/step_pipeline.py(201): launch", 105, 20),
        _frame(3, 1, "tandem/worker/input_batch.py(50): prepare", 300, 290),
        _frame(4, 3, "tandem/worker/input_batch.py(90): _rows", 310, 200),
        _frame(5, 4, "numpy/core(1): asarray", 400, 5),
        _frame(6, 1, "tandem/worker/step_graphs.py(240): run", 595, 10),
        _frame(7, None, "tandem/llm.py(153): generate", 2000, 50),
        # Another thread's frames, started inside the request's gap: not the request's stack.
        _frame(8, None, "threading.py(1000): run", 320, 900, tid=2),
        _frame(9, 8, "tandem/server/serve.py(70): poll", 440, 300, tid=2),
    ]
    ops = [
        _op("cuda_runtime", "cudaLaunchKernel", 110, 4, 11),
        _op("kernel", "A", 120, 180, 11),
        _op("cuda_runtime", "cudaGraphLaunch", 600, 3, 12),
        _op("kernel", "B", 700, 300, 12),
        _op("kernel", "C", 1000, 2, 12),  # back to back with B: no gap
        _op("cuda_runtime", "cudaMalloc", 2010, 40, 13),  # in the second request's window
        _op("cuda_runtime", "cudaMalloc", 1500, 40, 14),  # between the requests: not counted
    ]
    return {"traceEvents": frames + ops}


def test_stack_at_walks_up_from_the_last_started_frame():
    trace = _trace()["traceEvents"]
    python = sorted(
        (e for e in trace if e["cat"] == "python_function" and e["tid"] == 1),
        key=lambda e: e["ts"],
    )
    starts = [e["ts"] for e in python]
    by_id = {e["args"]["Python id"]: e for e in python}
    # At 450 "asarray" (started 400) has ended: its parents are still running.
    assert stack_at(450, python, starts, by_id) == [
        "tandem/llm.py(153): generate",
        "tandem/worker/input_batch.py(50): prepare",
        "tandem/worker/input_batch.py(90): _rows",
    ]
    assert stack_at(50, python, starts, by_id) == []
    assert stack_at(1500, python, starts, by_id) == []  # between the requests


def test_read_timeline_names_the_host_frames_at_each_gap():
    reading = read_timeline(_trace())
    (request,) = reading["requests"]
    assert request["host_before_first_op_us"] == pytest.approx(20)
    assert request["host_after_last_op_us"] == pytest.approx(1100 - 1002)
    assert request["device_window_us"] == pytest.approx(1002 - 120)
    assert request["device_busy_us"] == pytest.approx(180 + 300 + 2)
    assert (request["gaps"], request["gaps_us"]) == (1, pytest.approx(400))
    (gap,) = reading["longest"]
    assert (gap["before"], gap["after"], gap["offset_us"]) == ("A", "B", pytest.approx(180))
    assert gap["host_during"][-1] == "tandem/worker/input_batch.py(90): _rows"
    assert gap["launched_by"][-1] == "tandem/worker/step_graphs.py(240): run"
    assert reading["gap_us_by_launcher"] == [
        {"frame": "tandem/worker/step_graphs.py(240): run", "us": pytest.approx(400), "count": 1}
    ]
    # The runtime's calls inside the requests' windows, by total host time.
    assert reading["host_calls"] == [
        {"name": "cudaMalloc", "calls": 1, "us": pytest.approx(40)},
        {"name": "cudaLaunchKernel", "calls": 1, "us": pytest.approx(4)},
        {"name": "cudaGraphLaunch", "calls": 1, "us": pytest.approx(3)},
    ]
    # A bound past the gap leaves none.
    assert read_timeline(_trace(), bound=500.0)["requests"][0]["gaps"] == 0


def _generate(x: torch.Tensor) -> torch.Tensor:  # named as the engine's entry point
    return torch.mm(x, x) + 1


def _spin(stop: threading.Event) -> None:
    while not stop.is_set():
        sum(range(50))


def test_the_profilers_own_trace_has_the_fields_read(tmp_path):
    # On the CPU there are no device ops (no request window), but the stacks must resolve,
    # with another thread running Python meanwhile (as a test suite's leftover servers do).
    stop = threading.Event()
    spinner = threading.Thread(target=_spin, args=(stop,), daemon=True)
    spinner.start()
    try:
        with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
            _generate(torch.ones(32, 32))
    finally:
        stop.set()
        spinner.join()
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    trace = json.loads(path.read_text())
    threads, by_id = thread_frames(trace["traceEvents"])
    inner = next(
        e for frames, _ in threads.values() for e in frames if e["name"].endswith(": _generate")
    )
    stack = stack_at(inner["ts"] + inner["dur"] / 2, *threads[inner["tid"]], by_id)
    assert any(frame.endswith(": _generate") for frame in stack)
    assert read_timeline(trace, package="test_timeline")["requests"] == []


def test_question_timeline_script_runs_on_the_cpu(tmp_path):
    """scripts/question_timeline.py end to end on the tiny dummy model (its random head) on
    the CPU: the questions timed, the profiled trace read (no device ops there, so no
    request window), the JSON written; the gzipped trace kept with ``--trace``."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    script = os.path.join(root, "scripts", "question_timeline.py")
    args = [sys.executable, script, "dummy:tiny", str(tmp_path), "--device", "cpu"]
    args += ["--speculative-model", "dummy", "--questions", "2", "--profiled", "1"]
    args += ["--modes", "mtp", "--max-tokens", "4", "--trace"]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    subprocess.run(args, env=env, cwd=root, check=True, capture_output=True)
    results = json.loads((tmp_path / "question-timeline.json").read_text())
    assert len(results["mtp"]["question_seconds"]) == 2
    assert results["mtp"]["profiled"]["requests"] == []
    with gzip.open(tmp_path / "timeline-mtp.json.gz") as f:
        events = json.load(f)["traceEvents"]
    assert any(e["name"].endswith(": generate") for e in events if "name" in e)
    assert not (tmp_path / "timeline-mtp.json").exists()  # only the gzipped copy stays
