"""The draft schedule in the engine: a resolved step of n rows verifies the drafts the
schedule gives n (fewer where a row's slot holds fewer: a larger step drafted it) and drafts
as many for the next step; greedy outputs and logprobs stay plain decoding's, and the whole
step graphs' functions draw what the eager resolved step draws at every (verified, drafted)
pair the schedule brings."""

from __future__ import annotations

import pytest
from output_checks import assert_same_logprobs

from tandem import SamplingParams
from tandem.bench.datasets import load_mtbench

K = 3
SCHEDULE = ((3, 2), (6, 1))  # 1-2 rows: 3 drafts, 3-5 rows: 2, 6 and more: 1


@pytest.fixture(scope="module")
def prompts(offline):
    """Eight MT-Bench first turns under the default model's chat template."""
    chat = offline.tokenizer.apply_chat_template
    return [
        {"prompt_token_ids": chat([{"role": "user", "content": q["turns"][0]}])}
        for q in load_mtbench()[2::7][:8]
    ]


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def _record_resolved_steps(mtp, records: list) -> None:
    """Wrap ``mtp.launch_resolved`` to record (rows, drafts verified, drafts drafted, the
    rows' slot depths before the step) per resolved step."""
    launch = mtp.launch_resolved

    def recording(step):
        states = [mtp.batch.states[row.request.request_id] for row in step.scheduled]
        before = [state.slot_depth for state in states]
        plans, sample, rows = launch(step)
        records.append((len(plans), plans[0].num_drafts, states[0].slot_depth, before))
        return plans, sample, rows

    mtp.launch_resolved = recording


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "read-first"])
def test_greedy_outputs_follow_plain_decoding_as_the_batch_shrinks(make_llm, prompts, overlap):
    """Eight requests of different lengths: the batch shrinks through both thresholds, so
    steps verify 1, 2 and 3 drafts, and some verify fewer than they draft (their rows'
    slots were drafted by a larger step); with overlap they still launch ahead."""
    llm = make_llm(
        speculative="mtp",
        num_speculative_tokens=K,
        speculative_draft_schedule=SCHEDULE,
        overlap=overlap,
    )
    spec = llm.engine.config.speculative
    params = [
        SamplingParams(temperature=0.0, max_tokens=8 + 6 * i, ignore_eos=True, logprobs=2)
        for i in range(len(prompts))
    ]
    pipeline = llm.engine.pipeline
    mtp = pipeline.mtp
    records: list = []
    _record_resolved_steps(mtp, records)
    ahead_before = pipeline.num_launched_ahead
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        del mtp.launch_resolved
    if overlap:  # the schedule keeps decode steps launching before the read in front
        assert pipeline.num_launched_ahead - ahead_before >= 0.9 * (len(records) - 1)
    want = make_llm().generate(prompts, params, use_tqdm=False)
    assert _tokens(outputs) == _tokens(want)
    for got_output, want_output in zip(outputs, want, strict=True):
        for got, expected in zip(
            got_output.outputs[0].logprobs, want_output.outputs[0].logprobs, strict=True
        ):
            for token, entry in expected.items():
                assert abs(got[token].logprob - entry.logprob) < 1e-4
    for rows, verified, drafted, depths in records:
        assert drafted == spec.drafts_for(rows)
        assert verified == min([drafted, *depths])
    assert {verified for _, verified, _, _ in records} == {1, 2, 3}
    assert any(verified < drafted for _, verified, drafted, _ in records)


def test_the_step_graph_functions_draw_what_the_eager_step_draws_at_every_pair(make_llm):
    """The resolved-step graphs' functions, run eagerly with Triton's interpreter on a tiny
    model whose random head's drafts get rejected: greedy, then sampled rows (top-p and
    not) with a greedy one and logprobs, requests ending one after the other so that steps
    of 3 rows (1 draft) give way to steps of 2 and 1 (3 drafts) whose rows' slots hold 1:
    the tokens and logprobs of the eager resolved step."""
    from tandem.worker.spec_decode.step_graphs import ResolvedStepGraphs

    engine = {
        "model": "dummy:tiny",
        "attention_backend": "triton",
        "max_num_seqs": 4,
        "kv_cache_memory_gb": 0.01,  # Triton's interpreter copies every tensor per launch
        "speculative": "mtp",
        "num_speculative_tokens": K,
        "speculative_model": "dummy",
        "speculative_draft_schedule": ((3, 1),),
    }
    prompts = [{"prompt_token_ids": list(range(3 + i, 30 + 2 * i))} for i in range(3)]
    greedy = [
        SamplingParams(temperature=0.0, max_tokens=4 * (i + 1), ignore_eos=True) for i in range(3)
    ]
    mixed = [
        SamplingParams(
            temperature=0.9, top_p=0.8, seed=3, max_tokens=12, ignore_eos=True, logprobs=3
        ),
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1),
        SamplingParams(temperature=1.2, seed=5, max_tokens=4, ignore_eos=True),
    ]
    eager = make_llm(**engine)
    want = [eager.generate(prompts, params, use_tqdm=False) for params in (greedy, mixed)]
    graphed = make_llm(**engine, seed=0, enforce_eager=True)
    mtp = graphed.engine.pipeline.mtp
    mtp.step_graphs = ResolvedStepGraphs(graphed.engine.runner, mtp.slots, 4)
    calls = []
    run = mtp.step_graphs.run
    mtp.step_graphs.run = lambda *args: (
        calls.append((len(args[0]), args[4], args[2], args[3])) or run(*args)
    )
    try:
        got = [graphed.generate(prompts, params, use_tqdm=False) for params in (greedy, mixed)]
    finally:
        mtp.step_graphs = None
    for family in ("greedy", "sampled_top_p"):
        pairs = {(verified, drafted) for _, f, verified, drafted in calls if f == family}
        assert {(1, 1), (1, 3), (3, 3)} <= pairs, (family, pairs)
    for got_outputs, want_outputs in zip(got, want, strict=True):
        assert _tokens(got_outputs) == _tokens(want_outputs)
        for got_output, want_output in zip(got_outputs, want_outputs, strict=True):
            assert_same_logprobs(got_output, want_output, ranks=True)
