"""On a GPU, one engine in one fresh process: does a CUDA profiler session slow the runs
after it? `bench decode`'s steady batch-64 row (512 ShareGPT requests) runs twice, then
`bench decode`'s profiled rerun of its fixed row (64 MT-Bench prompts, 256 tokens), then the
steady row twice more, then once more after a garbage collection. Each run carries
`bench decode`'s step counts (MTP: steps resolved, in graphs, host launch and wait seconds).
Run it with TEARDOWN_CUPTI=1 in the environment to see whether finalizing CUPTI at the
profiler's exit removes an after-effect.

Usage: python scripts/profiler_aftereffect_probe.py MODEL.gguf OUT.json plain|mtp"""

import gc
import json
import os
import sys

import torch

from tandem import LLM, SamplingParams
from tandem.bench.decode_runs import mtbench_prompts, profiled_generate, steady_requests, steady_run

model, out, mode = sys.argv[1], sys.argv[2], sys.argv[3]
k = 3 if mode == "mtp" else None
extra = {"speculative": "mtp", "num_speculative_tokens": k} if k else {}
llm = LLM(model=model, device="cuda", max_num_seqs=64, **extra)
fixed = mtbench_prompts(llm, 64)
greedy = SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True)
llm.generate(fixed, greedy, use_tqdm=False)  # warm-up, as bench decode's
requests = steady_requests(llm, 512, 256)
runs = []


def steady(label: str) -> None:
    run = {"label": label, **steady_run(llm, requests, 64, k, 256)}
    runs.append(run)
    print(label, round(run["tokens_per_s"], 1), run["num_steps"], flush=True)


steady("before_1")
steady("before_2")
profile = profiled_generate(llm, fixed, greedy, "cuda")
runs.append({"label": "profiled_fixed", **profile})
print("profiled", profile.get("gpu_idle_fraction"), flush=True)
steady("after_1")
steady("after_2")
gc.collect()
steady("after_gc")
with open(out, "w") as f:
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "mode": mode,
        "teardown_cupti": os.environ.get("TEARDOWN_CUPTI"),
        "runs": runs,
    }
    json.dump(result, f, indent=2)
