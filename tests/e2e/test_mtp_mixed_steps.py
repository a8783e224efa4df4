"""MTP with overlap where a step goes whole (``split_steps`` off, as on models over 2 GiB):
a step of decode rows the device resolves beside prompt chunks goes before the read of the
step in front as one forward (``StepPipeline._launch_mixed``); its tokens, logprobs and
drafts are those of the same step in parts, and greedy ones plain decoding's. No block
leaks (``make_llm``)."""

from __future__ import annotations

import pytest
from chat_prompts import mtbench_chat_prompts
from output_checks import assert_same_logprobs

from tandem import SamplingParams

K = 3


@pytest.fixture(scope="module")
def prompts(llm_cache):
    return mtbench_chat_prompts(llm_cache, 3, 5, 12)


def _params(index: int) -> SamplingParams:
    """Greedy and seeded sampled requests of several lengths, some that may end early (end
    token, a stop string), all with logprobs."""
    sampled = index % 3 == 1
    return SamplingParams(
        temperature=0.8 if sampled else 0.0,
        top_p=0.95,
        seed=100 + index if sampled else None,
        max_tokens=8 + 7 * (index % 4),
        logprobs=2,
        ignore_eos=index % 2 == 0,
        stop=["\n\n"] if index % 4 == 3 else None,
    )


def _run(llm, prompts, split_steps: bool) -> tuple[list, dict]:
    """Generate with steps in parts or whole; count per step its launches, and the steps
    that mix a prompt chunk with other rows."""
    pipeline = llm.engine.pipeline
    step_ahead, timed_launch = pipeline.step_ahead, pipeline._timed_launch
    launches: list[int] = []
    counts = {"chunk_beside_others": 0, "mixed_before": pipeline.num_mixed_steps}

    def counting_step(step):
        launches.append(0)
        # A follow-up row's start is stale (its prompt's step is in flight): not a chunk.
        in_prompt = [
            not row.follow_up and row.start < row.request.num_prompt_tokens
            for row in step.scheduled
        ]
        counts["chunk_beside_others"] += any(in_prompt) and not all(in_prompt)
        return step_ahead(step)

    def counting_launch(step, resolvable=None, resolved_rows=None):
        launches[-1] += 1
        return timed_launch(step, resolvable, resolved_rows)

    saved = pipeline.split_steps
    pipeline.split_steps = split_steps
    pipeline.step_ahead, pipeline._timed_launch = counting_step, counting_launch
    try:
        params = [_params(i) for i in range(len(prompts))]
        outputs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        pipeline.split_steps = saved
        del pipeline.step_ahead, pipeline._timed_launch
    counts["mixed"] = pipeline.num_mixed_steps - counts.pop("mixed_before")
    counts["most_launches"] = max(launches)
    return outputs, counts


def test_mixed_steps_launch_ahead_in_one_forward_and_match_the_parts(make_llm, prompts):
    # No prefix caching: both runs schedule the same rows in the same steps.
    llm = make_llm(
        speculative="mtp", num_speculative_tokens=K, max_num_seqs=4, enable_prefix_caching=False
    )
    pipeline = llm.engine.pipeline
    waited = pipeline.num_parts_after_read
    whole, counts = _run(llm, prompts, split_steps=False)
    waited = pipeline.num_parts_after_read - waited
    parts, _ = _run(llm, prompts, split_steps=True)
    assert [o.outputs[0].token_ids for o in whole] == [o.outputs[0].token_ids for o in parts]
    for got, want in zip(whole, parts, strict=True):
        assert got.outputs[0].finish_reason == want.outputs[0].finish_reason
        assert got.outputs[0].logprobs  # every request asks for them
        assert_same_logprobs(got, want)
    # Greedy requests: plain decoding's tokens.
    plain = make_llm(max_num_seqs=4, enable_prefix_caching=False)
    greedy = [i for i in range(len(prompts)) if _params(i).temperature == 0.0]
    want = plain.generate([prompts[i] for i in greedy], [_params(i) for i in greedy])
    assert [whole[i].outputs[0].token_ids for i in greedy] == [o.outputs[0].token_ids for o in want]
    # Whole: one launch a step; most steps with a chunk beside decode rows go as one mixed
    # forward before the read (the rest wait for the read: a row the device cannot resolve).
    assert counts["most_launches"] == 1
    assert counts["chunk_beside_others"] >= 5
    assert counts["mixed"] >= 0.8 * counts["chunk_beside_others"], counts
    assert waited <= counts["chunk_beside_others"] - counts["mixed"] + 2, (waited, counts)


def test_mixed_steps_replay_the_step_graphs_without_their_forward(make_llm):
    """With the resolved-step graphs attached (not captured on the CPU: ``run`` computes
    what a graph records, eagerly, under Triton's interpreter), a mixed step's resolved
    rows take the graph without the forward, fed the shared forward's hidden states: the
    tokens and logprobs of the eager mixed step, for the greedy family and the sampled
    ones, on a tiny model whose random head drafts and gets rejected."""
    from tandem.worker.spec_decode.step_graphs import ResolvedStepGraphs

    engine = {
        "model": "dummy:tiny",
        "attention_backend": "triton",
        "max_num_seqs": 3,
        # Triton's interpreter copies every tensor argument per launch: a small cache.
        "kv_cache_memory_gb": 0.01,
        "enable_prefix_caching": False,
        "speculative": "mtp",
        "num_speculative_tokens": 2,
        "speculative_model": "dummy",
    }
    # Five prompts three at a time, ending at different steps: prompts join decode rows.
    prompts = [{"prompt_token_ids": list(range(3 + i, 20 + 3 * i))} for i in range(5)]
    greedy = [
        SamplingParams(temperature=0.0, max_tokens=4 + 2 * i, ignore_eos=True) for i in range(5)
    ]
    sampled = [
        SamplingParams(
            temperature=0.9 if i % 2 else 0.0,
            top_p=0.8 if i % 4 == 1 else 1.0,
            seed=7 + i,
            max_tokens=4 + 2 * i,
            ignore_eos=True,
            logprobs=2,
        )
        for i in range(5)
    ]
    eager = make_llm(**engine)
    graphed = make_llm(**engine, enforce_eager=True)
    mtp = graphed.engine.pipeline.mtp
    mtp.step_graphs = ResolvedStepGraphs(graphed.engine.runner, mtp.slots, 3)
    calls = []
    run = mtp.step_graphs.run
    mtp.step_graphs.run = lambda *args: calls.append((args[4], args[7] is not None)) or run(*args)
    for llm in (eager, graphed):
        llm.engine.pipeline.split_steps = False  # whole steps, as on models over 2 GiB
    try:
        for params in (greedy, sampled):
            mixed_before = graphed.engine.pipeline.num_mixed_steps
            want = eager.generate(prompts, params, use_tqdm=False)
            calls.clear()
            got = graphed.generate(prompts, params, use_tqdm=False)
            mixed_calls = [family for family, mixed in calls if mixed]
            assert graphed.engine.pipeline.num_mixed_steps - mixed_before == len(mixed_calls)
            assert mixed_calls, calls
            assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
            for got_output, want_output in zip(got, want, strict=True):
                assert_same_logprobs(got_output, want_output)
        assert {"sampled", "sampled_top_p"} & set(mixed_calls), calls
    finally:
        mtp.step_graphs = None


def test_step_graphs_without_mixed_ones_refuse_hidden_states(make_llm):
    """Step graphs built without the mixed ones (steps in parts) hold no buffer for a
    shared forward's hidden states and refuse them, before writing any static buffer;
    hidden states of the wrong row count are refused too."""
    import torch

    from tandem.worker.spec_decode.step_graphs import ResolvedStepGraphs

    llm = make_llm(
        model="dummy:tiny",
        max_num_seqs=2,
        speculative="mtp",
        num_speculative_tokens=2,
        speculative_model="dummy",
    )
    runner, slots = llm.engine.runner, llm.engine.pipeline.mtp.slots
    hidden_size = runner.arch.hidden_size
    plain = ResolvedStepGraphs(runner, slots, 2, mixed=False)
    assert plain.mixed_hidden is None
    num_drafts, depth = plain.shapes[plain.padded_size(1)][0]
    hidden = torch.zeros((num_drafts + 1, hidden_size), dtype=runner.dtype)
    before = plain.slot_ids.clone()  # the scratch slot (0) everywhere
    with pytest.raises(ValueError, match="no mixed steps"):
        plain.run([1], [[runner.scratch_block]], num_drafts, depth, hidden=hidden)
    assert torch.equal(plain.slot_ids, before)
    mixed = ResolvedStepGraphs(runner, slots, 2, mixed=True)
    with pytest.raises(ValueError, match="hidden states for 1 rows"):
        mixed.run([1], [[runner.scratch_block]], num_drafts, depth, hidden=hidden[:0])
