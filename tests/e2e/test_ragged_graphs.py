"""The ragged steps' graph function (``worker/ragged_graphs.py``): the model over padded
static buffers, its padding rows of zero length and padding tokens on the scratch block,
attention in the mixed mode. Without a GPU it runs eagerly in Triton's interpreter, in place
of the replay, and must give what the eager forward gives: the same greedy tokens and
logprobs, plain and with MTP (whose ragged rows draft from the returned hidden states at
their read), with overlap."""

from __future__ import annotations

import pytest
import torch
from test_triton_engine import DEVICE, interpreter  # noqa: F401 (a fixture)

from tandem import LLM, SamplingParams
from tandem.worker.ragged_graphs import RaggedBatch, RaggedGraphRunner, ragged_token_sizes

pytestmark = pytest.mark.slow  # whole engines with the Triton kernels in Triton's interpreter

MAX_TOKENS = 48


def test_sizes_cover_every_token_count_up_to_the_step_budget():
    assert ragged_token_sizes(48) == [16, 32, 48]
    assert ragged_token_sizes(5) == [5]
    assert ragged_token_sizes(300) == [16, 32, 64, 128, 160, 192, 224, 256, 300]
    # Past 128 tokens, four sizes a doubling: a batch is padded by under a quarter of its
    # tokens, where the GEMMs grow with the rows.
    sizes = ragged_token_sizes(2048)
    assert sizes[:8] == [16, 32, 64, 128, 160, 192, 224, 256]
    assert sizes[-5:] == [1024, 1280, 1536, 1792, 2048] and len(sizes) == 20
    for tokens in range(129, 2049):
        padded = next(size for size in sizes if size >= tokens)
        assert padded < tokens * 1.25


def _engine(with_graph: bool, **engine) -> LLM:
    llm = LLM(
        model="dummy:tiny",
        device=DEVICE,
        dtype="float32",
        attention_backend="triton",
        enforce_eager=True,
        max_num_seqs=4,
        max_num_batched_tokens=MAX_TOKENS,
        kv_cache_memory_gb=0.01,
        **engine,
    )
    if with_graph:
        llm.engine.runner.ragged_graphs = RaggedGraphRunner(llm.engine.runner)
    return llm


def _outputs(llm: LLM) -> list:
    prompts = [
        {"prompt_token_ids": [(5 * i + 3 * j) % 500 + 1 for j in range(4 + 11 * i)]}
        for i in range(6)
    ]
    outputs = llm.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=6, logprobs=2), use_tqdm=False
    )
    return [
        (
            o.outputs[0].token_ids,
            [{t: lp.logprob for t, lp in e.items()} for e in o.outputs[0].logprobs],
        )
        for o in outputs
    ]


def _assert_same(got: list, want: list) -> None:
    """The same tokens, and logprobs within 1e-5, run by run (``_outputs``)."""
    for (got_tokens, got_logprobs), (tokens, logprobs) in zip(got, want, strict=True):
        assert got_tokens == tokens
        for got_entry, entry in zip(got_logprobs, logprobs, strict=True):
            assert got_entry.keys() == entry.keys()
            for token, value in entry.items():
                assert abs(got_entry[token] - value) <= 1e-5


@pytest.mark.parametrize(
    "engine",
    [{}, {"speculative": "mtp", "num_speculative_tokens": 2, "speculative_model": "dummy"}],
    ids=["plain", "mtp"],
)
def test_the_ragged_graph_function_gives_the_eager_forwards_outputs(interpreter, engine):  # noqa: F811
    want_llm = _engine(False, **engine)
    want = _outputs(want_llm)
    want_llm.engine.shutdown()
    llm = _engine(True, **engine)
    try:
        got = _outputs(llm)
        ragged = llm.engine.runner.ragged_graphs
        assert ragged.num_replays > 0
        assert llm.engine.block_manager.all_blocks_free()
    finally:
        llm.engine.shutdown()
    _assert_same(got, want)


def test_mixed_steps_replay_the_ragged_graph(interpreter):  # noqa: F811
    """Steps going whole (as on a model over 2 GiB): a step of resolved decode rows and
    prompt chunks runs as one forward, through the ragged graph's function when one fits
    (the resolved rows' inputs copied in on the device, their true lengths too), and gives
    the eager mixed forward's tokens and logprobs."""
    mtp = {"speculative": "mtp", "num_speculative_tokens": 2, "speculative_model": "dummy"}
    results, mixed = [], []
    for with_graph in (False, True):
        llm = _engine(with_graph, **mtp)
        pipeline = llm.engine.pipeline
        pipeline.split_steps = False
        try:
            results.append(_outputs(llm))
            mixed.append(pipeline.num_mixed_steps)
            ragged = llm.engine.runner.ragged_graphs
            if with_graph:
                assert ragged.num_replays >= pipeline.num_mixed_steps
            assert llm.engine.block_manager.all_blocks_free()
        finally:
            llm.engine.shutdown()
    assert mixed[0] == mixed[1] >= 2
    (want, got) = results
    _assert_same(got, want)


def test_padded_size_refuses_what_no_graph_holds(interpreter):  # noqa: F811
    llm = _engine(False)
    runner = llm.engine.runner
    ragged = RaggedGraphRunner(runner)
    llm.engine.shutdown()
    assert ragged.padded_size(RaggedBatch([3, 1], [3, 9], [[0], [1]])) == 16
    assert ragged.padded_size(RaggedBatch([17], [17], [[0, 1]])) == 32
    assert ragged.padded_size(RaggedBatch([40, 8], [40, 8], [[0], [1]])) == 48
    assert ragged.padded_size(RaggedBatch([40, 9], [40, 9], [[0], [1]])) is None  # tokens
    assert ragged.padded_size(RaggedBatch([1] * 5, [1] * 5, [[0]] * 5)) is None  # rows
    too_long = runner.max_model_len + runner.block_size
    assert ragged.padded_size(RaggedBatch([1], [too_long], [[0]])) is None
    # The graph's inputs: real rows first, then rows of no query; padding on the scratch.
    ragged.slots[:MAX_TOKENS].fill_(-7)
    ragged.prepare(RaggedBatch([3, 1], [3, 9], [[5], [6]]), 16)
    assert ragged.query_starts.tolist() == [0, 3, 4, 4, 4]
    assert ragged.seq_lens.tolist() == [3, 9, 0, 0]
    # A mixed step's resolved rows: their true lengths from the device over the bounds.
    first = torch.tensor([2], dtype=torch.int32, device=ragged.seq_lens.device)
    ragged.prepare(RaggedBatch([3, 1], [3, 9], [[5], [6]]), 16, first)
    assert ragged.seq_lens.tolist() == [2, 9, 0, 0]
    scratch = runner.scratch_block * runner.block_size
    assert ragged.slots[4:16].tolist() == [scratch + j for j in range(12)]
    assert ragged.slots[16:MAX_TOKENS].tolist() == [-7] * (MAX_TOKENS - 16)
    assert torch.equal(
        ragged.block_tables[:2, :1].cpu(), torch.tensor([[5], [6]], dtype=torch.int32)
    )
