"""scripts/ragged_padding.py on a few ShareGPT requests: every mode's ragged forwards are
noted, the oracle runs follow their recordings, and the sizes four a doubling pad no more
than the powers of two did."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_ragged_padding_counts_every_modes_ragged_forwards(tmp_path):
    out = tmp_path / "padding.json"
    script = os.path.join(ROOT, "scripts", "ragged_padding.py")
    args = [sys.executable, script, str(out), "--requests", "12", "--max-tokens", "24"]
    subprocess.run([*args, "--batch", "4"], cwd=ROOT, check=True, capture_output=True)
    results = json.loads(out.read_text())
    assert [mode["mode"] for mode in results["modes"]] == [
        "plain, overlap",
        "oracle k = 1, overlap",
        "oracle k = 2, overlap",
    ]
    for mode in results["modes"]:
        counts = mode["token_counts"]
        assert mode["ragged_forwards"] == len(counts) > 0 and min(counts) > 0
        before, now = mode["padding"].values()
        assert before["real_tokens"] == now["real_tokens"] == sum(counts)
        assert now["real_tokens"] <= now["padded_tokens"] <= before["padded_tokens"]
        assert now["graphs"] == 20 and before["graphs"] == 8
    for mode in results["modes"][1:]:
        assert mode["recording_match"] == 1.0
    k2 = results["modes"][2]
    assert k2["mean_acceptance_length"] == 3.0  # rate 0: every draft accepted
