"""Where the host's time goes in MTP launches: wraps the step pipeline's launch and read
methods with timers, runs ``tandem.cli`` with the given arguments in this process, and
prints each method's summed seconds, calls and mean at the end (nested methods count in
their callers too).

Usage (on the GPU machine): python3 scripts/host_sections.py bench decode --device cuda ...
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict

from tandem.cli import main as cli_main
from tandem.worker import step_pipeline
from tandem.worker.spec_decode import mtp_steps, uniform_step

SECTIONS = (
    (step_pipeline.StepPipeline, "_launch_mixed"),
    (step_pipeline.StepPipeline, "_prepare_ragged"),
    (step_pipeline.StepPipeline, "_finish_ragged"),
    (step_pipeline.StepPipeline, "_resolved_part"),
    (step_pipeline.StepPipeline, "read"),
    (step_pipeline, "forward_mixed"),
    (mtp_steps.MTPSteps, "mixed_inputs"),
    (mtp_steps.MTPSteps, "finish_mixed"),
    (mtp_steps.MTPSteps, "draft_at_launch"),
    (mtp_steps.MTPSteps, "launch_resolved"),
    (mtp_steps.MTPSteps, "after_read"),
    (uniform_step, "sample_step"),
    (uniform_step, "accept"),
)


def main(argv: list[str]) -> int:
    totals: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)

    def timed(owner, name: str) -> None:
        original, label = getattr(owner, name), name.lstrip("_")

        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                totals[label] += time.perf_counter() - start
                counts[label] += 1

        setattr(owner, name, wrapper)

    for owner, name in SECTIONS:
        timed(owner, name)
    code = cli_main(argv)
    for label in sorted(totals, key=totals.get, reverse=True):
        ms, calls = totals[label] * 1e3, counts[label]
        print(f"{label:18s} {ms:10.1f} ms  {calls:6d} calls  {ms / calls:8.3f} ms each")
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
