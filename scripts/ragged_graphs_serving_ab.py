"""The ragged steps' CUDA graphs on `bench decode`'s batch-64 rows, in one process: SmolLM2's
real weights, plain decoding with overlap, then MTP (the shipped head, k = 3) with overlap.
Each engine runs the fixed row (64 MT-Bench first turns, 256 tokens each) and the steady
row (512 ShareGPT requests at once, the dataset's lengths capped at 256) with its ragged
graphs on, then off, twice (``tandem/bench/decode_runs.py``; greedy, ``ignore_eos``).

Usage: python scripts/ragged_graphs_serving_ab.py MODEL.gguf OUT.json
"""

from __future__ import annotations

import argparse
import gc
import json

import torch

from tandem import LLM, SamplingParams
from tandem.bench.decode_runs import fixed_run, steady_requests, steady_run

MODES = {
    "overlap": {},
    "mtp+overlap": {"speculative": "mtp", "num_speculative_tokens": 3},
}
FIELDS = ("kind", "tokens_per_s", "num_steps", "seconds", "mean_acceptance_length")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("out")
    args = parser.parse_args()
    results: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    for mode, options in MODES.items():
        llm = LLM(
            model=args.model,
            device="cuda",
            max_num_seqs=64,
            overlap=True,
            kv_cache_memory_gb=16,
            **options,
        )
        k = options.get("num_speculative_tokens")
        params = SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True)
        requests = steady_requests(llm, 512, 256)
        graphs = llm.engine.runner.ragged_graphs
        warmup = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        fixed_run(llm, 64, warmup, k, "cpu")  # "cpu": no profiled rerun
        for rep in range(2):
            for on in (True, False):
                llm.engine.runner.ragged_graphs = graphs if on else None
                for run in (
                    fixed_run(llm, 64, params, k, "cpu"),
                    steady_run(llm, requests, 64, k, 256),
                ):
                    row = {
                        "mode": mode,
                        "ragged": on,
                        "rep": rep,
                        **{f: run.get(f) for f in FIELDS},
                    }
                    results["rows"].append(row)
                    print(row, flush=True)
        llm.engine.runner.ragged_graphs = graphs
        llm.engine.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
