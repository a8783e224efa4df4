"""Logit bias and penalties (tandem/layers/logit_adjustments.py) against a row-by-row
reference of vLLM's semantics, with drafts counted at the positions after them; and their
parameters' bounds and wire form."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from tandem.layers.logit_adjustments import AdjustedRow, adjust_logits
from tandem.sampling_params import ParamError, SamplingParams
from tandem.worker.step_sampler import SamplingRow, sample_step

VOCAB = 40


def reference_row(logits: torch.Tensor, params: SamplingParams, prompt, output) -> torch.Tensor:
    """One logits row adjusted token by token: bias, repetition over prompt and output,
    then frequency and presence over the output."""
    x = logits.double().clone()
    for token, bias in (params.logit_bias or {}).items():
        x[token] += bias
    for token in set(prompt) | set(output):
        p = params.repetition_penalty
        x[token] = x[token] / p if x[token] > 0 else x[token] * p
    for token, n in Counter(output).items():
        x[token] -= params.frequency_penalty * n + params.presence_penalty
    return x.float()


def test_rows_with_drafts_count_the_drafts_before_each_position():
    torch.manual_seed(0)
    logits = torch.randn(9, VOCAB) * 3
    row_tokens = torch.randint(0, VOCAB, (9,))
    row_tokens[6:9] = torch.tensor([7, 7, 3])  # row b's drafts repeat a token
    a = SamplingParams(temperature=0, presence_penalty=1.5, logit_bias={2: 5.0, 9: -100.0})
    b = SamplingParams(temperature=0, frequency_penalty=0.7, repetition_penalty=1.4)
    c = SamplingParams(temperature=0, presence_penalty=-0.5, frequency_penalty=-1.0)
    rows = [
        AdjustedRow.of(0, 0, a, [1, 2, 3], [4, 4, 9]),
        # rows 1-4: a request with nothing to adjust (must stay bit for bit)
        AdjustedRow.of(5, 3, b, [7, 8], [3, 3, 11]),
    ]
    raw = logits.clone()
    got = adjust_logits(logits, rows, row_tokens)
    assert torch.equal(logits, raw)  # the raw logits (for logprobs) are untouched
    assert torch.equal(got[1:5], logits[1:5])
    torch.testing.assert_close(got[0], reference_row(logits[0], a, [1, 2, 3], [4, 4, 9]))
    drafts = row_tokens[6:9].tolist()
    for j in range(4):
        want = reference_row(logits[5 + j], b, [7, 8], [3, 3, 11] + drafts[:j])
        torch.testing.assert_close(got[5 + j], want)
    # Negative penalties raise the logits of tokens already output.
    one = adjust_logits(logits[:1], [AdjustedRow.of(0, 0, c, [], [5, 5])], row_tokens)
    assert one[0, 5] == pytest.approx(logits[0, 5].item() + 2.5)


def test_greedy_verification_uses_the_adjusted_logits():
    """A draft equal to the raw argmax is rejected when a penalty moves the argmax, and a
    later position counts the accepted draft; logprobs stay raw."""
    logits = torch.zeros(3, VOCAB)
    logits[0, 5] = 2.0  # raw argmax 5; with 5 already output twice, 6 wins
    logits[0, 6] = 1.0
    logits[1, 6] = 3.0
    row_tokens = torch.tensor([1, 6, 6])
    params = SamplingParams(temperature=0, frequency_penalty=1.0, max_tokens=8, logprobs=0)
    row = SamplingRow(0, 2, params, 0, 10, 2, history=([1], [5, 5]))
    sample = sample_step([row], logits, row_tokens)
    # Position 0: 2 - 2 = 0 < 1, so 6 is chosen and draft 1 (6) accepted; position 1: 6 now
    # counted once (3 - 1 = 2, still the best): draft 2 (6) accepted; bonus at position 2.
    assert sample.num_emitted.tolist() == [3]
    assert sample.candidates[:2].tolist() == [6, 6]
    raw = logits.log_softmax(-1)
    assert sample.logprobs.token_logprobs[0].item() == pytest.approx(raw[0, 6].item())
    banned = SamplingParams(temperature=0, logit_bias={6: -100.0}, max_tokens=8)
    row = SamplingRow(0, 2, banned, 0, 10, 2, history=([1], [5, 5]))
    assert sample_step([row], logits, row_tokens).num_emitted.tolist() == [1]


def test_a_row_with_penalties_and_no_history_is_an_error():
    params = SamplingParams(temperature=0, presence_penalty=1.0)
    with pytest.raises(ValueError, match="no history"):
        sample_step([SamplingRow(0, 0, params, 0, 3, 0)], torch.zeros(1, VOCAB), torch.zeros(1))


@pytest.mark.parametrize(
    "field, value",
    [
        ("presence_penalty", 2.01),
        ("frequency_penalty", -2.5),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", float("nan")),
        ("logit_bias", {1: 100.5}),
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", {1: float("inf")}),
        ("logit_bias", [1, 2]),
    ],
)
def test_out_of_range_values_name_their_field(field, value):
    with pytest.raises(ParamError) as error:
        SamplingParams(**{field: value})
    assert error.value.param == field


def test_bias_beyond_the_vocabulary_and_the_wire_form():
    params = SamplingParams(logit_bias={3: 1, 7: -2.5}, repetition_penalty=1.2)
    assert params.adjusts_logits and not SamplingParams().adjusts_logits
    with pytest.raises(ParamError, match="logit_bias"):
        SamplingParams(logit_bias={VOCAB: 1.0}).validate_for_vocab(VOCAB)
    back = SamplingParams.from_dict(params.to_dict())
    assert back.logit_bias == {3: 1.0, 7: -2.5} and back.repetition_penalty == 1.2
    with pytest.raises(ParamError, match="pairs"):
        SamplingParams.from_dict({**params.to_dict(), "logit_bias": [[[1], 2.0]]})
