"""The Triton paged-attention kernel against the torch reference backend, on ragged batches
mixing prefill, chunked-prefill continuation, decode and verification rows, with GQA and
scattered (shuffled) block tables.

Without a GPU the kernel runs in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1,
set here before the kernel module is imported); with one, the same tests run compiled.
"""

from __future__ import annotations

import importlib
import random

import pytest
import torch

from tandem.layers.attention import TorchAttentionBackend, store_kv

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# (query_lens, seq_lens): a whole prefill, a chunked-prefill continuation, a decode row and a
# verification row (k + 1 = 4 queries) in one ragged batch.
MIXED = ([37, 20, 1, 4], [37, 53, 70, 33])


@pytest.fixture(scope="module")
def triton_attention():
    """The kernel module; without a GPU, Triton's interpreter is switched on while this
    module's tests run (it must be on when the kernel is decorated and when it runs)."""
    with pytest.MonkeyPatch.context() as patch:
        if DEVICE.type == "cpu":
            patch.setenv("TRITON_INTERPRET", "1")
        pytest.importorskip("triton")
        yield importlib.import_module("tandem.layers.triton_attention")


def make_batch(
    query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed, device=DEVICE
):
    """Random caches (with stale values in every slot), a shuffled block table, the new
    tokens' q/k/v and their slots."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_needed) + 7
    free = list(range(num_blocks))
    rng.shuffle(free)  # non-contiguous, out of order
    tables = [[free.pop() for _ in range(n)] for n in blocks_needed]
    slots = [
        table[p // block_size] * block_size + p % block_size
        for table, q, s in zip(tables, query_lens, seq_lens, strict=True)
        for p in range(s - q, s)
    ]
    total = sum(query_lens)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    return {
        "q": randn(total, num_heads, head_dim),
        "k": randn(total, num_kv_heads, head_dim),
        "v": randn(total, num_kv_heads, head_dim),
        "k_cache": randn(num_blocks, block_size, num_kv_heads, head_dim),
        "v_cache": randn(num_blocks, block_size, num_kv_heads, head_dim),
        "tables": tables,
        "slots": torch.tensor(slots, device=device),
    }


def run_backend(backend, batch, query_lens, seq_lens, block_size):
    """One forward of ``backend`` on copies of the batch's caches; returns (out, k_cache)."""
    k_cache, v_cache = batch["k_cache"].clone(), batch["v_cache"].clone()
    metadata = backend.build_metadata(
        query_lens, seq_lens, batch["tables"], batch["slots"], block_size, batch["q"].device
    )
    scale = batch["q"].shape[-1] ** -0.5
    out = backend.forward(batch["q"], batch["k"], batch["v"], k_cache, v_cache, metadata, scale)
    return out, k_cache


def relative_error(out, ref):
    """Frobenius norm of the difference over the reference's, in fp32."""
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (8, 2, 128)])
def test_mixed_batch_matches_torch_fp32(
    triton_attention, num_heads, num_kv_heads, head_dim, block_size
):
    query_lens, seq_lens = MIXED
    batch = make_batch(
        query_lens,
        seq_lens,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        torch.float32,
        seed=block_size + head_dim,
    )
    ref, ref_cache = run_backend(TorchAttentionBackend(), batch, query_lens, seq_lens, block_size)
    out, cache = run_backend(
        triton_attention.TritonAttentionBackend(), batch, query_lens, seq_lens, block_size
    )
    torch.testing.assert_close(cache, ref_cache, atol=0, rtol=0)  # store_kv ran first
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "query_lens,seq_lens,num_heads,num_kv_heads,head_dim,block_size",
    [
        # decode-only batch (the 16-row tile), including a context shorter than one block
        ([1, 1, 1, 1, 1], [5, 70, 33, 16, 17], 8, 2, 128, 16),
        # many requests whose tiles straddle each other: exercises the tile -> request search
        ([5, 9, 1, 17, 3, 1, 8, 2], [5, 30, 2, 17, 40, 99, 8, 3], 4, 4, 64, 16),
        # a group wider than the 16-row tile (32 query heads on one KV head), odd block size
        ([3, 1, 6], [3, 50, 29], 32, 1, 64, 24),
        # a head dim that is not a power of two (padded and masked)
        ([11, 1, 4], [11, 40, 21], 6, 2, 80, 16),
    ],
)
def test_edge_shapes_match_torch_fp32(
    triton_attention, query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size
):
    batch = make_batch(
        query_lens,
        seq_lens,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        torch.float32,
        seed=len(query_lens),
    )
    ref, _ = run_backend(TorchAttentionBackend(), batch, query_lens, seq_lens, block_size)
    out, _ = run_backend(
        triton_attention.TritonAttentionBackend(), batch, query_lens, seq_lens, block_size
    )
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("min_query_len", [None, 1])
def test_launcher_takes_strided_q_and_int64_metadata(triton_attention, min_query_len):
    """q as a column slice of a fused qkv projection (non-contiguous), int64 index tensors;
    one launch for the mixed batch, or (given its shortest query) one per kind of row."""
    query_lens, seq_lens = MIXED
    num_heads, num_kv_heads, head_dim, block_size = 8, 2, 64, 16
    batch = make_batch(
        query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, torch.float32, seed=7
    )
    ref, _ = run_backend(TorchAttentionBackend(), batch, query_lens, seq_lens, block_size)
    k_cache, v_cache = batch["k_cache"].clone(), batch["v_cache"].clone()
    store_kv(batch["k"], batch["v"], k_cache, v_cache, batch["slots"])
    total = sum(query_lens)
    qkv = torch.randn(total, (num_heads + 2 * num_kv_heads) * head_dim, device=DEVICE)
    qkv[:, : num_heads * head_dim] = batch["q"].reshape(total, -1)
    q = qkv[:, : num_heads * head_dim].view(total, num_heads, head_dim)
    assert not q.is_contiguous()
    max_blocks = max(len(t) for t in batch["tables"])
    tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in batch["tables"]], device=DEVICE)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], device=DEVICE)
    out = triton_attention.paged_attention(
        q,
        k_cache,
        v_cache,
        tables,
        starts,
        torch.tensor(seq_lens, device=DEVICE),
        max(query_lens),
        head_dim**-0.5,
        min_query_len=min_query_len,
    )
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_splits", [1, 2, 4, 16])
@pytest.mark.parametrize("sharp", [False, True])
def test_split_keys_decode_and_verify_rows(triton_attention, num_splits, sharp):
    """Flash-decoding: decode and verification rows whose keys are split over programs
    (ranges that are empty, or hold no key a verification row may see), combined by the
    second kernel. ``sharp`` scales the queries so most scores underflow exp2."""
    query_lens, seq_lens = [1, 4, 1, 3], [300, 130, 17, 64]
    num_heads, num_kv_heads, head_dim, block_size = 8, 2, 64, 16
    batch = make_batch(
        query_lens,
        seq_lens,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        torch.float32,
        seed=num_splits,
    )
    if sharp:
        batch["q"] = batch["q"] * 12.0
    ref, _ = run_backend(TorchAttentionBackend(), batch, query_lens, seq_lens, block_size)
    k_cache, v_cache = batch["k_cache"].clone(), batch["v_cache"].clone()
    store_kv(batch["k"], batch["v"], k_cache, v_cache, batch["slots"])
    max_blocks = max(len(t) for t in batch["tables"])
    tables = torch.tensor(
        [t + [0] * (max_blocks - len(t)) for t in batch["tables"]], device=DEVICE, dtype=torch.int32
    )
    starts = torch.tensor(
        [0, *torch.tensor(query_lens).cumsum(0).tolist()], device=DEVICE, dtype=torch.int32
    )
    out = triton_attention.paged_attention(
        batch["q"],
        k_cache,
        v_cache,
        tables,
        starts,
        torch.tensor(seq_lens, device=DEVICE, dtype=torch.int32),
        max(query_lens),
        head_dim**-0.5,
        num_splits=num_splits,
    )
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_split_count_follows_the_batch(triton_attention):
    assert triton_attention.num_kv_splits(1, 8, 16) == 16
    assert triton_attention.num_kv_splits(8, 8, 16) == 4
    assert triton_attention.num_kv_splits(64, 3, 16) == 1
    assert triton_attention.num_kv_splits(1, 8, 64) == 1  # prefill tiles are not split


def test_fp16_matches_torch(triton_attention):
    """Half inputs: fp32 accumulation, probabilities rounded to half for the P @ V dot."""
    query_lens, seq_lens = MIXED
    batch = make_batch(query_lens, seq_lens, 8, 2, 64, 16, torch.float16, seed=11)
    ref, _ = run_backend(TorchAttentionBackend(), batch, query_lens, seq_lens, 16)
    out, _ = run_backend(triton_attention.TritonAttentionBackend(), batch, query_lens, seq_lens, 16)
    assert out.dtype == torch.float16
    assert relative_error(out, ref) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize(
    "query_lens,seq_lens",
    [
        MIXED,
        # Llama-sized mix: a long prefill chunk, many decode rows, verification rows
        ([300, 200, *[1] * 24, *[4] * 8], [300, 1200, *range(100, 2500, 100), *[777] * 8]),
    ],
)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (32, 8, 128)])
def test_bf16_on_cuda_matches_torch(
    triton_attention, query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size
):
    batch = make_batch(
        query_lens,
        seq_lens,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        torch.bfloat16,
        seed=3,
        device=torch.device("cuda"),
    )
    ref, _ = run_backend(TorchAttentionBackend(), batch, query_lens, seq_lens, block_size)
    out, _ = run_backend(
        triton_attention.TritonAttentionBackend(), batch, query_lens, seq_lens, block_size
    )
    assert out.dtype == torch.bfloat16
    assert torch.isfinite(out).all()
    assert relative_error(out, ref) < 1e-2
