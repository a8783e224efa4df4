"""MTP with overlap: a prompt's later chunks launch before the read of the step in front
(their start moved on when the chunk before them was launched), also for a model whose steps
go whole (``split_steps`` off: a step of prompt chunks, with or without decode rows the
device resolves beside them, goes ahead as one forward).
Greedy outputs and logprobs are the plain engine's; no block leaks (``make_llm``)."""

from __future__ import annotations

import pytest
from chat_prompts import mtbench_chat_prompts
from output_checks import assert_same_logprobs

from tandem import SamplingParams

K = 3
BUDGET = 64  # tokens a step: every prompt comes in several chunks


@pytest.fixture(scope="module")
def prompts(llm_cache):
    return mtbench_chat_prompts(llm_cache, 2, 9, 6)


def _is_later_chunk(row) -> bool:
    """A prompt chunk after the first (a follow-up row's start is stale: not one)."""
    prompt_end = row.request.num_prompt_tokens
    fresh = row.reset_token_ids is None and not row.follow_up
    return fresh and 0 < row.start and row.end <= prompt_end


@pytest.mark.parametrize("split_steps", [True, False], ids=["in-parts", "whole"])
def test_later_prompt_chunks_launch_before_the_read(make_llm, prompts, split_steps):
    params = SamplingParams(temperature=0.0, max_tokens=10, logprobs=2, ignore_eos=True)
    # An engine per case: no prefix hits across them.
    llm = make_llm(
        speculative="mtp",
        num_speculative_tokens=K,
        max_num_batched_tokens=BUDGET,
        max_num_seqs=4,
        seed=1 if split_steps else 2,
    )
    pipeline = llm.engine.pipeline
    step_ahead, read, launch = pipeline.step_ahead, pipeline.read, pipeline._timed_launch
    call = {"unread": False, "read": False}
    ahead_chunks, later_chunks = [], []

    def counting_step_ahead(step):
        call.update(unread=pipeline._launched is not None, read=False)
        return step_ahead(step)

    def counting_read(launched):
        call["read"] = True
        return read(launched)

    def counting_launch(step, resolvable=None, resolved_rows=None):
        chunks = [(r.request.request_id, r.start) for r in step.scheduled if _is_later_chunk(r)]
        later_chunks.extend(chunks)
        if call["unread"] and not call["read"]:
            ahead_chunks.extend(chunks)
        return launch(step, resolvable, resolved_rows)

    saved_split = pipeline.split_steps
    pipeline.split_steps = split_steps
    pipeline.step_ahead, pipeline.read = counting_step_ahead, counting_read
    pipeline._timed_launch = counting_launch
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        pipeline.split_steps = saved_split
        del pipeline.step_ahead, pipeline.read, pipeline._timed_launch
    plain = make_llm(max_num_batched_tokens=BUDGET, max_num_seqs=4)
    want = plain.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in want]
    for got, expected in zip(outputs, want, strict=True):
        assert got.outputs[0].logprobs  # every request asks for them
        assert_same_logprobs(got, expected)
    # Each later chunk launched once, and before the read of the step in front (several:
    # the prompts' shared chat-template start is a prefix hit, so short ones fit one chunk).
    assert len(set(later_chunks)) == len(later_chunks) >= 4
    assert ahead_chunks == later_chunks
