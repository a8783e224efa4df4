"""Where the host's time goes in the steady state at batch 64: SmolLM2 (or MODEL) with MTP
(k = 3) and plain decoding, each with overlap, 256 ShareGPT requests submitted at once to a
64-sequence engine: one timed run, then one under cProfile (``tandem.bench.host_profile``).

Usage: python scripts/steady_host_profile.py MODEL OUT.json
"""

from __future__ import annotations

import json
import sys
import time
from functools import partial

import torch

from tandem import LLM, SamplingParams
from tandem.bench.decode_runs import steady_requests
from tandem.bench.host_profile import profile_host


def main() -> None:
    model, out = sys.argv[1], sys.argv[2]
    results = {}
    for mode in ("mtp", "plain"):
        extra = {"speculative": "mtp", "num_speculative_tokens": 3} if mode == "mtp" else {}
        llm = LLM(model=model, device="cuda", max_num_seqs=64, kv_cache_memory_gb=16, **extra)
        requests = steady_requests(llm, 256, 256)
        prompts = [{"prompt_token_ids": list(r.prompt)} for r in requests]
        params = [
            SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=r.output_len)
            for r in requests
        ]
        llm.generate(prompts[:64], params[:64], use_tqdm=False)  # warm-up
        before, start = llm.get_metrics(), time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        steps = llm.get_metrics()["num_steps"] - before["num_steps"]
        profile = profile_host(partial(llm.generate, prompts, params, use_tqdm=False), top=45)
        results[mode] = {
            "seconds": seconds,
            "steps": steps,
            "ms_per_step": 1000 * seconds / steps,
            "profile": profile,
        }
        print(mode, f"{seconds:.3f} s, {steps} steps, {1000 * seconds / steps:.2f} ms/step")
        llm.engine.shutdown()
        del llm
        torch.cuda.empty_cache()
    with open(out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
