"""``scripts/gemm_triton_rows.py``'s two Triton GEMMs (pointer loads, tensor descriptors)
equal ``F.linear`` on a small shape whose rows do not fill their tile (Triton's interpreter
on the CPU), so a GPU lease spends its time on the timings, not on a broken kernel."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("kind", ["pointer", "tma"])
def test_the_triton_gemms_equal_f_linear(kind):
    spec = importlib.util.spec_from_file_location(
        "gemm_triton_rows", os.path.join(ROOT, "scripts", "gemm_triton_rows.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # On a GPU in bf16, the script's dtype (fp32 there would multiply in TF32).
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(70, 128, generator=generator).to(device, dtype)
    w = torch.randn(192, 128, generator=generator).to(device, dtype)
    config = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64}
    got = module.triton_linear(kind, x, w, config)
    assert got.shape == (70, 192)
    tolerance = 5e-2 if cuda else 1e-3
    torch.testing.assert_close(got, F.linear(x, w), rtol=tolerance, atol=tolerance)
    assert module.configs() and all(c["BLOCK_M"] in (64, 128) for c in module.configs())
