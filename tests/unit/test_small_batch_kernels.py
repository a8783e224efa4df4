"""scripts/small_batch_kernels.py, norm_linear_bench.py and layer_chain_bench.py in their
smoke modes (every case once, untimed; the kernels in Triton's interpreter): the variants
they would time on a GPU give the engine's outputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_small_batch_kernels_smoke(tmp_path):
    out = tmp_path / "kernels.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    script = os.path.join(ROOT, "scripts", "small_batch_kernels.py")
    subprocess.run([sys.executable, script, str(out), "--smoke"], env=env, cwd=ROOT, check=True)
    results = json.loads(out.read_text())
    assert results["device"] == "cpu" and len(results["attention"]) == 4
    for row in results["attention"]:
        assert row["engine_splits"] == 16  # the split count the engine picks at batch 1
        assert row["max_abs_diff_splits_1"] < 1e-5 and row["max_abs_diff_splits_16"] == 0
        assert row["us_splits_1"] is None and row["us_splits_16"] is None  # untimed on the CPU
        assert row["rotating_same_caches"] and row["rotating_max_abs_diff"] < 1e-5
        assert row["us_rotating"] is None and row["us_rotate_then_attend"] is None
    assert [row["rows"] for row in results["argmax"]] == [1, 4]
    assert all(row["same_tokens"] for row in results["argmax"])
    assert all(row["same_tokens_one_launch"] for row in results["argmax"])


def test_norm_linear_bench_smoke(tmp_path):
    """scripts/norm_linear_bench.py's smoke mode: every fused op (in the interpreter) gives
    the unfused chain's output, and nothing is timed on the CPU."""
    out = tmp_path / "norm-linear.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    script = os.path.join(ROOT, "scripts", "norm_linear_bench.py")
    subprocess.run([sys.executable, script, str(out), "--smoke"], env=env, cwd=ROOT, check=True)
    runs = json.loads(out.read_text())["runs"]
    ops = {"norm+qkv", "norm+gate_up+silu", "two_norms+eh_proj"}
    assert {row["op"] for row in runs} == ops and len(runs) == 6
    for row in runs:
        assert row["max_abs_diff"] < 1e-5
        assert row["fused_us"] is None and row["unfused_us"] is None


def test_layer_chain_bench_smoke(tmp_path):
    """scripts/layer_chain_bench.py's smoke mode: the decoder-layer chain with the output
    projection by the Triton GEMM (plainly and with dependent launch) ends where the one by
    ``F.linear`` does, and nothing is timed on the CPU."""
    out = tmp_path / "layer-chain.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    script = os.path.join(ROOT, "scripts", "layer_chain_bench.py")
    subprocess.run([sys.executable, script, str(out), "--smoke"], env=env, cwd=ROOT, check=True)
    runs = json.loads(out.read_text())["runs"]
    assert [(row["rows"], row["variant"]) for row in runs] == [
        (rows, variant)
        for rows in (1, 4)
        for variant in ("cublas", "triton", "triton_pdl", "triton_pdl_no_prefetch")
    ]
    for row in runs:
        assert row["max_abs_diff"] < 1e-4 and row["us_per_layer"] is None
