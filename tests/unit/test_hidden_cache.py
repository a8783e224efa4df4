"""A head of several MTP layers keeps each layer's outputs in KV-shaped tensors
(``HiddenCache``), so that PD's connectors move them block by block with the KV: values
read back as written, at any width against the KV's head size; a block copied tensor by
tensor (what every connector does) carries the positions' values with it; the runner hands
them over with the KV and sizes the cache for them."""

from __future__ import annotations

import pytest
import torch

from tandem.worker.spec_decode.hidden_cache import HiddenCache

BLOCK_SIZE = 4


@pytest.mark.parametrize("hidden_size", [24, 64, 70])  # one piece; whole tensors; a partial one
def test_values_read_back_as_written(hidden_size):
    shape = (2, 6, BLOCK_SIZE, 2, 8)  # pieces of 16 values, two a tensor
    cache = HiddenCache(shape, hidden_size, torch.float32, "cpu")
    assert len(cache.tensors) == -(-hidden_size // 32)
    assert all(t.shape == shape for t in cache.tensors)
    values = torch.randn(5, hidden_size)
    slots = torch.tensor([0, 7, 9, 22, 23])
    cache.write(slots, values)
    assert torch.equal(cache.read(slots), values)
    assert torch.equal(cache.read(torch.tensor([1, 8])), torch.zeros(2, hidden_size))
    assert cache.scratch_block == 5


def test_a_block_copied_tensor_by_tensor_carries_its_positions():
    shape = (2, 6, BLOCK_SIZE, 3, 8)
    source = HiddenCache(shape, 56, torch.float32, "cpu")
    target = HiddenCache(shape, 56, torch.float32, "cpu")
    slots = torch.arange(2 * BLOCK_SIZE, 3 * BLOCK_SIZE)  # block 2's positions
    values = torch.randn(BLOCK_SIZE, 56)
    source.write(slots, values)
    for src, dst in zip(source.tensors, target.tensors, strict=True):
        dst[:, 4].copy_(src[:, 2])  # what a connector does: every layer's keys and values
    assert torch.equal(target.read(slots + 2 * BLOCK_SIZE), values)


def test_the_runner_hands_the_hidden_caches_over_and_sizes_the_cache_for_them(tmp_path):
    from mtp_head_helpers import TINY, random_head

    from tandem.config import CacheConfig, EngineConfig, SpeculativeConfig
    from tandem.core.engine_core import EngineCore
    from tandem.models.mtp_files import save_head
    from tandem.worker.model_runner import kv_cache_bytes_per_block

    pieces = HiddenCache.num_tensors(TINY.hidden_size, TINY.num_kv_heads, TINY.head_dim)
    layer_bytes = 2 * 16 * TINY.num_kv_heads * TINY.head_dim * 4  # a KV block, fp32
    one_layer = kv_cache_bytes_per_block(TINY, 16, torch.float32, 1)
    three_layers = kv_cache_bytes_per_block(TINY, 16, torch.float32, 3)
    assert three_layers - one_layer == (2 + 2 * pieces) * layer_bytes
    save_head(random_head(TINY, 2, seed=0), str(tmp_path), "dummy:tiny")
    config = EngineConfig(
        model="dummy:tiny",
        dtype="float32",
        cache=CacheConfig(num_blocks=8),
        speculative=SpeculativeConfig("mtp", 2, model=str(tmp_path)),
    )
    core = EngineCore(config)
    try:
        handed = core.runner.kv_caches_with_mtp()
        hidden = core.runner.proposer.hidden_caches[0].tensors
        assert len(handed) == TINY.num_layers + 2 + pieces
        assert all(a is b for a, b in zip(handed[-pieces:], hidden, strict=True))
    finally:
        core.shutdown()
