"""Linear layers of a few rows with their input's elementwise op fused in: RMSNorm (with the
residual add) before a projection, SiLU-and-multiply before the down projection.

At batch 1 a decode step is a chain of some 300 kernels of a few microseconds each, and the
device idles between consecutive ones; the norm and the SwiGLU middle are separate kernels
only because cuBLAS cannot run them. :func:`norm_linear` and :func:`silu_mul_linear` run
them inside one Triton GEMM for at most :data:`MAX_ROWS` rows: two of a layer's nine
kernels go (the norms) and a third (SiLU-and-multiply), and with them their round trips
through memory.

Each program owns ``BLOCK_N`` output columns for every row (rows padded to 16 for the tensor
cores) and streams its slice of the weight once. The prologue rounds where its reference
rounds (the residual sum and the normalized input to the input dtype, then the product with
the norm's weight; SiLU, then its product with ``up``), so the GEMM sees the very operand the
unfused chain hands cuBLAS; only the order of the GEMM's fp32 sums differs, and it is the
same for every row count (a row's output does not depend on the rows beside it). fp32
operands are multiplied in full precision (no TF32).

As for :mod:`tandem.layers.fused`: the PyTorch form runs on the CPU, without triton and
whenever autograd needs it; ``use_triton=True`` forces the kernel (tests run it in Triton's
interpreter on the CPU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.layers.fused import kernels_apply, rms_norm_reference, silu_mul_reference

try:
    import triton
    import triton.language as tl
except ImportError:  # tandem runs without triton: every op takes its PyTorch form
    triton = None
    tl = None

MAX_ROWS = 16
"""Most rows the fused kernels take (one tensor-core tile); more go to the unfused chain."""

_LAUNCH_CONFIG = (16, 64, 4, 3)  # BLOCK_N, BLOCK_K, warps, pipeline stages
_PROLOGUE_NONE, _PROLOGUE_NORM, _PROLOGUE_NORM_RESIDUAL, _PROLOGUE_SILU_MUL = 0, 1, 2, 3


def fused_linear_applies(x: torch.Tensor, *tensors: torch.Tensor) -> bool:
    """The fused kernels take ``x``: CUDA tensors of one floating dtype, no gradient to
    record, at most :data:`MAX_ROWS` rows."""
    if not kernels_apply(x, *tensors) or x.numel() == 0:
        return False
    if any(t.dtype != x.dtype for t in tensors) or x.dtype not in _DTYPES:
        return False
    return x.numel() // x.shape[-1] <= MAX_ROWS


_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


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
):
    """:func:`norm_linear_reference` in one kernel where it applies (the module docstring);
    returns the projection, and with ``residual`` the pair (projection, ``x + residual``)."""
    tensors = [norm_weight, weight] + [t for t in (bias, residual) if t is not None]
    if not (fused_linear_applies(x, *tensors) if use_triton is None else use_triton):
        return norm_linear_reference(x, norm_weight, eps, weight, bias, residual)
    rows = _rows(x)
    summed = torch.empty_like(rows) if residual is not None else rows
    prologue = _PROLOGUE_NORM if residual is None else _PROLOGUE_NORM_RESIDUAL
    out = _launch(
        rows,
        weight,
        bias,
        prologue,
        residual=rows if residual is None else _rows(residual),
        summed=summed,
        norm_weight=norm_weight,
        eps=eps,
    )
    out = out.view(*x.shape[:-1], weight.shape[0])
    return out if residual is None else (out, summed.view(x.shape))


def silu_mul_linear_reference(gate_up, weight):
    """``F.linear(silu(gate) * up, weight)`` for ``gate_up`` = [gate | up] on its last dim."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.linear(silu_mul_reference(gate, up), weight)


def silu_mul_linear(gate_up: torch.Tensor, weight: torch.Tensor, use_triton: bool | None = None):
    """:func:`silu_mul_linear_reference` in one kernel where it applies."""
    if not (fused_linear_applies(gate_up, weight) if use_triton is None else use_triton):
        return silu_mul_linear_reference(gate_up, weight)
    rows = _rows(gate_up)
    out = _launch(rows, weight, None, _PROLOGUE_SILU_MUL)
    return out.view(*gate_up.shape[:-1], weight.shape[0])


def _rows(x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _launch(x, weight, bias, prologue, residual=None, summed=None, norm_weight=None, eps=0.0):
    block_n, block_k, num_warps, num_stages = _LAUNCH_CONFIG
    return launch_with(
        x,
        weight,
        bias,
        prologue,
        residual,
        summed,
        norm_weight,
        eps,
        block_n=block_n,
        block_k=block_k,
        num_warps=num_warps,
        num_stages=num_stages,
    )


def launch_with(
    x,
    weight,
    bias,
    prologue,
    residual=None,
    summed=None,
    norm_weight=None,
    eps=0.0,
    *,
    block_n,
    block_k,
    num_warps,
    num_stages,
):
    """The kernel with a chosen tiling (benchmarks sweep it)."""
    num_rows = x.shape[0]
    n_out, k_in = weight.shape
    if x.shape[1] != (2 * k_in if prologue == _PROLOGUE_SILU_MUL else k_in):
        raise ValueError(f"input width {x.shape[1]} does not fit a weight of {k_in} columns")
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    out = torch.empty(num_rows, n_out, dtype=x.dtype, device=x.device)
    residual = x if residual is None else residual
    summed = x if summed is None else summed
    norm_weight = weight if norm_weight is None else norm_weight
    _skinny_linear_kernel[(triton.cdiv(n_out, block_n),)](
        x,
        residual,
        summed,
        norm_weight,
        weight,
        weight if bias is None else bias,
        out,
        num_rows,
        n_out,
        k_in,
        x.stride(0),
        residual.stride(0),
        summed.stride(0),
        weight.stride(0),
        out.stride(0),
        eps,
        PROLOGUE=prologue,
        HAS_BIAS=bias is not None,
        FULL_PRECISION=x.dtype == torch.float32,
        BLOCK_M=MAX_ROWS,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


if triton is not None:

    @triton.jit
    def _prologue_tile(
        x_ptr,
        res_ptr,
        norm_w_ptr,
        rows,
        ks,
        mask,
        k_in,
        stride_x,
        stride_r,
        inv_rms,
        PROLOGUE: tl.constexpr,
    ):
        """The GEMM operand's [rows, ks] tile, rounded as the unfused chain rounds it."""
        dtype = x_ptr.dtype.element_ty
        x = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=mask, other=0.0)
        if PROLOGUE == 3:
            up = tl.load(
                x_ptr + rows[:, None] * stride_x + k_in + ks[None, :], mask=mask, other=0.0
            )
            g = x.to(tl.float32)
            silu = (g / (1.0 + tl.exp(-g))).to(dtype)
            x = (silu.to(tl.float32) * up.to(tl.float32)).to(dtype)
        elif PROLOGUE != 0:
            if PROLOGUE == 2:
                r = tl.load(res_ptr + rows[:, None] * stride_r + ks[None, :], mask=mask, other=0.0)
                x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
            normed = (x.to(tl.float32) * inv_rms[:, None]).to(dtype)
            w = tl.load(norm_w_ptr + ks, mask=ks < k_in, other=0.0)
            x = (normed.to(tl.float32) * w.to(tl.float32)[None, :]).to(dtype)
        return x

    # Row counts change with the batch: left unspecialized, so no new variant mid-run.
    @triton.jit(do_not_specialize=["num_rows"])
    def _skinny_linear_kernel(
        x_ptr,
        res_ptr,
        sum_ptr,
        norm_w_ptr,
        w_ptr,
        b_ptr,
        out_ptr,
        num_rows,
        n_out,
        k_in,
        stride_x,
        stride_r,
        stride_s,
        stride_w,
        stride_o,
        eps,
        PROLOGUE: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        FULL_PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        pid = tl.program_id(0)
        rows = tl.arange(0, BLOCK_M)
        row_mask = rows < num_rows
        cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < n_out
        inv_rms = tl.zeros([BLOCK_M], dtype=tl.float32)
        if PROLOGUE == 1 or PROLOGUE == 2:  # the norm needs the whole row's sum of squares
            squares = tl.zeros([BLOCK_M], dtype=tl.float32)
            for k0 in range(0, k_in, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                mask = row_mask[:, None] & (ks < k_in)[None, :]
                x = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=mask, other=0.0)
                if PROLOGUE == 2:
                    r = tl.load(
                        res_ptr + rows[:, None] * stride_r + ks[None, :], mask=mask, other=0.0
                    )
                    x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
                    if pid == 0:  # one program writes the residual stream's new value
                        tl.store(sum_ptr + rows[:, None] * stride_s + ks[None, :], x, mask=mask)
                x32 = x.to(tl.float32)
                squares += tl.sum(x32 * x32, axis=1)
            inv_rms = tl.rsqrt(squares / k_in + eps)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, k_in, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_mask = ks < k_in
            operand = _prologue_tile(
                x_ptr,
                res_ptr,
                norm_w_ptr,
                rows,
                ks,
                row_mask[:, None] & k_mask[None, :],
                k_in,
                stride_x,
                stride_r,
                inv_rms,
                PROLOGUE,
            )
            w = tl.load(
                w_ptr + cols[None, :] * stride_w + ks[:, None],
                mask=k_mask[:, None] & col_mask[None, :],
                other=0.0,
            )
            if FULL_PRECISION:
                acc = tl.dot(operand, w, acc, input_precision="ieee")
            else:
                acc = tl.dot(operand, w, acc)
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        out_mask = row_mask[:, None] & col_mask[None, :]
        tl.store(
            out_ptr + rows[:, None] * stride_o + cols[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )
