"""The engine's step log and its summary by step shape (what `bench throughput` reports)."""

import os

import pytest

from tandem import SamplingParams
from tandem.bench.steps import recording_steps, summarize_steps
from tandem.core.engine_core import StepRecord


def test_summary_splits_time_by_step_shape():
    records = [
        StepRecord(0.0, 2, 2, 40, 0.0, 0.5),  # first step: counted, no interval
        StepRecord(1.0, 3, 1, 22, 0.5, 0.75),  # a prefill chunk beside two decode rows: 1 s
        StepRecord(1.5, 3, 0, 3, 0.25, 0.5),  # decode only, 3 rows: 0.5 s
        StepRecord(1.75, 40, 0, 40, 0.0, 0.125),  # decode only, 40 rows: 0.25 s, no wait
    ]
    summary = summarize_steps(records)
    assert summary["num_steps"] == 4 and summary["time_s"] == 1.75
    assert summary["steps_with_prefill"] == 1
    assert summary["time_in_steps_with_prefill_s"] == 1.0
    assert summary["host_wait_in_steps_with_prefill_s"] == 0.5
    assert summary["device_in_steps_with_prefill_s"] == 0.75
    assert summary["mean_tokens_in_steps_with_prefill"] == 22
    assert summary["decode_only_steps"] == 2
    assert summary["time_in_decode_only_steps_s"] == 0.75
    assert summary["mean_rows_in_decode_only_steps"] == 21.5
    assert summary["series"] == [
        [3, 1, 1000.0, 0.0, 0.0, 500.0, 750.0],
        [3, 0, 500.0, 0.0, 0.0, 250.0, 500.0],
        [40, 0, 250.0, 0.0, 0.0, 0.0, 125.0],
    ]
    assert summary["decode_only_steps_by_rows"] == [
        {
            "rows": "1-8",
            "steps": 1,
            "time_s": 0.5,
            "mean_step_ms": 500.0,
            "host_wait_s": 0.25,
            "device_s": 0.5,
            "schedule_s": 0.0,
            "launch_s": 0.0,
        },
        {
            "rows": "33-64",
            "steps": 1,
            "time_s": 0.25,
            "mean_step_ms": 250.0,
            "host_wait_s": 0.0,
            "device_s": 0.125,
            "schedule_s": 0.0,
            "launch_s": 0.0,
        },
    ]


def test_engine_logs_each_applied_step(make_llm):
    llm = make_llm(model="dummy:tiny", device="cpu", max_num_batched_tokens=16)
    engine = llm.engine
    # Work before the log starts: none of its time may land in the first record.
    llm.generate(
        [{"prompt_token_ids": list(range(100, 140))}],
        SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=20),
        use_tqdm=False,
    )
    steps_before = engine.metrics()["num_steps"]
    launch_before, schedule_before = engine.pipeline.launch_seconds, engine._schedule_seconds
    with recording_steps(engine) as log:
        # 20 + 30 prompt tokens in chunks of at most 16 per step, then decode rows.
        llm.generate(
            [{"prompt_token_ids": list(range(1, 21))}, {"prompt_token_ids": list(range(1, 31))}],
            SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=5),
            use_tqdm=False,
        )
    assert engine.step_log is None  # recording ends with the block
    assert len(log) == engine.metrics()["num_steps"] - steps_before
    assert all(r.num_tokens <= 16 for r in log)
    assert sum(r.num_prompt_rows > 0 for r in log) >= 4  # 50 prompt tokens, 16 a step
    # The last steps decode both requests: two rows, no prompt.
    assert (log[-1].num_rows, log[-1].num_prompt_rows) in {(1, 0), (2, 0)}
    assert [r.time_s for r in log] == sorted(r.time_s for r in log)
    assert all(r.wait_s == 0.0 and r.device_s == 0.0 for r in log)  # no device to wait for
    assert not engine.pipeline.reader.time_steps  # step timing ends with the block too
    # The host's scheduling and launching are timed, and fit in the steps' intervals.
    assert all(r.schedule_s > 0 and r.launch_s > 0 for r in log[1:])
    assert sum(r.schedule_s + r.launch_s for r in log[1:]) < log[-1].time_s - log[0].time_s
    # Every record, the first included, counts only time spent inside the block.
    assert sum(r.launch_s for r in log) <= engine.pipeline.launch_seconds - launch_before + 1e-9
    assert sum(r.schedule_s for r in log) <= engine._schedule_seconds - schedule_before + 1e-9
    summary = summarize_steps(log)
    assert summary["steps_with_prefill"] + summary["decode_only_steps"] == len(log) - 1


def test_host_profile_ranks_the_functions_that_ran():
    from tandem.bench.host_profile import profile_host

    def busy(n):
        return sum(i * i for i in range(n))

    profile = profile_host(lambda: [busy(20_000) for _ in range(5)], top=5)
    own = profile["by_own_time"]
    assert len(own) == 5 and own == sorted(own, key=lambda r: r["own_s"], reverse=True)
    assert any("busy" in r["function"] for r in profile["by_cumulative_time"])
    assert profile["total_s"] > 0


@pytest.mark.gpu
def test_steps_are_timed_on_the_device():
    """On CUDA every logged step carries its device time, which the steps' intervals (with
    overlap: back to back on the device) bound from above, summed."""
    from tandem import LLM

    llm = LLM(model=os.environ.get("TANDEM_MODEL"), device="cuda", kv_cache_memory_gb=4)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=32)
    prompts = [{"prompt_token_ids": list(range(1, 40 + i))} for i in range(8)]
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    with recording_steps(llm.engine) as log:
        llm.generate(prompts, params, use_tqdm=False)
    llm.engine.shutdown()
    assert len(log) >= 32 and all(r.device_s > 0 for r in log)
    summary = summarize_steps(log)
    intervals = summary["time_in_steps_with_prefill_s"] + summary["time_in_decode_only_steps_s"]
    assert sum(r.device_s for r in log[1:]) <= intervals * 1.05


def test_step_window_profile_runs_its_steps_and_leaves_the_engine_idle(make_llm):
    from tandem.bench.steps import profile_step_window
    from tandem.bench.throughput import parse_step_windows

    assert parse_step_windows("60:10,400:5") == [(60, 10), (400, 5)]
    with pytest.raises(ValueError, match="FIRST:COUNT"):
        parse_step_windows("60")
    llm = make_llm(model="dummy:tiny", device="cpu")
    engine = llm.engine
    free = engine.block_manager.num_free_blocks
    steps_before = engine.metrics()["num_steps"]
    prompts = [{"prompt_token_ids": list(range(1, 10 + i))} for i in range(4)]
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=50)] * 4
    profile = profile_step_window(llm, prompts, params, first=5, count=3)
    assert profile["first_step"] == 5 and profile["num_steps"] == 3
    assert profile["mean_rows"] == 4 and profile["prompt_rows"] == 0  # all four decoding
    assert profile["device_ops_per_step"] == 0  # no CUDA device: nothing to profile
    # The rest was aborted: nothing runs, every block is back, and far fewer than the
    # 4 x 50 tokens' steps ran.
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == free
    assert engine.metrics()["num_steps"] - steps_before <= 10


def test_full_collections_are_timed_while_the_block_runs():
    import gc

    from tandem.bench.steps import timing_full_collections

    with timing_full_collections() as durations:
        gc.collect(1)  # a younger generation only: not counted
        gc.collect()
        gc.collect()
    gc.collect()  # after the block: not counted
    assert len(durations) == 2 and all(d >= 0 for d in durations)
