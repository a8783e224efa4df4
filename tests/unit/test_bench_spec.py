"""``tandem bench spec`` for a head study: held-out prompts (ShareGPT past the records
training may have used), the training tokens read from head configs and recorded by
``train_mtp``, and one run over two heads on the CPU with its JSON and PNG."""

from __future__ import annotations

import json
from itertools import islice
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tandem.bench.datasets import iter_sharegpt
from tandem.bench.spec import category_acceptance, first_turns, run_spec_bench
from tandem.models.mtp_files import HEAD_CONFIG_FILE, head_training_tokens
from tandem.train.mtp_distill import TrainConfig, train_mtp

SHIPPED_HEAD = str(Path(__file__).resolve().parents[2] / "tandem/heads/smollm2-135m-instruct")


def write_config(directory, training) -> str:
    directory.mkdir()
    (directory / HEAD_CONFIG_FILE).write_text(json.dumps({"num_layers": 1, "training": training}))
    return str(directory)


def test_training_tokens_from_head_configs(tmp_path):
    run = {"steps_run": 10, "config": {"batch_size": 4, "seq_len": 8, "init_head": None}}
    assert head_training_tokens(write_config(tmp_path / "a", run)) == (320, True)
    continued = {**run, "config": {**run["config"], "init_head": "elsewhere"}}
    assert head_training_tokens(write_config(tmp_path / "b", continued)) == (320, False)
    counted = {**continued, "total_tokens": 1000}
    assert head_training_tokens(write_config(tmp_path / "c", counted)) == (1000, True)
    assert head_training_tokens(write_config(tmp_path / "d", "no")) == (None, False)
    assert head_training_tokens(str(tmp_path / "missing")) == (None, False)
    assert head_training_tokens(None) == (None, False)
    # The shipped head records its whole lineage (mtp_config.json: total_tokens).
    assert head_training_tokens(SHIPPED_HEAD) == (49_028 * 32 * 256, True)


def test_train_mtp_records_the_tokens_it_saw(tmp_path):
    tokens = torch.randint(0, 500, (8, 16))
    config = TrainConfig(steps=2, batch_size=2, seq_len=16, eval_every=1)
    first = str(tmp_path / "first")
    _, summary = train_mtp("dummy:tiny", tokens, tokens[:2], config, out_dir=first, progress=False)
    assert summary["total_tokens"] == 2 * 2 * 16
    assert head_training_tokens(first) == (64, True)
    then = TrainConfig(steps=3, batch_size=2, seq_len=16, eval_every=1, init_head=first)
    _, summary = train_mtp("dummy:tiny", tokens, tokens[:2], then, progress=False)
    assert summary["total_tokens"] == 64 + 3 * 2 * 16


def test_sharegpt_turns_are_past_the_skipped_records():
    skip = 50
    turns = first_turns("sharegpt", 3, sharegpt_skip=skip)
    expected = []
    for record in islice(iter_sharegpt(), skip, None):
        first = record["conversations"][0] if record.get("conversations") else {}
        if first.get("from") == "human" and first.get("value", "").strip():
            expected.append(first["value"])
        if len(expected) == 3:
            break
    assert turns == expected
    assert len(first_turns("mtbench", 5)) == 5
    with pytest.raises(ValueError, match="dataset"):
        first_turns("alpaca", 1)


@pytest.mark.slow  # three engines on the CPU
def test_a_study_of_two_heads_writes_json_and_png(tmp_path):
    png = tmp_path / "study.png"
    results = run_spec_bench(
        None,
        [SHIPPED_HEAD, "dummy"],
        2,
        [2],
        2,
        8,
        "cpu",
        None,
        str(tmp_path),
        dataset="sharegpt",
        sharegpt_skip=20,
        plot=str(png),
    )
    written = json.loads(open(results["output_path"]).read())
    assert written["config"]["dataset"] == "sharegpt" and written["config"]["sharegpt_skip"] == 20
    shipped, dummy = written["runs"]
    assert shipped["head"] == SHIPPED_HEAD and shipped["training_tokens"] == 49_028 * 32 * 256
    assert dummy["training_tokens"] is None
    for run in (shipped, dummy):
        assert len(run["acceptance_rate_per_position"]) == 2
        assert run["mean_acceptance_length"] == pytest.approx(
            1 + run["num_accepted_tokens"] / run["num_drafts"]
        )
    # The trained head accepts more than a random one.
    assert shipped["mean_acceptance_length"] > dummy["mean_acceptance_length"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


class _DraftCountingLLM:
    """Each generate drafts once per prompt and accepts as many tokens as the prompt's
    first id says (the metrics a category's rows leave)."""

    def __init__(self):
        self.metrics = {
            "spec_decode_num_drafts": 0,
            "spec_decode_num_accepted_tokens": 0,
            "spec_decode_num_accepted_tokens_per_pos": [0, 0],
        }
        self.batches = []
        self.config = SimpleNamespace(device="cpu")

    def get_metrics(self):
        return {
            **self.metrics,
            "spec_decode_num_accepted_tokens_per_pos": list(
                self.metrics["spec_decode_num_accepted_tokens_per_pos"]
            ),
        }

    def generate(self, prompts, params, use_tqdm=False):
        self.batches.append(len(prompts))
        for prompt in prompts:
            accepted = prompt["prompt_token_ids"][0]
            self.metrics["spec_decode_num_drafts"] += 1
            self.metrics["spec_decode_num_accepted_tokens"] += accepted
            for position in range(accepted):
                self.metrics["spec_decode_num_accepted_tokens_per_pos"][position] += 1
        return []


def test_acceptance_by_category_runs_each_category_as_one_batch():
    llm = _DraftCountingLLM()
    prompts = [{"prompt_token_ids": [n]} for n in (2, 0, 1, 2, 2)]
    categories = ["writing", "writing", "math", "math", "coding"]
    result = category_acceptance(llm, prompts, categories, None, 2)
    assert list(result) == ["writing", "math", "coding"] and llm.batches == [2, 2, 1]
    assert result["writing"]["questions"] == 2
    assert result["writing"]["mean_acceptance_length"] == pytest.approx(1 + 2 / 2)
    assert result["writing"]["acceptance_rate_per_position"] == pytest.approx([0.5, 0.5])
    assert result["math"]["mean_acceptance_length"] == pytest.approx(1 + 3 / 2)
    assert result["coding"]["acceptance_rate_per_position"] == pytest.approx([1.0, 1.0])


def test_mtbench_study_reports_acceptance_by_category(tmp_path):
    # MT-Bench lists ten questions a category: twelve are writing's ten and two of roleplay.
    results = run_spec_bench(
        None, ["dummy"], 2, [4], 12, 4, "cpu", None, str(tmp_path), dataset="mtbench"
    )
    (run,) = results["runs"]
    by_category = run["acceptance_by_category"]
    assert {c: e["questions"] for c, e in by_category.items()} == {"writing": 10, "roleplay": 2}
    for entry in by_category.values():
        assert 1.0 <= entry["mean_acceptance_length"] <= 3.0
        assert len(entry["acceptance_rate_per_position"]) == 2


def test_the_packaged_sharegpt_holds_out_enough_first_turns():
    """The held-out index lies inside the packaged (cut-off) file, past the shipped head's
    training data, with the 80 first turns a study measures."""
    from tandem.bench.datasets import SHAREGPT_HELD_OUT_FROM

    assert SHAREGPT_HELD_OUT_FROM > 15_430  # the shipped head's last training record
    assert len(first_turns("sharegpt", 80)) == 80
