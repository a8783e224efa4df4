"""The one-launch argmax against torch's ``argmax(dim=-1)``, in Triton's interpreter on the
CPU (compiled on a GPU): ties (the first index wins, within a lane's columns and across
lanes), NaN (the first NaN wins), rows of -inf, widths past one block, every float dtype."""

import pytest
import torch

from tandem.layers import argmax

pytestmark = pytest.mark.skipif(argmax.triton is None, reason="needs triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n_cols", [7, 1000, 20_011])  # one partial block, three blocks
def test_random_rows_with_ties_nan_and_minus_infinity(dtype, n_cols):
    gen = torch.Generator().manual_seed(n_cols)
    logits = torch.randn(6, n_cols, generator=gen).to(dtype)
    top = logits.max() + 1
    logits[1, [n_cols - 1, n_cols // 2, 3 % n_cols]] = top  # a tie: the first index wins
    logits[2, :] = 0.0  # every column ties
    logits[3, :] = float("-inf")
    logits[4, [n_cols - 1, n_cols // 3]] = float("nan")  # the first NaN wins
    logits[5, n_cols // 2] = float("inf")
    logits = logits.to(DEVICE)
    got = argmax.argmax_rows(logits, use_triton=True)
    assert got.dtype == torch.int64
    assert got.tolist() == logits.argmax(dim=-1).tolist()


def test_lanes_tie_across_blocks():
    """The same maximum in two blocks at the same lane, and at an earlier lane later on:
    the smallest index wins, not the first block's lane."""
    width = 3 * 8192
    logits = torch.zeros(2, width, device=DEVICE)
    logits[0, [8192 + 5, 2 * 8192 + 4]] = 1.0
    logits[1, [2 * 8192 + 5, 8192 + 9]] = 1.0
    assert argmax.argmax_rows(logits, use_triton=True).tolist() == [8192 + 5, 8192 + 9]


def test_other_shapes_and_devices_take_torch_argmax():
    logits = torch.randn(3, 4, 50)
    assert torch.equal(argmax.argmax_rows(logits), logits.argmax(dim=-1))
    assert argmax.argmax_rows(torch.empty(0, 5), use_triton=True).shape == (0,)
    with pytest.raises(ValueError, match="without columns"):
        argmax.argmax_rows(torch.empty(2, 0), use_triton=True)
