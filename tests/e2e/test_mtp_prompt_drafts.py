"""MTP with overlap: a prompt step verifies no drafts, so it drafts as it is launched (the
token it samples gathered on the device) and fills its request's slot; the request's first
decode row then launches before the prompt step is read. Its drafts are exactly those of
drafting at the read, and a request that ends at its first token while that row runs ahead
finishes as it does without MTP."""

from __future__ import annotations

import pytest

from tandem import SamplingParams
from tandem.bench.datasets import load_mtbench

K = 3


@pytest.fixture(scope="module")
def prompts(offline) -> list[dict]:
    questions = [q["turns"][0] for q in load_mtbench()[2::9]][:8]
    template = offline.tokenizer.apply_chat_template
    return [{"prompt_token_ids": template([{"role": "user", "content": q}])} for q in questions]


def _count_first_rows_ahead(pipeline, monkeypatch) -> list[str]:
    """Record the requests whose row was found resolvable ahead of the read of their
    prompt step (the step in flight emits their first token)."""
    found: list[str] = []
    resolvable = pipeline.mtp.row_resolvable

    def counting(row, ahead):
        state = pipeline.batch.states.get(row.request.request_id)
        result = resolvable(row, ahead)
        if result and ahead and state is not None and state.one_token_in_flight:
            found.append(row.request.request_id)
        return result

    monkeypatch.setattr(pipeline.mtp, "row_resolvable", counting)
    return found


def _record_unverifying_parts(pipeline, monkeypatch) -> list[bool]:
    """For every ragged part read whose rows verify no drafts: whether it was drafted at
    its launch and kept no hidden states (nothing for a later ragged replay to overwrite)."""
    seen: list[bool] = []
    read = pipeline.read

    def checking(launched):
        part = launched
        while part is not None:
            plans = part.inputs.plans
            if not part.resolved and plans and not any(p.num_drafts for p in plans):
                seen.append(part.drafted is not None and part.hidden is None)
            part = part.rest
        return read(launched)

    monkeypatch.setattr(pipeline, "read", checking)
    return seen


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_prompt_steps_draft_at_launch_as_at_their_read(make_llm, prompts, monkeypatch, temperature):
    """16 requests through 4 rows, each prompt drafted at its launch or (the head's rows
    then known to the host) at its read: the same tokens and the same accepted count at
    every depth; drafting at launch lets most first decode rows go before the read, so
    fewer steps have a part after it."""
    many = (prompts * 2)[:16]
    params = [
        SamplingParams(
            temperature=temperature,
            top_p=0.95,
            seed=100 + i,
            max_tokens=6 + 5 * (i % 5),
            ignore_eos=True,
        )
        for i in range(len(many))
    ]
    runs = {}
    for seed, at_launch in ((3, True), (4, False)):  # two engines: no prefix hits across runs
        llm = make_llm(speculative="mtp", num_speculative_tokens=K, max_num_seqs=4, seed=seed)
        pipeline = llm.engine.pipeline
        if not at_launch:
            monkeypatch.setattr(pipeline.mtp, "draft_at_launch", lambda launched: None)
        first_rows = _count_first_rows_ahead(pipeline, monkeypatch)
        unverifying = _record_unverifying_parts(pipeline, monkeypatch)
        waited = pipeline.num_parts_after_read
        launch, ragged = pipeline.launch_seconds, pipeline.ragged_launch_seconds
        before = llm.get_metrics()["spec_decode_num_accepted_tokens_per_pos"]
        outputs = llm.generate(many, params, use_tqdm=False)
        after = llm.get_metrics()["spec_decode_num_accepted_tokens_per_pos"]
        runs[at_launch] = {
            "tokens": [o.outputs[0].token_ids for o in outputs],
            "accepted": [a - b for a, b in zip(after, before, strict=True)],
            "first_rows_ahead": len(set(first_rows)),
            "waited": pipeline.num_parts_after_read - waited,
            "drafted_at_launch": unverifying,
            "launch_s": pipeline.launch_seconds - launch,
            "ragged_launch_s": pipeline.ragged_launch_seconds - ragged,
        }
        monkeypatch.undo()
    assert runs[True]["tokens"] == runs[False]["tokens"]
    assert runs[True]["accepted"] == runs[False]["accepted"] and sum(runs[True]["accepted"]) > 0
    assert runs[True]["first_rows_ahead"] >= 8 and runs[False]["first_rows_ahead"] == 0, runs
    assert runs[True]["waited"] < runs[False]["waited"], runs
    # Every prompt part drafted at its launch (the pipeline copies no hidden states for it);
    # 16 prompts in parts of at most 4 rows.
    assert len(runs[True]["drafted_at_launch"]) >= 4 and all(runs[True]["drafted_at_launch"])
    assert not any(runs[False]["drafted_at_launch"])
    # The host's launch seconds of the ragged parts (the prompts) are a part of all of them.
    for run in runs.values():
        assert 0 < run["ragged_launch_s"] < run["launch_s"], run


def test_a_request_ending_at_its_first_token_while_its_next_row_runs_ahead(
    make_llm, prompts, monkeypatch
):
    """Half the requests stop at their first token (a stop token id that is their greedy
    first token) while their first decode row, launched ahead from the slot their prompt
    step filled, is in flight: every output equals plain decoding's, nothing leaks (the
    fixture checks the blocks), and the rows did launch ahead."""
    plain = make_llm()
    firsts = [
        o.outputs[0].token_ids[0]
        for o in plain.generate(
            prompts, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False
        )
    ]
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=24,
            logprobs=2,
            stop_token_ids=[first] if i % 2 == 0 else None,
        )
        for i, first in enumerate(firsts)
    ]
    want = plain.generate(prompts, params, use_tqdm=False)
    llm = make_llm(speculative="mtp", num_speculative_tokens=K, max_num_seqs=4)
    first_rows = _count_first_rows_ahead(llm.engine.pipeline, monkeypatch)
    got = llm.generate(prompts, params, use_tqdm=False)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids, i
        assert g.outputs[0].finish_reason == w.outputs[0].finish_reason, i
        for got_entry, want_entry in zip(g.outputs[0].logprobs, w.outputs[0].logprobs, strict=True):
            assert got_entry.keys() == want_entry.keys()
            for token, logprob in want_entry.items():
                assert abs(got_entry[token].logprob - logprob.logprob) <= 1e-4
    stopped = {g.request_id for i, g in enumerate(got) if i % 2 == 0}
    assert all(len(got[i].outputs[0].token_ids) <= 1 for i in range(0, len(got), 2))
    assert stopped & set(first_rows), (stopped, first_rows)
