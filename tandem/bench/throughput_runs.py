"""The engines' runs of ``tandem bench throughput``: the requests, Tandem's timed run and its
reruns under the CUDA profiler and cProfile, the transformers baseline, and the numbers and
machine facts of a run. :mod:`tandem.bench.throughput` puts them together.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import time
from typing import Any

import torch

from tandem.bench.datasets import BenchRequest, load_sharegpt, random_requests
from tandem.bench.hf_reference import hf_generate_ids, load_hf_model
from tandem.bench.timing import sync_device, timed_generate

DATASETS = ("sharegpt", "random")
_WARMUP_TOKENS = 8


def build_requests(
    dataset: str,
    num_prompts: int,
    tokenizer: Any,
    max_prompt_len: int,
    max_output_len: int,
    seed: int,
    vocab_size: int | None = None,
) -> list[BenchRequest]:
    """The benchmark's requests, each with a token-id prompt.

    ``sharegpt`` samples conversations (prompt <= ``max_prompt_len`` tokens, output capped at
    ``max_output_len``); ``random`` makes prompts of exactly ``max_prompt_len`` random token
    ids (below ``vocab_size``, default the tokenizer's), each asking for exactly
    ``max_output_len`` tokens.
    """
    if dataset == "sharegpt":
        reqs = load_sharegpt(
            num_prompts,
            tokenizer,
            seed=seed,
            max_prompt_len=max_prompt_len,
            max_total_len=max_prompt_len + max_output_len,
            max_output_len=max_output_len,
        )
        return [BenchRequest(tokenizer.encode(r.prompt), r.prompt_len, r.output_len) for r in reqs]
    if dataset == "random":
        vocab_size = vocab_size or getattr(tokenizer, "vocab_size", None) or len(tokenizer)
        return random_requests(num_prompts, max_prompt_len, max_output_len, vocab_size, seed)
    raise ValueError(f"dataset must be one of {DATASETS}, got {dataset!r}")


def throughput_metrics(
    num_requests: int, prompt_tokens: int, output_tokens: int, elapsed: float
) -> dict:
    """Throughput numbers of one engine."""
    return {
        "elapsed_s": elapsed,
        "output_tokens": output_tokens,
        "requests_per_s": num_requests / elapsed,
        "output_tokens_per_s": output_tokens / elapsed,
        "total_tokens_per_s": (prompt_tokens + output_tokens) / elapsed,
    }


def engine_inputs(reqs: list[BenchRequest]) -> tuple[list[dict], list]:
    """The requests as Tandem prompts and greedy sampling parameters (their own output
    lengths, ignore_eos)."""
    from tandem import SamplingParams

    prompts = [{"prompt_token_ids": list(r.prompt)} for r in reqs]
    params = [
        SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=r.output_len) for r in reqs
    ]
    return prompts, params


def run_tandem(
    llm: Any, reqs: list[BenchRequest], warmup_ids: list[int], device: str
) -> tuple[float, int, dict]:
    """Generate every request with Tandem; returns (seconds, generated output tokens, the
    run's steps summarized by shape)."""
    from tandem import SamplingParams
    from tandem.bench.steps import recording_steps, summarize_steps, timing_full_collections

    prompts, params = engine_inputs(reqs)
    warmup = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=_WARMUP_TOKENS)
    llm.generate([{"prompt_token_ids": warmup_ids}], [warmup], use_tqdm=False)
    engine = llm.engine
    graph_steps = engine.metrics()["num_cuda_graph_steps"]
    with recording_steps(engine) as log, timing_full_collections() as collections:
        elapsed, generated = timed_generate(llm, prompts, params, use_tqdm=True)
    steps = summarize_steps(log)
    steps["cuda_graph_steps"] = engine.metrics()["num_cuda_graph_steps"] - graph_steps
    steps["gc_full_collections"] = len(collections)
    steps["gc_full_collection_s"] = sum(collections)
    return elapsed, generated, steps


def profile_tandem(llm: Any, reqs: list[BenchRequest]) -> dict:
    """``reqs`` once more under the CUDA profiler: the share of the run's wall time in which
    the GPU was busy, and the device operations ranked by total time."""
    from tandem.bench.device_profile import profile_generate

    prompts, params = engine_inputs(reqs)
    profiled = profile_generate(llm, prompts, params, llm.engine.config.device, top=20)
    if "note" in profiled:
        return {"note": profiled["note"]}
    return {
        "num_requests": len(reqs),
        "window_s": profiled["window_us"] / 1e6,
        "gpu_busy_fraction": profiled["busy_fraction"],
        "device_ops": profiled["device_ops"],
        "top_device_ops": profiled["top"],
    }


def profile_tandem_steps(
    llm: Any, reqs: list[BenchRequest], windows: list[tuple[int, int]]
) -> list[dict]:
    """For each (first, count) window, the requests rerun to step ``first`` and ``count``
    steps from there under the CUDA profiler (device time per step by kernel)."""
    from tandem.bench.steps import profile_step_window

    prompts, params = engine_inputs(reqs)
    return [profile_step_window(llm, prompts, params, first, count) for first, count in windows]


def host_profile_tandem(llm: Any, reqs: list[BenchRequest]) -> dict:
    """``reqs`` once more under cProfile: the host's hot functions, and the steps by shape
    of that (slowed) run."""
    from tandem.bench.host_profile import profile_host
    from tandem.bench.steps import recording_steps, summarize_steps

    prompts, params = engine_inputs(reqs)
    with recording_steps(llm.engine) as log:
        profile = profile_host(lambda: llm.generate(prompts, params, use_tqdm=False))
    profile["steps"] = summarize_steps(log)
    return profile


def run_hf(
    model_path: str,
    reqs: list[BenchRequest],
    warmup_ids: list[int],
    batch_size: int,
    device: str,
    dtype: torch.dtype,
) -> float:
    """Generate every request with transformers in batches; returns the seconds taken."""
    from tqdm import tqdm

    model = load_hf_model(model_path, dtype=dtype, device=device)
    hf_generate_ids(model, [warmup_ids], _WARMUP_TOKENS, min_new_tokens=_WARMUP_TOKENS)
    sync_device(device)
    start = time.perf_counter()
    with tqdm(total=len(reqs), desc="HF generate") as bar:
        for i in range(0, len(reqs), batch_size):
            batch = reqs[i : i + batch_size]
            new = max(r.output_len for r in batch)
            hf_generate_ids(model, [list(r.prompt) for r in batch], new, min_new_tokens=new)
            bar.update(len(batch))
    sync_device(device)
    return time.perf_counter() - start


def machine_info(device: str, threads: int) -> dict:
    """What the numbers were measured on."""
    info = {
        "cpu_count": os.cpu_count(),
        "torch_threads": threads,
        "torch_version": torch.__version__,
        "transformers_version": importlib.metadata.version("transformers"),
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor(),
        "device": device,
    }
    if str(device).startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return info
