"""Where the host is while the GPU waits at batch 1: SmolLM2 (or MODEL) with MTP (k = 3) and
with plain decoding, each with overlap, MT-Bench questions one at a time. Per mode: a
warm-up, the questions timed, then the first ``--profiled`` of them again (shorter:
``--profiled-max-tokens``) under ``torch.profiler`` with the CPU and CUDA activities and
Python stacks, read by
``tandem.bench.timeline`` (each gap over 8 µs inside a question: what the host ran during
it and which code launched the op that ended it; each question's host time before its first
device op and after its last). The stacks slow the host, so the gaps' shares matter, not
their sizes; the timed questions give the unprofiled seconds beside them.

Usage: python scripts/question_timeline.py MODEL OUT_DIR [--questions 16] [--profiled 2]
[--profiled-max-tokens 64] [--modes mtp,plain] [--max-tokens 256] [--trace] [--device cuda]
[--speculative-model M]
(``--trace``: also the gzipped traces; on the CPU the trace has no device ops to read)
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import time

import torch

from tandem import LLM, SamplingParams
from tandem.bench.decode_runs import mtbench_prompts
from tandem.bench.timeline import read_timeline
from tandem.bench.timing import sync_device


def _profiled(llm, prompts, params, trace_path: str, device: str) -> dict:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    activities += [ProfilerActivity.CUDA] if device.startswith("cuda") else []
    sync_device(device)
    with profile(activities=activities, with_stack=True) as p:
        for prompt in prompts:
            llm.generate([prompt], params, use_tqdm=False)
        sync_device(device)
    p.export_chrome_trace(trace_path)
    with open(trace_path) as f:
        return read_timeline(json.load(f))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("out_dir")
    parser.add_argument("--questions", type=int, default=16)
    parser.add_argument("--profiled", type=int, default=2)
    # Python stacks make big traces: the profiled questions run shorter (their start, end
    # and a few dozen steps between).
    parser.add_argument("--profiled-max-tokens", type=int, default=64)
    parser.add_argument("--modes", default="mtp,plain")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--trace", action="store_true")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--speculative-model", default=None)
    args = parser.parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.max_tokens)
    results: dict = {"config": vars(args)}
    for mode in args.modes.split(","):
        extra: dict = {}
        if mode == "mtp":
            extra.update(speculative="mtp", num_speculative_tokens=3)
            extra.update(speculative_model=args.speculative_model)
        if args.device.startswith("cuda"):
            extra["kv_cache_memory_gb"] = 16
        llm = LLM(model=args.model, device=args.device, max_num_seqs=1, **extra)
        prompts = mtbench_prompts(llm, args.questions)
        for prompt in prompts[:4]:  # warm-up
            llm.generate([prompt], params, use_tqdm=False)
        seconds = []
        for prompt in prompts:
            start = time.perf_counter()
            llm.generate([prompt], params, use_tqdm=False)
            sync_device(args.device)
            seconds.append(time.perf_counter() - start)
        trace = os.path.join(args.out_dir, f"timeline-{mode}.json")
        short = SamplingParams(
            temperature=0.0, ignore_eos=True, max_tokens=args.profiled_max_tokens
        )
        reading = _profiled(llm, prompts[: args.profiled], short, trace, args.device)
        results[mode] = {"question_seconds": seconds, "profiled": reading}
        if args.trace:
            with open(trace, "rb") as src, gzip.open(trace + ".gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
        os.remove(trace)
        requests = reading["requests"]
        print(mode, f"{sum(seconds):.3f} s over {len(seconds)} questions;", "profiled:", requests)
        print(" gaps by launcher:", reading["gap_us_by_launcher"][:8])
        print(" host calls:", reading["host_calls"][:8])
        llm.engine.shutdown()
        del llm
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    with open(os.path.join(args.out_dir, "question-timeline.json"), "w") as f:
        json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
