"""MTP draft head forward: one MTP layer over a paged KV cache (scattered blocks, the same
tokens in one pass and in two chunks, both inputs used). Tiny shapes (the ``dummy:tiny``
preset), CPU."""

from __future__ import annotations

import torch
from mtp_head_helpers import TINY, make_rotary

from tandem.layers.attention import TorchAttentionBackend
from tandem.models.loader import ModelFiles
from tandem.models.mtp import load_mtp_head

# ---- forward -------------------------------------------------------------------------------


BLOCK_SIZE = 4
NUM_BLOCKS = 4


def layer_pass(layer, backend, cache, positions, embeds, hidden, seq_len, block_table):
    slots = torch.tensor(
        [block_table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in positions]
    )
    metadata = backend.build_metadata(
        [len(positions)], [seq_len], [block_table], slots, BLOCK_SIZE, torch.device("cpu")
    )
    return layer(torch.tensor(positions), embeds, hidden, cache, metadata, backend)


def test_mtp_layer_forward_over_paged_cache():
    files = ModelFiles("dummy:tiny")
    head = load_mtp_head("dummy", files, make_rotary(files.arch)).eval()
    layer = head.layers[0]
    backend = TorchAttentionBackend()
    generator = torch.Generator().manual_seed(0)
    T = 6
    embeds = torch.randn(T, TINY.hidden_size, generator=generator)
    hidden = torch.randn(T, TINY.hidden_size, generator=generator)
    table = [2, 0]  # scattered blocks
    shape = (2, NUM_BLOCKS, BLOCK_SIZE, TINY.num_kv_heads, TINY.head_dim)

    with torch.no_grad():
        cache = torch.zeros(shape)
        full = layer_pass(layer, backend, cache, list(range(T)), embeds, hidden, T, table)
        assert full.shape == (T, TINY.hidden_size)
        assert torch.isfinite(full).all()
        assert cache[:, 2].abs().sum() > 0 and cache[:, 0, : T - BLOCK_SIZE].abs().sum() > 0
        assert cache[:, 1].abs().sum() == 0 and cache[:, 3].abs().sum() == 0

        # The same tokens in two chunks (prefill, then a continuation over the cached KV).
        chunked_cache = torch.zeros(shape)
        first = layer_pass(
            layer, backend, chunked_cache, [0, 1, 2, 3], embeds[:4], hidden[:4], 4, table
        )
        second = layer_pass(layer, backend, chunked_cache, [4, 5], embeds[4:], hidden[4:], 6, table)
        torch.testing.assert_close(torch.cat([first, second]), full, rtol=1e-5, atol=1e-5)

        # The output depends on both inputs.
        other = layer_pass(
            layer, backend, torch.zeros(shape), list(range(T)), embeds, hidden.flip(0), T, table
        )
        assert not torch.allclose(other, full)


def test_forward_normed_is_the_layer_output_and_its_final_norm():
    """``forward_normed`` (the residual add inside the final norm's kernel) gives what
    ``forward`` then ``final_norm`` give, in that order."""
    files = ModelFiles("dummy:tiny")
    head = load_mtp_head("dummy", files, make_rotary(files.arch)).eval()
    layer = head.layers[0]
    backend = TorchAttentionBackend()
    generator = torch.Generator().manual_seed(1)
    embeds = torch.randn(3, TINY.hidden_size, generator=generator)
    hidden = torch.randn(3, TINY.hidden_size, generator=generator)
    shape = (2, NUM_BLOCKS, BLOCK_SIZE, TINY.num_kv_heads, TINY.head_dim)
    slots = torch.tensor([0, 1, 2])
    metadata = backend.build_metadata([3], [3], [[0]], slots, BLOCK_SIZE, torch.device("cpu"))
    positions = torch.tensor([0, 1, 2])
    with torch.no_grad():
        g = layer(positions, embeds, hidden, torch.zeros(shape), metadata, backend)
        got_g, got_normed = layer.forward_normed(
            positions, embeds, hidden, torch.zeros(shape), metadata, backend
        )
        torch.testing.assert_close(got_g, g, rtol=0, atol=0)
        torch.testing.assert_close(got_normed, layer.final_norm(g), rtol=1e-6, atol=1e-6)
        assert not torch.allclose(got_normed, g)
