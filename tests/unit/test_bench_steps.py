"""The engine's step log and its summary by step shape (what `bench throughput` reports)."""

from tandem import SamplingParams
from tandem.bench.steps import recording_steps, summarize_steps
from tandem.core.engine_core import StepRecord


def test_summary_splits_time_by_step_shape():
    records = [
        StepRecord(0.0, 2, 2, 40, 0.0),  # first step: counted, no interval
        StepRecord(1.0, 3, 1, 22, 0.5),  # a prefill chunk beside two decode rows: 1 s
        StepRecord(1.5, 3, 0, 3, 0.25),  # decode only, 3 rows: 0.5 s
        StepRecord(1.75, 40, 0, 40, 0.0),  # decode only, 40 rows: 0.25 s, no wait
    ]
    summary = summarize_steps(records)
    assert summary["num_steps"] == 4 and summary["time_s"] == 1.75
    assert summary["steps_with_prefill"] == 1
    assert summary["time_in_steps_with_prefill_s"] == 1.0
    assert summary["host_wait_in_steps_with_prefill_s"] == 0.5
    assert summary["mean_tokens_in_steps_with_prefill"] == 22
    assert summary["decode_only_steps"] == 2
    assert summary["time_in_decode_only_steps_s"] == 0.75
    assert summary["mean_rows_in_decode_only_steps"] == 21.5
    assert summary["decode_only_steps_by_rows"] == [
        {"rows": "1-8", "steps": 1, "time_s": 0.5, "mean_step_ms": 500.0, "host_wait_s": 0.25},
        {"rows": "33-64", "steps": 1, "time_s": 0.25, "mean_step_ms": 250.0,
         "host_wait_s": 0.0},
    ]


def test_engine_logs_each_applied_step(make_llm):
    llm = make_llm(model="dummy:tiny", device="cpu", max_num_batched_tokens=16)
    engine = llm.engine
    steps_before = engine.metrics()["num_steps"]
    with recording_steps(engine) as log:
        # 20 + 30 prompt tokens in chunks of at most 16 per step, then decode rows.
        llm.generate([{"prompt_token_ids": list(range(1, 21))},
                      {"prompt_token_ids": list(range(1, 31))}],
                     SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=5),
                     use_tqdm=False)
    assert engine.step_log is None  # recording ends with the block
    assert len(log) == engine.metrics()["num_steps"] - steps_before
    assert all(r.num_tokens <= 16 for r in log)
    assert sum(r.num_prompt_rows > 0 for r in log) >= 4  # 50 prompt tokens, 16 a step
    # The last steps decode both requests: two rows, no prompt.
    assert (log[-1].num_rows, log[-1].num_prompt_rows) in {(1, 0), (2, 0)}
    assert [r.time_s for r in log] == sorted(r.time_s for r in log)
    assert all(r.wait_s == 0.0 for r in log)  # the CPU never waits for a device
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
