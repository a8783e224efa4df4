"""How many MTP steps wait for the read of the step in front with a part of their own (a
host bubble on a GPU), on the CPU: MT-Bench prompts through ``dummy:tiny`` with a random
head, k = 2, overlap on, as a model whose steps go in parts (``split_steps``, under 2 GiB of
weights) and as one whose steps go whole (over 2 GiB); a fresh engine per case (no prefix
hits from another). Counts, not times: which steps the pipeline launches before the read.
The staggered cases end their requests at different steps (max_tokens from half the case's
to the whole), so new prompts join while others decode, as in a steady state.

Usage: .venv/bin/python scripts/parts_after_read.py OUT.json
"""

from __future__ import annotations

import json
import subprocess
import sys

from tandem import LLM, SamplingParams
from tandem.bench.decode_runs import mtbench_prompts

# (name, split_steps, prompts, max_num_seqs, max_num_batched_tokens, max_tokens, staggered)
CASES = (
    ("whole, 64 prompts, first token only", False, 64, 64, 2048, 1, False),
    ("whole, 64 prompts, 64 tokens", False, 64, 64, 2048, 64, False),
    (
        "in parts, 64 prompts, 16 at a time, 256-token steps, 32 tokens",
        True,
        64,
        16,
        256,
        32,
        False,
    ),
    (
        "whole, 64 prompts, 16 at a time, 256-token steps, 16-32 tokens",
        False,
        64,
        16,
        256,
        32,
        True,
    ),
)


def count(
    split_steps: bool, num_prompts: int, seqs: int, budget: int, tokens: int, staggered: bool
) -> dict:
    llm = LLM(
        "dummy:tiny",
        device="cpu",
        speculative="mtp",
        num_speculative_tokens=2,
        speculative_model="dummy",
        max_num_seqs=seqs,
        max_num_batched_tokens=budget,
    )
    pipeline = llm.engine.pipeline
    pipeline.split_steps = split_steps
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=tokens - (i % 8) * tokens // 16 if staggered else tokens,
            ignore_eos=True,
        )
        for i in range(num_prompts)
    ]
    llm.generate(mtbench_prompts(llm, num_prompts), params, use_tqdm=False)
    return {
        "steps": llm.get_metrics()["num_steps"],
        "steps_with_a_part_after_the_read": pipeline.num_parts_after_read,
        "steps_with_prompts_ahead": pipeline.num_prompts_ahead,
        "steps_with_resolved_rows_ahead": pipeline.num_launched_ahead,
        # Steps of resolved rows and prompt chunks in one forward (none before 6420e3d).
        "steps_mixed": getattr(pipeline, "num_mixed_steps", 0),
    }


def main() -> None:
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    results = {"commit": commit, "cases": []}
    for name, *case in CASES:
        results["cases"].append({"case": name, **count(*case)})
        print(json.dumps(results["cases"][-1]), flush=True)
    with open(sys.argv[1], "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
