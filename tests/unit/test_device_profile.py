"""``tandem.bench.device_profile`` and the decode bench's profiled runs: the busy-fraction
arithmetic, the idle split by gap length, the long gaps' places and neighbours, the
profiler event filter, and the idle of a profiled ``generate`` (over all, within each
question)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch.profiler
from torch.autograd import DeviceType

from tandem.bench import decode_runs
from tandem.bench.device_profile import (
    busy_fraction,
    device_intervals,
    host_gaps,
    idle_by_gap,
    kernel_totals,
    within_waves,
)


def test_busy_fraction_overlapping_intervals_count_once():
    # [0, 4) u [2, 6) u [5, 7) = [0, 7): 7 of 10.
    assert busy_fraction([(2, 6), (0, 4), (5, 7)], (0, 10)) == pytest.approx(0.7)


def test_busy_fraction_disjoint_intervals_add_up():
    # 2 + 1 + 3 = 6 of 20, given out of order.
    assert busy_fraction([(10, 11), (0, 2), (15, 18)], (0, 20)) == pytest.approx(0.3)


def test_busy_fraction_clips_to_the_window():
    # [-5, 3) -> [0, 3); [8, 15) -> [8, 10); [20, 30) lies outside: 5 of 10.
    assert busy_fraction([(-5, 3), (8, 15), (20, 30)], (0, 10)) == pytest.approx(0.5)
    # One interval covering the whole window and more.
    assert busy_fraction([(-1, 11)], (0, 10)) == pytest.approx(1.0)
    # Touching intervals [0, 5) and [5, 10) fill it exactly.
    assert busy_fraction([(5, 10), (0, 5)], (0, 10)) == pytest.approx(1.0)


def test_busy_fraction_empty_and_degenerate():
    assert busy_fraction([], (0, 10)) == 0.0
    assert busy_fraction([(3, 3), (6, 4)], (0, 10)) == 0.0  # empty and reversed intervals
    assert busy_fraction([(0, 1)], (5, 5)) == 0.0  # zero-length window


def test_idle_by_gap_splits_the_idle_share_by_gap_length():
    # Busy [0, 10) u [11, 20) u [25, 30) u [50, 100) of [0, 110): gaps of 1 (launch
    # spacing), 5 (short), 20 (host) and 10 after the last span (host).
    spans = [(50, 100), (0, 10), (11, 20), (25, 30), (12, 14)]
    shares = idle_by_gap(spans, (0, 110))
    assert shares == {
        "launch_spacing": pytest.approx(1 / 110),
        "short": pytest.approx(5 / 110),
        "host": pytest.approx(30 / 110),
    }
    assert sum(shares.values()) == pytest.approx(1 - busy_fraction(spans, (0, 110)))
    # Idle before the first span waits for the host too; a degenerate window has none.
    assert idle_by_gap([(4, 10)], (0, 10))["host"] == pytest.approx(0.4)
    assert set(idle_by_gap([], (3, 3)).values()) == {0.0}


def test_host_gaps_say_where_in_their_wave_the_long_gaps_fall():
    # A wave over [0, 2000.5): a gap of 5 (spacing: not listed), 12 at 3 (its start), 30
    # at 520 (its decode) and 20 at 1980 (its end); overlapping spans merge first.
    spans = [(0, 3), (15, 500), (100, 200), (505, 520), (550, 1980), (2000, 2000.5)]
    gaps = host_gaps(spans, (0, 2000.5))
    assert [(round(g["offset_us"]), round(g["us"]), g["place"]) for g in gaps] == [
        (3, 12, "start"),
        (520, 30, "middle"),
        (1980, 20, "end"),
    ]
    within = within_waves([spans, [(0, 10), (40, 50)]])
    assert within["host_gaps"]["count"] == 4
    assert within["host_gaps"]["us_by_place"] == pytest.approx(
        {"start": 12, "middle": 60, "end": 20}
    )
    longest = within["host_gaps"]["longest"]
    assert [(g["wave"], round(g["us"])) for g in longest] == [(0, 30), (1, 30), (0, 20), (0, 12)]
    assert "before" not in longest[0]  # spans without names: no neighbours to name


def test_host_gaps_name_the_device_ops_around_each_gap():
    # "b" ends last before the gap at 520 although "c" started after it; "d" ends the gap.
    spans = [(0, 3, "a"), (2, 520, "b"), (100, 200, "c"), (550, 600, "d")]
    (gap,) = host_gaps(spans, (0, 600))
    assert (round(gap["offset_us"]), round(gap["us"])) == (520, 30)
    assert (gap["before"], gap["after"]) == ("b", "d")
    (named,) = within_waves([spans])["host_gaps"]["longest"]
    assert (named["before"], named["after"]) == ("b", "d")
    # Long kernel names are cut; equal spans without names still sort.
    long_name = "void at::native::" + "x" * 200
    (cut,) = host_gaps([(0, 1, long_name), (20, 21, "e")], (0, 21))
    assert cut["before"] == long_name[:80]
    assert host_gaps([(0, 1), (0, 1), (20, 21)], (0, 21))[0]["us"] == pytest.approx(19)


class _FakeKinetoEvent:
    def __init__(self, name, device_type, activity, start_ns, end_ns, annotation=False):
        self._v = (name, device_type, activity, start_ns, end_ns, annotation)

    def name(self):
        return self._v[0]

    def device_type(self):
        return self._v[1]

    def activity_type(self):
        return self._v[2]

    def start_ns(self):
        return self._v[3]

    def end_ns(self):
        return self._v[4]

    def is_user_annotation(self):
        return self._v[5]


def test_device_intervals_keeps_kernels_memcpys_and_memsets_only():
    base = 1_795_953_165_979_151_403  # absolute ns, as Kineto gives them
    events = [
        _FakeKinetoEvent("aten::mm", DeviceType.CPU, "cpu_op", base, base + 9000),
        _FakeKinetoEvent("gemm", DeviceType.CUDA, "kernel", base + 1000, base + 3000),
        _FakeKinetoEvent("Memcpy HtoD", DeviceType.CUDA, "gpu_memcpy", base + 4000, base + 4500),
        _FakeKinetoEvent("Memset", DeviceType.CUDA, "gpu_memset", base + 5000, base + 5001),
        _FakeKinetoEvent(
            "step", DeviceType.CUDA, "gpu_user_annotation", base, base + 9000, annotation=True
        ),
        _FakeKinetoEvent("[memory]", DeviceType.CUDA, "cpu_instant_event", base, base + 10),
    ]
    results = SimpleNamespace(events=lambda: events)
    prof = SimpleNamespace(profiler=SimpleNamespace(kineto_results=results))
    intervals, counts = device_intervals(prof)
    assert intervals == [(0.0, 2.0), (3.0, 3.5), (4.0, 4.001)]  # microseconds from the first
    assert counts == {"kernel": 1, "gpu_memcpy": 1, "gpu_memset": 1}


def test_kernel_totals_ranks_device_ops_by_total_time():
    events = [
        _FakeKinetoEvent("gemm", DeviceType.CUDA, "kernel", 0, 3000),
        _FakeKinetoEvent("norm", DeviceType.CUDA, "kernel", 3000, 3500),
        _FakeKinetoEvent("gemm", DeviceType.CUDA, "kernel", 4000, 6000),
        _FakeKinetoEvent("norm", DeviceType.CUDA, "kernel", 6000, 6400),
        _FakeKinetoEvent("aten::mm", DeviceType.CPU, "cpu_op", 0, 90000),  # host: not counted
        _FakeKinetoEvent("Memcpy HtoD", DeviceType.CUDA, "gpu_memcpy", 7000, 8000),
    ]
    prof = SimpleNamespace(
        profiler=SimpleNamespace(kineto_results=SimpleNamespace(events=lambda: events))
    )
    assert kernel_totals(prof) == [
        {"name": "gemm", "count": 2, "total_us": 5.0},
        {"name": "Memcpy HtoD", "count": 1, "total_us": 1.0},
        {"name": "norm", "count": 2, "total_us": 0.9},
    ]
    assert [e["name"] for e in kernel_totals(prof, top=1)] == ["gemm"]


class _FakeProfile:
    """Stands in for ``torch.profiler.profile``; replays the given Kineto events."""

    def __init__(self, events):
        results = SimpleNamespace(events=lambda: events)
        self.profiler = SimpleNamespace(kineto_results=results)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_profiled_generate_idle_fraction(monkeypatch):
    # Kernels busy [0, 3) and [5, 10) us of a 10 us window: idle 20%.
    events = [
        _FakeKinetoEvent("k1", DeviceType.CUDA, "kernel", 0, 2000),
        _FakeKinetoEvent("k2", DeviceType.CUDA, "kernel", 1000, 3000),
        _FakeKinetoEvent("k3", DeviceType.CUDA, "gpu_memcpy", 5000, 10000),
    ]
    monkeypatch.setattr(torch.profiler, "profile", lambda activities: _FakeProfile(events))
    llm = SimpleNamespace(generate=lambda prompts, params, use_tqdm: [])
    result = decode_runs.profiled_generate(llm, [], None, "cpu")
    assert result["gpu_idle_fraction"] == pytest.approx(0.2)
    assert "gpu_idle_unprofiled_estimate" not in result  # no unprofiled seconds given
    assert result["profile_window_s"] == pytest.approx(1e-5)
    assert result["profile_device_events"] == 3 and result["profile_wall_s"] >= 0
    assert "profiler_note" not in result
    # What a step launches: the ops ranked by total time, with their counts.
    assert [(op["name"], op["count"], op["total_us"]) for op in result["top_device_ops"]] == [
        ("k3", 1, 5.0),
        ("k1", 1, 2.0),
        ("k2", 1, 2.0),
    ]

    monkeypatch.setattr(torch.profiler, "profile", lambda activities: _FakeProfile([]))
    result = decode_runs.profiled_generate(llm, [], None, "cpu")
    assert result["gpu_idle_fraction"] is None and "no CUDA" in result["profiler_note"]


def test_profiled_questions_idle_within_each_generate(monkeypatch):
    # Two questions, one generate each, a marker kernel after each. Question 1: busy [0, 4)
    # and [4.5, 5) us, a 0.5 us launch-length gap. Question 2: busy [105, 108) and
    # [118, 120), a 10 us gap (the host's). Over the whole window [0, 120) the 100 us
    # between the questions count as idle too; within their own windows (5 + 15 us) only
    # the two gaps are idle: 10.5 of 20 us, 10 of them the host's.
    events = [
        _FakeKinetoEvent("k1", DeviceType.CUDA, "kernel", 0, 4000),
        _FakeKinetoEvent("copy", DeviceType.CUDA, "gpu_memcpy", 4500, 5000),
        _FakeKinetoEvent("spin_kernel", DeviceType.CUDA, "kernel", 50000, 50100),
        _FakeKinetoEvent("k2", DeviceType.CUDA, "kernel", 105000, 108000),
        _FakeKinetoEvent("k3", DeviceType.CUDA, "kernel", 118000, 120000),
        _FakeKinetoEvent("spin_kernel", DeviceType.CUDA, "kernel", 121000, 121100),
    ]
    monkeypatch.setattr(torch.profiler, "profile", lambda activities: _FakeProfile(events))
    llm = SimpleNamespace(generate=lambda prompts, params, use_tqdm: [])
    prompts = [{"prompt_token_ids": [1]}, {"prompt_token_ids": [2]}]
    result = decode_runs.profiled_generate(llm, prompts, None, "cpu", batch_size=1)
    # The markers are not the run's device work: 4 ops in a window of 120 us.
    assert result["profile_device_events"] == 4
    assert result["profiler_activity_counts"] == {"kernel": 3, "gpu_memcpy": 1}
    assert result["profile_window_s"] == pytest.approx(120e-6)
    assert result["gpu_idle_fraction"] == pytest.approx(1 - 9.5 / 120)
    assert result["gpu_idle_within_requests"] == pytest.approx(10.5 / 20)
    assert result["gpu_idle_within_requests_host"] == pytest.approx(10 / 20)
    # The same questions took 25 us unprofiled: 9.5 us busy leaves 62% of it idle; a
    # profiled busy time longer than the unprofiled run reads below 0 (no estimate).
    timed = decode_runs.profiled_generate(llm, prompts, None, "cpu", 25e-6, batch_size=1)
    assert timed["gpu_idle_unprofiled_estimate"] == pytest.approx(1 - 9.5 / 25)
    faster = decode_runs.profiled_generate(llm, prompts, None, "cpu", 5e-6, batch_size=1)
    assert faster["gpu_idle_unprofiled_estimate"] == pytest.approx(1 - 9.5 / 5)
    # One generate of every prompt (no waves): no within-requests share.
    whole = decode_runs.profiled_generate(llm, prompts, None, "cpu")
    assert "gpu_idle_within_requests" not in whole
    # Markers missing (three generates, two waves found): a note, no share.
    three = decode_runs.profiled_generate(llm, prompts + prompts[:1], None, "cpu", batch_size=1)
    assert "gpu_idle_within_requests" not in three
    assert three["gpu_idle_within_requests_note"] == "2 waves of device work, 3 runs"
