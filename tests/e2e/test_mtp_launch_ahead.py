"""MTP with overlap launches step n+1 before reading step n: uniform decode steps are
resolved on the device (positions, inputs and drafts from per-request device slots), their
output is exactly the plain engine's, the slots always agree with the host once a step is
read, and no resolved row writes outside its blocks or the context."""

from __future__ import annotations

import pytest
import torch
from chat_prompts import mtbench_chat_prompts
from output_checks import assert_same_logprobs

from tandem import SamplingParams

K = 3
TINY_TOKENS = 8  # per request on the tiny model under Triton's interpreter (slow)


@pytest.fixture(scope="module")
def prompts(llm_cache):
    return mtbench_chat_prompts(llm_cache, 1, 7, 8)


def _greedy(max_tokens: int = 48, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=2, **kwargs)


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def _sampled(max_tokens: int = 48, **kwargs) -> SamplingParams:
    return SamplingParams(
        temperature=0.8, top_p=0.95, seed=7, max_tokens=max_tokens, logprobs=2, **kwargs
    )


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_mtp_decode_steps_are_queued_before_the_previous_read(
    make_llm, prompts, sampled, monkeypatch
):
    """Greedy: the plain engine's tokens. Sampled (rejection sampling against the head's
    drafts and their q, kept in the device slots): the tokens and logprobs of MTP without
    overlap and without resolved steps, whose rows are all ragged and known to the host."""
    llm = make_llm(speculative="mtp", num_speculative_tokens=K)
    params = _sampled(ignore_eos=True) if sampled else _greedy(ignore_eos=True)
    pipeline = llm.engine.pipeline
    step_ahead = pipeline.step_ahead
    decode_steps = ahead = 0

    def counting(step):
        nonlocal decode_steps, ahead
        before = pipeline.num_launched_ahead
        decode_only = not step.is_empty and all(
            row.reset_token_ids is None and row.start >= row.request.num_prompt_tokens
            for row in step.scheduled
        )
        output = step_ahead(step)
        if decode_only:
            decode_steps += 1
            ahead += pipeline.num_launched_ahead - before
        return output

    pipeline.step_ahead = counting
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        del pipeline.step_ahead
    if sampled:
        reference = make_llm(speculative="mtp", num_speculative_tokens=K, overlap=False)
        mtp = reference.engine.pipeline.mtp
        monkeypatch.setattr(mtp, "row_resolvable", lambda row, ahead: False)
    else:
        reference = make_llm()
    want = reference.generate(prompts, params, use_tqdm=False)
    assert _tokens(outputs) == _tokens(want)
    if sampled:  # and the same logprobs, from the target's raw logits
        for got_output, want_output in zip(outputs, want, strict=True):
            for got, expected in zip(
                got_output.outputs[0].logprobs, want_output.outputs[0].logprobs, strict=True
            ):
                for token, entry in expected.items():
                    assert abs(got[token].logprob - entry.logprob) < 1e-4
    assert decode_steps >= 10
    assert ahead >= 0.9 * decode_steps, f"{ahead} of {decode_steps} decode steps ran ahead"


def test_decode_rows_launch_ahead_while_prompts_keep_joining(make_llm, prompts):
    """Steady state: sixteen requests of mixed lengths through four sequence slots, so a
    prompt joins most steps; the decode rows of those steps still launch before the read of
    the step in front (so do the joining prompts: the next test), and the outputs are plain
    decoding's."""
    llm = make_llm(speculative="mtp", num_speculative_tokens=K, max_num_seqs=4)
    pipeline = llm.engine.pipeline
    step_ahead = pipeline.step_ahead
    mixed = mixed_ahead = 0

    def counting(step):
        nonlocal mixed, mixed_ahead
        before = pipeline.num_launched_ahead
        joining = [
            row.reset_token_ids is not None or row.start < row.request.num_prompt_tokens
            for row in step.scheduled
        ]
        output = step_ahead(step)
        if any(joining) and not all(joining):
            mixed += 1
            mixed_ahead += pipeline.num_launched_ahead - before
        return output

    many = (prompts * 2)[:16]
    params = [
        SamplingParams(temperature=0.0, max_tokens=6 + 5 * (i % 5), ignore_eos=True)
        for i in range(len(many))
    ]
    pipeline.step_ahead = counting
    try:
        outputs = llm.generate(many, params, use_tqdm=False)
    finally:
        del pipeline.step_ahead
    plain = make_llm(max_num_seqs=4).generate(many, params, use_tqdm=False)
    assert _tokens(outputs) == _tokens(plain)
    assert mixed >= 5
    assert mixed_ahead >= 0.7 * mixed, f"{mixed_ahead} of {mixed} mixed steps ran ahead"


def test_a_step_goes_whole_when_its_parts_would_cost_weight_reads(make_llm, prompts):
    """Models over the size bound (``split_steps`` off) launch each step as one part: ahead
    if every row is resolvable or a prompt chunk (then in one forward: test_mtp_mixed_steps.py),
    else after the read; the outputs stay plain decoding's (the parts of small models:
    test_decode_rows_launch_ahead_while_prompts_keep_joining)."""
    llm = make_llm(speculative="mtp", num_speculative_tokens=K, max_num_seqs=4)
    pipeline = llm.engine.pipeline
    assert pipeline.split_steps  # SmolLM2-135M is far under the bound
    pipeline.split_steps = False
    step_ahead, timed_launch = pipeline.step_ahead, pipeline._timed_launch
    parts_per_step: list[int] = []

    def counting_launch(step, resolvable=None, resolved_rows=None):
        parts_per_step[-1] += 1
        return timed_launch(step, resolvable, resolved_rows)

    def counting_step(step):
        parts_per_step.append(0)
        return step_ahead(step)

    pipeline.step_ahead, pipeline._timed_launch = counting_step, counting_launch
    many = (prompts * 2)[:12]
    params = [
        SamplingParams(temperature=0.0, max_tokens=6 + 5 * (i % 5), ignore_eos=True)
        for i in range(len(many))
    ]
    try:
        outputs = llm.generate(many, params, use_tqdm=False)
    finally:
        del pipeline.step_ahead, pipeline._timed_launch
    plain = make_llm(max_num_seqs=4).generate(many, params, use_tqdm=False)
    assert _tokens(outputs) == _tokens(plain)
    assert len(parts_per_step) >= 10
    assert max(parts_per_step) == 1
    assert pipeline.num_launched_ahead > 0


@pytest.mark.parametrize(
    ("overlap", "schedule"),
    [(False, ()), (True, ()), (True, ((3, 2), (6, 1)))],
    ids=["read-first", "overlap", "overlap-draft-schedule"],
)
def test_device_slots_agree_with_the_host_under_preemption_and_aborts(
    make_llm, prompts, overlap, schedule
):
    """With a draft schedule a slot holds the drafts its last step drafted (fewer than k at
    a large batch): the host's count of them agrees."""
    llm = make_llm(
        speculative="mtp",
        num_speculative_tokens=K,
        num_kv_blocks=48,
        max_num_seqs=8,
        overlap=overlap,
        speculative_draft_schedule=schedule,
    )
    pipeline = llm.engine.pipeline
    slots = pipeline.mtp.slots
    before = llm.get_metrics()["num_preemptions"]
    ids = [llm.add_request(p, _greedy(64, ignore_eos=True)) for p in prompts]
    checked = steps = 0
    depths = set()
    while llm.engine.has_unfinished_requests():
        llm.step()
        steps += 1
        if steps == 6:
            for request_id in ids[::3]:
                llm.abort_request(request_id)
        held, part = set(), pipeline._launched
        while part is not None:  # the parts of the step in flight
            held |= {p.request_id for p in part.inputs.plans}
            part = part.rest
        for request_id, state in pipeline.batch.states.items():
            if not state.slot_ready or request_id in held:
                continue  # a step in flight has yet to be read for it
            checked += 1
            assert slots.next_start[state.slot].item() == len(state.token_ids) - 1
            assert slots.last_token[state.slot].item() == state.token_ids[-1]
            drafts = pipeline.batch.drafts_of(state)
            assert drafts.shape[0] == state.slot_depth
            assert torch.equal(slots.drafts[state.slot, : state.slot_depth], drafts)
            depths.add(state.slot_depth)
    assert checked > 0
    # With the schedule, slots checked holding fewer than k drafts (at 6 rows and more
    # every request has a step in flight, so the 1-deep ones are not checked here).
    assert min(depths) < K if schedule else depths == {K}
    assert llm.get_metrics()["num_preemptions"] > before
    assert pipeline.num_resolved_steps > 0


@pytest.mark.parametrize(
    ("overlap", "schedule"),
    [(True, ()), (False, ((3, 1),))],
    ids=["overlap", "read-first-draft-schedule"],
)
def test_resolved_rows_stay_inside_their_blocks_and_the_context(
    make_llm, prompts, monkeypatch, overlap, schedule
):
    """Requests run to the context's end: every resolved row's writes (the target's v + 1
    positions for v drafts verified, the head's d - 1 deeper ones for d drafted) stay below
    the context and inside the blocks the scheduler gave it; rows too near the end are not
    resolved. With a draft schedule and no overlap the scheduler budgets a row only the
    drafts its slot holds (fewer than k), and the written-length bound counts those."""
    from tandem.worker.spec_decode import mtp_steps

    max_model_len = 160
    # Eager: on CUDA a step graph replays the recorded step without calling the function
    # wrapped here (the graphs' own function is checked against it below).
    llm = make_llm(
        speculative="mtp",
        num_speculative_tokens=K,
        max_model_len=max_model_len,
        enforce_eager=True,
        overlap=overlap,
        speculative_draft_schedule=schedule,
    )
    block_size = llm.engine.block_manager.block_size
    launch = mtp_steps.launch_uniform_step
    writes: list[tuple[int, int]] = []  # (highest position a row may write, its limit)
    shapes = set()  # (drafts verified, drafts drafted)

    def checked(runner, slots, plans, num_drafts, depth):
        for plan in plans:  # reading a slot waits for the steps queued before this one
            start = int(slots.next_start[plan.state.slot])
            limit = min(max_model_len, len(plan.row.block_ids) * block_size)
            writes.append((start + num_drafts + depth - 1, limit))
        shapes.add((num_drafts, depth))
        return launch(runner, slots, plans, num_drafts, depth)

    monkeypatch.setattr(mtp_steps, "launch_uniform_step", checked)
    short_prompts = [p for p in prompts if len(p["prompt_token_ids"]) < 100][:4]
    outputs = llm.generate(short_prompts, _greedy(None, ignore_eos=True), use_tqdm=False)
    plain = make_llm(max_model_len=max_model_len).generate(
        short_prompts, _greedy(None, ignore_eos=True), use_tqdm=False
    )
    assert _tokens(outputs) == _tokens(plain)
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    assert writes and all(highest < limit for highest, limit in writes)
    assert max(highest for highest, _ in writes) >= max_model_len - 4 * K - 2
    # With the schedule: steps of 1 draft (rows budgeted 2 tokens) and, once fewer rows
    # run, of k.
    assert shapes >= {(1, 1), (K, K)} if schedule else shapes == {(K, K)}


def test_the_whole_step_graph_function_equals_the_eager_resolved_step(make_llm):
    """The functions the resolved-step graphs record (verification, slot update and
    drafting in one pass over static buffers, padding rows on the scratch slot and block),
    run eagerly with Triton's interpreter: greedy rows get the eager resolved step's tokens
    (which equal decoding without MTP: test_triton_engine.py); sampled rows (with greedy
    ones and logprobs) the eager resolved step's tokens and logprobs, on a tiny model whose
    random head drafts and gets rejected."""
    from tandem.worker.spec_decode.step_graphs import ResolvedStepGraphs

    engine = {
        "model": "dummy:tiny",
        "attention_backend": "triton",
        "max_num_seqs": 4,
        # Triton's interpreter copies every tensor argument per launch: a small cache.
        "kv_cache_memory_gb": 0.01,
    }
    prompts = [{"prompt_token_ids": list(range(3 + i, 30 + 2 * i))} for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=TINY_TOKENS, ignore_eos=True)
    eager = make_llm(
        **engine, speculative="mtp", num_speculative_tokens=K, speculative_model="dummy"
    )
    want = eager.generate(prompts, params, use_tqdm=False)
    graphed = make_llm(
        **engine,
        speculative="mtp",
        num_speculative_tokens=K,
        speculative_model="dummy",
        seed=0,
        enforce_eager=True,
    )
    mtp = graphed.engine.pipeline.mtp
    mtp.step_graphs = ResolvedStepGraphs(graphed.engine.runner, mtp.slots, 4)
    calls = []
    run = mtp.step_graphs.run
    mtp.step_graphs.run = lambda *args: calls.append((len(args[0]), args[4])) or run(*args)
    try:
        got = graphed.generate(prompts, params, use_tqdm=False)
        assert calls and max(calls) == (3, "greedy")  # three rows, padded to a batch of 4
        assert _tokens(got) == _tokens(want)
        # Sampled rows (top-p, and not), a greedy row, logprobs: the sampled family draws
        # what the eager resolved step draws, with the same logprobs.
        mixed = [
            SamplingParams(
                temperature=0.9,
                top_p=0.8,
                seed=3,
                max_tokens=TINY_TOKENS,
                ignore_eos=True,
                logprobs=3,
            ),
            SamplingParams(temperature=0.0, max_tokens=TINY_TOKENS, ignore_eos=True, logprobs=1),
            SamplingParams(temperature=1.2, seed=5, max_tokens=TINY_TOKENS, ignore_eos=True),
        ]
        want = eager.generate(prompts, mixed, use_tqdm=False)
        calls.clear()
        got = graphed.generate(prompts, mixed, use_tqdm=False)
    finally:
        mtp.step_graphs = None
    assert (3, "sampled_top_p") in calls
    assert _tokens(got) == _tokens(want)
    for got_output, want_output in zip(got[:2], want[:2], strict=True):
        assert got_output.outputs[0].logprobs  # these two ask for them
        assert_same_logprobs(got_output, want_output, ranks=True)


def test_joining_prompts_launch_before_the_read_and_draft_as_after_it(
    make_llm, prompts, monkeypatch
):
    """A request joining the batch has nothing in flight, so its prompt goes before the read
    of the step in front, beside the resolved rows: fewer steps wait for that read with a
    part of their own. Its prompt drafts exactly as when it waits (the same acceptance at
    every depth: the unread hidden states it drafts from are its own when another ragged
    part replays a graph), and the outputs are the same."""
    many = (prompts * 2)[:16]
    params = [
        SamplingParams(temperature=0.0, max_tokens=6 + 5 * (i % 5), ignore_eos=True)
        for i in range(len(many))
    ]
    runs = {}
    for seed, ahead in ((1, True), (2, False)):  # two engines: no prefix hits across runs
        llm = make_llm(speculative="mtp", num_speculative_tokens=K, max_num_seqs=4, seed=seed)
        pipeline = llm.engine.pipeline
        if not ahead:
            monkeypatch.setattr(pipeline, "_joins", lambda row: False)
        joined, waited = pipeline.num_prompts_ahead, pipeline.num_parts_after_read
        before = llm.get_metrics()["spec_decode_num_accepted_tokens_per_pos"]
        outputs = llm.generate(many, params, use_tqdm=False)
        after = llm.get_metrics()["spec_decode_num_accepted_tokens_per_pos"]
        runs[ahead] = {
            "tokens": _tokens(outputs),
            "accepted": [a - b for a, b in zip(after, before, strict=True)],
            "joined": pipeline.num_prompts_ahead - joined,
            "waited": pipeline.num_parts_after_read - waited,
        }
        monkeypatch.undo()
    assert runs[True]["tokens"] == runs[False]["tokens"]
    assert runs[True]["accepted"] == runs[False]["accepted"] and sum(runs[True]["accepted"]) > 0
    assert runs[True]["joined"] >= 5 and runs[False]["joined"] == 0
    assert runs[True]["waited"] < runs[False]["waited"], runs
