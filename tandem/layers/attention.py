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

from tandem.device_copy import to_device


@dataclass
class PaddedGroup:
    """Reference backend: requests of similar lengths, padded to a common [B, Q, L] shape."""

    token_rows: torch.Tensor | None  # flat query rows of this group (None: all rows, in order)
    block_tables: torch.Tensor  # [B, max_blocks] block ids, padded with 0
    token_batch_index: torch.Tensor  # [T_group] request of each query row within the group
    token_query_index: torch.Tensor  # [T_group] its row within the request's queries
    attn_mask: torch.Tensor  # [B, 1, max_query_len, max_blocks * block_size] causal mask
    max_query_len: int


@dataclass
class AttentionMetadata:
    """Everything a backend needs about one step's ragged batch (shared by all layers)."""

    slot_mapping: torch.Tensor  # [T] flat KV slot of each new token
    max_query_len: int
    groups: list[PaddedGroup] | None = None  # reference backend only


class AttentionBackend(ABC):
    """Computes attention of new tokens over a paged KV cache.

    A paged backend (``attends_cache``) reads the step's own keys and values back from the
    cache, so the layer may store them itself (fused with the rotary embedding) and call
    ``attend_cached``; ``forward`` stores, then attends."""

    attends_cache = False

    def attend_cached(self, q, k_cache, v_cache, metadata, scale) -> torch.Tensor:
        """Attend q [T, H_q, D] over the cache, which holds this step's keys and values."""
        raise NotImplementedError(f"{type(self).__name__} attends to k and v directly")

    def attend_rotating(
        self,
        qk: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        rotary,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        num_q_heads: int,
        use_triton: bool | None = None,
        after_triton: bool = False,
    ) -> torch.Tensor:
        """For a paged backend: rotate the unrotated queries and keys ``qk`` [T, H_q + H_kv,
        D] by ``rotary`` (a ``RotaryEmbedding``) at ``positions``, store the keys and ``v``
        in the cache and attend; returns [T, H_q, D]. Here the rotation kernel stores and
        ``attend_cached`` attends; a backend may do both in one launch (``use_triton``
        forces its kernels, as in :mod:`tandem.layers.fused`; ``after_triton``: a Triton
        kernel wrote ``qk`` and ``v`` just before, so that launch may overlap its tail)."""
        q = rotary.rotate_and_store(
            positions, qk, v, k_cache, v_cache, metadata.slot_mapping, num_q_heads
        )
        return self.attend_cached(q, k_cache, v_cache, metadata, scale)

    @abstractmethod
    def build_metadata(
        self,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        slot_mapping: torch.Tensor,
        block_size: int,
        device: torch.device,
        seq_lens_device: torch.Tensor | None = None,
    ) -> AttentionMetadata:
        """Prepare per-step metadata once; every layer reuses it. ``seq_lens_device``: the
        true sequence lengths as a device tensor, for rows whose length only the device
        knows (a step launched before the one in front of it was read); ``seq_lens`` then
        holds upper bounds, used only to size the step's tensors."""

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
        """Store k, v [T, H_kv, D] into the cache, then attend q [T, H_q, D]; returns [T, H_q, D].
        (Backends that attend to k and v directly override this.)"""
        store_kv(k, v, k_cache, v_cache, metadata.slot_mapping)
        return self.attend_cached(q, k_cache, v_cache, metadata, scale)


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


def query_start_locations(query_lens: list[int]) -> list[int]:
    """Flat index of each request's first query row, then the total: ``[0, q0, q0+q1, ...]``."""
    starts = [0]
    for length in query_lens:
        starts.append(starts[-1] + length)
    return starts


def group_by_length(query_lens: list[int], seq_lens: list[int]) -> list[list[int]]:
    """Split requests into groups whose padded attention wastes little: sorted by length,
    a new group starts when a query or context length would more than double the group's
    smallest (so a long prefill never pads a batch of decode rows)."""
    order = sorted(range(len(seq_lens)), key=lambda i: (query_lens[i], seq_lens[i]))
    groups: list[list[int]] = []
    for index in order:
        if groups:
            first = groups[-1][0]
            if query_lens[index] <= 2 * query_lens[first] and seq_lens[index] <= 2 * max(
                seq_lens[first], 64
            ):
                groups[-1].append(index)
                continue
        groups.append([index])
    return groups


class TorchAttentionBackend(AttentionBackend):
    """Reference backend: per group of similar lengths, gather the paged KV and run one
    masked SDPA."""

    def build_metadata(
        self,
        query_lens,
        seq_lens,
        block_tables,
        slot_mapping,
        block_size,
        device,
        seq_lens_device=None,
    ):
        query_start = query_start_locations(query_lens)
        groups = group_by_length(query_lens, seq_lens)
        padded = [
            self._group(
                members,
                query_lens,
                seq_lens,
                block_tables,
                query_start,
                block_size,
                device,
                whole_batch=len(groups) == 1 and members == sorted(members),
                seq_lens_device=seq_lens_device,
            )
            for members in groups
        ]
        return AttentionMetadata(slot_mapping, max(query_lens), padded)

    @staticmethod
    def _group(
        members,
        query_lens,
        seq_lens,
        block_tables,
        query_start,
        block_size,
        device,
        whole_batch: bool,
        seq_lens_device: torch.Tensor | None = None,
    ) -> PaddedGroup:
        # Built from host ints and copied without a wait (see tandem.device_copy).
        q_lens = [query_lens[i] for i in members]
        s_lens = [seq_lens[i] for i in members]
        max_query_len = max(q_lens)
        max_blocks = -(-max(s_lens) // block_size)
        table = torch.zeros((len(members), max_blocks), dtype=torch.long)
        for row, i in enumerate(members):
            used = block_tables[i][:max_blocks]
            table[row, : len(used)] = torch.tensor(used, dtype=torch.long)
        token_batch_index = [row for row, q in enumerate(q_lens) for _ in range(q)]
        token_query_index = [j for q in q_lens for j in range(q)]
        token_rows = None
        if not whole_batch:
            token_rows = to_device(
                [t for i in members for t in range(query_start[i], query_start[i + 1])],
                torch.long,
                device,
            )
        # Query row j of a request sits at position seq_len - query_len + j and sees keys
        # up to and including that position.
        if seq_lens_device is None:
            starts = torch.tensor([s - q for s, q in zip(s_lens, q_lens, strict=True)])
        else:  # lengths the host does not know: the mask is built on the device
            members_index = to_device(members, torch.long, device)
            q_tensor = to_device(q_lens, torch.long, device)
            starts = seq_lens_device.long().index_select(0, members_index) - q_tensor
        query_pos = starts[:, None] + torch.arange(max_query_len, device=starts.device)[None, :]
        key_pos = torch.arange(max_blocks * block_size, device=starts.device)
        mask = key_pos[None, None, :] <= query_pos[:, :, None]
        # Padding rows attend to key 0 only, so they stay finite; their output is dropped.
        padding = torch.arange(max_query_len)[None, :] >= torch.tensor(q_lens)[:, None]
        mask[..., 0] |= padding.to(mask.device)
        return PaddedGroup(
            token_rows=token_rows,
            block_tables=to_device(table, torch.long, device),
            token_batch_index=to_device(token_batch_index, torch.long, device),
            token_query_index=to_device(token_query_index, torch.long, device),
            attn_mask=to_device(mask.unsqueeze(1), torch.bool, device),
            max_query_len=max_query_len,
        )

    attends_cache = True

    def attend_cached(self, q, k_cache, v_cache, metadata, scale):
        if len(metadata.groups) == 1 and metadata.groups[0].token_rows is None:
            return self._attend(q, k_cache, v_cache, metadata.groups[0], scale)
        out = torch.empty_like(q)
        for group in metadata.groups:
            group_q = q.index_select(0, group.token_rows)
            out.index_copy_(
                0, group.token_rows, self._attend(group_q, k_cache, v_cache, group, scale)
            )
        return out

    @staticmethod
    def _attend(q, k_cache, v_cache, group: PaddedGroup, scale: float) -> torch.Tensor:
        num_seqs = group.block_tables.shape[0]
        num_kv_heads, head_dim = k_cache.shape[-2:]
        num_heads = q.shape[1]
        # index_select on flat block ids copies far faster than 2-D advanced indexing.
        flat_blocks = group.block_tables.view(-1)
        keys = k_cache.index_select(0, flat_blocks).view(num_seqs, -1, num_kv_heads, head_dim)
        values = v_cache.index_select(0, flat_blocks).view(num_seqs, -1, num_kv_heads, head_dim)
        padded_q = q.new_zeros((num_seqs, group.max_query_len, num_heads, head_dim))
        padded_q[group.token_batch_index, group.token_query_index] = q
        out = F.scaled_dot_product_attention(
            padded_q.transpose(1, 2),
            keys.transpose(1, 2).to(q.dtype),
            values.transpose(1, 2).to(q.dtype),
            attn_mask=group.attn_mask,
            scale=scale,
            enable_gqa=num_heads != num_kv_heads,
        )
        return out.transpose(1, 2)[group.token_batch_index, group.token_query_index]


class DenseCausalBackend(AttentionBackend):
    """Plain causal attention over a [batch, seq_len] block of equal-length sequences, with
    no KV cache: for training and scoring (autograd flows through it)."""

    def __init__(self, batch_size: int, seq_len: int):
        self.batch_size, self.seq_len = batch_size, seq_len

    def build_metadata(self, query_lens, seq_lens, block_tables, slot_mapping, block_size, device):
        raise NotImplementedError("DenseCausalBackend needs no metadata")

    def forward(self, q, k, v, k_cache, v_cache, metadata, scale):
        shape = (self.batch_size, self.seq_len)
        out = F.scaled_dot_product_attention(
            q.view(*shape, *q.shape[1:]).transpose(1, 2),
            k.view(*shape, *k.shape[1:]).transpose(1, 2),
            v.view(*shape, *v.shape[1:]).transpose(1, 2),
            is_causal=True,
            scale=scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        return out.transpose(1, 2).reshape(q.shape)
