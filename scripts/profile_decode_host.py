"""Where the host's time goes in steady decoding: one engine per mode (plain decoding with
overlap, MTP k=3 with overlap), BATCH prompts decoded for TOKENS tokens under cProfile, and
the functions with the most own time per engine step (Tandem's, then torch's and others').

Usage: python scripts/profile_decode_host.py --device cuda --batch-sizes 1,64 --tokens 256
(prints a table per run and writes the rows as JSON with --out).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import time

from tandem import LLM, SamplingParams
from tandem.bench.datasets import load_mtbench
from tandem.bench.device_profile import profile_generate


def _rows(stats: pstats.Stats, steps: int, top: int) -> list[dict]:
    ranked = sorted(stats.stats.items(), key=lambda item: item[1][2], reverse=True)
    return [
        {
            "function": f"{path.split('tandem/')[-1]}:{line}({name})",
            "calls_per_step": round(calls[1] / steps, 2),
            "own_ms_per_step": round(1000 * calls[2] / steps, 4),
            "cumulative_ms_per_step": round(1000 * calls[3] / steps, 4),
        }
        for (path, line, name), calls in ranked[:top]
    ]


def profile_run(llm: LLM, batch: int, tokens: int, top: int, device_top: int = 0) -> dict:
    """One profiled generate of ``batch`` MT-Bench prompts, ``tokens`` tokens each."""
    questions = load_mtbench()
    prompts = [
        {
            "prompt_token_ids": llm.tokenizer.apply_chat_template(
                [{"role": "user", "content": questions[i % len(questions)]["turns"][0]}]
            )
        }
        for i in range(batch)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    before = llm.get_metrics()
    profiler = cProfile.Profile()
    started = time.perf_counter()
    profiler.enable()
    llm.generate(prompts, params, use_tqdm=False)
    profiler.disable()
    wall = time.perf_counter() - started
    steps = llm.get_metrics()["num_steps"] - before["num_steps"]
    stats = pstats.Stats(profiler)
    run = {
        "batch": batch,
        "wall_s": wall,
        "steps": steps,
        "profiled_ms_per_step": 1000 * wall / steps,
        "by_own_time": _rows(stats, steps, top),
    }
    if device_top:  # the same run under the CUDA profiler: device ops per step
        device = str(llm.engine.runner.device)
        before = llm.get_metrics()["num_steps"]
        profiled = profile_generate(llm, prompts, params, device, top=device_top)
        steps = llm.get_metrics()["num_steps"] - before
        run["device_busy_ms_per_step"] = profiled.get("busy_us", 0) / 1000 / steps
        run["device_window_ms_per_step"] = profiled.get("window_us", 0) / 1000 / steps
        run["device_ops"] = [
            {**op, "us_per_step": op["total_us"] / steps} for op in profiled.get("top", [])
        ]
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch-sizes", default="1,64")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--top", type=int, default=45)
    parser.add_argument("--modes", default="overlap,mtp+overlap")
    parser.add_argument("--device-top", type=int, default=0, help="device ops to list (CUDA)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    batches = [int(b) for b in args.batch_sizes.split(",")]
    results = []
    for mode in args.modes.split(","):
        extra = {"speculative": "mtp", "num_speculative_tokens": 3} if "mtp" in mode else {}
        llm = LLM(device=args.device, max_num_seqs=max(batches), overlap=True, **extra)
        for batch in batches:
            run = {"mode": mode, **profile_run(llm, batch, args.tokens, args.top, args.device_top)}
            results.append(run)
            print(f"== {mode} batch {batch}: {run['profiled_ms_per_step']:.3f} ms/step profiled")
            for row in run["by_own_time"]:
                print(
                    f"{row['own_ms_per_step']:8.3f} own {row['cumulative_ms_per_step']:8.3f} cum"
                    f" {row['calls_per_step']:7.2f}/step  {row['function']}"
                )
            if "device_ops" in run:
                print(
                    f"-- device busy {run['device_busy_ms_per_step']:.3f} ms/step of a window"
                    f" of {run['device_window_ms_per_step']:.3f}"
                )
                for op in run["device_ops"]:
                    print(f"{op['us_per_step']:9.2f} us/step {op['count']:6d}x  {op['name'][:90]}")
        llm.engine.shutdown()
        del llm
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
