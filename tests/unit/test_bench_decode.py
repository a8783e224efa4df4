"""``tandem bench decode``: the mode parsing, the aggregation of the questions (with the
fit of their seconds against their steps) and steady-state rows, and a small CPU run on the
``tiny`` dummy model (the profiling arithmetic: ``test_device_profile.py``)."""

from __future__ import annotations

import json
import statistics
from types import SimpleNamespace

import pytest

from tandem.bench import decode_runs, timing
from tandem.bench.datasets import BenchRequest
from tandem.bench.decode import mode_name, parse_modes, run_decode_bench
from tandem.bench.decode_engines import EngineSpec
from tandem.bench.timing import fixed_and_per_step
from tandem.cli import build_parser


def test_fixed_and_per_step_fits_question_seconds_against_steps():
    # 2 ms a question besides its steps, 1 ms a step, exactly.
    questions = [{"num_steps": n, "seconds": (2.0 + 1.0 * n) / 1e3} for n in (70, 100, 136, 90)]
    fit = fixed_and_per_step(questions)
    assert fit["fixed_ms"] == pytest.approx(2.0)
    assert fit["per_step_ms"] == pytest.approx(1.0)
    assert fit["questions"] == 4
    # Plain decoding of a fixed length: every question the same steps, nothing to fit.
    assert fixed_and_per_step([{"num_steps": 256, "seconds": 0.2}] * 3) is None


def test_parse_modes_round_trips_names():
    names = ["plain", "overlap", "mtp", "mtp+overlap"]
    modes = parse_modes(",".join(names))
    assert modes == [
        {"overlap": False, "mtp": False},
        {"overlap": True, "mtp": False},
        {"overlap": False, "mtp": True},
        {"overlap": True, "mtp": True},
    ]
    assert [mode_name(m) for m in modes] == names
    with pytest.raises(ValueError, match="unknown mode"):
        parse_modes("plain,turbo")


def test_cli_registers_bench_decode():
    args = build_parser().parse_args(
        ["bench", "decode", "--model", "dummy:tiny", "--modes", "plain,mtp+overlap"]
    )
    assert args.batch_sizes == "1,8,64" and args.max_tokens == 256
    assert args.questions == 16 and args.steady_state_requests == 0 and args.fixed_repeats == 1
    assert args.handler.__module__ == "tandem.bench.decode"


def _cpu_bench(tmp_path, batch_sizes: list[int], modes: str, **options) -> dict:
    """``run_decode_bench`` of ``dummy:tiny`` on the CPU, 4 tokens a request, JSON under
    ``tmp_path``."""
    return run_decode_bench(
        "dummy:tiny", batch_sizes, 4, parse_modes(modes), "cpu", None, str(tmp_path), **options
    )


def test_run_decode_bench_on_cpu(tmp_path, capsys, tokenizer_loaded_once):
    results = _cpu_bench(
        tmp_path,
        [1, 2],
        "plain,overlap",
        num_questions=3,
        steady_state_requests=5,
        steady_max_tokens=8,
    )
    runs = results["runs"]
    assert [(r["mode"], r["kind"], r["batch_size"]) for r in runs] == [
        ("plain", "questions", 1),
        ("plain", "fixed", 2),
        ("plain", "steady", 2),
        ("overlap", "questions", 1),
        ("overlap", "fixed", 2),
        ("overlap", "steady", 2),
    ]
    for run in runs:
        assert run["tokens_per_s"] > 0
        assert run["gpu_idle_fraction"] is None
        if run["kind"] == "questions":
            assert run["output_tokens"] == 3 * 4 and len(run["per_question"]) == 3
        elif run["kind"] == "fixed":
            assert run["output_tokens"] == run["batch_size"] * 4 and run["max_tokens"] == 4
        else:  # every request ran to its own length (EOS ignored)
            assert run["num_requests"] == 5 and run["max_tokens"] == 8
            assert run["output_tokens"] == run["requested_output_tokens"] <= 5 * 8
            # Its one-token generate timed once, the decode past it counted.
            assert run["first_token_seconds_each"] == [run["first_token_seconds"]]
            decode_seconds = run["seconds"] - run["first_token_seconds"]
            decode_tokens = run["output_tokens"] - run["num_requests"]
            assert run["decode_tokens_per_s"] == pytest.approx(decode_tokens / decode_seconds)
    with open(results["output_path"]) as f:
        assert json.load(f)["runs"] == runs
    assert results["output_path"].startswith(str(tmp_path / "decode-cpu-"))
    assert len([line for line in capsys.readouterr().out.splitlines() if "tok/s" in line]) == 6


def test_fixed_rows_report_the_median_of_their_repeats(tmp_path, capsys, tokenizer_loaded_once):
    results = _cpu_bench(tmp_path, [2, 3], "overlap", num_questions=0, fixed_repeats=3)
    assert results["config"]["fixed_repeats"] == 3
    for run in results["runs"]:
        assert run["kind"] == "fixed" and len(run["seconds_each"]) == 3
        assert run["seconds"] == statistics.median(run["seconds_each"])
        assert run["tokens_per_s"] == run["output_tokens"] / run["seconds"]
        # Counts are one generate's, not the repeats' sum.
        assert run["output_tokens"] == run["batch_size"] * 4
        # The decode alone: the tokens after each first one, past the first tokens' median.
        assert len(run["first_token_seconds_each"]) == 3
        assert run["first_token_seconds"] == statistics.median(run["first_token_seconds_each"])
        decode_seconds = run["seconds"] - run["first_token_seconds"]
        assert run["decode_tokens_per_s"] == pytest.approx(run["batch_size"] * 3 / decode_seconds)
    out = capsys.readouterr().out
    assert "the median of 3" in out and "after the first tokens" in out
    with pytest.raises(ValueError, match="fixed_repeats must be >= 1"):
        _cpu_bench(tmp_path, [2], "overlap", fixed_repeats=0)


class _CountingLLM:
    """A stand-in engine for the rows' bookkeeping: each generate of one prompt takes the
    next scripted (seconds, tokens, drafts, accepted) and advances the engine counters."""

    def __init__(self, script, max_model_len=2048):
        self.script = list(script)
        self.counters = {
            "num_steps": 0,
            "num_preemptions": 0,
            "prefix_cache_hits": 0,
            "spec_decode_num_drafts": 0,
            "spec_decode_num_accepted_tokens": 0,
            "spec_decode_num_accepted_tokens_per_pos": [0, 0, 0],
        }
        self.model_path = "model.gguf"
        graphs = SimpleNamespace(num_replays=0)
        pipeline = SimpleNamespace(
            num_launched_ahead=0,
            num_prompts_ahead=0,
            num_parts_after_read=0,
            num_resolved_steps=0,
            num_mixed_steps=0,
            mtp=SimpleNamespace(step_graphs=graphs),
            launch_seconds=0.0,
            ragged_launch_seconds=0.0,
            reader=SimpleNamespace(wait_seconds=0.0),
        )
        runner = SimpleNamespace(
            proposer=SimpleNamespace(prompt_graphs=SimpleNamespace(num_replays=0))
        )
        self.engine = SimpleNamespace(
            arch=SimpleNamespace(vocab_size=1000),
            max_model_len=max_model_len,
            pipeline=pipeline,
            runner=runner,
        )
        self.tokenizer = SimpleNamespace(
            apply_chat_template=lambda messages: [1, 2] + [7] * len(messages[0]["content"])
        )
        self.calls = []

    def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")

    def get_metrics(self):
        return {
            **self.counters,
            "spec_decode_num_accepted_tokens_per_pos": list(
                self.counters["spec_decode_num_accepted_tokens_per_pos"]
            ),
        }

    def timed_generate(self, llm, prompts, params, batch_size=None):
        assert llm is self
        self.calls.append((prompts, params))
        seconds, tokens, drafts, accepted = self.script.pop(0)
        self.counters["num_steps"] += drafts
        self.counters["prefix_cache_hits"] += 16 * len(prompts)  # a shared block each
        self.counters["spec_decode_num_drafts"] += drafts
        self.counters["spec_decode_num_accepted_tokens"] += accepted
        self.counters["spec_decode_num_accepted_tokens_per_pos"][0] += min(accepted, drafts)
        pipeline = self.engine.pipeline  # all but the first step launched ahead, one waited
        pipeline.num_launched_ahead += max(drafts - 1, 0)
        pipeline.num_parts_after_read += 1
        pipeline.num_resolved_steps += max(drafts - 1, 0)  # all but one of them in a graph
        pipeline.mtp.step_graphs.num_replays += max(drafts - 2, 0)
        pipeline.num_mixed_steps += 1 if drafts > 2 else 0  # one beside a prompt chunk
        self.engine.runner.proposer.prompt_graphs.num_replays += 1 if drafts else 0  # its prompt
        pipeline.launch_seconds += seconds / 4  # a quarter of the time in launches, half waits
        pipeline.ragged_launch_seconds += seconds / 8  # half the launches' time in ragged parts
        pipeline.reader.wait_seconds += seconds / 2
        return seconds, tokens


def test_questions_row_sums_tokens_and_seconds_and_lists_each_acceptance(monkeypatch):
    # Three questions of unequal speed: tok/s is the sum of tokens over the sum of seconds
    # (not the mean of the per-question rates), acceptance one per question and overall.
    llm = _CountingLLM([(1.0, 100, 50, 50), (0.5, 100, 25, 75), (2.5, 60, 60, 0)])
    monkeypatch.setattr(decode_runs, "timed_generate", llm.timed_generate)
    params = SimpleNamespace(max_tokens=100)
    run = decode_runs.questions_run(llm, 3, params, 3, "cpu")
    assert run["kind"] == "questions" and run["batch_size"] == 1
    assert run["output_tokens"] == 260 and run["seconds"] == pytest.approx(4.0)
    assert run["tokens_per_s"] == pytest.approx(260 / 4.0)
    assert run["acceptance_length_per_question"] == [2.0, 4.0, 1.0]
    assert run["mean_acceptance_length"] == pytest.approx(1 + 125 / 135)
    assert run["num_drafts"] == 135 and run["num_steps"] == 135
    # The step pipeline's counts over the row: 49 + 24 + 59 ahead, one waiting per question.
    assert run["steps_launched_ahead"] == 132 and run["steps_parts_after_read"] == 3
    assert run["steps_prompts_ahead"] == 0
    assert run["steps_resolved"] == 132 and run["steps_resolved_in_graphs"] == 129
    assert run["steps_mixed"] == 3
    assert run["ragged_drafts_in_graphs"] == 3
    assert run["host_launch_s"] == pytest.approx(1.0) and run["host_wait_s"] == pytest.approx(2.0)
    assert run["host_ragged_launch_s"] == pytest.approx(0.5)
    assert [q["question_id"] for q in run["per_question"]] == [81, 82, 83]
    # Each question's own steps and host clocks (a quarter, an eighth and half its time).
    first = run["per_question"][0]
    assert first["num_steps"] == 50 and first["host_launch_s"] == pytest.approx(0.25)
    assert first["host_ragged_launch_s"] == pytest.approx(0.125)
    assert first["host_wait_s"] == pytest.approx(0.5)
    # The line through (50, 1.0), (25, 0.5), (60, 2.5) s by least squares: slope 32.5 / 650
    # s a step, through the means (45 steps, 4/3 s).
    fit = run["per_question_fit"]
    assert fit["per_step_ms"] == pytest.approx(50.0)
    assert fit["fixed_ms"] == pytest.approx(4000 / 3 - 50.0 * 45)
    # Each question was its own generate of one prompt, and the prompts all differ.
    assert [len(prompts) for prompts, _ in llm.calls] == [1, 1, 1]
    assert len({tuple(p[0]["prompt_token_ids"]) for p, _ in llm.calls}) == 3


def test_questions_row_without_speculation_has_no_acceptance(monkeypatch):
    llm = _CountingLLM([(1.0, 10, 0, 0), (1.0, 10, 0, 0)])
    monkeypatch.setattr(decode_runs, "timed_generate", llm.timed_generate)
    run = decode_runs.questions_run(llm, 2, SimpleNamespace(max_tokens=10), None, "cpu")
    assert "mean_acceptance_length" not in run and "acceptance_length_per_question" not in run
    assert run["tokens_per_s"] == pytest.approx(10.0) and len(run["per_question"]) == 2


def test_steady_rows_submit_every_request_at_once_with_its_dataset_length(monkeypatch):
    # The dataset's output lengths (capped at max_tokens by the loader) become each
    # request's max_tokens, and what the context leaves after the prompt caps them too.
    sampled = [
        BenchRequest("a" * 10, 10, 40),
        BenchRequest("b" * 20, 20, 7),
        BenchRequest("c" * 90, 90, 64),
    ]
    seen = {}

    def fake_load(num_requests, tokenizer, **options):
        seen.update(options, num_requests=num_requests)
        return sampled

    monkeypatch.setattr(decode_runs, "load_sharegpt", fake_load)
    # The run, then its one-token generate (the requests' prefill and first tokens).
    llm = _CountingLLM([(2.0, 100, 40, 60), (0.5, 3, 0, 0)], max_model_len=130)
    requests = decode_runs.steady_requests(llm, 3, max_tokens=64)
    assert seen["num_requests"] == 3 and seen["max_output_len"] == 64
    assert [len(r.prompt) for r in requests] == [12, 22, 92]
    # 130 - 92 - 8 (the margin) = 30 for the longest prompt.
    assert [r.output_len for r in requests] == [40, 7, 30]
    monkeypatch.setattr(decode_runs, "timed_generate", llm.timed_generate)
    monkeypatch.setattr(timing, "timed_generate", llm.timed_generate)
    run = decode_runs.steady_run(llm, requests, 2, 3, 64)
    # The run and its one-token generate meet the prompts outside the prefix cache.
    reset, (prompts, params), reset_again, (first_prompts, first_params) = llm.calls
    assert reset == reset_again == "reset_prefix_cache"
    assert first_prompts == prompts and [p.max_tokens for p in first_params] == [1, 1, 1]
    assert run["first_token_seconds"] == 0.5 and run["first_token_seconds_each"] == [0.5]
    # The run's own cache hits (its three prompts'), not its one-token generate's.
    assert run["prefix_cache_hit_tokens"] == 48
    # The 97 tokens after the 3 first ones over the 1.5 s past the first tokens.
    assert run["decode_tokens_per_s"] == pytest.approx(97 / 1.5)
    assert len(prompts) == 3 and [p.max_tokens for p in params] == [40, 7, 30]
    assert all(p.ignore_eos and p.temperature == 0.0 for p in params)
    assert run["kind"] == "steady" and run["num_requests"] == 3 and run["batch_size"] == 2
    assert run["requested_output_tokens"] == 77 and run["max_tokens"] == 64
    assert run["tokens_per_s"] == pytest.approx(50.0)
    assert run["mean_acceptance_length"] == pytest.approx(2.5)


def test_the_draft_schedule_reaches_the_speculative_engines_only(tokenizer_loaded_once):
    args = build_parser().parse_args(["bench", "decode", "--draft-schedule", "2:1"])
    assert args.draft_schedule == ((2, 1),)
    spec = EngineSpec("dummy:tiny", "cpu", None, 4, 3, "dummy", None, args.draft_schedule)
    mtp = spec.build({"overlap": True, "mtp": True})
    assert mtp.engine.config.speculative.draft_schedule == ((2, 1),)
    assert mtp.engine.config.speculative.drafts_for(4) == 1
    plain = spec.build({"overlap": True, "mtp": False})
    assert plain.engine.config.speculative.draft_schedule == ()
    for llm in (mtp, plain):
        llm.engine.shutdown()
