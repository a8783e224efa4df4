"""The tie-rule comparison that every exactness test relies on flags what it must."""

from __future__ import annotations

from tandem.bench.hf_reference import reference_from_output, tie_rule_mismatches
from tandem.outputs import CompletionOutput, Logprob, RequestOutput


def _output(tokens, logprobs):
    positions = [
        {t: Logprob(lp, 1), 99: Logprob(lp - 1.0, 2)}
        for t, lp in zip(tokens, logprobs, strict=True)
    ]
    return RequestOutput("r", None, [1], [CompletionOutput(0, "", tokens, None, positions)])


def _ref(tokens, logprobs, margins):
    return {
        "token_ids": tokens,
        "logprobs": logprobs,
        "top2": [(lp, lp - m) for lp, m in zip(logprobs, margins, strict=True)],
    }


def test_equal_outputs_pass():
    ref = _ref([5, 6, 7], [-0.1, -0.2, -0.3], [1.0, 1.0, 1.0])
    assert tie_rule_mismatches([_output([5, 6, 7], [-0.1, -0.2, -0.3])], [ref]) == ([], 0)


def test_a_real_divergence_is_a_problem_and_a_tie_is_not():
    ours = _output([5, 8, 7], [-0.1, -0.2, -0.3])
    wide = _ref([5, 6, 7], [-0.1, -0.2, -0.3], [1.0, 1.0, 1.0])
    tie = _ref([5, 6, 7], [-0.1, -0.2, -0.3], [1.0, 5e-5, 1.0])
    problems, ties = tie_rule_mismatches([ours], [wide])
    assert len(problems) == 1 and "token 1" in problems[0] and ties == 1
    assert tie_rule_mismatches([ours], [tie]) == ([], 1)


def test_logprob_drift_and_length_mismatch_are_problems():
    ref = _ref([5, 6, 7], [-0.1, -0.2, -0.3], [1.0, 1.0, 1.0])
    drift, _ = tie_rule_mismatches([_output([5, 6, 7], [-0.1, -0.2005, -0.3])], [ref])
    short, _ = tie_rule_mismatches([_output([5, 6], [-0.1, -0.2])], [ref])
    assert len(drift) == 1 and "logprob at 1" in drift[0]
    assert len(short) == 1 and "2 tokens" in short[0]


def test_reference_from_output_round_trips():
    output = _output([5, 6], [-0.1, -0.2])
    ref = reference_from_output(output.outputs[0])
    assert ref["token_ids"] == [5, 6] and ref["logprobs"] == [-0.1, -0.2]
    assert ref["top2"][0] == (-0.1, -1.1)
    assert tie_rule_mismatches([output], [ref]) == ([], 0)
