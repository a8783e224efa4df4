"""``bench decode --steady-rounds``: the modes' steady rows in alternating rounds."""

import json

import pytest

from tandem.bench import decode_interleaved
from tandem.bench.decode import parse_modes, run_decode_bench
from tandem.bench.decode_interleaved import interleaved_steady, summarize_rounds
from tandem.core.engine_core import EngineCore


def _round(mode: str, index: int, rate: float) -> dict:
    return {"mode": mode, "round": index, "tokens_per_s": rate, "kind": "steady_round"}


def test_summary_takes_each_rounds_ratio_within_the_round():
    # The host slows in round 1 for both modes: the per-round ratios stay 2, 1.5, 2.5,
    # while the ratio of the two medians (150 / 80) would be neither.
    runs = [
        _round("overlap", 0, 100.0),
        _round("mtp+overlap", 0, 200.0),
        _round("mtp+overlap", 1, 75.0),
        _round("overlap", 1, 50.0),
        _round("overlap", 2, 80.0),
        _round("mtp+overlap", 2, 200.0),
    ]
    summary = summarize_rounds(runs, ["overlap", "mtp+overlap"])
    assert summary["base_mode"] == "overlap" and summary["rounds"] == 3
    assert summary["tokens_per_s"]["overlap"] == {"median": 80.0, "min": 50.0, "max": 100.0}
    ratio = summary["ratio_to_base"]["mtp+overlap"]
    assert ratio["per_round"] == pytest.approx([2.0, 1.5, 2.5])
    assert ratio["median"] == pytest.approx(2.0)
    assert (ratio["min"], ratio["max"]) == pytest.approx((1.5, 2.5))
    assert "overlap" not in summary["ratio_to_base"]


def test_rounds_alternate_the_order_of_the_modes(monkeypatch):
    calls = []

    def fake_steady_run(llm, requests, batch_size, k, max_tokens, recordings, sampling):
        calls.append((llm, k))
        return {"kind": "steady", "tokens_per_s": 1.0, "batch_size": batch_size}

    monkeypatch.setattr(decode_interleaved, "steady_run", fake_steady_run)
    engines = [("overlap", "plain-engine", None), ("mtp+overlap", "mtp-engine", 3)]
    runs = interleaved_steady(engines, [], 64, 256, 3)
    assert calls == [
        ("plain-engine", None),
        ("mtp-engine", 3),
        ("mtp-engine", 3),
        ("plain-engine", None),
        ("plain-engine", None),
        ("mtp-engine", 3),
    ]
    assert [(r["mode"], r["round"], r["kind"]) for r in runs] == [
        ("overlap", 0, "steady_round"),
        ("mtp+overlap", 0, "steady_round"),
        ("mtp+overlap", 1, "steady_round"),
        ("overlap", 1, "steady_round"),
        ("overlap", 2, "steady_round"),
        ("mtp+overlap", 2, "steady_round"),
    ]
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        interleaved_steady(engines, [], 64, 256, 0)


def test_bench_decode_runs_the_steady_rows_in_rounds_on_cpu(
    tmp_path, monkeypatch, tokenizer_loaded_once
):
    shut_down = []
    shutdown = EngineCore.shutdown

    def counting_shutdown(engine):
        shut_down.append(engine)
        shutdown(engine)

    monkeypatch.setattr(EngineCore, "shutdown", counting_shutdown)
    common = {
        "model": "dummy:tiny",
        "batch_sizes": [2],
        "max_tokens": 4,
        "modes": parse_modes("plain,overlap"),
        "device": "cpu",
        "dtype": None,
        "out_dir": str(tmp_path),
        "steady_state_requests": 5,
        "steady_max_tokens": 8,
    }
    with pytest.raises(ValueError, match="steady_rounds must be >= 1, got 0"):
        run_decode_bench(**common, steady_rounds=0)
    results = run_decode_bench(**common, steady_rounds=3)
    # Every engine it built was shut down (its memory and frozen GC heap given back) before
    # the next: one per mode for the per-engine rows, then both interleaved ones.
    assert len(shut_down) == 4 and len({id(engine) for engine in shut_down}) == 4
    runs = results["runs"]
    # The per-engine rows have no steady row; the rounds follow, alternating.
    assert [(r["mode"], r["kind"], r.get("round")) for r in runs] == [
        ("plain", "fixed", None),
        ("overlap", "fixed", None),
        ("plain", "steady_round", 0),
        ("overlap", "steady_round", 0),
        ("overlap", "steady_round", 1),
        ("plain", "steady_round", 1),
        ("plain", "steady_round", 2),
        ("overlap", "steady_round", 2),
    ]
    for run in runs[2:]:  # the same requests every round, each to its own length
        assert run["num_requests"] == 5 and run["output_tokens"] == runs[2]["output_tokens"]
    summary = results["steady_rounds"]
    assert summary["base_mode"] == "plain" and summary["rounds"] == 3
    ratios = [r["tokens_per_s"] for r in runs[2:]]
    want = [ratios[1] / ratios[0], ratios[2] / ratios[3], ratios[5] / ratios[4]]
    assert summary["ratio_to_base"]["overlap"]["per_round"] == pytest.approx(want)
    assert summary["kv_cache_memory_gb_each"] is None  # on the CPU: the engine's own
    with open(results["output_path"]) as f:
        written = json.load(f)
    assert written["steady_rounds"] == summary and written["config"]["steady_rounds"] == 3
