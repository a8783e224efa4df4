"""Fused elementwise kernels for the decoder: RMSNorm (with the residual add) and
SiLU-and-multiply, and the rule for when a fused op takes its kernel (:func:`kernels_apply`,
shared with the rotary kernels in :mod:`tandem.layers.fused_rotary`).

Each op is one Triton launch on CUDA in place of the 2 to 12 small kernels its PyTorch form
issues; at small batch a decode step is a long chain of such kernels, so their count sets
the step time. Every op rounds where its PyTorch reference rounds (to the input dtype after
the normalization, after the residual add, after SiLU), so bf16 results match the reference
up to the order of fp32 sums. The PyTorch form runs on the CPU, without triton, and
whenever autograd needs it (training); ``use_triton=True`` forces the kernel (tests run it
in Triton's interpreter on the CPU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # tandem runs without triton: every op takes its PyTorch form
    triton = None
    tl = None


def kernels_apply(*tensors: torch.Tensor) -> bool:
    """The Triton form applies: CUDA tensors and no gradient to record."""
    if triton is None or not all(t.is_cuda for t in tensors):
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


# ---- RMSNorm -------------------------------------------------------------------------------


def rms_norm_reference(x, weight, eps, residual=None):
    """RMSNorm in fp32, cast back to x's dtype before the weight (HF's Llama order); with
    ``residual``, normalizes ``x + residual`` and also returns that sum."""
    if residual is not None:
        x = x + residual
    x32 = x.float()
    out = weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return out if residual is None else (out, x)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    use_triton: bool | None = None,
):
    """``rms_norm_reference`` in one kernel where it applies (see the module docstring)."""
    tensors = (x, weight) if residual is None else (x, weight, residual)
    if not (kernels_apply(*tensors) if use_triton is None else use_triton) or (
        residual is not None and residual.dtype != x.dtype
    ):
        return rms_norm_reference(x, weight, eps, residual)
    shape = x.shape
    x2 = as_rows(x)
    # The reference's dtype: the weight's product with the normalized x (in x's dtype).
    out = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    summed = out if residual is None else torch.empty_like(x2)
    res2 = x2 if residual is None else as_rows(residual)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            x2,
            res2,
            weight,
            out,
            summed,
            x2.stride(0),
            res2.stride(0),
            out.stride(0),
            summed.stride(0),
            shape[-1],
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=triton.next_power_of_2(shape[-1]),
        )
    out = out.view(shape)
    return out if residual is None else (out, summed.view(shape))


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, last dim] with the last dimension contiguous (a view where possible)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


# ---- SiLU and multiply ---------------------------------------------------------------------


def silu_mul_reference(gate, up):
    """``silu(gate) * up`` (the SwiGLU MLP's middle), each rounded to the input dtype."""
    return F.silu(gate) * up


def silu_mul(gate: torch.Tensor, up: torch.Tensor, use_triton: bool | None = None):
    """``silu_mul_reference`` in one kernel where it applies. ``gate`` and ``up`` may be views
    with row strides (the two halves of one fused gate-up projection): no copy is made."""
    if not (kernels_apply(gate, up) if use_triton is None else use_triton):
        return silu_mul_reference(gate, up)
    n_cols = gate.shape[-1]
    gate2, up2 = (
        t.reshape(-1, n_cols) if t.stride(-1) == 1 else t.contiguous().view(-1, n_cols)
        for t in (gate, up)
    )
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    rows = gate2.shape[0]
    if rows and n_cols:
        block = 1024
        _silu_mul_kernel[(rows, triton.cdiv(n_cols, block))](
            gate2, up2, out, n_cols, gate2.stride(0), up2.stride(0), n_cols, BLOCK=block
        )
    return out


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(
        x_ptr,
        res_ptr,
        w_ptr,
        out_ptr,
        sum_ptr,
        stride_x,
        stride_r,
        stride_o,
        stride_s,
        n_cols,
        eps,
        HAS_RESIDUAL: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(sum_ptr.dtype.element_ty)
            tl.store(sum_ptr + row * stride_s + cols, x, mask=mask)
        x32 = x.to(tl.float32)
        variance = tl.sum(x32 * x32, axis=0) / n_cols
        normed = (x32 * tl.rsqrt(variance + eps)).to(x_ptr.dtype.element_ty)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        out = normed.to(tl.float32) * w.to(tl.float32)
        tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _silu_mul_kernel(
        gate_ptr, up_ptr, out_ptr, n_cols, stride_g, stride_u, stride_o, BLOCK: tl.constexpr
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        g = tl.load(gate_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(up_ptr + row * stride_u + cols, mask=mask, other=0.0)
        silu = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty)
        out = silu.to(tl.float32) * u.to(tl.float32)
        tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)
