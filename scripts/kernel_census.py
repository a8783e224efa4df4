"""The kernels of a decode step on a GPU: per mode, how many kernels a step launches (by
name, with their mean duration), the device's busy time per step, and the gaps between
consecutive kernels by length (the spacing a CUDA graph leaves between kernels it launches
back to back, against longer waits for the host).

Modes: ``overlap`` (plain decoding; also records greedy outputs for the oracle),
``mtp+overlap`` (the model's MTP head, k = ``--k``, default 3) and ``oracle:RATE`` (the
oracle proposer, k = ``--k``, replaying the ``overlap`` run's recordings; list ``overlap``
first). Each mode decodes BATCH MT-Bench prompts for TOKENS tokens: once to warm up, once
timed, once profiled; the first tenth of the profiled kernels (the prefill) is left out of
the per-step numbers.

Usage: python scripts/kernel_census.py MODEL OUT.json --batch 1 --tokens 128 \
           --modes overlap,mtp+overlap
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from tandem import LLM, SamplingParams
from tandem.bench.datasets import load_mtbench
from tandem.bench.device_profile import device_events

K = 3
GAP_BUCKETS_US = ((1.5, "<=1.5us"), (3.0, "1.5-3us"), (8.0, "3-8us"), (50.0, "8-50us"))


def _engine(model: str, mode: str, batch: int, k: int = K) -> LLM:
    options = {"model": model, "device": "cuda", "max_num_seqs": max(8, batch)}
    if mode.startswith("mtp"):
        options.update(speculative="mtp", num_speculative_tokens=k)
    elif mode.startswith("oracle:"):
        rate = float(mode.split(":")[1])
        options.update(speculative="oracle", num_speculative_tokens=k, oracle_corruption=rate)
    return LLM(kv_cache_memory_gb=8, **options)


def _gap_bucket(gap_us: float) -> str:
    for bound, name in GAP_BUCKETS_US:
        if gap_us <= bound:
            return name
    return ">50us"


def census(llm: LLM, prompts: list[dict], tokens: int) -> dict:
    """Time one generate, then profile another: the per-step numbers of the module doc."""
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)
    first = llm.get_metrics()
    torch.cuda.synchronize()
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    timed = llm.get_metrics()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
    steps = (llm.get_metrics()["num_steps"] - timed["num_steps"]) * 0.9
    events = sorted(device_events(prof), key=lambda event: event[2])
    events = events[len(events) // 10 :]
    by_name: dict[str, list] = defaultdict(lambda: [0, 0.0])
    gap_counts: dict[str, float] = defaultdict(float)
    gap_us: dict[str, float] = defaultdict(float)
    for i, (name, _, begin, end) in enumerate(events):
        by_name[name][0] += 1
        by_name[name][1] += end - begin
        if i:
            gap = max(begin - events[i - 1][3], 0.0)
            gap_counts[_gap_bucket(gap)] += 1 / steps
            gap_us[_gap_bucket(gap)] += gap / steps
    drafts = timed.get("spec_decode_num_drafts", 0) - first.get("spec_decode_num_drafts", 0)
    accepted = timed.get("spec_decode_num_accepted_tokens", 0)
    accepted -= first.get("spec_decode_num_accepted_tokens", 0)
    ranked = sorted(by_name.items(), key=lambda item: -item[1][1])
    return {
        "tokens_per_s": len(prompts) * tokens / seconds,
        "wall_ms_per_step": 1000 * seconds / (timed["num_steps"] - first["num_steps"]),
        "acceptance_length": 1 + accepted / drafts if drafts else None,
        "kernels_per_step": len(events) / steps,
        "window_ms_per_step": (events[-1][3] - events[0][2]) / 1000 / steps,
        "busy_ms_per_step": sum(end - begin for _, _, begin, end in events) / 1000 / steps,
        "gap_counts_per_step": dict(gap_counts),
        "gap_us_per_step": dict(gap_us),
        "kernels": [
            {"name": name[:120], "per_step": count / steps, "mean_us": us / count}
            for name, (count, us) in ranked[:60]
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model")
    parser.add_argument("out")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--modes", default="overlap,mtp+overlap")
    parser.add_argument("--k", type=int, default=K, help="draft tokens per step (default 3)")
    args = parser.parse_args()
    questions = load_mtbench()
    results: dict = {"model": args.model, "batch": args.batch, "tokens": args.tokens, "k": args.k}
    recordings = None
    for mode in args.modes.split(","):
        llm = _engine(args.model, mode, args.batch, args.k)
        prompts = [
            {
                "prompt_token_ids": llm.tokenizer.apply_chat_template(
                    [{"role": "user", "content": q}]
                )
            }
            for q in (questions[i % len(questions)]["turns"][0] for i in range(args.batch))
        ]
        if mode == "overlap":
            longer = SamplingParams(
                temperature=0.0, max_tokens=args.tokens + args.k, ignore_eos=True
            )
            outputs = llm.generate(prompts, longer, use_tqdm=False)
            recordings = {
                tuple(p["prompt_token_ids"]): o.outputs[0].token_ids
                for p, o in zip(prompts, outputs, strict=True)
            }
        elif mode.startswith("oracle:"):
            if recordings is None:
                raise SystemExit("list the overlap mode before an oracle mode")
            llm.engine.runner.proposer.set_recordings(recordings)
        run = census(llm, prompts, args.tokens)
        results[mode] = run
        summary = {key: value for key, value in run.items() if key != "kernels"}
        print(mode, json.dumps(summary), flush=True)
        for kernel in run["kernels"][:25]:
            print(
                f"  {kernel['per_step']:7.2f}x {kernel['mean_us']:8.2f} us  {kernel['name'][:90]}"
            )
        llm.engine.shutdown()
        del llm
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
