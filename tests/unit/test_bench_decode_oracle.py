"""``tandem bench decode --oracle-corruption``: the rates, the prompts recorded, the check of
the outputs against the recordings, and a small CPU run of plain decoding followed by the
oracle's ``mtp+overlap`` engine on the ``tiny`` dummy model."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tandem.bench import decode_runs
from tandem.bench.datasets import BenchRequest
from tandem.bench.decode import parse_modes, run_decode_bench
from tandem.bench.decode_oracle import oracle_fields, oracle_mode, parse_rates, recorded_prompts
from tandem.cli import build_parser


def test_rates_parse_and_the_documented_ones_give_acceptance_3_and_2():
    assert parse_rates(None) == parse_rates("") == []
    assert parse_rates("0,0.19,0.456") == [0.0, 0.19, 0.456]
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        parse_rates("0.5,1.5")
    fields = [oracle_fields(oracle_mode(rate), 3) for rate in (0.0, 0.19, 0.456, 1.0)]
    assert all(f["proposer"] == "oracle" for f in fields)
    expected = [f["expected_acceptance_length"] for f in fields]
    assert expected == pytest.approx([4.0, 3.0, 2.0, 1.0], abs=0.01)
    assert oracle_fields({"overlap": True, "mtp": True}, 3) == {"proposer": "mtp"}
    assert oracle_fields({"overlap": True, "mtp": False}, 3) == {"proposer": None}
    args = build_parser().parse_args(["bench", "decode", "--oracle-corruption", "0.19,0.456"])
    assert parse_rates(args.oracle_corruption) == [0.19, 0.456]


def test_every_prompt_is_recorded_once_for_the_longest_row_plus_k():
    llm = SimpleNamespace(
        model_path="model.gguf",
        engine=SimpleNamespace(arch=SimpleNamespace(vocab_size=1 << 20)),
        tokenizer=SimpleNamespace(
            apply_chat_template=lambda m: [1, *map(ord, m[0]["content"][:12])]
        ),
    )
    steady = [BenchRequest([5, 6], 2, 30), BenchRequest([5, 6], 2, 50), BenchRequest([7], 1, 9)]
    prompts, lengths = recorded_prompts(llm, 3, 16, steady, k=3)
    keys = [tuple(p["prompt_token_ids"]) for p in prompts]
    assert len(keys) == len(set(keys)) == 3 + 2  # three MT-Bench turns, two steady prompts
    assert lengths[:3] == [19, 19, 19]
    assert dict(zip(keys, lengths, strict=True))[(5, 6)] == 53 and lengths[-1] == 12


def test_recording_match_counts_the_prefix_each_output_shares(monkeypatch):
    recordings = {(1,): [10, 11, 12, 13], (2,): [20, 21, 22, 23]}
    outputs = [[10, 11, 12, 13], [20, 99, 22, 23]]  # the second leaves it after one token

    def fake_timed(llm, prompts, params, outputs=None):
        for tokens in outputs_by_call:
            outputs.append(SimpleNamespace(outputs=[SimpleNamespace(token_ids=tokens)]))
        return 1.0, 8

    outputs_by_call = outputs
    monkeypatch.setattr(decode_runs, "timed_generate", fake_timed)
    tally = [0, 0]
    prompts = [{"prompt_token_ids": [1]}, {"prompt_token_ids": [2]}]
    assert decode_runs._timed(None, prompts, None, recordings, tally) == (1.0, 8)
    assert tally == [4 + 1, 8]
    assert decode_runs._match_field(tally) == {"recording_match": 5 / 8}
    assert decode_runs._match_field([0, 0]) == {}


def test_oracle_run_after_plain_decoding_on_cpu(tmp_path, tokenizer_loaded_once):
    results = run_decode_bench(
        "dummy:tiny",
        [1, 2],
        6,
        parse_modes("overlap"),
        "cpu",
        None,
        str(tmp_path),
        num_questions=2,
        steady_state_requests=3,
        steady_max_tokens=8,
        oracle_corruptions=[0.0],
    )
    recording = results["config"]["oracle_recording"]
    assert recording["engine"] == "overlap" and recording["num_prompts"] == 2 + 3
    runs = results["runs"]
    assert [(r["mode"], r["proposer"], r["kind"]) for r in runs] == [
        ("overlap", None, "questions"),
        ("overlap", None, "fixed"),
        ("overlap", None, "steady"),
        ("mtp+overlap", "oracle", "questions"),
        ("mtp+overlap", "oracle", "fixed"),
        ("mtp+overlap", "oracle", "steady"),
    ]
    for plain, oracle in zip(runs[:3], runs[3:], strict=True):
        assert oracle["output_tokens"] == plain["output_tokens"]
        assert oracle["oracle_corruption"] == 0.0 and oracle["expected_acceptance_length"] == 4
        assert oracle["mean_acceptance_length"] == 4.0  # every draft accepted
        assert oracle["recording_match"] == 1.0 and oracle["oracle_unrecorded_requests"] == 0
