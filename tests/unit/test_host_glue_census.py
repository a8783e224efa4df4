"""scripts/host_glue_census.py on the tiny dummy model: the GPU's graph path simulated on the
CPU (graph functions run eagerly, left out of the glue), both step kinds launched and
measured."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_host_glue_census_measures_both_step_kinds(tmp_path):
    out = tmp_path / "glue.json"
    script = os.path.join(ROOT, "scripts", "host_glue_census.py")
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    args = [sys.executable, script, str(out), "--requests", "2", "--max-tokens", "8"]
    subprocess.run(args, env=env, cwd=ROOT, check=True, capture_output=True)
    kinds = json.loads(out.read_text())["kinds"]
    assert set(kinds) == {"prompt", "resolved"}
    assert kinds["prompt"]["launches"] == 2  # one joining prompt a request
    assert kinds["resolved"]["launches"] >= 2  # its later steps resolved on the device
    for kind in kinds.values():
        assert kind["glue_us_per_launch"] > 0 and kind["ops_per_launch"] > 0
    # A prompt launch builds its step from the host; a resolved one only fills the graph's
    # slot ids and block tables.
    assert kinds["prompt"]["ops_per_launch"] > kinds["resolved"]["ops_per_launch"]
    # Named parts, each timed less the graphs inside it: a prompt's forward and drafting,
    # a resolved step's launch; a part nested in another costs no more than it.
    prompt_parts = kinds["prompt"]["parts_us_per_launch"]
    assert prompt_parts["ModelRunner.forward"] > 0
    assert 0 < prompt_parts["PromptDraftGraphs.propose"] <= prompt_parts["MTPSteps.draft_at_launch"]
    assert kinds["resolved"]["parts_us_per_launch"]["MTPSteps.launch_resolved"] > 0
