"""The greedy token of each row of logits in one Triton launch.

A batch-1 MTP step takes four argmaxes over the vocabulary (the verification and each draft
depth); torch's reduction spends about 13 us on each of SmolLM2's 49,152 logits on an H200,
more than the vocabulary projection before it streams its weights in. :func:`argmax_rows`
gives torch's ``argmax(dim=-1)`` exactly (the first index of the maximum; a row holding NaN
gives its first NaN, as torch does) with one program per row. Off CUDA (and under autograd
nothing changes: the result has no gradient) it is torch's own argmax; ``use_triton=True``
forces the kernel (tests run it in Triton's interpreter on the CPU).
"""

from __future__ import annotations

import torch

from tandem.layers.fused import kernels_apply

try:
    import triton
    import triton.language as tl
except ImportError:  # tandem runs without triton: torch's argmax
    triton = None
    tl = None

_BLOCK, _WARPS = 8192, 16  # logits a program reads at a time, and its warps


def argmax_rows(logits: torch.Tensor, use_triton: bool | None = None) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` (int64) for ``logits`` [rows, V] of any float dtype."""
    if not (kernels_apply(logits) if use_triton is None else use_triton) or logits.dim() != 2:
        return logits.argmax(dim=-1)
    rows, n_cols = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    if n_cols == 0:
        raise ValueError("argmax of rows without columns")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    block = min(_BLOCK, triton.next_power_of_2(n_cols))
    warps = max(1, min(_WARPS, block // 512))  # a power of two: 16 lanes a thread at most
    _argmax_kernel[(rows,)](logits, out, n_cols, logits.stride(0), BLOCK=block, num_warps=warps)
    return out


if triton is not None:

    @triton.jit
    def _argmax_kernel(x_ptr, out_ptr, n_cols, stride, BLOCK: tl.constexpr):
        """One row: each lane keeps the first maximum (and the first NaN) of the columns it
        sees, in increasing order; then the smallest index among the lanes' winners."""
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        best_idx = offs
        nan_idx = tl.full([BLOCK], n_cols, tl.int32)
        for start in range(0, n_cols, BLOCK):
            cols = start + offs
            value = tl.load(
                x_ptr + row * stride + cols, mask=cols < n_cols, other=float("-inf")
            ).to(tl.float32)
            better = value > best
            best = tl.where(better, value, best)
            best_idx = tl.where(better, cols, best_idx)
            nan_idx = tl.where((value != value) & (nan_idx == n_cols), cols, nan_idx)
        top = tl.max(best, 0)
        first = tl.min(tl.where(best == top, best_idx, n_cols), 0)
        first_nan = tl.min(nan_idx, 0)
        tl.store(out_ptr + row, tl.where(first_nan < n_cols, first_nan, first).to(tl.int64))
