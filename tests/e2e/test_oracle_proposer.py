"""The benchmarks' oracle proposer (``speculative="oracle"``): drafts replayed from the
target's recorded greedy outputs, each corrupted at a set rate. At rate 0 every draft is
accepted, at rate 1 none, in between the measured acceptance length is near the expected
one; the outputs are plain decoding's every time (lossless), with and without overlap
(steps resolved on the device), and through the function a resolved step's graph records."""

from __future__ import annotations

import pytest
import torch

from tandem import SamplingParams
from tandem.worker.spec_decode.oracle_proposer import (
    corruption_hash,
    expected_acceptance_length,
    request_key,
)

K = 3
MAX_TOKENS = 40
ENGINE = {"model": "dummy:tiny", "max_num_seqs": 4}


def _prompts(count: int) -> list[dict]:
    return [{"prompt_token_ids": list(range(3 + 5 * i, 30 + 7 * i))} for i in range(count)]


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def recorded(cached_llm):
    """Plain decoding of 8 prompts (64 tokens each): the reference outputs, and the
    recordings the oracle replays (k tokens longer, so drafts near the end are recorded).
    Made on the test engines' device (a dummy model's weights differ between devices)."""
    plain = cached_llm(**ENGINE)
    prompts = _prompts(8)
    reference = _tokens(plain.generate(prompts, _greedy(64), use_tqdm=False))
    longer = _tokens(plain.generate(prompts, _greedy(64 + K), use_tqdm=False))
    recordings = {tuple(p["prompt_token_ids"]): t for p, t in zip(prompts, longer, strict=True)}
    return prompts, reference, recordings


def _oracle_run(make_llm, recorded, rate: float, num_prompts: int, max_tokens: int, **options):
    """The oracle engine's outputs and mean acceptance length on the first prompts."""
    prompts, reference, recordings = recorded
    llm = make_llm(
        **ENGINE,
        speculative="oracle",
        num_speculative_tokens=K,
        oracle_corruption=rate,
        **options,
    )
    proposer = llm.engine.runner.proposer
    proposer.set_recordings(recordings)
    before = llm.get_metrics()
    outputs = llm.generate(prompts[:num_prompts], _greedy(max_tokens), use_tqdm=False)
    after = llm.get_metrics()
    drafts = after["spec_decode_num_drafts"] - before["spec_decode_num_drafts"]
    accepted = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
    assert drafts > 0 and proposer.num_recorded_requests >= num_prompts
    assert proposer.num_unrecorded_requests == 0
    want = [tokens[:max_tokens] for tokens in reference[:num_prompts]]
    return _tokens(outputs), want, 1 + accepted / drafts, llm


@pytest.mark.parametrize("overlap", [True, False])
def test_corruption_zero_accepts_every_draft_and_is_lossless(make_llm, recorded, overlap):
    got, want, acceptance, llm = _oracle_run(
        make_llm, recorded, 0.0, 6, MAX_TOKENS, overlap=overlap
    )
    assert got == want
    assert acceptance == K + 1
    assert llm.engine.pipeline.num_resolved_steps > 0  # the device path drafted too


@pytest.mark.parametrize("overlap", [True, False])
def test_corruption_one_accepts_no_draft_and_is_lossless(make_llm, recorded, overlap):
    got, want, acceptance, _ = _oracle_run(make_llm, recorded, 1.0, 6, MAX_TOKENS, overlap=overlap)
    assert got == want
    assert acceptance == 1.0


def test_corruption_between_gives_about_the_expected_acceptance(make_llm, recorded):
    # Rate 0.456 with k = 3: expected 1 + s + s^2 + s^3 = 2.00 (s = 0.544), over 8 x 64
    # tokens (about 250 verifications).
    rate = 0.456
    got, want, acceptance, _ = _oracle_run(make_llm, recorded, rate, 8, 64)
    assert got == want
    expected = expected_acceptance_length(rate, K)
    assert expected == pytest.approx(2.0, abs=0.01)
    assert acceptance == pytest.approx(expected, abs=0.25)


def test_requests_without_a_recording_still_decode_losslessly(make_llm, recorded):
    prompts, reference, _ = recorded
    llm = make_llm(**ENGINE, speculative="oracle", num_speculative_tokens=K)
    proposer = llm.engine.runner.proposer
    proposer.set_recordings({})
    outputs = llm.generate(prompts[:2], _greedy(16), use_tqdm=False)
    assert _tokens(outputs) == [tokens[:16] for tokens in reference[:2]]
    assert proposer.num_unrecorded_requests >= 2


def test_the_step_graph_function_drafts_from_the_oracle(make_llm, recorded):
    """The function a resolved step's CUDA graph records, run eagerly with Triton's
    interpreter on the oracle (padding rows on the scratch slot): plain decoding's tokens,
    every draft accepted at rate 0."""
    from tandem.worker.spec_decode.step_graphs import ResolvedStepGraphs

    prompts, reference, recordings = recorded
    llm = make_llm(
        **ENGINE,
        attention_backend="triton",
        speculative="oracle",
        num_speculative_tokens=K,
        enforce_eager=True,
    )
    llm.engine.runner.proposer.set_recordings(recordings)
    mtp = llm.engine.pipeline.mtp
    mtp.step_graphs = ResolvedStepGraphs(llm.engine.runner, mtp.slots, 4)
    calls = []
    run = mtp.step_graphs.run
    mtp.step_graphs.run = lambda *args: calls.append(len(args[0])) or run(*args)
    before = llm.get_metrics()
    outputs = llm.generate(prompts[:3], _greedy(12), use_tqdm=False)
    after = llm.get_metrics()
    assert calls and max(calls) == 3  # three rows, padded to a batch of 4
    assert _tokens(outputs) == [tokens[:12] for tokens in reference[:3]]
    drafts = after["spec_decode_num_drafts"] - before["spec_decode_num_drafts"]
    accepted = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
    assert accepted == K * drafts


def test_the_corruption_hash_is_deterministic_and_splits_at_the_rate():
    positions = torch.arange(20_000)[:, None]
    draft_index = torch.arange(K)
    hashed = corruption_hash(positions, draft_index)
    assert torch.equal(hashed, corruption_hash(positions.clone(), draft_index.clone()))
    assert int(hashed.min()) >= 0 and int(hashed.max()) < 1 << 24
    for rate in (0.1, 0.456, 0.8):
        share = (hashed < round(rate * (1 << 24))).float().mean().item()
        assert share == pytest.approx(rate, abs=0.01)
    assert expected_acceptance_length(0.0, K) == K + 1
    assert expected_acceptance_length(1.0, K) == 1.0


def test_each_request_key_corrupts_its_own_positions():
    """Requests of one run cover the same few hundred positions: keyed by the request too,
    their corruptions are independent draws, and the run's share is the set rate."""
    rate, threshold = 0.19, round(0.19 * (1 << 24))
    positions = torch.arange(100, 300)[:, None]
    draft_index = torch.arange(K)
    keys = [request_key(tuple(range(i, i + 20))) for i in range(64)]
    masks = [corruption_hash(positions, draft_index, key) < threshold for key in keys]
    both = (masks[0] == masks[1]).float().mean().item()
    assert both == pytest.approx(rate**2 + (1 - rate) ** 2, abs=0.05)
    share = torch.stack(masks).float().mean().item()
    assert share == pytest.approx(rate, abs=0.005)
    assert len(set(keys)) == len(keys)


def test_sampled_requests_verify_the_oracles_drafts_as_one_hot_on_every_path(
    make_llm, recorded, monkeypatch
):
    """Seeded sampled requests: the oracle's drafts are deterministic, so their q is one-hot,
    in the slots of resolved steps (overlap) as in the ragged rows' states (no resolved
    step at all): both give the same tokens, drafts accepted on both."""
    prompts, _, recordings = recorded
    params = [
        # Near-greedy, so the recorded greedy drafts are often right.
        SamplingParams(temperature=0.05, seed=11 + i, max_tokens=24, ignore_eos=True)
        for i in range(4)
    ]
    outputs = {}
    for overlap in (True, False):
        llm = make_llm(
            **ENGINE,
            speculative="oracle",
            num_speculative_tokens=K,
            oracle_corruption=0.0,
            overlap=overlap,
        )
        llm.engine.runner.proposer.set_recordings(recordings)
        mtp = llm.engine.pipeline.mtp
        if not overlap:  # every row ragged: q from the proposer's own proposal
            monkeypatch.setattr(mtp, "row_resolvable", lambda row, ahead: False)
        before = llm.get_metrics()["spec_decode_num_accepted_tokens"]
        resolved = llm.engine.pipeline.num_resolved_steps
        outputs[overlap] = _tokens(llm.generate(prompts[:4], params, use_tqdm=False))
        assert llm.get_metrics()["spec_decode_num_accepted_tokens"] > before
        assert (llm.engine.pipeline.num_resolved_steps > resolved) == overlap
        monkeypatch.undo()
    assert outputs[True] == outputs[False]


@pytest.mark.gpu
@pytest.mark.parametrize("split_steps", [True, False], ids=["in-parts", "whole"])
def test_the_oracle_engine_hides_no_synchronization_on_cuda(split_steps):
    """On the GPU, with torch's sync debug mode "error" on every step (only the reader's own
    wait is allowed): the oracle engine's steps, each request's recording written into the
    oracle's table at its first draft and, with steps going whole, the steps of resolved
    rows and prompt chunks in one forward (their resolved rows' step graphs replayed without
    the forward). A Python int assigned into the table's keys had waited for the device at
    every joining prompt. The outputs are plain decoding's."""
    from tandem import LLM

    engine = {**ENGINE, "device": "cuda", "dtype": "float32"}
    prompts = _prompts(8)
    plain = LLM(**engine)
    try:
        reference = _tokens(plain.generate(prompts, _greedy(32), use_tqdm=False))
        longer = _tokens(plain.generate(prompts, _greedy(32 + K), use_tqdm=False))
    finally:
        plain.engine.shutdown()
    llm = LLM(**engine, speculative="oracle", num_speculative_tokens=K, oracle_corruption=0.3)
    llm.engine.runner.proposer.set_recordings(
        {tuple(p["prompt_token_ids"]): t for p, t in zip(prompts, longer, strict=True)}
    )
    pipeline = llm.engine.pipeline
    pipeline.split_steps = split_steps
    mixed_replays = []
    if not split_steps:  # this small model's steps go in parts: capture the mixed graphs too
        from tandem.worker.spec_decode.step_graphs import ResolvedStepGraphs

        mtp = pipeline.mtp
        mtp.step_graphs = ResolvedStepGraphs(llm.engine.runner, mtp.slots, 4, mixed=True)
        mtp.capture()
        run = mtp.step_graphs.run
        mtp.step_graphs.run = lambda *args: mixed_replays.append(args[7] is not None) or run(*args)
    llm.generate(prompts[:2], _greedy(4), use_tqdm=False)  # warm-up: allocations, pinning
    mixed_replays.clear()
    step_ahead, calls = pipeline.step_ahead, []

    def strict(step):
        calls.append(step)
        torch.cuda.set_sync_debug_mode("error")
        try:
            return step_ahead(step)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    pipeline.step_ahead = strict
    try:
        outputs = llm.generate(prompts, _greedy(32), use_tqdm=False)
    finally:
        del pipeline.step_ahead
        llm.engine.shutdown()
    assert _tokens(outputs) == reference
    assert len(calls) >= 8
    assert pipeline.num_mixed_steps > 0 or split_steps
    # Whole: the mixed steps' resolved rows replayed the step graphs without the forward.
    assert any(mixed_replays) or split_steps
