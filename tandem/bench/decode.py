"""``tandem bench decode``: decode throughput (output tokens/s) at given batch sizes, with and
without overlap scheduling and MTP, and the fraction of the wall time the GPU sits idle.

Every request is one MT-Bench question's first turn (chat template applied), decoded greedily
with EOS ignored, so each produces exactly ``max_tokens`` tokens. On CUDA each batch runs a
second time under ``torch.profiler`` (CUDA activity only); the GPU idle fraction is one minus
the union of the kernel, memcpy and memset intervals over the window from the first such event
to the last. Profiling slows the host a little, so that run's wall time is reported beside it.
"""

from __future__ import annotations

import gc
import os
from typing import Any

from tandem.bench.datasets import load_mtbench
from tandem.bench.device_profile import profile_generate
from tandem.bench.results import result_path, write_json
from tandem.bench.spec import acceptance
from tandem.bench.timing import timed_generate

MODE_NAMES = {
    "plain": {"overlap": False, "mtp": False},
    "overlap": {"overlap": True, "mtp": False},
    "mtp": {"overlap": False, "mtp": True},
    "mtp+overlap": {"overlap": True, "mtp": True},
}
_WARMUP_TOKENS = 8


def parse_modes(text: str) -> list[dict]:
    """``"plain,overlap,mtp,mtp+overlap"`` -> mode dicts with ``overlap`` and ``mtp`` flags."""
    modes = []
    for name in (part.strip() for part in text.split(",")):
        if name not in MODE_NAMES:
            raise ValueError(f"unknown mode {name!r}; choose from {sorted(MODE_NAMES)}")
        modes.append(dict(MODE_NAMES[name]))
    return modes


def mode_name(mode: dict) -> str:
    """The name of a mode dict (``plain``, ``overlap``, ``mtp`` or ``mtp+overlap``)."""
    if mode["mtp"]:
        return "mtp+overlap" if mode["overlap"] else "mtp"
    return "overlap" if mode["overlap"] else "plain"


def _prompts(llm: Any, batch_size: int) -> list[dict]:
    """``batch_size`` token-id prompts: the MT-Bench first turns in order, cycled past 80.

    Dummy models borrow a tokenizer whose ids can exceed their vocabulary; those ids are
    folded into it (the weights are random, so only the shape of the work matters).
    """
    questions = load_mtbench()
    vocab = getattr(getattr(llm.engine, "arch", None), "vocab_size", None)
    prompts = []
    for i in range(batch_size):
        turn = questions[i % len(questions)]["turns"][0]
        ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": turn}])
        if vocab and llm.model_path.startswith("dummy:"):
            ids = [t % vocab for t in ids]
        prompts.append({"prompt_token_ids": ids})
    return prompts


def _profiled_generate(llm: Any, prompts: list[dict], params: Any, device: str) -> dict:
    """Run the prompts once more under the CUDA profiler; returns the GPU idle numbers."""
    profiled = profile_generate(llm, prompts, params, device, top=0)
    result: dict = {
        "profile_wall_s": profiled["wall_s"],
        "profile_device_events": profiled["device_ops"],
        "profiler_activity_counts": profiled["activity_counts"],
    }
    if "note" in profiled:
        return {
            **result,
            "gpu_idle_fraction": None,
            "profile_window_s": None,
            "profiler_note": profiled["note"],
        }
    return {
        **result,
        "gpu_idle_fraction": 1.0 - profiled["busy_fraction"],
        "profile_window_s": profiled["window_us"] / 1e6,
        "profile_busy_s": profiled["busy_us"] / 1e6,
    }


def _build_llm(
    model,
    mode: dict,
    device: str,
    dtype: str | None,
    max_num_seqs: int,
    k: int,
    speculative_model: str | None,
    kv_cache_memory_gb: float | None,
) -> Any:
    """One engine for ``mode``."""
    from tandem import LLM

    extra: dict = {}
    if mode["mtp"]:
        extra.update(
            speculative="mtp", num_speculative_tokens=k, speculative_model=speculative_model
        )
    if kv_cache_memory_gb is not None:
        extra["kv_cache_memory_gb"] = kv_cache_memory_gb
    return LLM(
        model=model,
        device=device,
        dtype=dtype,
        max_num_seqs=max_num_seqs,
        overlap=mode["overlap"],
        **extra,
    )


def _release_memory(device: str) -> None:
    """Collect a dropped engine and give its GPU memory back before the next is built."""
    gc.collect()
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


def _print_run(run: dict) -> None:
    idle = run["gpu_idle_fraction"]
    line = (
        f"{run['mode']:>11} batch {run['batch_size']:>4}: {run['tokens_per_s']:9.1f} tok/s "
        f"({run['output_tokens']} tokens in {run['seconds']:.3f} s), GPU idle "
        + ("n/a" if idle is None else f"{idle:.1%}")
    )
    if "mean_acceptance_length" in run:
        line += f", mean acceptance length {run['mean_acceptance_length']}"
    print(line, flush=True)


def run_decode_bench(
    model,
    batch_sizes: list[int],
    max_tokens: int,
    modes: list[dict],
    device: str,
    dtype: str | None,
    out_dir: str | None,
    num_speculative_tokens: int = 3,
    speculative_model: str | None = None,
    kv_cache_memory_gb: float | None = None,
) -> dict:
    """Decode throughput and GPU idle fraction of every mode at every batch size.

    One engine per mode (``max_num_seqs = max(batch_sizes)``), warmed up once at the largest
    batch size; each batch size is one ``generate`` of that many MT-Bench prompts (greedy,
    ``ignore_eos``, ``max_tokens`` each).
    Returns ``{"config": ..., "runs": [...]}`` and writes it as
    ``decode-<device>-<stamp>.json`` under ``out_dir`` when one is given.
    """
    import torch

    from tandem import SamplingParams

    if not batch_sizes or min(batch_sizes) < 1:
        raise ValueError(f"batch sizes must be positive, got {batch_sizes}")
    on_cuda = device.startswith("cuda")
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    warmup = SamplingParams(temperature=0.0, max_tokens=_WARMUP_TOKENS, ignore_eos=True)
    config = {
        "model": model,
        "device": device,
        "dtype": dtype,
        "batch_sizes": batch_sizes,
        "max_tokens": max_tokens,
        "modes": [mode_name(m) for m in modes],
        "num_speculative_tokens": num_speculative_tokens,
        "speculative_model": speculative_model,
        "kv_cache_memory_gb": kv_cache_memory_gb,
        "torch_version": torch.__version__,
    }
    if on_cuda and torch.cuda.is_available():
        config["gpu"] = torch.cuda.get_device_name(torch.device(device))
    results: dict = {"config": config, "runs": []}
    path = None
    if out_dir:
        path = result_path(out_dir, f"decode-{device.split(':')[0]}")
    for mode in modes:
        llm = _build_llm(
            model,
            mode,
            device,
            dtype,
            max(batch_sizes),
            num_speculative_tokens,
            speculative_model,
            kv_cache_memory_gb,
        )
        # At the largest batch: its chunked prefill mixes prefill and decode rows, whose
        # kernel variants would otherwise compile inside the first timed run.
        llm.generate(_prompts(llm, max(batch_sizes)), warmup, use_tqdm=False)
        for batch_size in batch_sizes:
            prompts = _prompts(llm, batch_size)
            before = llm.get_metrics()
            seconds, tokens = timed_generate(llm, prompts, params)
            after = llm.get_metrics()
            run: dict = {
                "mode": mode_name(mode),
                "batch_size": batch_size,
                "max_tokens": max_tokens,
                "output_tokens": tokens,
                "seconds": seconds,
                "tokens_per_s": tokens / seconds,
                "num_steps": after.get("num_steps", 0) - before.get("num_steps", 0),
                "num_preemptions": (
                    after.get("num_preemptions", 0) - before.get("num_preemptions", 0)
                ),
            }
            if mode["mtp"]:
                run.update(acceptance(before, after, num_speculative_tokens))
            if on_cuda:
                run.update(_profiled_generate(llm, prompts, params, device))
            else:
                run["gpu_idle_fraction"] = None
            results["runs"].append(run)
            _print_run(run)
            if path:  # after every run, so a run cut short still leaves its numbers
                write_json(results, path)
        del llm
        _release_memory(device)
    if path:
        results["output_path"] = path
        print(f"wrote {path}")
    return results


def add_cli_arguments(parser) -> None:
    """Options of ``tandem bench decode``."""
    parser.add_argument("--model", default=None, help="GGUF file, HF directory or dummy:NAME")
    parser.add_argument("--batch-sizes", default="1,8,64")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument(
        "--modes",
        default="plain,overlap,mtp,mtp+overlap",
        help=f"comma-separated, from {', '.join(MODE_NAMES)}",
    )
    parser.add_argument("--num-speculative-tokens", type=int, default=3)
    parser.add_argument("--speculative-model", default=None, help="MTP head directory")
    parser.add_argument(
        "--kv-cache-memory-gb",
        type=float,
        default=None,
        help="KV cache size (default: the engine's); too small preempts",
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--out-dir", default=os.path.join("benchmarks", "results"))


def main_from_args(args) -> int:
    """Run ``tandem bench decode`` from parsed arguments."""
    run_decode_bench(
        args.model,
        [int(b) for b in args.batch_sizes.split(",")],
        args.max_tokens,
        parse_modes(args.modes),
        args.device,
        args.dtype,
        args.out_dir,
        args.num_speculative_tokens,
        args.speculative_model,
        args.kv_cache_memory_gb,
    )
    return 0
