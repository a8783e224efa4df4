"""BlockManager: block accounting, lookahead, all-or-nothing allocation, prefix caching with
chained hashes, and LRU eviction of unreferenced cached blocks. Plain Python, no model."""

from __future__ import annotations

import pytest

from tandem.core.kv_cache import ROOT_HASH, BlockManager, hash_block
from tandem.request import Request
from tandem.sampling_params import SamplingParams

BS = 4  # block size used throughout


def make_request(request_id: str, tokens: list[int], **params) -> Request:
    return Request(request_id, list(tokens), SamplingParams(**params))


def compute(bm: BlockManager, request: Request) -> tuple[list[int], int]:
    """Admit ``request`` like the scheduler does: prefix hits, allocate the rest, mark every
    token computed and register the full blocks. Returns the prefix hit."""
    hits, num_hit = bm.get_computed_blocks(request)
    assert bm.allocate_slots(request, request.num_tokens - num_hit, hits)
    request.num_computed_tokens = request.num_tokens
    bm.cache_full_blocks(request, request.num_computed_tokens)
    return hits, num_hit


def ref_counts(bm: BlockManager) -> list[int]:
    return [block.ref_count for block in bm.blocks]


# ---- allocation ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("num_tokens", "num_blocks"), [(1, 1), (3, 1), (4, 1), (5, 2), (8, 2), (9, 3), (16, 4)]
)
def test_allocation_rounds_up_to_whole_blocks(num_tokens, num_blocks):
    bm = BlockManager(16, BS)
    request = make_request("a", range(num_tokens))
    assert bm.allocate_slots(request, num_tokens)
    assert len(bm.block_ids("a")) == num_blocks == bm.blocks_needed(num_tokens)
    assert bm.num_free_blocks == 16 - num_blocks
    assert all(bm.blocks[b].ref_count == 1 for b in bm.block_ids("a"))


def test_incremental_allocation_only_adds_blocks_when_a_block_boundary_is_crossed():
    bm = BlockManager(16, BS)
    request = make_request("a", range(5))
    assert bm.allocate_slots(request, 5)
    first = list(bm.block_ids("a"))
    assert len(first) == 2
    request.num_computed_tokens = 5
    assert bm.allocate_slots(request, 3)  # positions 5..7 fit in block 2
    assert bm.block_ids("a") == first
    request.num_computed_tokens = 8
    assert bm.allocate_slots(request, 1)  # position 8 opens block 3
    assert bm.block_ids("a")[:2] == first
    assert len(bm.block_ids("a")) == 3
    assert len(set(bm.block_ids("a"))) == 3


@pytest.mark.parametrize(
    ("num_new", "lookahead", "num_blocks"), [(5, 0, 2), (5, 3, 2), (5, 4, 3), (4, 5, 3), (1, 8, 3)]
)
def test_lookahead_tokens_reserve_extra_blocks(num_new, lookahead, num_blocks):
    bm = BlockManager(16, BS)
    request = make_request("a", range(num_new))
    assert bm.allocate_slots(request, num_new, num_lookahead_tokens=lookahead)
    assert len(bm.block_ids("a")) == num_blocks


def test_allocate_slots_out_of_blocks_returns_false_and_changes_nothing():
    bm = BlockManager(4, BS)
    a = make_request("a", range(12))
    assert bm.allocate_slots(a, 12)  # 3 of 4 blocks
    a.num_computed_tokens = 12
    held = list(bm.block_ids("a"))
    counts = ref_counts(bm)

    b = make_request("b", range(100, 105))
    assert not bm.allocate_slots(b, 5)  # needs 2, 1 free
    assert bm.block_ids("b") == []
    assert not bm.allocate_slots(a, 8)  # a would need 2 more
    assert not bm.allocate_slots(a, 1, num_lookahead_tokens=4)  # lookahead counts too
    assert bm.block_ids("a") == held
    assert ref_counts(bm) == counts
    assert bm.num_free_blocks == 1

    assert bm.allocate_slots(b, 4)  # exactly the last block
    assert bm.num_free_blocks == 0


def test_failed_allocation_with_prefix_hits_leaves_hit_blocks_cached_and_free():
    bm = BlockManager(3, BS)
    a = make_request("a", range(9))
    compute(bm, a)
    cached = bm.block_ids("a")[:2]
    bm.free(a)

    # Same 8-token prefix, 13 tokens in all: 2 hits + 2 new blocks > 3 blocks.
    b = make_request("b", list(range(8)) + [50, 51, 52, 53, 54])
    hits, num_hit = bm.get_computed_blocks(b)
    assert (hits, num_hit) == (cached, 8)
    assert not bm.allocate_slots(b, b.num_tokens - num_hit, hits)
    assert bm.block_ids("b") == []
    assert bm.num_free_blocks == 3
    assert ref_counts(bm) == [0, 0, 0]
    assert all(bm.blocks[i].block_hash is not None for i in cached)

    # Hits that are free still count against the free blocks: 2 hits + 1 new = 3 fits.
    c = make_request("c", list(range(8)) + [60])
    hits, num_hit = bm.get_computed_blocks(c)
    assert bm.allocate_slots(c, c.num_tokens - num_hit, hits)
    assert bm.block_ids("c")[:2] == cached
    assert bm.num_free_blocks == 0


def test_free_is_idempotent_and_returns_every_block():
    bm = BlockManager(8, BS)
    a = make_request("a", range(9))
    b = make_request("b", range(100, 106))
    compute(bm, a)
    compute(bm, b)
    assert bm.num_free_blocks == 8 - 3 - 2
    assert not bm.all_blocks_free()

    bm.free(a)
    bm.free(a)
    assert bm.num_free_blocks == 8 - 2
    assert bm.block_ids("a") == []
    assert not bm.all_blocks_free()

    bm.free(b)
    bm.free(b)
    bm.free(make_request("never-allocated", [1]))
    assert bm.all_blocks_free()
    assert bm.num_free_blocks == 8
    assert bm.usage == 0.0
    assert ref_counts(bm) == [0] * 8


def test_usage_is_fraction_of_held_blocks():
    bm = BlockManager(8, BS)
    a = make_request("a", range(8))
    assert bm.allocate_slots(a, 8)
    assert bm.usage == pytest.approx(2 / 8)


# ---- prefix cache --------------------------------------------------------------------------


def test_second_request_reuses_first_two_cached_full_blocks_with_shared_ref_counts():
    bm = BlockManager(16, BS)
    a = make_request("a", range(10))  # 2 full blocks + 2 tokens
    compute(bm, a)
    a_blocks = list(bm.block_ids("a"))

    b = make_request("b", list(range(8)) + [70, 71, 72])
    hits, num_hit = bm.get_computed_blocks(b)
    assert hits == a_blocks[:2]
    assert num_hit == 2 * BS
    free_before = bm.num_free_blocks
    assert bm.allocate_slots(b, b.num_tokens - num_hit, hits)
    b_blocks = bm.block_ids("b")
    assert b_blocks[:2] == a_blocks[:2]
    assert b_blocks[2] not in a_blocks
    assert bm.num_free_blocks == free_before - 1  # only the tail block is new
    assert [bm.blocks[i].ref_count for i in a_blocks[:2]] == [2, 2]

    bm.free(a)
    assert [bm.blocks[i].ref_count for i in a_blocks[:2]] == [1, 1]
    assert not bm.all_blocks_free()
    bm.free(b)
    assert bm.all_blocks_free()
    assert ref_counts(bm) == [0] * 16


def test_hit_only_covers_the_matching_prefix():
    bm = BlockManager(16, BS)
    a = make_request("a", range(13))  # 3 full blocks
    compute(bm, a)
    b = make_request("b", list(range(8)) + [99, 10, 11, 12, 13])  # diverges in block 3
    hits, num_hit = bm.get_computed_blocks(b)
    assert hits == bm.block_ids("a")[:2]
    assert num_hit == 8


def test_block_aligned_prompt_never_hits_the_last_tokens_block():
    bm = BlockManager(16, BS)
    a = make_request("a", range(8))  # exactly 2 blocks
    compute(bm, a)
    assert all(bm.blocks[i].block_hash is not None for i in bm.block_ids("a"))

    same = make_request("same", range(8))
    hits, num_hit = bm.get_computed_blocks(same)
    assert hits == bm.block_ids("a")[:1]
    assert num_hit == BS
    assert num_hit < same.num_tokens  # at least one token is left to compute

    longer = make_request("longer", list(range(8)) + [42])
    assert bm.get_computed_blocks(longer) == (bm.block_ids("a"), 8)

    one_block = make_request("one", range(4))
    assert bm.get_computed_blocks(one_block) == ([], 0)


def test_prompt_logprobs_requests_skip_prefix_cache():
    bm = BlockManager(16, BS)
    compute(bm, make_request("a", range(10)))
    for n in (0, 5):
        request = make_request(f"lp{n}", range(10), prompt_logprobs=n)
        assert bm.get_computed_blocks(request) == ([], 0)
    assert bm.get_computed_blocks(make_request("plain", range(10)))[1] == 8


def test_prefix_caching_disabled_never_hits():
    bm = BlockManager(16, BS, enable_prefix_caching=False)
    a = make_request("a", range(10))
    compute(bm, a)
    assert all(bm.blocks[i].block_hash is None for i in bm.block_ids("a"))
    assert bm.get_computed_blocks(make_request("b", range(10))) == ([], 0)


def test_only_computed_full_blocks_are_cached():
    bm = BlockManager(16, BS)
    a = make_request("a", range(12))
    assert bm.allocate_slots(a, 12)
    a.num_computed_tokens = 7  # chunked prefill: block 0 full, block 1 partial
    bm.cache_full_blocks(a, 7)
    blocks = bm.block_ids("a")
    assert bm.blocks[blocks[0]].block_hash is not None
    assert bm.blocks[blocks[1]].block_hash is None
    assert bm.get_computed_blocks(make_request("b", range(12))) == (blocks[:1], 4)


def test_blocks_filled_by_decoding_are_cached_as_they_fill_and_again_after_a_free():
    """cache_full_blocks only looks at blocks that became full since its last call: blocks
    filled one decode step at a time are still all cached, and a request freed (preempted)
    and computed again registers from its first block once more."""
    bm = BlockManager(32, BS)
    a = make_request("a", range(6))
    compute(bm, a)  # block 0 full, block 1 half
    for token in range(100, 107):  # decode 7 tokens, one step each: blocks 1 and 2 fill
        a.output_token_ids.append(token)
        assert bm.allocate_slots(a, 1)
        a.num_computed_tokens = a.num_tokens
        bm.cache_full_blocks(a, a.num_computed_tokens)
    blocks = bm.block_ids("a")
    assert [bm.blocks[b].block_hash is not None for b in blocks] == [True, True, True, False]
    tokens = a.all_token_ids()
    assert bm.get_computed_blocks(make_request("b", tokens))[0] == blocks[:3]

    bm.free(a)
    bm.reset_prefix_cache()  # forget them, so only a fresh registration can cache them
    a.num_computed_tokens = 0
    compute(bm, a)
    assert bm.get_computed_blocks(make_request("c", tokens))[0] == bm.block_ids("a")[:3]


def test_chained_hash_depends_on_the_whole_prefix():
    x, y, z = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]
    assert hash_block(ROOT_HASH, y) == hash_block(ROOT_HASH, list(y))
    assert hash_block(hash_block(ROOT_HASH, x), y) != hash_block(hash_block(ROOT_HASH, z), y)
    assert hash_block(ROOT_HASH, x) != hash_block(ROOT_HASH, y)


def test_same_second_block_after_different_first_block_does_not_hit():
    bm = BlockManager(16, BS)
    x, y, z = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]
    a = make_request("a", x + y + [0])
    compute(bm, a)

    b = make_request("b", z + y + [0])
    hits, num_hit = compute(bm, b)
    assert (hits, num_hit) == ([], 0)
    # b's second block has the same tokens as a's but a different chained hash, so it is
    # cached as a block of its own rather than treated as a duplicate.
    a1, b1 = bm.block_ids("a")[1], bm.block_ids("b")[1]
    assert bm.blocks[b1].block_hash is not None
    assert bm.blocks[b1].block_hash != bm.blocks[a1].block_hash

    assert bm.get_computed_blocks(make_request("c", z + y + [0]))[0] == bm.block_ids("b")[:2]
    assert bm.get_computed_blocks(make_request("d", x + y + [0]))[0] == bm.block_ids("a")[:2]


def test_duplicate_full_block_stays_private_and_cache_points_to_first():
    bm = BlockManager(16, BS)
    a = make_request("a", range(9))
    b = make_request("b", range(9))
    # Both allocated before either is computed: no hits for either.
    assert bm.allocate_slots(a, 9)
    assert bm.allocate_slots(b, 9)
    for request in (a, b):
        request.num_computed_tokens = 9
        bm.cache_full_blocks(request, 9)
    assert all(bm.blocks[i].block_hash is None for i in bm.block_ids("b"))
    assert bm.get_computed_blocks(make_request("c", range(9)))[0] == bm.block_ids("a")[:2]


# ---- eviction ------------------------------------------------------------------------------


def test_cached_free_blocks_are_reused_only_after_uncached_free_blocks():
    bm = BlockManager(4, BS)
    a = make_request("a", range(9))  # blocks: 2 cached full + 1 partial
    compute(bm, a)
    a_cached = bm.block_ids("a")[:2]
    a_partial = bm.block_ids("a")[2]
    bm.free(a)
    assert bm.all_blocks_free()

    # Two blocks for an unrelated request: the uncached ones (a's partial and the unused one).
    b = make_request("b", range(100, 108))
    assert bm.allocate_slots(b, 8)
    assert a_partial in bm.block_ids("b")
    assert not set(bm.block_ids("b")) & set(a_cached)
    assert all(bm.blocks[i].block_hash is not None for i in a_cached)
    assert bm.get_computed_blocks(make_request("a2", range(9))) == (a_cached, 8)

    # Now only cached blocks are free: the next allocation evicts one and forgets its hash.
    c = make_request("c", range(200, 204))
    assert bm.allocate_slots(c, 4)
    (evicted,) = bm.block_ids("c")
    assert evicted in a_cached
    assert bm.blocks[evicted].block_hash is None
    # The tail block of a goes first, so the shared first block still hits.
    assert evicted == a_cached[1]
    assert bm.get_computed_blocks(make_request("a3", range(9))) == (a_cached[:1], 4)

    d = make_request("d", range(300, 304))
    assert bm.allocate_slots(d, 4)
    assert bm.block_ids("d") == a_cached[:1]
    assert bm.get_computed_blocks(make_request("a4", range(9))) == ([], 0)


def test_least_recently_freed_cached_blocks_are_evicted_first():
    bm = BlockManager(4, BS)
    a = make_request("a", range(5))  # 1 cached block + 1 partial
    b = make_request("b", range(100, 105))
    compute(bm, a)
    compute(bm, b)
    a0, b0 = bm.block_ids("a")[0], bm.block_ids("b")[0]
    bm.free(a)
    bm.free(b)

    c = make_request("c", range(200, 212))  # 3 blocks: 2 uncached + the oldest cached
    assert bm.allocate_slots(c, 12)
    assert a0 in bm.block_ids("c")
    assert b0 not in bm.block_ids("c")
    assert bm.get_computed_blocks(make_request("a2", range(5))) == ([], 0)
    assert bm.get_computed_blocks(make_request("b2", range(100, 105))) == ([b0], 4)


def test_reset_prefix_cache_forgets_free_blocks_but_keeps_held_ones():
    bm = BlockManager(16, BS)
    a = make_request("a", range(9))
    held = make_request("held", range(100, 109))
    compute(bm, a)
    compute(bm, held)
    a_blocks = bm.block_ids("a")[:2]
    bm.free(a)

    bm.reset_prefix_cache()
    assert all(bm.blocks[i].block_hash is None for i in a_blocks)
    assert bm.get_computed_blocks(make_request("a2", range(9))) == ([], 0)
    assert bm.get_computed_blocks(make_request("h2", range(100, 109))) == (
        bm.block_ids("held")[:2],
        8,
    )
    # A recomputed a registers its blocks again.
    compute(bm, make_request("a3", range(9)))
    assert bm.get_computed_blocks(make_request("a4", range(9)))[1] == 8
