"""Projections of a few rows with the RMSNorm before them inside the GEMM.

At batch 1 a decode step is a chain of a few hundred kernels of a few microseconds each,
and the device idles between consecutive ones. A decoder layer's two norms and its
SiLU-and-multiply are kernels of their own only because cuBLAS cannot run them:
:func:`norm_linear` runs the norm (with the residual add) inside one Triton GEMM of at most
:data:`MAX_ROWS` rows, with ``gated=True`` also SiLU-and-multiply in the gate-up GEMM's
epilogue, and :func:`two_norm_linear` the MTP head's input projection with both its norms
(the token embedding's and the hidden state's, concatenated) in one launch where there were
four (two norms, the concatenation, the GEMM).

Each program owns ``BLOCK_N`` output columns for every row (rows padded to 16 for the tensor
cores; gated, as many gate columns and their up columns) and streams its slice of the
weight once; it first reads its rows whole for the norm's sum of squares. The prologue
rounds where the unfused chain rounds (the residual sum and the normalized input to the
input dtype, then the product with the norm's weight), and so does the gated epilogue (the
projection, SiLU, the product), so the GEMM sees the very operand the chain hands cuBLAS;
only the order of the GEMM's fp32 sums differs, and it is the same for every row count (a
row's output does not depend on the rows beside it, so one row of plain decoding and four
of a verification agree). fp32 operands are multiplied in full precision (no TF32).

Measured on one H200 (benchmarks/README.md, "Fewer launches"): faster than the unfused
kernels and cuBLAS at SmolLM2's widths, slower at the 8B's; :data:`MAX_WIDTH` keeps the
kernels to the small ones. As for :mod:`tandem.layers.fused`: the PyTorch form runs on the
CPU, without triton and whenever autograd needs it; ``use_triton=True`` forces the kernel
(tests run it in Triton's interpreter on the CPU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.layers.dependent_launch import pdl_launch
from tandem.layers.fused import (
    as_rows,
    kernels_apply,
    rms_norm,
    rms_norm_reference,
    silu_mul_reference,
)

try:
    import triton
    import triton.language as tl

    from tandem.layers.dependent_launch import pdl_prologue
except ImportError:  # tandem runs without triton: every op takes its PyTorch form
    triton = None
    tl = None

MAX_ROWS = 16
"""Most rows the kernels take (one tensor-core tile); more go to the unfused chain."""

MAX_WIDTH = 1024
"""Widest normalized input the kernels take: measured faster at 576 (SmolLM2), slower at
4,096 (the 8B shape), where cuBLAS streams the weights better than one tile of rows does."""

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_PLAIN, _NORM, _NORM_RESIDUAL, _TWO_NORMS = 0, 1, 2, 3


def norm_linear_applies(x: torch.Tensor, *tensors: torch.Tensor) -> bool:
    """The kernels take ``x`` (the input to be normalized): CUDA tensors of one floating
    dtype, no gradient to record, at most :data:`MAX_ROWS` rows of at most
    :data:`MAX_WIDTH` columns."""
    if not kernels_apply(x, *tensors) or x.numel() == 0:
        return False
    if x.dtype not in _DTYPES or any(t.dtype != x.dtype for t in tensors):
        return False
    return x.shape[-1] <= MAX_WIDTH and x.numel() // x.shape[-1] <= MAX_ROWS


def norm_linear_reference(x, norm_weight, eps, weight, bias=None, residual=None):
    """``F.linear(rms_norm(x [+ residual]), weight, bias)``; with ``residual`` also the sum."""
    normed = rms_norm_reference(x, norm_weight, eps, residual)
    if residual is None:
        return F.linear(normed, weight, bias)
    normed, summed = normed
    return F.linear(normed, weight, bias), summed


def norm_linear(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    use_triton: bool | None = None,
    gated: bool = False,
    after_triton: bool = False,
):
    """:func:`norm_linear_reference` in one kernel where it applies (the module docstring);
    returns the projection, and with ``residual`` the pair (projection, ``x + residual``).
    ``gated``: ``weight`` is a SwiGLU MLP's fused gate-up matrix (gate rows, then up rows)
    and the kernel returns ``silu(gate) * up`` (:func:`gated_reference`), SiLU-and-multiply
    in its epilogue, rounded where ``fused.silu_mul`` rounds. ``after_triton``: a Triton
    kernel wrote ``x`` just before (this launch may overlap it: ``dependent_launch``)."""
    tensors = [norm_weight, weight] + [t for t in (bias, residual) if t is not None]
    if gated and bias is not None:
        raise ValueError("the gated form takes no bias")
    if not (norm_linear_applies(x, *tensors) if use_triton is None else use_triton):
        out = norm_linear_reference(x, norm_weight, eps, weight, bias, residual)
        if not gated:
            return out
        return gated_reference(out) if residual is None else (gated_reference(out[0]), out[1])
    rows = as_rows(x)
    second = rows if residual is None else as_rows(residual)
    summed = torch.empty_like(rows) if residual is not None else rows
    prologue = _NORM if residual is None else _NORM_RESIDUAL
    out = _launch(
        prologue,
        rows,
        second,
        summed,
        norm_weight,
        norm_weight,
        eps,
        weight,
        bias,
        gated=gated,
        after_triton=after_triton,
    )
    out = out.view(*x.shape[:-1], out.shape[-1])
    return out if residual is None else (out, summed.view(x.shape))


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    after_triton: bool = False,
    use_triton: bool | None = None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` in the same Triton GEMM, no norm, where it applies:
    between two Triton kernels (``after_triton``: one wrote ``x``) it overlaps both launches
    (``dependent_launch``), which cuBLAS cannot (the attention's output projection's
    candidate, timed against cuBLAS by ``scripts/layer_chain_bench.py``)."""
    tensors = [weight] + ([bias] if bias is not None else [])
    if not (norm_linear_applies(x, *tensors) if use_triton is None else use_triton):
        return F.linear(x, weight, bias)
    rows = as_rows(x)
    out = _launch(
        _PLAIN, rows, rows, rows, weight, weight, 1.0, weight, bias, after_triton=after_triton
    )
    return out.view(*x.shape[:-1], weight.shape[0])


def gated_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of a fused gate-up projection's output [..., 2I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return silu_mul_reference(gate, up)


def two_norm_linear_reference(first, second, first_norm, second_norm, eps, weight):
    """``F.linear(cat([rms_norm(first), rms_norm(second)], -1), weight)``: the MTP head's
    input projection of the normalized token embedding and hidden state."""
    normed = torch.cat(
        [rms_norm_reference(first, first_norm, eps), rms_norm_reference(second, second_norm, eps)],
        dim=-1,
    )
    return F.linear(normed, weight)


def two_norm_linear(
    first: torch.Tensor,
    second: torch.Tensor,
    first_norm: torch.Tensor,
    second_norm: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    use_triton: bool | None = None,
):
    """:func:`two_norm_linear_reference` in one kernel where it applies. ``second`` may be a
    view with a row stride (the last columns of a wider tensor)."""
    tensors = (second, first_norm, second_norm, weight)
    if second.shape != first.shape:
        raise ValueError(f"the two inputs differ in shape: {first.shape} and {second.shape}")
    if not (norm_linear_applies(first, *tensors) if use_triton is None else use_triton):
        # The unfused chain: each norm its own kernel where those apply (many rows).
        normed = [rms_norm(first, first_norm, eps), rms_norm(second, second_norm, eps)]
        return F.linear(torch.cat(normed, dim=-1), weight)
    rows = as_rows(first)
    out = _launch(
        _TWO_NORMS, rows, as_rows(second), rows, first_norm, second_norm, eps, weight, None
    )
    return out.view(*first.shape[:-1], weight.shape[0])


def tiling(n_out: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, warps, pipeline stages) for ``n_out`` output columns: the fastest
    of a sweep on one H200 at SmolLM2's widths (16 columns a program up to 2,048 outputs,
    32 past them)."""
    return (16 if n_out <= 2048 else 32), 256, 4, 3


def _launch(
    prologue,
    x,
    second,
    summed,
    norm_w,
    second_norm_w,
    eps,
    weight,
    bias,
    gated=False,
    after_triton=False,
):
    num_rows, width = x.shape
    n_out, k_in = weight.shape
    if k_in != (2 * width if prologue == _TWO_NORMS else width):
        raise ValueError(f"input width {width} does not fit a weight of {k_in} columns")
    if gated and n_out % 2:
        raise ValueError(f"a gate-up matrix has an even number of rows, not {n_out}")
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    block_n, block_k, num_warps, num_stages = tiling(n_out)
    if gated:  # each program takes block_n // 2 columns of the gate and the same of up
        n_out, block_n = n_out // 2, block_n // 2
    out = torch.empty(num_rows, n_out, dtype=x.dtype, device=x.device)
    wait, release, launch = pdl_launch(x, after_triton)
    _norm_linear_kernel[(triton.cdiv(n_out, block_n),)](
        x,
        second,
        summed,
        norm_w,
        second_norm_w,
        weight,
        weight if bias is None else bias,
        out,
        num_rows,
        n_out,
        width,
        x.stride(0),
        second.stride(0),
        summed.stride(0),
        weight.stride(0),
        out.stride(0),
        eps,
        PROLOGUE=prologue,
        GATED=gated,
        HAS_BIAS=bias is not None,
        FULL_PRECISION=x.dtype == torch.float32,
        BLOCK_M=MAX_ROWS,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        # After a cuBLAS GEMM no wait (it never signals); the launch after it may overlap.
        PDL_WAIT=wait,
        PDL_RELEASE=release,
        num_warps=num_warps,
        num_stages=num_stages,
        **launch,
    )
    return out


if triton is not None:

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
    ):
        pdl_prologue(PDL_WAIT, PDL_RELEASE)
        pid = tl.program_id(0)
        dtype = x_ptr.dtype.element_ty
        rows = tl.arange(0, BLOCK_M)
        row_mask = rows < num_rows
        cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < n_out
        k_in = width * 2 if PROLOGUE == 3 else width
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
        for k0 in range(0, k_in, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_mask = ks < k_in
            mask = row_mask[:, None] & k_mask[None, :]
            x = _input_tile(x_ptr, y_ptr, rows, ks, mask, width, stride_x, stride_y, PROLOGUE)
            operand = _operand(
                x, ks, k_mask, inv_rms, inv_rms2, norm_w_ptr, norm_w2_ptr, width, PROLOGUE
            )
            w_mask = k_mask[:, None] & col_mask[None, :]
            w = tl.load(w_ptr + cols[None, :] * stride_w + ks[:, None], mask=w_mask, other=0.0)
            acc = _dot(operand, w, acc, FULL_PRECISION)
            if GATED:  # the up row of each gate row sits n_out rows further down
                w = tl.load(
                    w_ptr + (cols + n_out)[None, :] * stride_w + ks[:, None], mask=w_mask, other=0.0
                )
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
