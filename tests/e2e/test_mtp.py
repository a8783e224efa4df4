"""MTP speculative decoding is lossless (DESIGN.md invariant 1 and 3): greedy tokens equal
the non-speculative engine's, logprobs within 1e-4, for k = 1..4, under preemption and
prefix-cache hits; accepted drafts go through every stop condition."""

from __future__ import annotations

import pytest
from chat_prompts import mtbench_chat_prompts

from tandem import SamplingParams
from tandem.bench.hf_reference import reference_from_output, tie_rule_mismatches
from tandem.worker.spec_decode.proposer import Proposal

pytestmark = pytest.mark.slow  # MTP engines (k = 1..4) against the plain engine over 16 prompts

MAX_TOKENS = 20
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def prompts(llm_cache):
    return mtbench_chat_prompts(llm_cache, 0, 5, 16)


@pytest.fixture(scope="module")
def baseline(prompts, llm_cache):
    outputs = llm_cache[()].generate(prompts, _greedy())
    return [o.outputs[0] for o in outputs]


def _greedy(max_tokens: int = MAX_TOKENS, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=2, **kwargs)


def assert_same_as_baseline(outputs, baseline) -> None:
    """Token-for-token equality with the non-speculative run, under the tie rule."""
    references = [reference_from_output(expected) for expected in baseline]
    problems, _ = tie_rule_mismatches(outputs, references, TOLERANCE)
    assert not problems, problems
    for output, expected in zip(outputs, baseline, strict=True):
        if output.outputs[0].token_ids == expected.token_ids:
            assert output.outputs[0].finish_reason == expected.finish_reason


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_invariant_lossless_mtp_greedy(make_llm, prompts, baseline, k):
    llm = make_llm(speculative="mtp", num_speculative_tokens=k, speculative_model="dummy")
    before = llm.get_metrics()["spec_decode_num_drafts"]
    outputs = llm.generate(prompts, _greedy())
    assert llm.get_metrics()["spec_decode_num_drafts"] > before, "no drafts were verified"
    assert_same_as_baseline(outputs, baseline)


def test_mtp_lossless_under_preemption_and_prefix_hits(make_llm, prompts, baseline):
    llm = make_llm(
        speculative="mtp",
        num_speculative_tokens=3,
        speculative_model="dummy",
        num_kv_blocks=40,
        max_num_seqs=16,
    )
    metrics = llm.get_metrics()
    first = llm.generate(prompts, _greedy())
    second = llm.generate(prompts, _greedy())
    after = llm.get_metrics()
    assert after["num_preemptions"] > metrics["num_preemptions"]
    assert after["prefix_cache_hits"] > metrics["prefix_cache_hits"]
    assert_same_as_baseline(first, baseline)
    assert_same_as_baseline(second, baseline)


class OracleProposer:
    """Wraps the real proposer (which still fills the MTP KV cache) and replaces its drafts
    by the true greedy continuation, with one wrong token every ``wrong_every`` proposals."""

    def __init__(
        self, inner, batch, continuations: dict[tuple[int, ...], list[int]], wrong_every: int
    ):
        # The worker's own request states: with overlap it may draft for a request that the
        # scheduler has just finished.
        self.inner, self.batch, self.continuations = inner, batch, continuations
        self.wrong_every = wrong_every
        self.calls = 0

    def propose(self, rows, hidden, sampling, sampled=None) -> Proposal:
        proposal = self.inner.propose(rows, hidden, sampling, sampled)
        for row in rows:
            drafts_tensor = proposal.draft_token_ids.get(row.request_id)
            if drafts_tensor is None:
                continue
            drafts = drafts_tensor.tolist()
            state = self.batch.states[row.request_id]
            prompt = state.token_ids[: state.num_prompt_tokens]
            # Drafts cover the positions after the bonus token at positions[-1] + 1.
            first_output = row.positions[-1] + 2 - len(prompt)
            truth = self.continuations[tuple(prompt)][first_output : first_output + len(drafts)]
            new = truth + drafts[len(truth) :]
            self.calls += 1
            if self.wrong_every and self.calls % self.wrong_every == 0:
                new[-1] = (new[-1] + 1) % 49152
            proposal.draft_token_ids[row.request_id] = drafts_tensor.new_tensor(new)
        return proposal


def _run_with_oracle(llm, prompts, baseline, params, wrong_every):
    """Generate with drafts taken from the known greedy continuation."""
    runner = llm.engine.runner
    continuations = {
        tuple(p["prompt_token_ids"]): list(b.token_ids)
        for p, b in zip(prompts, baseline, strict=True)
    }
    original = runner.proposer
    runner.proposer = OracleProposer(
        original, llm.engine.pipeline.batch, continuations, wrong_every
    )
    try:
        return llm.generate(prompts, params)
    finally:
        runner.proposer = original


def test_accepted_drafts_match_baseline_and_count(make_llm, prompts, baseline):
    llm = make_llm(speculative="mtp", num_speculative_tokens=3, speculative_model="dummy")
    before = llm.get_metrics()
    outputs = _run_with_oracle(llm, prompts, baseline, _greedy(), wrong_every=3)
    after = llm.get_metrics()
    accepted = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
    assert accepted > 0, "the oracle's drafts were never accepted"
    per_pos = after["spec_decode_num_accepted_tokens_per_pos"]
    assert per_pos[0] >= per_pos[1] >= per_pos[2] > 0
    assert_same_as_baseline(outputs, baseline)


def test_stop_conditions_inside_an_accepted_run(make_llm, prompts, baseline):
    llm = make_llm(speculative="mtp", num_speculative_tokens=3, speculative_model="dummy")
    # max_tokens that ends inside an accepted run is never exceeded.
    short = _run_with_oracle(llm, prompts[:4], baseline[:4], _greedy(max_tokens=5), wrong_every=0)
    for output, expected in zip(short, baseline[:4], strict=True):
        assert output.outputs[0].token_ids == expected.token_ids[:5]
        assert output.outputs[0].finish_reason == "length"
    # A stop token inside an accepted run truncates there.
    stop_token = baseline[0].token_ids[6]
    cut = baseline[0].token_ids.index(stop_token) + 1
    stopped = _run_with_oracle(
        llm, prompts[:1], baseline[:1], _greedy(stop_token_ids=[stop_token]), wrong_every=0
    )
    assert stopped[0].outputs[0].token_ids == baseline[0].token_ids[:cut]
    assert stopped[0].outputs[0].finish_reason == "stop"


def test_seeded_sampling_with_mtp_same_alone_and_in_batch(make_llm, prompts):
    llm = make_llm(speculative="mtp", num_speculative_tokens=2, speculative_model="dummy")
    seeded = SamplingParams(temperature=0.8, top_k=50, seed=99, max_tokens=16)
    alone = llm.generate(prompts[0], seeded)[0].outputs[0].token_ids
    batch = llm.generate(prompts[:6], [seeded] + [SamplingParams(max_tokens=16)] * 5)
    assert batch[0].outputs[0].token_ids == alone


def test_shipped_head_is_used_by_default_and_gets_accepted(make_llm, prompts, baseline):
    llm = make_llm(speculative="mtp", num_speculative_tokens=3)
    before = llm.get_metrics()
    outputs = llm.generate(prompts, _greedy())
    after = llm.get_metrics()
    assert_same_as_baseline(outputs, baseline)
    drafts = after["spec_decode_num_drafts"] - before["spec_decode_num_drafts"]
    accepted = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
    # A trained head: well above what a random head gets (nothing).
    assert accepted / drafts > 0.2, f"{accepted} accepted tokens over {drafts} draft runs"
