"""The Triton kernel of :mod:`tandem.layers.skinny_linear`: a GEMM of at most 16 rows
(one tensor-core tile, rows padded) whose prologue may normalize its input (RMSNorm, with
the residual add, or two norms over two concatenated inputs) and whose epilogue may apply
SiLU-and-multiply to a gate-up projection. The host side, the rounding rules and when the
kernels apply are in that module's docstring.

Each program owns ``BLOCK_N`` output columns (gated: as many gate columns and their up
columns) for every row and streams its slice of the weight once, after one pass over its
rows for the norm's sums of squares (none without a norm). With programmatic dependent
launch (``PDL_WAIT``) it first loads the first tile of its weight slice, which no kernel
writes, and only then waits for the kernel before it, so that load overlaps that kernel's
tail (:mod:`tandem.layers.dependent_launch`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from tandem.layers.dependent_launch import pdl_prologue


@triton.jit
def _input_tile(x_ptr, y_ptr, rows, ks, mask, width, stride_x, stride_y, PROLOGUE):
    """The [rows, ks] tile of the input before its norm: ``x`` (+ ``y`` rounded, with the
    residual; ``x`` then ``y`` concatenated, with two norms)."""
    dtype = x_ptr.dtype.element_ty
    if PROLOGUE == 3:
        in_x = ks < width
        x = tl.load(
            x_ptr + rows[:, None] * stride_x + ks[None, :],
            mask=mask & in_x[None, :],
            other=0.0,
        )
        y = tl.load(
            y_ptr + rows[:, None] * stride_y + (ks - width)[None, :],
            mask=mask & (ks >= width)[None, :],
            other=0.0,
        )
        return tl.where(in_x[None, :], x, y)
    x = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=mask, other=0.0)
    if PROLOGUE == 2:
        r = tl.load(y_ptr + rows[:, None] * stride_y + ks[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
    return x


# Row counts change with the batch: left unspecialized, so no new variant mid-run.
@triton.jit(do_not_specialize=["num_rows"])
def _norm_linear_kernel(
    x_ptr,
    y_ptr,
    sum_ptr,
    norm_w_ptr,
    norm_w2_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    num_rows,
    n_out,
    width,
    stride_x,
    stride_y,
    stride_s,
    stride_w,
    stride_o,
    eps,
    PROLOGUE: tl.constexpr,
    GATED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    FULL_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL_WAIT: tl.constexpr,
    PDL_RELEASE: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_out
    k_in = width * 2 if PROLOGUE == 3 else width
    if PREFETCH:  # the weight's first tile (no kernel writes weights) before the wait
        w_first = _weight_tile(w_ptr, cols, tl.arange(0, BLOCK_K), k_in, col_mask, stride_w, 0)
        if GATED:
            first_up = _weight_tile(
                w_ptr, cols, tl.arange(0, BLOCK_K), k_in, col_mask, stride_w, n_out
            )
    pdl_prologue(PDL_WAIT, PDL_RELEASE)
    dtype = x_ptr.dtype.element_ty
    rows = tl.arange(0, BLOCK_M)
    row_mask = rows < num_rows
    # The norms need their rows' whole sums of squares (the two halves' apart; no pass
    # without a norm).
    squares = tl.zeros([BLOCK_M], dtype=tl.float32)
    squares2 = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, 0 if PROLOGUE == 0 else k_in, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        mask = row_mask[:, None] & (ks < k_in)[None, :]
        x = _input_tile(x_ptr, y_ptr, rows, ks, mask, width, stride_x, stride_y, PROLOGUE)
        if PROLOGUE == 2 and pid == 0:  # one program writes the residual stream's sum
            tl.store(sum_ptr + rows[:, None] * stride_s + ks[None, :], x, mask=mask)
        x32 = x.to(tl.float32)
        if PROLOGUE == 3:
            squares += tl.sum(tl.where((ks < width)[None, :], x32 * x32, 0.0), axis=1)
            squares2 += tl.sum(tl.where((ks >= width)[None, :], x32 * x32, 0.0), axis=1)
        else:
            squares += tl.sum(x32 * x32, axis=1)
    inv_rms = tl.rsqrt(squares / width + eps)
    inv_rms2 = tl.rsqrt(squares2 / width + eps)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)  # GATED: the up half's
    if PREFETCH:  # the first tile's product with the prefetched weights, then the rest
        ks = tl.arange(0, BLOCK_K)
        k_mask = ks < k_in
        x = _input_tile(
            x_ptr, y_ptr, rows, ks, row_mask[:, None] & k_mask[None, :], width, stride_x,
            stride_y, PROLOGUE,
        )  # fmt: skip
        operand = _operand(
            x, ks, k_mask, inv_rms, inv_rms2, norm_w_ptr, norm_w2_ptr, width, PROLOGUE
        )
        acc = _dot(operand, w_first, acc, FULL_PRECISION)
        if GATED:
            acc_up = _dot(operand, first_up, acc_up, FULL_PRECISION)
    for k0 in range(BLOCK_K if PREFETCH else 0, k_in, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < k_in
        mask = row_mask[:, None] & k_mask[None, :]
        x = _input_tile(x_ptr, y_ptr, rows, ks, mask, width, stride_x, stride_y, PROLOGUE)
        operand = _operand(
            x, ks, k_mask, inv_rms, inv_rms2, norm_w_ptr, norm_w2_ptr, width, PROLOGUE
        )
        w = _weight_tile(w_ptr, cols, ks, k_in, col_mask, stride_w, 0)
        acc = _dot(operand, w, acc, FULL_PRECISION)
        if GATED:  # the up row of each gate row sits n_out rows further down
            w = _weight_tile(w_ptr, cols, ks, k_in, col_mask, stride_w, n_out)
            acc_up = _dot(operand, w, acc_up, FULL_PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    out = acc.to(dtype)
    if GATED:  # fused.silu_mul's rounding: the projection, SiLU, then the product
        gate = out.to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(dtype)
        out = (silu.to(tl.float32) * acc_up.to(dtype).to(tl.float32)).to(dtype)
    tl.store(
        out_ptr + rows[:, None] * stride_o + cols[None, :],
        out,
        mask=row_mask[:, None] & col_mask[None, :],
    )


@triton.jit
def _weight_tile(w_ptr, cols, ks, k_in, col_mask, stride_w, row_offset):
    """The [ks, cols] tile of the weight's transpose, from row ``row_offset`` on."""
    mask = (ks < k_in)[:, None] & col_mask[None, :]
    return tl.load(
        w_ptr + (cols + row_offset)[None, :] * stride_w + ks[:, None], mask=mask, other=0.0
    )


@triton.jit
def _operand(x, ks, k_mask, inv_rms, inv_rms2, norm_w_ptr, norm_w2_ptr, width, PROLOGUE):
    """The GEMM's operand from the input tile ``x``: itself without a norm, else
    normalized by its rows' ``inv_rms`` (the second half's ``inv_rms2`` with two norms)
    and multiplied by the norm's weight, rounded as the norm kernel rounds."""
    if PROLOGUE == 0:
        return x
    dtype = norm_w_ptr.dtype.element_ty  # the input's (``norm_linear_applies``)
    if PROLOGUE == 3:
        first = (ks < width)[None, :]
        scale = tl.where(first, inv_rms[:, None], inv_rms2[:, None])
        nw = tl.where(
            ks < width,
            tl.load(norm_w_ptr + ks, mask=ks < width, other=0.0).to(tl.float32),
            tl.load(norm_w2_ptr + ks - width, mask=(ks >= width) & k_mask, other=0.0).to(
                tl.float32
            ),
        )
    else:
        scale = inv_rms[:, None]
        nw = tl.load(norm_w_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)
    normed = (x.to(tl.float32) * scale).to(dtype)
    return (normed.to(tl.float32) * nw[None, :]).to(dtype)


@triton.jit
def _dot(a, b, acc, FULL_PRECISION: tl.constexpr):
    if FULL_PRECISION:  # fp32 operands multiplied in full precision (no TF32)
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)
