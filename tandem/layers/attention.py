"""Paged attention: the backend interface and the torch reference backend.

A step's tokens are flattened into one ragged batch: request b owns query rows
``query_start_loc[b]:query_start_loc[b+1]``, which are the last positions of its
``seq_lens[b]`` tokens. Prefill chunks, decode rows and multi-token verification rows are
all this one shape. KV lives in per-layer caches of shape [num_blocks, block_size, H_kv, D].
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Everything a backend needs about one step's ragged batch (shared by all layers)."""

    slot_mapping: torch.Tensor  # [T] flat KV slot of each new token
    block_tables: torch.Tensor  # [B, max_blocks] block ids, padded with 0
    query_start_loc: torch.Tensor  # [B + 1] on the host
    seq_lens: torch.Tensor  # [B] tokens in context after this step, on the host
    max_query_len: int
    max_seq_len: int
    # Reference backend: where each flat query row lands in the padded [B, Q] layout,
    # and the causal mask over the gathered keys.
    token_batch_index: torch.Tensor | None = None
    token_query_index: torch.Tensor | None = None
    attn_mask: torch.Tensor | None = None  # [B, 1, max_query_len, max_blocks * block_size]

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])


class AttentionBackend(ABC):
    """Computes attention of new tokens over a paged KV cache."""

    @abstractmethod
    def build_metadata(
        self,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        slot_mapping: torch.Tensor,
        block_size: int,
        device: torch.device,
    ) -> AttentionMetadata:
        """Prepare per-step metadata once; every layer reuses it."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Store k, v [T, H_kv, D] into the cache, then attend q [T, H_q, D]; returns [T, H_q, D]."""


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write new keys and values into their slots of the paged cache."""
    num_kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


class TorchAttentionBackend(AttentionBackend):
    """Reference backend: gather each request's paged KV, one masked SDPA for the batch."""

    def build_metadata(self, query_lens, seq_lens, block_tables, slot_mapping, block_size, device):
        num_seqs = len(query_lens)
        max_query_len = max(query_lens)
        max_seq_len = max(seq_lens)
        max_blocks = -(-max_seq_len // block_size)
        table = torch.zeros((num_seqs, max_blocks), dtype=torch.long)
        for row, blocks in enumerate(block_tables):
            used = blocks[:max_blocks]
            table[row, : len(used)] = torch.tensor(used, dtype=torch.long)
        query_lens_t = torch.tensor(query_lens, dtype=torch.long)
        seq_lens_t = torch.tensor(seq_lens, dtype=torch.long)
        query_start_loc = torch.zeros(num_seqs + 1, dtype=torch.long)
        torch.cumsum(query_lens_t, 0, out=query_start_loc[1:])
        token_batch_index = torch.repeat_interleave(torch.arange(num_seqs), query_lens_t)
        token_query_index = torch.arange(int(query_start_loc[-1])) - torch.repeat_interleave(
            query_start_loc[:-1], query_lens_t
        )
        # Query row i of request b sits at position seq_len - query_len + i and sees keys
        # up to and including that position.
        query_pos = (seq_lens_t - query_lens_t)[:, None] + torch.arange(max_query_len)[None, :]
        key_pos = torch.arange(max_blocks * block_size)
        mask = key_pos[None, None, :] <= query_pos[:, :, None]
        # Padding rows attend to key 0 only, so they stay finite; their output is dropped.
        padding = torch.arange(max_query_len)[None, :] >= query_lens_t[:, None]
        mask[..., 0] |= padding
        return AttentionMetadata(
            slot_mapping=slot_mapping,
            block_tables=table.to(device),
            query_start_loc=query_start_loc,
            seq_lens=seq_lens_t,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            token_batch_index=token_batch_index.to(device),
            token_query_index=token_query_index.to(device),
            attn_mask=mask.unsqueeze(1).to(device),
        )

    def forward(self, q, k, v, k_cache, v_cache, metadata, scale):
        store_kv(k, v, k_cache, v_cache, metadata.slot_mapping)
        num_seqs = metadata.block_tables.shape[0]
        num_kv_heads, head_dim = k_cache.shape[-2:]
        num_heads = q.shape[1]
        # index_select on flat block ids copies far faster than 2-D advanced indexing.
        flat_blocks = metadata.block_tables.view(-1)
        keys = k_cache.index_select(0, flat_blocks).view(num_seqs, -1, num_kv_heads, head_dim)
        values = v_cache.index_select(0, flat_blocks).view(num_seqs, -1, num_kv_heads, head_dim)
        padded_q = q.new_zeros((num_seqs, metadata.max_query_len, num_heads, head_dim))
        padded_q[metadata.token_batch_index, metadata.token_query_index] = q
        out = F.scaled_dot_product_attention(
            padded_q.transpose(1, 2),
            keys.transpose(1, 2).to(q.dtype),
            values.transpose(1, 2).to(q.dtype),
            attn_mask=metadata.attn_mask,
            scale=scale,
            enable_gqa=num_heads != num_kv_heads,
        )
        return out.transpose(1, 2)[metadata.token_batch_index, metadata.token_query_index]
