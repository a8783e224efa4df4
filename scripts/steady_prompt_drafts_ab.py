"""On a GPU, one process: `bench decode`'s steady batch-64 row (512 ShareGPT requests, MTP
k = 3 with overlap), prompt steps drafting at their launch against drafting at their read,
alternating, with plain decoding with overlap first. With PREFIX=bench the MTP engine first
runs what `bench decode` runs before its steady row (a warm-up of 64 MT-Bench prompts, then
the fixed row of 256 tokens with its profiled rerun), and the plain engine is dropped
without shutdown() as there. Writes JSON (each run with `bench decode`'s MTP step counts).

Usage: [PREFIX=bench] python scripts/steady_prompt_drafts_ab.py MODEL.gguf OUT.json [ROUNDS]"""

import gc
import json
import os
import sys

import torch

from tandem import LLM, SamplingParams
from tandem.bench.decode_runs import fixed_run, mtbench_prompts, steady_requests, steady_run

model, out = sys.argv[1], sys.argv[2]
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 2
bench_prefix = os.environ.get("PREFIX") == "bench"
common = {"model": model, "device": "cuda", "max_num_seqs": 64}
plain = LLM(**common)
requests = steady_requests(plain, 512, 256)
runs = [{"arm": "plain", **steady_run(plain, requests, 64, None, 256)}]
if not bench_prefix:
    plain.engine.shutdown()
del plain
gc.collect()
torch.cuda.empty_cache()
llm = LLM(**common, speculative="mtp", num_speculative_tokens=3)
if bench_prefix:
    greedy = SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True)
    llm.generate(mtbench_prompts(llm, 64), greedy, use_tqdm=False)
    runs.append({"arm": "fixed", **fixed_run(llm, 64, greedy, 3, "cuda")})
mtp = llm.engine.pipeline.mtp
at_launch = mtp.draft_at_launch
for _ in range(rounds):
    for arm in ("at_launch", "at_read"):
        mtp.draft_at_launch = at_launch if arm == "at_launch" else (lambda launched: None)
        run = steady_run(llm, requests, 64, 3, 256)
        runs.append({"arm": arm, **run})
        print(arm, round(run["tokens_per_s"], 1), run["num_steps"], flush=True)
with open(out, "w") as f:
    json.dump({"device": torch.cuda.get_device_name(), "runs": runs}, f, indent=2)
