"""The fused norm+linear and SiLU+linear kernels against their PyTorch references, in
Triton's interpreter on the CPU (fp32 and fp16; bf16 on the GPU)."""

import pytest
import torch

from tandem.layers import skinny_linear

pytestmark = pytest.mark.skipif(skinny_linear.triton is None, reason="needs triton")
TOLERANCE = {
    torch.float32: {"rtol": 1e-5, "atol": 1e-5},
    torch.float16: {"rtol": 2e-3, "atol": 2e-3},
}


def _tensors(rows, k_in, n_out, dtype, seed):
    generator = torch.Generator().manual_seed(seed)

    def draw(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=generator)).to(dtype)

    return {
        "x": draw(rows, k_in),
        "residual": draw(rows, k_in),
        "norm_weight": (1 + 0.1 * torch.randn(k_in, generator=generator)).to(dtype),
        "weight": draw(n_out, k_in, scale=k_in**-0.5),
        "bias": draw(n_out),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [1, 4, 16])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_norm_linear(dtype, rows, with_residual, with_bias):
    # 100 input columns: not a multiple of the kernel's K tile; 40 outputs: not of its N tile.
    t = _tensors(rows, 100, 40, dtype, seed=rows)
    residual = t["residual"] if with_residual else None
    bias = t["bias"] if with_bias else None
    args = (t["x"], t["norm_weight"], 1e-5, t["weight"], bias, residual)
    got = skinny_linear.norm_linear(*args, use_triton=True)
    expected = skinny_linear.norm_linear_reference(*args)
    if not with_residual:
        got, expected = (got,), (expected,)
    for g, e in zip(got, expected, strict=True):
        assert g.dtype == dtype and g.shape == e.shape
        torch.testing.assert_close(g, e, **TOLERANCE[dtype])
    if with_residual:  # the residual stream's new value is the sum, rounded, exactly
        assert torch.equal(got[1], t["x"] + residual)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_silu_mul_linear(dtype, rows):
    t = _tensors(rows, 2 * 72, 24, dtype, seed=100 + rows)
    weight = t["weight"][:, :72].contiguous()
    got = skinny_linear.silu_mul_linear(t["x"], weight, use_triton=True)
    expected = skinny_linear.silu_mul_linear_reference(t["x"], weight)
    assert got.shape == (rows, 24)
    torch.testing.assert_close(got, expected, **TOLERANCE[dtype])


def test_a_row_does_not_depend_on_the_rows_beside_it():
    """Plain decoding runs one row where the verification runs four: a row's output must be
    the same bits either way, or greedy MTP could part from plain decoding."""
    t = _tensors(9, 80, 48, torch.float32, seed=7)
    args = (t["norm_weight"], 1e-5, t["weight"])
    together = skinny_linear.norm_linear(t["x"], *args, use_triton=True)
    for row in range(9):
        alone = skinny_linear.norm_linear(t["x"][row : row + 1], *args, use_triton=True)
        assert torch.equal(alone[0], together[row])


def test_the_rule_for_when_the_kernels_apply():
    x = torch.randn(4, 8)
    weight = torch.randn(8, 8)
    assert not skinny_linear.fused_linear_applies(x, weight)  # CPU tensors
    out = skinny_linear.norm_linear(x, torch.ones(8), 1e-5, weight)  # the reference form
    torch.testing.assert_close(
        out, skinny_linear.norm_linear_reference(x, torch.ones(8), 1e-5, weight)
    )


def test_a_misfitting_weight_is_refused():
    x = torch.randn(2, 10)
    with pytest.raises(ValueError, match="does not fit"):
        skinny_linear.silu_mul_linear(x, torch.randn(4, 10), use_triton=True)
