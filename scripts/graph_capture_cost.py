"""What the ragged graphs cost at start: seconds and device memory to capture them (and the
head's prompt-draft graphs over the same sizes, where the model has a one-layer MTP head),
per token budget (``max_num_batched_tokens``), each budget in a fresh process. Timers wrap
the ``capture`` methods; memory is ``torch.cuda.memory_reserved`` before and after each
(the graphs' pool and their kept outputs), beside the whole engine's construction time;
with a proposer, the resolved MTP steps' graphs too (``--speculative oracle`` for a dummy
model without a head).

Usage (on a GPU): python3 scripts/graph_capture_cost.py OUT.json MODEL [--tokens 2048,16384]
[--speculative mtp|oracle] [--num-speculative-tokens 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def measure(model: str, tokens: int, speculative: str | None, k: int) -> dict:
    """Builds one engine on CUDA at ``tokens`` a step; returns the captures' costs."""
    import torch

    from tandem import LLM
    from tandem.worker.ragged_graphs import RaggedGraphRunner
    from tandem.worker.spec_decode.prompt_draft_graphs import PromptDraftGraphs
    from tandem.worker.spec_decode.step_graphs import ResolvedStepGraphs

    costs: dict[str, dict] = {}

    def timed(cls, name: str):
        capture = cls.capture

        def wrapper(self):
            torch.cuda.synchronize()
            reserved, start = torch.cuda.memory_reserved(), time.perf_counter()
            capture(self)
            torch.cuda.synchronize()
            costs[name] = {
                "seconds": time.perf_counter() - start,
                "reserved_bytes": torch.cuda.memory_reserved() - reserved,
                "graphs": len(self.graphs),
            }

        cls.capture = wrapper

    timed(RaggedGraphRunner, "ragged")
    timed(PromptDraftGraphs, "prompt_drafts")
    timed(ResolvedStepGraphs, "step_graphs")
    start = time.perf_counter()
    options = {"num_speculative_tokens": k} if speculative else {}
    LLM(
        model,
        device="cuda",
        speculative=speculative,
        max_num_batched_tokens=tokens,
        kv_cache_memory_gb=16,
        **options,
    )
    torch.cuda.synchronize()
    return {
        "max_num_batched_tokens": tokens,
        "engine_seconds": time.perf_counter() - start,
        "captures": costs,
        "reserved_bytes": torch.cuda.memory_reserved(),
        "gpu": torch.cuda.get_device_name(),
        "torch_version": torch.__version__,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("model")
    parser.add_argument("--tokens", default="2048,16384")
    parser.add_argument("--speculative", default=None)
    parser.add_argument("--num-speculative-tokens", type=int, default=3)
    parser.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one is not None:  # the child: one budget, its result in OUT.json.TOKENS
        result = measure(args.model, args.one, args.speculative, args.num_speculative_tokens)
        with open(f"{args.out}.{args.one}", "w") as f:
            json.dump(result, f)
        return
    rows = []
    for tokens in [int(t) for t in args.tokens.split(",")]:
        child = [sys.executable, __file__, args.out, args.model, "--one", str(tokens)]
        if args.speculative:
            child += ["--speculative", args.speculative]
            child += ["--num-speculative-tokens", str(args.num_speculative_tokens)]
        subprocess.run(child, check=True)
        with open(f"{args.out}.{tokens}") as f:
            rows.append(json.load(f))
        os.remove(f"{args.out}.{tokens}")
        print(json.dumps(rows[-1]), flush=True)
    config = {"model": args.model, "speculative": args.speculative}
    if args.speculative:
        config["num_speculative_tokens"] = args.num_speculative_tokens
    with open(args.out, "w") as f:
        json.dump({"config": config, "runs": rows}, f, indent=1)


if __name__ == "__main__":
    main()
