"""On the GPU: the engine with CUDA graphs (the default on CUDA) is exact.

fp32 greedy outputs match Hugging Face transformers' (the tie rule, logprobs within 1e-4)
and the eager engine's, plain and with MTP; seeded sampled MTP rows draw the eager
engine's tokens; the decode steps really ran as graph replays, and so did the ragged steps
(prompt chunks beside decode rows: a step budget of 512 tokens chunks the 16 prompts).
TANDEM_MODEL names the model file where the default package is not installed.
"""

from __future__ import annotations

import os

import pytest
import torch

from tandem import SamplingParams
from tandem.bench.datasets import load_mtbench
from tandem.bench.hf_reference import (
    hf_greedy_generate,
    load_hf_model,
    reference_from_output,
    tie_rule_mismatches,
)
from tandem.models.loader import default_model_path

MAX_TOKENS = 48
ENGINES = {
    "plain": {},
    "mtp": {"speculative": "mtp", "num_speculative_tokens": 3},
    # Fewer drafts at larger batches: 16 rows verify 1, 4 to 11 rows 2, fewer 3; the batch
    # shrinks as requests end, so steps verify fewer drafts than they draft too.
    "mtp-draft-schedule": {
        "speculative": "mtp",
        "num_speculative_tokens": 3,
        "speculative_draft_schedule": ((4, 2), (12, 1)),
    },
}


def _model() -> str:
    return os.environ.get("TANDEM_MODEL") or default_model_path()


def _run(engine: dict, device: str = "cuda", params=None, **options):
    from tandem import LLM

    llm = LLM(
        model=_model(),
        device=device,
        dtype="float32",
        kv_cache_memory_gb=4,
        max_num_batched_tokens=512,
        **engine,
        **options,
    )
    prompts = [
        llm.tokenizer.apply_chat_template([{"role": "user", "content": q["turns"][0]}])
        for q in load_mtbench()[::5]
    ][:16]
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        params or SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=2),
        use_tqdm=False,
    )
    # Target forwards replayed alone, and whole resolved MTP steps.
    graphs, mtp = llm.engine.runner.graphs, llm.engine.pipeline.mtp
    replays = graphs.num_replays if graphs is not None else 0
    if mtp is not None and mtp.step_graphs is not None:
        replays += mtp.step_graphs.num_replays
    proposer = llm.engine.runner.proposer
    drafting = {
        # Later draft depths replay alone (after a ragged step) or inside a resolved step.
        "draft_replays": (
            proposer.graphs.num_replays if proposer is not None and proposer.graphs else 0
        )
        + (mtp.step_graphs.num_replays if mtp is not None and mtp.step_graphs else 0),
        "accepted": llm.get_metrics().get("spec_decode_num_accepted_tokens", 0),
        "ragged_replays": (
            llm.engine.runner.ragged_graphs.num_replays if llm.engine.runner.ragged_graphs else 0
        ),
    }
    eos = sorted(llm.tokenizer.end_token_ids)
    llm.engine.shutdown()
    return prompts, outputs, replays, eos, drafting


@pytest.mark.gpu
@pytest.mark.parametrize("engine", list(ENGINES))
def test_graphs_match_eager_and_hf_on_cuda(engine):
    prompts, graphed, replays, eos, drafting = _run(ENGINES[engine])
    _, eager, eager_replays, _, eager_drafting = _run(ENGINES[engine], enforce_eager=True)
    assert replays >= MAX_TOKENS // 4, f"only {replays} graph replays: graphs were not used"
    assert eager_replays == 0
    # Prefill chunks (some beside decode rows) replayed as ragged graphs: every step that
    # carries a prompt chunk is ragged, and the prompts need at least this many 512-token steps.
    prompt_steps = -(-sum(map(len, prompts)) // 512)
    assert prompt_steps >= 2 and drafting["ragged_replays"] >= prompt_steps
    assert eager_drafting["ragged_replays"] == 0
    if engine != "plain":  # later draft depths replayed too, and drafted as well as eagerly
        _assert_drafted_as_eagerly(drafting, eager_drafting)
    _assert_outputs_match(graphed, eager)
    hf = load_hf_model(_model(), torch.float32, "cuda")
    references = hf_greedy_generate(hf, prompts, MAX_TOKENS, eos)
    problems, ties = tie_rule_mismatches(graphed, references)
    assert not problems, problems
    assert ties <= 2


@pytest.mark.gpu
def test_a_head_with_fused_features_drafts_in_graphs_as_eagerly(tmp_path):
    """The features computed inside the target's graphs (``MTPHead.feature_layers``) draft
    what the eager forward's do; outputs stay the eager engine's."""
    from tandem.models.loader import ModelFiles, load_model
    from tandem.models.mtp import load_mtp_head
    from tandem.models.mtp_files import save_head
    from tests.unit.mtp_head_helpers import head_with_features, without_features

    files = ModelFiles(_model())
    base = load_model(files, 512, torch.float32, torch.device("cpu"))
    last = files.arch.num_layers - 1
    shipped = without_features(load_mtp_head(None, files, base.rotary), base.rotary)
    # Small random low and middle blocks: they steer some drafts, most stay accepted.
    head = head_with_features(base, shipped, (1, last // 2, last), low_scale=0.01)
    save_head(head, str(tmp_path), files.path, dtype=torch.float32)
    engine = {**ENGINES["mtp"], "speculative_model": str(tmp_path)}
    _, graphed, _, _, drafting = _run(engine)
    _, eager, _, _, eager_drafting = _run(engine, enforce_eager=True)
    _assert_drafted_as_eagerly(drafting, eager_drafting)
    _assert_outputs_match(graphed, eager)


def _assert_drafted_as_eagerly(drafting: dict, eager_drafting: dict) -> None:
    assert drafting["draft_replays"] >= MAX_TOKENS // 4
    assert eager_drafting["draft_replays"] == 0
    assert drafting["accepted"] >= 0.95 * eager_drafting["accepted"] > 0, (
        drafting,
        eager_drafting,
    )


def _assert_outputs_match(graphed, eager) -> None:
    problems, ties = tie_rule_mismatches(
        graphed, [reference_from_output(o.outputs[0]) for o in eager]
    )
    assert not problems, problems
    assert ties <= 2


@pytest.mark.gpu
@pytest.mark.parametrize("engine", ["mtp", "mtp-draft-schedule"])
def test_sampled_step_graphs_draw_what_the_eager_steps_draw_on_cuda(engine):
    """fp32, MTP k=3 (with a draft schedule too), seeded sampled rows (top-p and not)
    beside greedy ones, with logprobs: the resolved steps' graphs (the sampled families)
    emit the eager engine's tokens, with its logprobs within 1e-4."""
    params = [
        SamplingParams(
            temperature=[0.0, 0.8, 1.1][i % 3],
            top_p=0.9 if i % 2 else 1.0,
            seed=i,
            max_tokens=MAX_TOKENS,
            logprobs=2,
        )
        for i in range(16)
    ]
    _, graphed, replays, _, _ = _run(ENGINES[engine], params=params)
    _, eager, eager_replays, _, _ = _run(ENGINES[engine], params=params, enforce_eager=True)
    assert replays >= MAX_TOKENS // 4 and eager_replays == 0
    for got, want in zip(graphed, eager, strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        pairs = zip(got.outputs[0].logprobs, want.outputs[0].logprobs, strict=True)
        for got_entry, want_entry in pairs:
            for token, entry in want_entry.items():
                assert abs(got_entry[token].logprob - entry.logprob) < 1e-4


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_an_engine_on_the_second_gpu_matches_the_first():
    """Triton launches on CUDA's current device: the runner makes it its own for each call,
    so an engine on cuda:1 (built while cuda:0 is current) gives cuda:0's outputs."""
    torch.cuda.set_device(0)
    _, first, _, _, _ = _run(ENGINES["plain"], device="cuda:0")
    _, second, replays, _, _ = _run(ENGINES["plain"], device="cuda:1")
    assert replays >= MAX_TOKENS // 4
    problems, _ = tie_rule_mismatches(second, [reference_from_output(o.outputs[0]) for o in first])
    assert not problems, problems
