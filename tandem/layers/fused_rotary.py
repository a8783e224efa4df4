"""Rotary embedding as one Triton kernel: alone, or fused with the store of the new keys and
values into the paged cache (one launch for what the PyTorch form does in several); and the
rotation of loaded rows that the paged attention kernel's rotating form calls.

As for every op of :mod:`tandem.layers.fused`: the kernel rounds where the PyTorch reference
rounds, the reference runs on the CPU, without triton and whenever autograd needs it, and
``use_triton=True`` forces the kernel (tests run it in Triton's interpreter on the CPU).
"""

from __future__ import annotations

import torch

from tandem.layers.attention import store_kv
from tandem.layers.fused import kernels_apply

try:
    import triton
    import triton.language as tl
except ImportError:  # tandem runs without triton: every op takes its PyTorch form
    triton = None
    tl = None


def rotary_reference(x, positions, cos, sin):
    """Rotate x [T, H, D] (rotate-half layout) by the angles of ``positions`` [T], in fp32;
    ``cos``/``sin`` are [max_position, D / 2] tables."""
    cos = cos[positions].unsqueeze(1)
    sin = sin[positions].unsqueeze(1)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    out = torch.empty_like(x)
    out[..., :half] = x1 * cos - x2 * sin
    out[..., half:] = x2 * cos + x1 * sin
    return out


def rotary(
    x: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    use_triton: bool | None = None,
) -> torch.Tensor:
    """``rotary_reference`` in one kernel where it applies."""
    if not (kernels_apply(x, cos) if use_triton is None else use_triton):
        return rotary_reference(x, positions, cos, sin)
    num_tokens, num_heads, head_dim = x.shape
    if x.stride(-1) != 1 or cos.stride(-1) != 1 or cos.stride() != sin.stride():
        raise ValueError("rotary needs x, cos and sin contiguous in their last dimension")
    out = torch.empty_like(x)
    if num_tokens:
        half = head_dim // 2
        _rotary_kernel[(num_tokens, num_heads)](
            x,
            out,
            positions,
            cos,
            sin,
            x.stride(0),
            x.stride(1),
            out.stride(0),
            out.stride(1),
            cos.stride(0),
            HALF=half,
            BLOCK=triton.next_power_of_2(half),
        )
    return out


def rotary_store_kv_reference(
    qk, v, positions, cos, sin, k_cache, v_cache, slot_mapping, num_q_heads
):
    """Rotate ``qk`` [T, H_q + H_kv, D] (``rotary_reference``), write the rotated keys and
    ``v`` [T, H_kv, D] into flat slots ``slot_mapping`` of the caches [..., H_kv, D], and
    return the rotated queries [T, H_q, D]."""
    q, k = rotary_reference(qk, positions, cos, sin).split(
        [num_q_heads, qk.shape[1] - num_q_heads], dim=1
    )
    store_kv(k, v, k_cache, v_cache, slot_mapping)
    return q


def rotary_store_kv(
    qk: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_q_heads: int,
    use_triton: bool | None = None,
) -> torch.Tensor:
    """``rotary_store_kv_reference`` in one kernel where it applies: one program per token
    and head; a key head's program also copies that head's value."""
    if not (kernels_apply(qk, v, cos) if use_triton is None else use_triton):
        return rotary_store_kv_reference(
            qk, v, positions, cos, sin, k_cache, v_cache, slot_mapping, num_q_heads
        )
    num_tokens, num_heads, head_dim = qk.shape
    num_kv_heads = num_heads - num_q_heads
    if (
        qk.stride(-1) != 1
        or v.stride(-1) != 1
        or cos.stride(-1) != 1
        or cos.stride() != sin.stride()
        or not k_cache.is_contiguous()
        or not v_cache.is_contiguous()
        or k_cache.shape[-2:] != (num_kv_heads, head_dim)
    ):
        raise ValueError(
            "rotary_store_kv needs x, v, cos and sin contiguous in their last "
            "dimension and caches [..., H_kv, D] contiguous"
        )
    q = torch.empty((num_tokens, num_q_heads, head_dim), dtype=qk.dtype, device=qk.device)
    if num_tokens:
        half = head_dim // 2
        _rotary_store_kv_kernel[(num_tokens, num_heads)](
            qk,
            v,
            q,
            k_cache,
            v_cache,
            positions,
            slot_mapping,
            cos,
            sin,
            qk.stride(0),
            qk.stride(1),
            v.stride(0),
            v.stride(1),
            q.stride(0),
            q.stride(1),
            cos.stride(0),
            num_q_heads,
            NUM_KV_HEADS=num_kv_heads,
            HEAD_DIM=head_dim,
            HALF=half,
            BLOCK=triton.next_power_of_2(half),
        )
    return q


if triton is not None:

    @triton.jit
    def _rotate_halves(x1, x2, cos, sin):
        """A rotate-half pair (fp32): the first half ``x1 cos - x2 sin``, the second
        ``x2 cos + x1 sin``. Every kernel that rotates uses this one expression, so they
        round alike (fused multiply-adds included)."""
        return x1 * cos - x2 * sin, x2 * cos + x1 * sin

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
        each half by ``_rotate_halves``, in fp32, rounded to x's dtype. [R, len(offs_d)],
        0 past HEAD_DIM and on rows not ``rows_ok``. The paged attention kernel's rotating
        form rotates its queries and the step's own keys with it
        (:mod:`tandem.layers.triton_attention_kernels`)."""
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
        # The pair's first and second halves by the rotation kernel's expression, then this
        # lane's one.
        x1 = tl.where(first[None, :], x, other)
        x2 = tl.where(first[None, :], other, x)
        out1, out2 = _rotate_halves(x1, x2, cos, sin)
        return tl.where(first[None, :], out1, out2).to(x_ptr.dtype.element_ty)

    @triton.jit
    def _rotate(
        x_ptr,
        pos_ptr,
        cos_ptr,
        sin_ptr,
        token,
        head,
        stride_xt,
        stride_xh,
        stride_c,
        HALF: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """Both halves of one head of one token, rotated, rounded to x's dtype (as the
        reference rounds), with the lane offsets and mask."""
        d = tl.arange(0, BLOCK)
        mask = d < HALF
        position = tl.load(pos_ptr + token).to(tl.int64)
        cos = tl.load(cos_ptr + position * stride_c + d, mask=mask, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + position * stride_c + d, mask=mask, other=0.0).to(tl.float32)
        base = x_ptr + token * stride_xt + head * stride_xh
        x1 = tl.load(base + d, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(base + HALF + d, mask=mask, other=0.0).to(tl.float32)
        out1, out2 = _rotate_halves(x1, x2, cos, sin)
        return out1.to(x_ptr.dtype.element_ty), out2.to(x_ptr.dtype.element_ty), d, mask

    @triton.jit
    def _rotary_kernel(
        x_ptr,
        out_ptr,
        pos_ptr,
        cos_ptr,
        sin_ptr,
        stride_xt,
        stride_xh,
        stride_ot,
        stride_oh,
        stride_c,
        HALF: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        token = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        out1, out2, d, mask = _rotate(
            x_ptr,
            pos_ptr,
            cos_ptr,
            sin_ptr,
            token,
            head,
            stride_xt,
            stride_xh,
            stride_c,
            HALF,
            BLOCK,
        )
        out = out_ptr + token * stride_ot + head * stride_oh
        tl.store(out + d, out1.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(out + HALF + d, out2.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rotary_store_kv_kernel(
        x_ptr,
        v_ptr,
        q_ptr,
        k_cache_ptr,
        v_cache_ptr,
        pos_ptr,
        slot_ptr,
        cos_ptr,
        sin_ptr,
        stride_xt,
        stride_xh,
        stride_vt,
        stride_vh,
        stride_qt,
        stride_qh,
        stride_c,
        num_q_heads,
        NUM_KV_HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        HALF: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        token = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        out1, out2, d, mask = _rotate(
            x_ptr,
            pos_ptr,
            cos_ptr,
            sin_ptr,
            token,
            head,
            stride_xt,
            stride_xh,
            stride_c,
            HALF,
            BLOCK,
        )
        if head < num_q_heads:
            out = q_ptr + token * stride_qt + head * stride_qh
            tl.store(out + d, out1, mask=mask)
            tl.store(out + HALF + d, out2, mask=mask)
        else:
            kv_head = head - num_q_heads
            slot = tl.load(slot_ptr + token).to(tl.int64)
            dst = (slot * NUM_KV_HEADS + kv_head) * HEAD_DIM
            tl.store(k_cache_ptr + dst + d, out1.to(k_cache_ptr.dtype.element_ty), mask=mask)
            tl.store(k_cache_ptr + dst + HALF + d, out2.to(k_cache_ptr.dtype.element_ty), mask=mask)
            src = v_ptr + token * stride_vt + kv_head * stride_vh
            for start in tl.static_range(0, HEAD_DIM, BLOCK):
                cols = start + d
                keep = cols < HEAD_DIM
                value = tl.load(src + cols, mask=keep, other=0.0)
                tl.store(
                    v_cache_ptr + dst + cols, value.to(v_cache_ptr.dtype.element_ty), mask=keep
                )
