"""The torch paged-attention backend against plain causal attention per request, on ragged
batches mixing prefill chunks, decode rows and multi-token rows, with scattered blocks."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from tandem.layers.attention import TorchAttentionBackend, group_by_length

BLOCK_SIZE = 4
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 6, 2, 8


def naive_attention(q, keys, values, num_computed):
    """q [Q, H, D] are the last Q positions of a request whose keys/values are [L, H_kv, D]."""
    group = NUM_HEADS // NUM_KV_HEADS
    keys = keys.repeat_interleave(group, dim=1)
    values = values.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, keys) * HEAD_DIM**-0.5
    query_pos = num_computed + torch.arange(q.shape[0])
    allowed = torch.arange(keys.shape[0])[None, :] <= query_pos[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", F.softmax(scores, dim=-1), values)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(
    "query_lens,computed",
    [
        ([1, 1, 1, 1], [3, 17, 40, 9]),  # decode rows of very different lengths
        ([25, 1, 1, 4], [0, 30, 2, 11]),  # a prefill, decodes and a 4-token (verify) row
        ([7, 13], [5, 0]),  # chunked prefill continuing after computed tokens
    ],
)
def test_paged_attention_matches_naive(seed, query_lens, computed):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    num_blocks = 64
    k_cache = torch.zeros(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    v_cache = torch.zeros_like(k_cache)
    free = list(range(num_blocks))
    rng.shuffle(free)  # scattered, non-contiguous block tables
    seq_lens = [c + q for c, q in zip(computed, query_lens, strict=True)]
    tables, histories = [], []
    for c, length in zip(computed, seq_lens, strict=True):
        blocks = [free.pop() for _ in range(-(-length // BLOCK_SIZE))]
        tables.append(blocks)
        history_k = torch.randn(length, NUM_KV_HEADS, HEAD_DIM)
        history_v = torch.randn(length, NUM_KV_HEADS, HEAD_DIM)
        histories.append((history_k, history_v))
        for pos in range(c):  # already-computed tokens are in the cache
            k_cache[blocks[pos // BLOCK_SIZE], pos % BLOCK_SIZE] = history_k[pos]
            v_cache[blocks[pos // BLOCK_SIZE], pos % BLOCK_SIZE] = history_v[pos]
    q_parts, k_new, v_new, slots = [], [], [], []
    for (hk, hv), c, n, blocks in zip(histories, computed, query_lens, tables, strict=True):
        q_parts.append(torch.randn(n, NUM_HEADS, HEAD_DIM))
        k_new.append(hk[c : c + n])
        v_new.append(hv[c : c + n])
        slots += [blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(c, c + n)]
    q = torch.cat(q_parts)
    backend = TorchAttentionBackend()
    metadata = backend.build_metadata(
        query_lens, seq_lens, tables, torch.tensor(slots), BLOCK_SIZE, torch.device("cpu")
    )
    out = backend.forward(
        q, torch.cat(k_new), torch.cat(v_new), k_cache, v_cache, metadata, HEAD_DIM**-0.5
    )
    offset = 0
    for (hk, hv), c, n, q_part in zip(histories, computed, query_lens, q_parts, strict=True):
        expected = naive_attention(q_part, hk[: c + n], hv[: c + n], c)
        torch.testing.assert_close(out[offset : offset + n], expected, rtol=1e-5, atol=1e-5)
        offset += n


def test_group_by_length_keeps_prefill_out_of_decode_groups():
    groups = group_by_length([1, 1, 500, 1], [100, 120, 500, 90])
    assert [2] in groups
    assert sorted(i for g in groups for i in g) == [0, 1, 2, 3]
