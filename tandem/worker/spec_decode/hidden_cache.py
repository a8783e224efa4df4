"""The paged cache of one MTP layer's outputs, for heads of several layers: layer L + 1 reads
layer L's output a position later (``MTPProposer.stream_later_layers``), so the output at a
step's last position waits there for the next step, on this instance or, under PD, on the
decode instance after the handoff.

It is stored in tensors shaped exactly like one layer of the KV cache ``[2, blocks,
block_size, kv_heads, head_dim]``, so that the KV connectors move its blocks with the KV's
and check one layout for all: a position's ``hidden_size`` values are cut into pieces of
``kv_heads x head_dim``, each tensor holding two (its key and value halves); the last piece
may be partly unused.
"""

from __future__ import annotations

import torch


class HiddenCache:
    """One layer's outputs [positions, hidden_size], paged by the KV cache's block table."""

    def __init__(
        self, kv_shape: tuple[int, ...], hidden_size: int, dtype: torch.dtype, device
    ) -> None:
        _, num_blocks, block_size, num_kv_heads, head_dim = kv_shape
        piece = num_kv_heads * head_dim
        self.tensors = [
            torch.zeros(kv_shape, dtype=dtype, device=device)
            for _ in range(self.num_tensors(hidden_size, num_kv_heads, head_dim))
        ]
        self.scratch_block = num_blocks - 1  # the cache's last block, as the KV's
        slots = num_blocks * block_size
        halves = [t.view(2, slots, piece)[half] for t in self.tensors for half in (0, 1)]
        num_pieces = -(-hidden_size // piece)
        widths = [min(piece, hidden_size - i * piece) for i in range(num_pieces)]
        self._pieces = [half[:, :width] for half, width in zip(halves, widths, strict=False)]

    @staticmethod
    def num_tensors(hidden_size: int, num_kv_heads: int, head_dim: int) -> int:
        """KV-shaped tensors one cache takes (for sizing the KV cache)."""
        return -(-hidden_size // (2 * num_kv_heads * head_dim))

    def write(self, slots: torch.Tensor, values: torch.Tensor) -> None:
        """``values`` [n, hidden_size] at the flat KV slots ``slots`` [n] (graph-safe)."""
        start = 0
        for piece in self._pieces:
            width = piece.shape[1]
            piece.index_copy_(0, slots, values[:, start : start + width].to(piece.dtype))
            start += width

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        """The values at ``slots`` [n]: [n, hidden_size]."""
        return torch.cat([piece.index_select(0, slots) for piece in self._pieces], dim=1)
