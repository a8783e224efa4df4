"""``tandem bench latency``: milliseconds per output token at a small batch, against the
memory-bandwidth roofline.

Like vLLM's ``bench latency``: ``batch_size`` random prompts of ``input_len`` tokens, each
decoded greedily for exactly ``output_len`` tokens (EOS ignored). A decode step must read
every weight once, so at batch 1 a step can take no less than weight bytes / memory
bandwidth: the roofline (4.14 TB/s by default, what a bf16 copy moves on the H200). The
prefill is timed alone (``max_tokens = 1``) and subtracted, so the figure is the decode's.
"""

from __future__ import annotations

import argparse
import os
import statistics

from tandem.bench.datasets import random_requests
from tandem.bench.results import result_path, write_json
from tandem.bench.timing import timed_generate


def weight_bytes(model) -> int:
    """Bytes of the model's parameters, tied weights counted once."""
    seen: set[int] = set()
    total = 0
    for param in model.parameters():
        if param.data_ptr() not in seen:
            seen.add(param.data_ptr())
            total += param.numel() * param.element_size()
    return total


def _kernel_profile(llm, prompts: list[dict], params, steps: int) -> dict:
    """One more run under the CUDA profiler: GPU busy time per decode step and the device
    operations that take it, by total time (what is left between a step and the roofline)."""
    from tandem.bench.device_profile import profile_generate

    profiled = profile_generate(llm, prompts, params, llm.engine.config.device)
    if "note" in profiled:
        return {"profile_note": profiled["note"]}
    for entry in profiled["top"]:
        entry["us_per_step"] = round(entry["total_us"] / steps, 2)
    return {
        "profile_busy_ms_per_step": profiled["busy_us"] / steps / 1000,
        "profile_window_ms_per_step": profiled["window_us"] / steps / 1000,
        "profile_device_ops_per_step": profiled["device_ops"] / steps,
        "profile_top_device_ops": profiled["top"],
    }


def run_latency_bench(
    model: str | None,
    batch_size: int,
    input_len: int,
    output_len: int,
    num_iters: int,
    bandwidth_tbps: float,
    out_dir: str | None,
    profile: bool = False,
    **engine_options,
) -> dict:
    """Median decode milliseconds per token over ``num_iters`` runs, and the roofline.

    With ``profile`` (CUDA only) one more run goes through the profiler and the result holds
    the GPU's busy time per step and the device operations ranked by time (prefill included,
    spread over the ``output_len`` steps)."""
    from tandem import LLM, SamplingParams

    if output_len < 2:
        raise ValueError(f"output_len must be >= 2, got {output_len}")
    llm = LLM(model=model, max_num_seqs=max(batch_size, 1), **engine_options)
    requests = random_requests(
        batch_size, input_len, output_len, llm.engine.arch.vocab_size, seed=0
    )
    prompts = [{"prompt_token_ids": r.prompt} for r in requests]
    full = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    timed_generate(llm, prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    prefill_s, decode_ms = [], []
    for _ in range(num_iters):
        prefill, _ = timed_generate(llm, prompts, first)
        total, _ = timed_generate(llm, prompts, full)
        prefill_s.append(prefill)
        decode_ms.append((total - prefill) / (output_len - 1) * 1000)
    ms_per_token = statistics.median(decode_ms)
    nbytes = weight_bytes(llm.engine.runner.model)
    roofline_ms = nbytes / (bandwidth_tbps * 1e12) * 1000
    result = {
        "config": {
            "model": llm.model_path,
            "batch_size": batch_size,
            "input_len": input_len,
            "output_len": output_len,
            "num_iters": num_iters,
            "bandwidth_tbps": bandwidth_tbps,
            **engine_options,
        },
        "weight_bytes": nbytes,
        "prefill_s": statistics.median(prefill_s),
        "decode_ms_per_token": ms_per_token,
        "decode_ms_per_token_runs": decode_ms,
        "roofline_ms_per_token": roofline_ms,
        "fraction_of_roofline": roofline_ms / ms_per_token,
        "tokens_per_s": batch_size * 1000 / ms_per_token,
    }
    _add_device(result, engine_options.get("device", "cpu"))
    if profile and str(engine_options.get("device", "cpu")).startswith("cuda"):
        result.update(_kernel_profile(llm, prompts, full, output_len))
    llm.engine.shutdown()
    print(
        f"decode {ms_per_token:.3f} ms/token at batch {batch_size} (roofline "
        f"{roofline_ms:.3f} ms: {result['fraction_of_roofline']:.1%}); prefill of "
        f"{input_len} tokens {result['prefill_s'] * 1000:.1f} ms",
        flush=True,
    )
    if out_dir:
        tp = engine_options.get("tensor_parallel_size", 1)
        path = result_path(out_dir, "latency" + (f"-tp{tp}" if tp > 1 else ""))
        write_json(result, path)
        print(f"wrote {path}")
    return result


def _add_device(result: dict, device: str) -> None:
    import torch

    result["torch_version"] = torch.__version__
    if device.startswith("cuda"):
        result["gpu"] = torch.cuda.get_device_name(torch.device(device))


def add_cli_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``tandem bench latency``."""
    parser.add_argument("--model", default=None, help="GGUF file, HF directory or dummy:NAME")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--num-iters", type=int, default=3)
    parser.add_argument(
        "--bandwidth-tbps",
        type=float,
        default=4.14,
        help="memory bandwidth for the roofline (H200: 4.14 TB/s measured)",
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--no-overlap", action="store_true")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="CUDA: one more run under the profiler; top device ops per step",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="N ranks, one process each, started by torchrun",
    )
    parser.add_argument("--out-dir", default=os.path.join("benchmarks", "results"))


def main_from_args(args: argparse.Namespace) -> int:
    """Run ``tandem bench latency`` (under torchrun with --tensor-parallel-size > 1: rank 0
    writes the result; the roofline is then one rank's weight bytes)."""
    from tandem.models.tensor_parallel import join_torchrun_group

    device, rank = join_torchrun_group(args.device, args.tensor_parallel_size)
    run_latency_bench(
        args.model,
        args.batch_size,
        args.input_len,
        args.output_len,
        args.num_iters,
        args.bandwidth_tbps,
        args.out_dir if rank == 0 else None,
        profile=args.profile,
        device=device,
        dtype=args.dtype,
        enforce_eager=args.enforce_eager,
        overlap=not args.no_overlap,
        tensor_parallel_size=args.tensor_parallel_size,
    )
    return 0
