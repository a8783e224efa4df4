"""Device helpers of the paged attention kernel's rotating form
(:mod:`tandem.layers.triton_attention_kernels`, ``ROTATE``): the rotary embedding of rows
it loads, and the store of a query tile's new keys and values into the paged cache. The
two together do in the attention launch what ``fused_rotary.rotary_store_kv`` does in a
launch of its own before it.

Triton is imported under a guard: without it this module defines nothing.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # tandem imports without triton
    triton = None
    tl = None


if triton is not None:

    @triton.jit
    def _rotated_rows(
        x_ptr,
        row_offset,
        rows_ok,
        position,
        cos_ptr,
        sin_ptr,
        stride_c,
        offs_d,
        HEAD_DIM: tl.constexpr,
    ):
        """Rows of x (one head of R tokens, starting at ``row_offset`` [R]; the head
        dimension contiguous) rotated by the angles of ``position`` [R], rotate-half layout:
        each half's expression as ``fused_rotary._rotate`` writes it, in fp32, rounded to
        x's dtype. [R, len(offs_d)], 0 past HEAD_DIM and on rows not ``rows_ok``."""
        half = HEAD_DIM // 2
        first = offs_d < half
        partner = tl.where(first, offs_d + half, offs_d - half)
        mask = rows_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
        rows = x_ptr + row_offset[:, None]
        x = tl.load(rows + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
        other = tl.load(rows + partner[None, :], mask=mask, other=0.0).to(tl.float32)
        angle = (
            tl.where(rows_ok, position, 0).to(tl.int64)[:, None] * stride_c
            + (offs_d % half)[None, :]
        )
        cos = tl.load(cos_ptr + angle, mask=mask, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + angle, mask=mask, other=0.0).to(tl.float32)
        # The pair's first and second halves, each expression as _rotate has it (the same
        # rounding, fused multiply-adds included), then this lane's one.
        x1 = tl.where(first[None, :], x, other)
        x2 = tl.where(first[None, :], other, x)
        out1 = x1 * cos - x2 * sin
        out2 = x2 * cos + x1 * sin
        return tl.where(first[None, :], out1, out2).to(x_ptr.dtype.element_ty)

    @triton.jit
    def _store_new_kv(
        new_k_ptr,
        new_v_ptr,
        k_cache_ptr,
        v_cache_ptr,
        slot_mapping_ptr,
        cos_ptr,
        sin_ptr,
        stride_nkt,
        stride_nkh,
        stride_nvt,
        stride_nvh,
        stride_c,
        stride_kb,
        stride_ks,
        stride_kh,
        stride_kd,
        stride_vb,
        stride_vs,
        stride_vh,
        stride_vd,
        q_start,
        q_len,
        context,
        tile_in_seq,
        kv_head,
        offs_m,
        offs_d,
        BLOCK_Q: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        HEAD_DIM: tl.constexpr,
    ):
        """The rotated keys and the values of one query tile's tokens, KV head
        ``kv_head``, into their cache slots (``slot_mapping``; flat slot s is slot
        s % BLOCK_SIZE of block s // BLOCK_SIZE). Query row j of the request sits at
        position ``context + j``, as everywhere in the attention kernel."""
        row = tile_in_seq * BLOCK_Q + offs_m
        ok = (offs_m < BLOCK_Q) & (row < q_len)
        token = tl.where(ok, q_start + row, 0).to(tl.int64)
        key = _rotated_rows(
            new_k_ptr,
            token * stride_nkt + kv_head * stride_nkh,
            ok,
            context + row,
            cos_ptr,
            sin_ptr,
            stride_c,
            offs_d,
            HEAD_DIM,
        )
        mask = ok[:, None] & (offs_d < HEAD_DIM)[None, :]
        value = tl.load(
            new_v_ptr + (token * stride_nvt + kv_head * stride_nvh)[:, None] + offs_d[None, :],
            mask=mask,
            other=0.0,
        )
        slot = tl.load(slot_mapping_ptr + token, mask=ok, other=0).to(tl.int64)
        block, within = slot // BLOCK_SIZE, slot % BLOCK_SIZE
        k_dst = block * stride_kb + within * stride_ks + kv_head * stride_kh
        v_dst = block * stride_vb + within * stride_vs + kv_head * stride_vh
        tl.store(
            k_cache_ptr + k_dst[:, None] + offs_d[None, :] * stride_kd,
            key.to(k_cache_ptr.dtype.element_ty),
            mask=mask,
        )
        tl.store(
            v_cache_ptr + v_dst[:, None] + offs_d[None, :] * stride_vd,
            value.to(v_cache_ptr.dtype.element_ty),
            mask=mask,
        )
