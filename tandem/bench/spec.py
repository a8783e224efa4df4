"""``tandem bench spec``: MTP acceptance on the MT-Bench questions (never used in training)
and tokens/s against no speculation, at given batch sizes."""

from __future__ import annotations

import os

from tandem.bench.datasets import load_mtbench
from tandem.bench.results import result_path, write_json
from tandem.bench.timing import timed_generate


def _prompts(tokenizer, num_questions: int) -> list[dict]:
    questions = load_mtbench()[:num_questions]
    return [
        {
            "prompt_token_ids": tokenizer.apply_chat_template(
                [{"role": "user", "content": q["turns"][0]}]
            )
        }
        for q in questions
    ]


def acceptance(before: dict, after: dict, k: int) -> dict:
    """Mean acceptance length (1 + accepted per draft run) and per-position rates."""
    drafts = after["spec_decode_num_drafts"] - before["spec_decode_num_drafts"]
    accepted = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
    per_pos = [
        a - b
        for a, b in zip(
            after["spec_decode_num_accepted_tokens_per_pos"],
            before["spec_decode_num_accepted_tokens_per_pos"],
            strict=True,
        )
    ]
    return {
        "num_drafts": drafts,
        "num_accepted_tokens": accepted,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
        "acceptance_rate_per_position": [p / drafts if drafts else None for p in per_pos[:k]],
    }


def run_spec_bench(
    model,
    head,
    k: int,
    batch_sizes: list[int],
    num_questions: int,
    max_tokens: int,
    device: str,
    dtype: str | None,
    out_dir: str | None,
) -> dict:
    """Greedy MT-Bench runs with and without MTP; returns and writes the results."""
    from tandem import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    common = {"model": model, "device": device, "dtype": dtype, "max_num_seqs": max(batch_sizes)}
    results: dict = {
        "config": {
            "model": model,
            "head": head,
            "k": k,
            "device": device,
            "dtype": dtype,
            "num_questions": num_questions,
            "max_tokens": max_tokens,
        },
        "runs": [],
    }
    base = LLM(**common)
    prompts = _prompts(base.tokenizer, num_questions)
    timed_generate(base, prompts[:2], params, 2)  # warm-up
    baseline = {b: timed_generate(base, prompts, params, b) for b in batch_sizes}
    del base
    spec = LLM(**common, speculative="mtp", num_speculative_tokens=k, speculative_model=head)
    timed_generate(spec, prompts[:2], params, 2)
    for batch_size in batch_sizes:
        before = spec.get_metrics()
        seconds, tokens = timed_generate(spec, prompts, params, batch_size)
        base_seconds, base_tokens = baseline[batch_size]
        results["runs"].append(
            {
                "batch_size": batch_size,
                "tokens_per_s": tokens / seconds,
                "baseline_tokens_per_s": base_tokens / base_seconds,
                "speedup": (tokens / seconds) / (base_tokens / base_seconds),
                **acceptance(before, spec.get_metrics(), k),
            }
        )
    if out_dir:
        path = result_path(out_dir, f"spec-mtbench-k{k}-{device.split(':')[0]}")
        write_json(results, path)
        results["output_path"] = path
    for run in results["runs"]:
        print(
            f"batch {run['batch_size']}: {run['tokens_per_s']:.1f} tok/s with MTP, "
            f"{run['baseline_tokens_per_s']:.1f} without ({run['speedup']:.2f}x); "
            f"mean acceptance length {run['mean_acceptance_length']}, per position "
            f"{run['acceptance_rate_per_position']}"
        )
    return results


def add_cli_arguments(parser) -> None:
    """Options of ``tandem bench spec``."""
    parser.add_argument("--model", default=None)
    parser.add_argument("--speculative-model", default=None, help="MTP head directory")
    parser.add_argument("--num-speculative-tokens", type=int, default=3)
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--num-questions", type=int, default=80)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--out-dir", default=os.path.join("benchmarks", "results"))


def main_from_args(args) -> int:
    run_spec_bench(
        args.model,
        args.speculative_model,
        args.num_speculative_tokens,
        [int(b) for b in args.batch_sizes.split(",")],
        args.num_questions,
        args.max_tokens,
        args.device,
        args.dtype,
        args.out_dir,
    )
    return 0
