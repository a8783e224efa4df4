"""Projections of a few rows with the RMSNorm before them inside the GEMM.

At batch 1 a decode step is a chain of a few hundred kernels of a few microseconds each,
and the device idles between consecutive ones. A decoder layer's two norms and its
SiLU-and-multiply are kernels of their own only because cuBLAS cannot run them:
:func:`norm_linear` runs the norm (with the residual add) inside one Triton GEMM of at most
:data:`MAX_ROWS` rows, with ``gated=True`` also SiLU-and-multiply in the gate-up GEMM's
epilogue, and :func:`two_norm_linear` the MTP head's input projection with both its norms
(the token embedding's and the hidden state's, concatenated) in one launch where there were
four (two norms, the concatenation, the GEMM). :func:`linear` is the same GEMM without a
norm, for a projection between two Triton kernels (dependent launch at both edges).

The kernel (:mod:`tandem.layers.skinny_linear_kernels`) pads the rows to 16 for the tensor
cores; each program streams its slice of the weight once. The prologue
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

    from tandem.layers.skinny_linear_kernels import _norm_linear_kernel
except ImportError:  # tandem runs without triton: every op takes its PyTorch form
    triton = None

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
    prefetch=None,
):
    """One launch of the kernel; ``prefetch`` (default: when it waits with PDL) loads the
    weight's first tile before waiting (``skinny_linear_kernels``)."""
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
        PREFETCH=wait if prefetch is None else prefetch,
        num_warps=num_warps,
        num_stages=num_stages,
        **launch,
    )
    return out
