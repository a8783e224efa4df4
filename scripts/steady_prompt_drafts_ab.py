"""On a GPU, one process: `bench decode`'s steady batch-64 row (512 ShareGPT requests, MTP
k = 3 with overlap), prompt steps drafting at their launch against drafting at their read,
alternating, with plain decoding with overlap first. Writes JSON (each run with `bench
decode`'s MTP step counts).

Usage: python scripts/steady_prompt_drafts_ab.py MODEL.gguf OUT.json [ROUNDS]"""

import gc
import json
import sys

import torch

from tandem import LLM
from tandem.bench.decode_runs import steady_requests, steady_run

model, out = sys.argv[1], sys.argv[2]
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 2
common = {"model": model, "device": "cuda", "max_num_seqs": 64}
plain = LLM(**common)
requests = steady_requests(plain, 512, 256)
runs = [{"arm": "plain", **steady_run(plain, requests, 64, None, 256)}]
plain.engine.shutdown()
del plain
gc.collect()
torch.cuda.empty_cache()
llm = LLM(**common, speculative="mtp", num_speculative_tokens=3)
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
