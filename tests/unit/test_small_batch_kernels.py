"""scripts/small_batch_kernels.py in its smoke mode (every case once, untimed; the attention
in Triton's interpreter): the variants it would time on a GPU give the engine's outputs."""

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
