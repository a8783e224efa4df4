"""The paged-attention kernel's rotating form (``new_keys``): the launch rotates the queries
and the step's keys and stores the keys and values itself. It must give what the rotation
kernel (``rotary_store_kv``) followed by the plain attention launch gives: the same cache
contents, the same attention output, for decode and verification rows, with and without
split key ranges, through the backend's ``attend_rotating`` as the layers call it. In
Triton's interpreter on the CPU (tests/conftest.py) the caches are equal bit for bit;
compiled, in fp32, the two kernels may fuse a multiply and an add where the other rounds
between them, so there they are compared to fp32's last bits (scripts/small_batch_kernels.py
checks bf16 caches bit for bit on the GPU).
"""

from __future__ import annotations

import pytest
import torch

from tandem.layers import fused_rotary, triton_attention
from tandem.layers.rotary import RotaryEmbedding

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BLOCK_SIZE = 16


def _step(query_lens, seq_lens, num_heads, num_kv_heads, head_dim, dtype, seed):
    """A decode/verification step: caches with stale values everywhere (and the earlier
    positions), scattered block tables, the fused qkv projection's output (unrotated
    queries and keys as views of it, values), positions and slots."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-s // BLOCK_SIZE) for s in seq_lens]
    order = torch.randperm(sum(blocks) + 3, generator=gen).tolist()
    tables = [[order.pop() for _ in range(n)] for n in blocks]
    positions = [p for q, s in zip(query_lens, seq_lens, strict=True) for p in range(s - q, s)]
    slots = [
        table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
        for table, q, s in zip(tables, query_lens, seq_lens, strict=True)
        for p in range(s - q, s)
    ]
    cache_shape = (sum(blocks) + 3, BLOCK_SIZE, num_kv_heads, head_dim)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(len(positions), width, generator=gen)
    return {
        "qkv": qkv.to(DEVICE, dtype),
        "k_cache": torch.randn(cache_shape, generator=gen).to(DEVICE, dtype),
        "v_cache": torch.randn(cache_shape, generator=gen).to(DEVICE, dtype),
        "tables": tables,
        "positions": torch.tensor(positions, device=DEVICE),
        "slots": torch.tensor(slots, device=DEVICE),
    }


def _assert_same_caches(got, want):
    for a, b in zip(got, want, strict=True):
        if DEVICE.type == "cpu":
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def _split(step, num_heads, num_kv_heads, head_dim):
    """The unrotated queries-and-keys view [T, H_q + H_kv, D] and the values [T, H_kv, D]."""
    qk, v = step["qkv"].split([(num_heads + num_kv_heads) * head_dim, num_kv_heads * head_dim], 1)
    return qk.view(-1, num_heads + num_kv_heads, head_dim), v.view(-1, num_kv_heads, head_dim)


@pytest.mark.parametrize("num_splits", [1, 4, 16])
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,query_lens,seq_lens",
    [
        (9, 3, 64, [1], [300]),  # SmolLM2's heads, a decode row
        (9, 3, 64, [4, 4, 1], [133, 70, 17]),  # verification rows (k = 3) and a decode row
        (8, 2, 128, [1, 4, 3, 1], [40, 161, 64, 1]),  # a row at position 0
    ],
)
def test_rotating_launch_equals_rotation_then_attention(
    num_splits, num_heads, num_kv_heads, head_dim, query_lens, seq_lens
):
    step = _step(query_lens, seq_lens, num_heads, num_kv_heads, head_dim, torch.float32, 3)
    rotary = RotaryEmbedding(head_dim, 512, 10000.0, None).to(DEVICE)
    qk, v = _split(step, num_heads, num_kv_heads, head_dim)
    backend = triton_attention.TritonAttentionBackend()
    metadata = backend.build_metadata(
        query_lens, seq_lens, step["tables"], step["slots"], BLOCK_SIZE, DEVICE
    )
    args = (
        metadata.block_tables,
        metadata.query_start_loc_device,
        metadata.seq_lens_device,
        max(query_lens),
        head_dim**-0.5,
    )
    k_ref, v_ref = step["k_cache"].clone(), step["v_cache"].clone()
    q = fused_rotary.rotary_store_kv(
        qk, v, step["positions"], rotary.cos, rotary.sin, k_ref, v_ref, step["slots"], num_heads,
        use_triton=True,
    )  # fmt: skip
    want = triton_attention.paged_attention(q, k_ref, v_ref, *args, num_splits=num_splits)

    k_cache, v_cache = step["k_cache"].clone(), step["v_cache"].clone()
    new_keys = triton_attention.NewKeys(qk[:, num_heads:], v, rotary.cos, rotary.sin, step["slots"])
    got = triton_attention.paged_attention(
        qk[:, :num_heads], k_cache, v_cache, *args, num_splits=num_splits, new_keys=new_keys
    )
    _assert_same_caches((k_cache, v_cache), (k_ref, v_ref))
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_the_backend_rotates_in_the_launch_only_where_every_row_fits_one_tile():
    """``attend_rotating`` as the layers call it: on a decode step it rotates in the
    launch (the rotation kernel does not run) and gives what rotating first gives; a step
    with a prefill row (too long for the 16-row tile) takes the rotation kernel first, with
    the same result as the base class's form."""
    num_heads, num_kv_heads, head_dim = 9, 3, 64
    rotary = RotaryEmbedding(head_dim, 512, 10000.0, None).to(DEVICE)
    rotations = []
    rotate_and_store = rotary.rotate_and_store
    rotary.rotate_and_store = lambda *args: rotations.append(args) or rotate_and_store(*args)
    backend = triton_attention.TritonAttentionBackend()
    for query_lens, seq_lens, kernel_rotations in (
        ([4, 1], [90, 31], 0),  # verification and decode rows: one launch
        ([4, 37], [90, 37], 1),  # a prefill row: the rotation kernel first
    ):
        step = _step(query_lens, seq_lens, num_heads, num_kv_heads, head_dim, torch.float32, 5)
        qk, v = _split(step, num_heads, num_kv_heads, head_dim)
        metadata = backend.build_metadata(
            query_lens, seq_lens, step["tables"], step["slots"], BLOCK_SIZE, DEVICE
        )
        results = []
        for rotate_in_launch in (True, False):
            k_cache, v_cache = step["k_cache"].clone(), step["v_cache"].clone()
            attend = backend.attend_rotating if rotate_in_launch else _rotate_first(backend)
            rotations.clear()
            out = attend(
                qk, v, step["positions"], rotary, k_cache, v_cache, metadata, 0.125, num_heads,
                use_triton=True,
            )  # fmt: skip
            if rotate_in_launch:
                assert len(rotations) == kernel_rotations
            results.append((out, k_cache, v_cache))
        (out, k_cache, v_cache), (want, k_ref, v_ref) = results
        _assert_same_caches((k_cache, v_cache), (k_ref, v_ref))
        torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-6)


def _rotate_first(backend):
    """The base class's form: the rotation kernel stores, then the plain launch attends."""

    def attend(qk, v, positions, rotary, k_cache, v_cache, metadata, scale, num_q_heads, **_):
        q = fused_rotary.rotary_store_kv(
            qk, v, positions, rotary.cos, rotary.sin, k_cache, v_cache, metadata.slot_mapping,
            num_q_heads, use_triton=True,
        )  # fmt: skip
        return backend.attend_cached(q, k_cache, v_cache, metadata, scale)

    return attend


def test_new_keys_refuse_rows_longer_than_one_tile():
    num_heads, num_kv_heads, head_dim = 9, 3, 64
    step = _step([6], [6], num_heads, num_kv_heads, head_dim, torch.float32, 1)
    rotary = RotaryEmbedding(head_dim, 64, 10000.0, None).to(DEVICE)
    qk, v = _split(step, num_heads, num_kv_heads, head_dim)
    backend = triton_attention.TritonAttentionBackend()
    metadata = backend.build_metadata([6], [6], step["tables"], step["slots"], BLOCK_SIZE, DEVICE)
    new_keys = triton_attention.NewKeys(qk[:, num_heads:], v, rotary.cos, rotary.sin, step["slots"])
    with pytest.raises(ValueError, match="at most 5 queries"):
        triton_attention.paged_attention(
            qk[:, :num_heads],
            step["k_cache"],
            step["v_cache"],
            metadata.block_tables,
            metadata.query_start_loc_device,
            metadata.seq_lens_device,
            6,
            0.125,
            new_keys=new_keys,
        )
