"""Offline throughput: Tandem against Hugging Face transformers on the same requests.

Like vLLM's ``benchmarks/benchmark_throughput.py``: every request is generated greedily with
EOS ignored, so it produces exactly its ``output_len`` tokens. Tandem gets all requests at
once; the transformers baseline runs them in order in left-padded batches of
``hf_batch_size``, each generating the longest ``output_len`` of its batch, of which only
each request's own ``output_len`` counts (as in vLLM's ``hf`` backend). Both engines get the
same token-id prompts, the same model file and the same torch thread count.
"""

from __future__ import annotations

import argparse
import gc
import os
import re
from typing import Any

import torch

from tandem.bench.hf_reference import torch_dtype
from tandem.bench.results import result_path, write_json
from tandem.bench.throughput_runs import (
    DATASETS,
    build_requests,
    host_profile_tandem,
    machine_info,
    profile_tandem,
    profile_tandem_steps,
    run_hf,
    run_tandem,
    throughput_metrics,
)
from tandem.models.loader import default_model_path

# Not one of the benchmark's prompts, so that the warm-up cannot prime a prefix cache.
_WARMUP_TEXT = "Warm-up: say something short about the weather."


def parse_step_windows(text: str) -> list[tuple[int, int]]:
    """``"60:10,400:10"`` -> [(60, 10), (400, 10)] (first step : number of steps)."""
    windows = []
    for part in filter(None, text.split(",")):
        first, sep, count = part.partition(":")
        if not sep or not first.strip().isdigit() or not count.strip().isdigit():
            raise ValueError(f"a step window is FIRST:COUNT, got {part!r}")
        windows.append((int(first), int(count)))
    return windows


def markdown_table(result: dict) -> str:
    """A small markdown table of a ``run_throughput`` result."""
    rows = [("tandem", result["tandem"])]
    if result.get("hf"):
        rows.append(("hf", result["hf"]))
    lines = [
        "| engine | elapsed s | req/s | output tok/s | total tok/s |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, m in rows:
        lines.append(
            f"| {name} | {m['elapsed_s']:.2f} | {m['requests_per_s']:.2f} | "
            f"{m['output_tokens_per_s']:.1f} | {m['total_tokens_per_s']:.1f} |"
        )
    if result.get("ratio"):
        r = result["ratio"]
        lines.append(
            f"| tandem/hf | | {r['requests_per_s']:.2f}x | {r['output_tokens_per_s']:.2f}x | "
            f"{r['total_tokens_per_s']:.2f}x |"
        )
    return "\n".join(lines)


def run_throughput(
    model: str | None,
    dataset: str,
    num_prompts: int,
    max_output_len: int,
    max_prompt_len: int,
    hf_batch_size: int,
    out_dir: str | None,
    seed: int,
    llm_kwargs: dict,
    skip_hf: bool = False,
    hf_num_prompts: int | None = None,
    profile_prompts: int = 0,
    host_profile: bool = False,
    profile_steps: list[tuple[int, int]] | None = None,
) -> dict:
    """Measure Tandem's (and unless ``skip_hf`` transformers') offline throughput.

    ``hf_num_prompts`` runs transformers on the first that many requests only (a slow
    reference on a big model); its rates are per second all the same. ``profile_prompts``
    (CUDA) runs that many of the requests once more under the profiler (``tandem_profile``);
    ``host_profile`` runs all of them once more under cProfile (``tandem_host_profile``);
    ``profile_steps`` (CUDA) lists (first, count) windows of steps of a rerun to profile
    (``tandem_step_profiles``).
    Writes the result to ``out_dir/throughput-<dataset>-<device>[-tpN]-<timestamp>.json`` (no
    file without ``out_dir``), prints a markdown table and returns the result dict
    (``output_path`` says where it went).
    """
    from tandem import LLM

    if dataset not in DATASETS:
        raise ValueError(f"dataset must be one of {DATASETS}, got {dataset!r}")
    for name, value in (
        ("num_prompts", num_prompts),
        ("max_output_len", max_output_len),
        ("max_prompt_len", max_prompt_len),
        ("hf_batch_size", hf_batch_size),
    ):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    device = str(llm_kwargs.get("device") or "cpu")
    model = model or default_model_path()

    llm = LLM(model=model, **llm_kwargs)
    vocab = llm.engine.arch.vocab_size  # a dummy model may have fewer ids than the tokenizer
    reqs = build_requests(
        dataset, num_prompts, llm.tokenizer, max_prompt_len, max_output_len, seed, vocab_size=vocab
    )
    prompt_tokens = sum(r.prompt_len for r in reqs)
    output_tokens = sum(r.output_len for r in reqs)
    model_path = llm.model_path
    warmup_ids = [t % vocab for t in llm.tokenizer.encode(_WARMUP_TEXT)]
    tandem_s, generated, steps = run_tandem(llm, reqs, warmup_ids, device)
    profiled = (
        profile_tandem(llm, reqs[:profile_prompts])
        if profile_prompts and device.startswith("cuda")
        else None
    )
    host_profiled = host_profile_tandem(llm, reqs) if host_profile else None
    step_profiles = (
        profile_tandem_steps(llm, reqs, profile_steps)
        if profile_steps and device.startswith("cuda")
        else None
    )
    threads = torch.get_num_threads()  # after Tandem ran, in case it set its own
    del llm
    gc.collect()
    if device.startswith("cuda") and torch.cuda.is_available():
        torch.cuda.empty_cache()

    result: dict[str, Any] = {
        "config": {
            "model": model,
            "model_path": model_path,
            "dataset": dataset,
            "num_prompts": num_prompts,
            "max_output_len": max_output_len,
            "max_prompt_len": max_prompt_len,
            "hf_batch_size": hf_batch_size,
            "seed": seed,
            "skip_hf": skip_hf,
            "hf_num_prompts": hf_num_prompts,
            "llm_kwargs": {
                k: v if isinstance(v, (str, int, float, bool)) else str(v)
                for k, v in llm_kwargs.items()
            },
        },
        "machine": machine_info(device, threads),
        "num_requests": len(reqs),
        "total_prompt_tokens": prompt_tokens,
        "total_output_tokens": output_tokens,
        "tandem": throughput_metrics(len(reqs), prompt_tokens, generated, tandem_s),
        "tandem_steps": steps,
        "hf": None,
        "ratio": None,
    }
    if profiled is not None:
        result["tandem_profile"] = profiled
    if host_profiled is not None:
        result["tandem_host_profile"] = host_profiled
    if step_profiles is not None:
        result["tandem_step_profiles"] = step_profiles
    safe_device = re.sub(r"[^A-Za-z0-9_.-]", "", device.split(":")[0])
    tp = llm_kwargs.get("tensor_parallel_size", 1)
    path = (
        result_path(out_dir, f"throughput-{dataset}-{safe_device}" + (f"-tp{tp}" if tp > 1 else ""))
        if out_dir
        else None
    )
    result["output_path"] = path
    if path:  # Tandem's numbers first, in case the reference run is cut short
        write_json(result, path)
    if not skip_hf:
        torch.set_num_threads(threads)
        dtype = torch_dtype(llm_kwargs.get("dtype"), device)
        hf_reqs = reqs[:hf_num_prompts] if hf_num_prompts else reqs
        hf_s = run_hf(model_path, hf_reqs, warmup_ids, hf_batch_size, device, dtype)
        result["hf"] = throughput_metrics(
            len(hf_reqs),
            sum(r.prompt_len for r in hf_reqs),
            sum(r.output_len for r in hf_reqs),
            hf_s,
        )
        result["hf"]["dtype"] = str(dtype).removeprefix("torch.")
        result["ratio"] = {
            key: result["tandem"][key] / result["hf"][key]
            for key in ("requests_per_s", "output_tokens_per_s", "total_tokens_per_s")
        }
        if path:
            write_json(result, path)
    print(markdown_table(result))
    if path:
        print(f"wrote {path}")
    return result


def add_cli_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``tandem bench throughput`` to ``parser``."""
    parser.add_argument(
        "--model", default=None, help="GGUF file or HF directory (default: SmolLM2)"
    )
    parser.add_argument("--dataset", choices=DATASETS, default="sharegpt")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument(
        "--max-output-len",
        type=int,
        default=128,
        help="cap on each ShareGPT output; the exact output length for --dataset random",
    )
    parser.add_argument(
        "--max-prompt-len",
        type=int,
        default=512,
        help="longest ShareGPT prompt; the exact prompt length for --dataset random",
    )
    parser.add_argument("--hf-batch-size", type=int, default=32)
    parser.add_argument("--out-dir", default=os.path.join("benchmarks", "results"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default=None, help="e.g. cpu or cuda (default: Tandem's)")
    parser.add_argument("--dtype", default=None, help="e.g. float32, bfloat16 (default: Tandem's)")
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="token budget of one step (prefill chunks and decode rows)",
    )
    parser.add_argument(
        "--kv-cache-memory-gb",
        type=float,
        default=None,
        help="KV cache size (default: the engine's)",
    )
    parser.add_argument("--skip-hf", action="store_true", help="measure Tandem only")
    parser.add_argument(
        "--profile-prompts",
        type=int,
        default=0,
        help="CUDA: run the first N requests again under the profiler (GPU "
        "busy share, top device ops)",
    )
    parser.add_argument(
        "--host-profile",
        action="store_true",
        help="run the requests again under cProfile (the host's hot functions)",
    )
    parser.add_argument(
        "--profile-steps",
        type=parse_step_windows,
        default=None,
        metavar="FIRST:COUNT[,...]",
        help="CUDA: rerun the requests and profile COUNT steps from step FIRST "
        "(device time per step by kernel), once per window",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="N ranks, one process each, started by torchrun (with --skip-hf)",
    )
    parser.add_argument(
        "--hf-num-prompts",
        type=int,
        default=None,
        help="run transformers on only the first N requests",
    )
    parser.add_argument(
        "--no-overlap", action="store_true", help="run Tandem without overlap scheduling"
    )


def main_from_args(args: argparse.Namespace) -> int:
    """Run the throughput benchmark from parsed CLI arguments; returns the exit status."""
    from tandem.models.tensor_parallel import join_torchrun_group

    if args.tensor_parallel_size > 1 and not args.skip_hf:
        raise SystemExit(
            "--tensor-parallel-size > 1 measures Tandem only: add --skip-hf "
            "(the transformers reference runs on one GPU, at size 1)"
        )
    llm_kwargs: dict[str, Any] = {}
    device, rank = join_torchrun_group(args.device or "cpu", args.tensor_parallel_size)
    if args.device is not None or args.tensor_parallel_size > 1:
        llm_kwargs["device"] = device
    if args.tensor_parallel_size > 1:
        llm_kwargs["tensor_parallel_size"] = args.tensor_parallel_size
    if args.dtype is not None:
        llm_kwargs["dtype"] = args.dtype
    if args.max_num_seqs is not None:
        llm_kwargs["max_num_seqs"] = args.max_num_seqs
    if args.max_num_batched_tokens is not None:
        llm_kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.kv_cache_memory_gb is not None:
        llm_kwargs["kv_cache_memory_gb"] = args.kv_cache_memory_gb
    if args.no_overlap:
        llm_kwargs["overlap"] = False
    run_throughput(
        model=args.model,
        dataset=args.dataset,
        num_prompts=args.num_prompts,
        max_output_len=args.max_output_len,
        max_prompt_len=args.max_prompt_len,
        hf_batch_size=args.hf_batch_size,
        out_dir=args.out_dir if rank == 0 else None,
        seed=args.seed,
        llm_kwargs=llm_kwargs,
        skip_hf=args.skip_hf,
        hf_num_prompts=args.hf_num_prompts,
        profile_prompts=args.profile_prompts,
        host_profile=args.host_profile,
        profile_steps=args.profile_steps,
    )
    return 0
