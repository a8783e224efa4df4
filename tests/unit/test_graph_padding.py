"""CUDA graph batches: padded batch sizes, and padding rows that change nothing real.

The capture itself needs CUDA (tests/e2e/test_cuda_graphs.py); the static buffers, the
host-side padding and the forward pass the graph records run here, with Triton's
interpreter on the CPU.
"""

import pytest
import torch

from tandem.layers.triton_attention import TritonAttentionBackend, block_table_array
from tandem.models.loader import ModelFiles, load_model
from tandem.worker.cuda_graphs import CudaGraphRunner, GraphBatch, graph_batch_sizes

BLOCK_SIZE = 4
NUM_BLOCKS = 8
SCRATCH = NUM_BLOCKS  # the cache's extra block


def test_block_table_array_cuts_and_pads_rows():
    table = block_table_array([[5, 6, 7], [3], []], width=2, num_rows=4, pad_block=SCRATCH)
    assert table.tolist() == [[5, 6], [3, SCRATCH], [SCRATCH, SCRATCH], [SCRATCH, SCRATCH]]
    assert str(table.dtype) == "int32"
    assert block_table_array([[1, 2], [4]], width=3).tolist() == [[1, 2, 0], [4, 0, 0]]


def test_graph_batch_sizes():
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert graph_batch_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert graph_batch_sizes(4) == [1, 2, 4]
    assert graph_batch_sizes(1) == [1]


def _rows(q: int) -> GraphBatch:
    """Two requests with q new tokens each: A at positions 2.. (blocks [1, 5]), B at 13..
    (blocks [3, 2, 6, 0]: not contiguous, not sorted)."""
    tables = [[1, 5], [3, 2, 6, 0]]
    starts = [2, 13]
    token_ids, positions, slots, seq_lens = [], [], [], []
    for table, start in zip(tables, starts, strict=True):
        for p in range(start, start + q):
            token_ids.append(7 + p)
            positions.append(p)
            slots.append(table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
        seq_lens.append(start + q)
    return GraphBatch(token_ids, positions, slots, seq_lens, tables, q)


@pytest.mark.parametrize("q", [1, 3])
def test_padding_rows_leave_real_rows_and_cache_unchanged(q):
    files = ModelFiles("dummy:tiny")
    model = load_model(files, 64, torch.float32, torch.device("cpu"), seed=0)
    arch = model.arch
    backend = TritonAttentionBackend()
    shape = (2, NUM_BLOCKS + 1, BLOCK_SIZE, arch.num_kv_heads, arch.head_dim)
    generator = torch.Generator().manual_seed(0)
    caches = [torch.randn(shape, generator=generator) for _ in range(arch.num_layers)]
    reference_caches = [cache.clone() for cache in caches]
    runner = CudaGraphRunner(
        model, caches, backend, BLOCK_SIZE, 64, 8, [1, 3], SCRATCH, torch.device("cpu")
    )
    batch = _rows(q)
    size = runner.padded_size([q, q])
    assert size == 2
    size = 8  # pad to the largest graph: six padding rows
    with torch.inference_mode():
        runner._fill(batch, size)
        padded = runner._forward(size, q)[: 2 * q]
        metadata = backend.build_metadata(
            [q, q], batch.seq_lens, batch.block_tables, torch.tensor(batch.slots), BLOCK_SIZE, "cpu"
        )
        reference = model(
            torch.tensor(batch.token_ids),
            torch.tensor(batch.positions),
            reference_caches,
            metadata,
            backend,
        )
    torch.testing.assert_close(padded, reference, rtol=1e-5, atol=1e-5)
    for cache, reference_cache in zip(caches, reference_caches, strict=True):
        # Real blocks hold the same keys and values; padding wrote only the scratch block.
        torch.testing.assert_close(
            cache[:, :NUM_BLOCKS], reference_cache[:, :NUM_BLOCKS], rtol=1e-5, atol=1e-5
        )
        assert torch.isfinite(cache[:, SCRATCH]).all()


def test_mixed_query_lengths_run_eagerly():
    files = ModelFiles("dummy:tiny")
    model = load_model(files, 64, torch.float32, torch.device("cpu"), seed=0)
    runner = CudaGraphRunner(
        model,
        [],
        TritonAttentionBackend(),
        BLOCK_SIZE,
        64,
        16,
        [1, 4],
        SCRATCH,
        torch.device("cpu"),
    )
    assert runner.padded_size([1] * 3) == 4
    assert runner.padded_size([4] * 9) == 16
    assert runner.padded_size([1, 4]) is None  # not uniform
    assert runner.padded_size([2, 2]) is None  # no graph for q = 2
    assert runner.padded_size([1] * 17) is None  # more rows than max_num_seqs


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_start_up_warm_up_writes_only_the_scratch_block(make_llm, backend):
    """The eager steps run at start-up on CUDA to compile their kernels (a prefill alone, a
    prefill beside a decode row) touch no block a request could own."""
    llm = make_llm(model="dummy:tiny", device="cpu", attention_backend=backend, num_kv_blocks=16)
    runner = llm.engine.runner
    scratch = llm.engine.num_blocks
    before = [cache.clone() for cache in runner.kv_caches]
    runner._warm_up_eager_steps(scratch_block=scratch)
    for old, new in zip(before, runner.kv_caches, strict=True):
        assert torch.equal(old[:, :scratch], new[:, :scratch])
        assert not torch.equal(old[:, scratch], new[:, scratch])  # it did write there
