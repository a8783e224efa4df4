"""Paged attention as one Triton kernel over a ragged batch.

One launch covers every request of a step, whatever its kind: a prefill or a chunk of one
(many query rows), a decode row (one) or a verification row (k + 1). Request b owns the
flat query rows ``query_start_loc[b]:query_start_loc[b+1]``, the last ``query_len`` of its
``seq_lens[b]`` positions; its query row j sits at position ``seq_lens[b] - query_len + j``
and attends causally to keys at positions up to and including its own. Keys and values
live in per-layer paged caches of shape [num_blocks, block_size, H_kv, D]; the block
table maps a request's logical block i to a physical block.

This module is the host side: the launcher (:func:`paged_attention`: the tile height, the
flash-decoding split count, one launch or two for a batch that mixes decode rows with a
prefill chunk, and for decode and verification steps the rotation of the queries and the
store of the step's keys inside the launch (:class:`NewKeys`); none reads a device value),
the step's metadata and the attention backend.
The kernels and their design are in :mod:`tandem.layers.triton_attention_kernels`.

Triton is imported under a guard, so this module (and tandem) imports without it; only
calling :func:`paged_attention` needs it. On a machine without a GPU, set
``TRITON_INTERPRET=1`` before this module is imported to run the kernel in Triton's
interpreter on CPU tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tandem.device_copy import to_device
from tandem.layers.attention import (
    AttentionBackend,
    AttentionMetadata,
    query_start_locations,
)
from tandem.layers.dependent_launch import pdl_launch
from tandem.layers.fused import kernels_apply

try:
    import triton
except ImportError:  # tandem imports without triton; paged_attention then raises
    triton = None

if triton is not None:
    from tandem.layers.triton_attention_kernels import (
        _combine_splits_kernel,
        _paged_attention_kernel,
    )

_LOG2_E = 1.4426950408889634


@dataclass
class NewKeys:
    """The step's own keys and values for the attention launch to rotate and store itself
    (``fused_rotary.rotary_store_kv``'s work, one launch fewer): the unrotated keys ``k``
    and the values ``v`` [T, H_kv, D] (head dimension contiguous), the rotary
    ``cos``/``sin`` tables [max_position, D / 2] (rows contiguous) and the cache slots
    ``slot_mapping`` [T]. The queries given with it are unrotated too. A token's position
    is the attention's: query row j of request b sits at ``seq_lens[b] - query_len + j``."""

    k: torch.Tensor
    v: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    slot_mapping: torch.Tensor


# Split a small batch's keys over more programs until about this many run (the H200 has
# 132 SMs); only for decode and short verification rows, whose tiles are few.
_TARGET_PROGRAMS = 256
_MAX_SPLITS = 16


def num_kv_splits(num_seqs: int, num_kv_heads: int, block_m: int) -> int:
    """How many programs share one query tile's keys (flash-decoding): a host-side choice
    from sizes alone, a power of two; 1 for prefill tiles and for batches that fill the GPU."""
    if block_m != 16:
        return 1
    splits = 1
    while splits < _MAX_SPLITS and num_seqs * num_kv_heads * splits * 2 <= _TARGET_PROGRAMS:
        splits *= 2
    return splits


def rows_per_short_tile(num_heads: int, num_kv_heads: int) -> int:
    """How many query rows of one request fit the 16-row tile of decode and verification
    rows (each row takes the GQA group's ``num_heads // num_kv_heads`` tile rows)."""
    return max(1, 16 // (num_heads // num_kv_heads))


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    scale: float,
    num_splits: int | None = None,
    min_query_len: int | None = None,
    tuning: dict | None = None,
    new_keys: NewKeys | None = None,
    after_triton: bool = False,
) -> torch.Tensor:
    """Causal attention of the ragged query rows ``q`` [T, H_q, D] over the paged cache.

    ``k_cache``/``v_cache`` are [num_blocks, block_size, H_kv, D] (H_q a multiple of H_kv);
    ``block_tables`` [B, max_blocks], ``query_start_loc`` [B + 1] and ``seq_lens`` [B] are
    integer tensors on q's device; ``max_query_len`` is any upper bound on the query
    lengths (it only picks the tile shape). Returns [T, H_q, D] in q's dtype (fp32, bf16 or
    fp16; accumulation is fp32). Reads no device value on the host, so it never waits.
    ``num_splits`` (a power of two; default ``num_kv_splits`` on CUDA, 1 in Triton's
    interpreter) splits each decode tile's keys over that many programs, combined by a
    second kernel. ``min_query_len`` (a lower
    bound, optional): when a batch mixes rows that fit the 16-row tile (decode,
    verification) with longer ones (prefill), each kind gets its own launch and tile.
    With ``new_keys`` (only for rows that fit the 16-row tile: ``rows_per_short_tile``), ``q``
    is unrotated and the cache does not hold the step's keys and values yet: the launch
    rotates and stores them (see :class:`NewKeys`). ``after_triton``: a Triton kernel wrote
    ``q`` just before; on a GPU that has it, the launch then overlaps that kernel's tail
    (programmatic dependent launch, :mod:`tandem.layers.dependent_launch`), as the
    combination of the splits always does.
    """
    if triton is None:
        raise RuntimeError("paged_attention needs triton (pip install triton)")
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, cache_head_dim = k_cache.shape[2:]
    if cache_head_dim != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError(f"cache shape {tuple(k_cache.shape)} does not fit q {tuple(q.shape)}")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads}")
    num_seqs = seq_lens.shape[0]
    out = torch.empty_like(q)
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    short_q = rows_per_short_tile(num_heads, num_kv_heads)
    if new_keys is not None and max_query_len > short_q:
        raise ValueError(f"new_keys needs rows of at most {short_q} queries, not {max_query_len}")
    args = (
        out,
        q,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        scale,
        group,
        short_q,
        new_keys,
    )
    if max_query_len <= short_q:
        if num_splits is not None:
            splits = num_splits
        elif q.is_cuda:
            splits = num_kv_splits(num_seqs, num_kv_heads, 16)
        else:  # Triton's interpreter runs programs one after another: splits only cost
            splits = 1
        _launch(*args, after_triton, block_m=16, rows=0, splits=splits, tuning=tuning)
    elif min_query_len is not None and min_query_len <= short_q:
        # Decode and verification rows, then the prefill rows (right after our kernel).
        _launch(*args, after_triton, block_m=16, rows=1, splits=1, tuning=tuning)
        _launch(*args, True, block_m=64, rows=2, splits=1, tuning=tuning)
    else:
        _launch(*args, after_triton, block_m=64, rows=0, splits=1, tuning=tuning)
    return out


def _launch(
    out,
    q,
    k_cache,
    v_cache,
    block_tables,
    query_start_loc,
    seq_lens,
    scale,
    group,
    short_q,
    new_keys,
    after_triton: bool,
    block_m: int,
    rows: int,
    splits: int,
    tuning: dict | None = None,
) -> None:
    """One launch of the attention kernel (plus the combination of its splits).
    ``tuning`` overrides launch choices (block_n, num_warps, num_stages) for measurements
    of variants."""
    # Chosen by timing variants on the H200 (scripts/kernel_sweep.py, bf16, 8B shape):
    # decode tiles 2-6% faster with 2 stages, prefill tiles 13% faster with 32-key tiles.
    defaults = (
        {"block_n": 64, "num_stages": 2} if block_m == 16 else {"block_n": 32, "num_stages": 3}
    )
    tuning = {**defaults, "num_warps": 4, **(tuning or {})}
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    if splits < 1 or splits & (splits - 1):
        raise ValueError(f"num_splits must be a power of two, got {splits}")
    block_m = max(block_m, triton.next_power_of_2(group))
    block_q = block_m // group
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    grid = (num_tokens // block_q + num_seqs, num_kv_heads, splits)
    part_out = part_ml = out  # unused without splits
    if splits > 1:
        part_out = torch.empty(
            (num_tokens, num_heads, splits, head_dim_pad), dtype=torch.float32, device=q.device
        )
        part_ml = torch.empty(
            (num_tokens, num_heads, splits, 2), dtype=torch.float32, device=q.device
        )
    rotate = new_keys is not None
    if rotate:
        k, v, cos, sin = new_keys.k, new_keys.v, new_keys.cos, new_keys.sin
        if k.stride(-1) != 1 or v.stride(-1) != 1 or q.stride(-1) != 1:
            raise ValueError("new_keys needs q, k and v contiguous in their head dimension")
        if cos.stride() != sin.stride() or sin.stride(-1) != 1:
            raise ValueError("new_keys needs cos and sin of one layout, rows contiguous")
        rotary_args = (
            k,
            v,
            new_keys.slot_mapping,
            cos,
            sin,
            *k.stride()[:2],
            *v.stride()[:2],
            sin.stride(0),
        )
    else:  # unused
        rotary_args = (out,) * 5 + (0,) * 5
    wait, release, launch = pdl_launch(q, after_triton)
    _paged_attention_kernel[grid](
        out,
        q,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        scale * _LOG2_E,
        num_seqs,
        *q.stride(),
        *out.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        block_tables.stride(0),
        part_out,
        part_ml,
        *rotary_args,
        GROUP=group,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        BLOCK_N=tuning["block_n"],
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        NUM_SPLITS=splits,
        ROWS=rows,
        SHORT_Q=short_q,
        ROTATE=rotate,
        PDL_WAIT=wait,
        PDL_RELEASE=release,
        num_warps=tuning["num_warps"],
        num_stages=tuning["num_stages"],
        **launch,
    )
    if splits > 1:  # (releasing early for a PDL launch after it: an output projection's)
        wait, release, launch = pdl_launch(q, after_triton=True)
        _combine_splits_kernel[(num_tokens, num_heads)](
            out,
            part_out,
            part_ml,
            *out.stride(),
            num_heads,
            NUM_SPLITS=splits,
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            PDL_WAIT=wait,
            PDL_RELEASE=release,
            **launch,
        )


def block_table_array(
    block_tables: list[list[int]], width: int, num_rows: int | None = None, pad_block: int = 0
) -> np.ndarray:
    """The rows' block tables as one int32 array of ``num_rows`` (default: as many as
    given) rows of ``width`` columns, cut to the width; every entry no row fills (the
    columns past a row's blocks, the rows past the given ones) is ``pad_block``. Filled row
    by row from the lists (a nested list through torch.tensor costs far more per element,
    and a step at a large batch holds tens of thousands of block ids)."""
    table = np.full((num_rows or len(block_tables), width), pad_block, dtype=np.int32)
    for i, row in enumerate(block_tables):
        row = row[:width]
        table[i, : len(row)] = row
    return table


@dataclass
class TritonAttentionMetadata(AttentionMetadata):
    """AttentionMetadata plus the device copies the kernel reads (int32)."""

    block_tables: torch.Tensor | None = None  # [B, max_blocks] block ids, padded with 0
    query_start_loc_device: torch.Tensor | None = None  # [B + 1]
    seq_lens_device: torch.Tensor | None = None  # [B]
    min_query_len: int | None = None  # a mixed batch's decode rows get their own launch


class TritonAttentionBackend(AttentionBackend):
    """Paged attention by one Triton kernel launch per layer (see the module docstrings here
    and in :mod:`tandem.layers.triton_attention_kernels`)."""

    def build_metadata(
        self,
        query_lens,
        seq_lens,
        block_tables,
        slot_mapping,
        block_size,
        device,
        seq_lens_device=None,
    ) -> TritonAttentionMetadata:
        """Host lists to device tensors, copied once per step without a wait
        (``seq_lens_device``: see ``AttentionBackend.build_metadata``)."""
        query_start = query_start_locations(query_lens)
        table = block_table_array(block_tables, -(-max(seq_lens) // block_size))
        if seq_lens_device is None:
            seq_lens_device = to_device(seq_lens, torch.int32, device)
        return TritonAttentionMetadata(
            slot_mapping=slot_mapping,
            max_query_len=max(query_lens),
            min_query_len=min(query_lens),
            block_tables=to_device(table, torch.int32, device),
            query_start_loc_device=to_device(query_start, torch.int32, device),
            seq_lens_device=seq_lens_device.to(torch.int32),
        )

    attends_cache = True

    def attend_cached(
        self,
        q,
        k_cache,
        v_cache,
        metadata: TritonAttentionMetadata,
        scale,
        new_keys=None,
        after_triton=False,
    ):
        """The kernel over the whole ragged batch; the cache holds the step's keys (or,
        with ``new_keys``, the launch rotates and stores them: see :func:`paged_attention`)."""
        return paged_attention(
            q,
            k_cache,
            v_cache,
            metadata.block_tables,
            metadata.query_start_loc_device,
            metadata.seq_lens_device,
            metadata.max_query_len,
            scale,
            min_query_len=metadata.min_query_len,
            new_keys=new_keys,
            after_triton=after_triton,
        )

    def attend_rotating(
        self,
        qk,
        v,
        positions,
        rotary,
        k_cache,
        v_cache,
        metadata: TritonAttentionMetadata,
        scale,
        num_q_heads,
        use_triton=None,
        after_triton=False,
    ):
        """Where every row fits the 16-row tile (decode and verification steps) and the
        kernels apply, one launch rotates, stores and attends (:class:`NewKeys`: each row
        at the attention's own position, which the layers' ``positions`` equal; with
        ``after_triton`` launched with programmatic dependent launch); else the rotation
        kernel first (``AttentionBackend.attend_rotating``)."""
        num_kv_heads = qk.shape[1] - num_q_heads
        applies = kernels_apply(qk, v, rotary.cos) if use_triton is None else use_triton
        if not applies or metadata.max_query_len > rows_per_short_tile(num_q_heads, num_kv_heads):
            return super().attend_rotating(
                qk, v, positions, rotary, k_cache, v_cache, metadata, scale, num_q_heads
            )
        new_keys = NewKeys(qk[:, num_q_heads:], v, rotary.cos, rotary.sin, metadata.slot_mapping)
        return self.attend_cached(
            qk[:, :num_q_heads], k_cache, v_cache, metadata, scale, new_keys, after_triton
        )
