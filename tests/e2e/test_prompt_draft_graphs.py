"""The head's depth 0 over a ragged step drafted at its launch as a graph function
(``worker/spec_decode/prompt_draft_graphs.py``): the head over the ragged graph's padded
buffers, then the argmax at each row's last token and the draft graphs for the later depths.
Without a GPU it runs eagerly in Triton's interpreter in place of the replay, and must give
what ``MTPProposer.propose`` gives: the same outputs, the same drafts (equal acceptance
counts, position by position) and the same head KV at every block the requests used. On
the GPU the captured graphs' replays are checked the same way (fp32, the shipped head)."""

from __future__ import annotations

import os

import pytest
import torch
from test_ragged_graphs import _engine as ragged_engine
from test_triton_engine import interpreter  # noqa: F401 (a fixture)

from tandem import LLM, SamplingParams
from tandem.bench.datasets import load_mtbench
from tandem.models.loader import default_model_path
from tandem.worker.spec_decode.draft_graphs import DraftGraphRunner
from tandem.worker.spec_decode.prompt_draft_graphs import PromptDraftGraphs

pytestmark = pytest.mark.slow  # whole engines with the Triton kernels in Triton's interpreter

K = 2


def _engine(prompt_graphs: bool, k: int = K) -> LLM:
    llm = ragged_engine(  # the ragged graphs' function attached, eagerly
        True, speculative="mtp", num_speculative_tokens=k, speculative_model="dummy"
    )
    runner = llm.engine.runner
    # The draft graphs' functions too, eagerly (nothing captured): what CUDA replays.
    if k > 1:
        runner.proposer.graphs = DraftGraphRunner(
            runner.proposer, k, runner.max_model_len, 4, runner.scratch_block
        )
    if prompt_graphs:
        runner.proposer.prompt_graphs = PromptDraftGraphs(runner.proposer, runner.ragged_graphs, k)
    return llm


def _run(prompt_graphs: bool, params: SamplingParams, k: int = K):
    llm = _engine(prompt_graphs, k)
    try:
        # Six prompts through four rows: later prompts join beside decoding rows, and the
        # longest (48 tokens and more) come in chunks.
        prompts = [
            {"prompt_token_ids": [(7 * i + 5 * j) % 400 + 1 for j in range(3 + 13 * i)]}
            for i in range(6)
        ]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        metrics = llm.get_metrics()
        graphs = llm.engine.runner.proposer.prompt_graphs
        replays = graphs.num_replays if graphs is not None else 0
        head_kv = llm.engine.runner.proposer.kv_caches[0][:, :-1].clone()  # not the scratch
        assert llm.engine.block_manager.all_blocks_free()
    finally:
        llm.engine.shutdown()
    tokens = [o.outputs[0].token_ids for o in outputs]
    accepted = (
        metrics["spec_decode_num_drafts"],
        metrics["spec_decode_num_accepted_tokens"],
        metrics["spec_decode_num_accepted_tokens_per_pos"],
    )
    return tokens, accepted, replays, head_kv


@pytest.fixture
def drafting_rows(monkeypatch):
    """The rows that drafted through the graph function (``num_drafts`` > 0); each call
    is checked against ``MTPProposer.propose`` on the same rows right after it: the same
    drafts, and the same head KV at the rows' positions (both write there)."""
    rows_seen = []
    propose = PromptDraftGraphs.propose

    def checking(self, rows, target_hidden, sampled):
        got = propose(self, rows, target_hidden, sampled)
        proposer = self.proposer
        flat = proposer.kv_caches[0].flatten(1, 2)  # [2, blocks x block_size, heads, dim]
        slots = torch.tensor(
            [proposer._slot(r.block_ids, p) for r in rows for p in r.positions],
            device=flat.device,
        )
        got_kv = flat[:, slots].clone()
        greedy = SamplingParams(temperature=0.0)
        sampling = {r.request_id: (greedy, 0) for r in rows if r.num_drafts}
        # Hidden states that are not the ragged graph's last output: its buffers may hold
        # another step, so the graph path must refuse them.
        assert not self.applies(rows, target_hidden.clone(), sampling)
        want = proposer.propose(rows, target_hidden.clone(), sampling, sampled)
        torch.testing.assert_close(got_kv, flat[:, slots], atol=1e-5, rtol=1e-5)
        assert got.draft_token_ids.keys() == want.draft_token_ids.keys()
        for request_id, drafts in want.draft_token_ids.items():
            assert got.draft_token_ids[request_id].tolist() == drafts.tolist()
        rows_seen.extend(row for row in rows if row.num_drafts)
        return got

    monkeypatch.setattr(PromptDraftGraphs, "propose", checking)
    return rows_seen


@pytest.mark.parametrize("k", [1, K])  # one draft: the head's depth 0 alone
def test_the_prompt_graph_function_drafts_what_propose_drafts(interpreter, drafting_rows, k):  # noqa: F811
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    want_tokens, want_accepted, _, want_kv = _run(False, params, k)
    tokens, accepted, replays, kv = _run(True, params, k)
    # Steps with a joining prompt drafted through the graph function, drafting rows among them.
    assert replays > 0 and drafting_rows
    assert tokens == want_tokens
    assert accepted == want_accepted
    torch.testing.assert_close(kv, want_kv, atol=1e-5, rtol=1e-5)


def test_sampled_rows_keep_the_eager_proposal(interpreter, drafting_rows):  # noqa: F811
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=10, ignore_eos=True)
    want_tokens, want_accepted, _, _ = _run(False, params)
    tokens, accepted, replays, _ = _run(True, params)
    # Only steps where no row drafts (a prompt's earlier chunks) take the graph function:
    # a sampled row's drafts are drawn with its keyed noise by ``propose``.
    assert replays > 0 and drafting_rows == []
    assert (tokens, accepted) == (want_tokens, want_accepted)


@pytest.mark.gpu
def test_replays_draft_what_propose_drafts_on_the_gpu(drafting_rows):
    llm = LLM(
        model=os.environ.get("TANDEM_MODEL") or default_model_path(),
        device="cuda",
        dtype="float32",
        kv_cache_memory_gb=4,
        max_num_seqs=4,
        speculative="mtp",
        num_speculative_tokens=3,
    )
    try:
        graphs = llm.engine.runner.proposer.prompt_graphs
        assert graphs is not None and graphs.graphs  # captured
        prompts = [
            llm.tokenizer.apply_chat_template([{"role": "user", "content": q["turns"][0]}])
            for q in load_mtbench()[::7]
        ][:12]
        llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True),
            use_tqdm=False,
        )
        # Twelve prompts through four rows: each joins beside decoding rows, drafted at
        # launch by a replay that the fixture checked against ``propose``.
        assert graphs.num_replays > 0 and drafting_rows
        assert llm.engine.block_manager.all_blocks_free()
    finally:
        llm.engine.shutdown()
