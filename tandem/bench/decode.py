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
import time
from typing import Any

from tandem.bench.datasets import load_mtbench
from tandem.bench.results import result_path, write_json
from tandem.bench.spec import acceptance
from tandem.bench.timing import sync_device, timed_generate

MODE_NAMES = {
    "plain": {"overlap": False, "mtp": False},
    "overlap": {"overlap": True, "mtp": False},
    "mtp": {"overlap": False, "mtp": True},
    "mtp+overlap": {"overlap": True, "mtp": True},
}
_WARMUP_TOKENS = 8
# Kineto activity types that sit on a GPU lane but are not work done by the GPU.
_NOT_DEVICE_WORK = frozenset({"gpu_user_annotation", "user_annotation", "cuda_sync", "overhead"})
_PROFILER_META_NAMES = frozenset({"[memory]", "[OutOfMemory]"})


def busy_fraction(intervals: list[tuple[float, float]], window: tuple[float, float]) -> float:
    """The fraction of ``window`` covered by the union of the ``[start, end)`` intervals.

    Intervals may overlap, come in any order, or reach outside the window (they are clipped
    to it); empty or reversed intervals count for nothing. A window of zero length gives 0.
    """
    lo, hi = window
    if hi <= lo:
        return 0.0
    clipped = sorted((max(s, lo), min(e, hi)) for s, e in intervals if min(e, hi) > max(s, lo))
    covered = 0.0
    cur_start = cur_end = None
    for start, end in clipped:
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                covered += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        covered += cur_end - cur_start
    return covered / (hi - lo)


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


def _method(obj: Any, name: str, default: Any = None) -> Any:
    """``obj.name()`` if ``obj`` has that method, else ``default``."""
    fn = getattr(obj, name, None)
    return fn() if callable(fn) else default


def _is_device_work(device_type: Any, activity: Any, name: str, annotation: bool) -> bool:
    """Whether a profiler event is a kernel, memcpy or memset on a CUDA device."""
    from torch.autograd import DeviceType

    if device_type != DeviceType.CUDA or annotation or name in _PROFILER_META_NAMES:
        return False
    return not (isinstance(activity, str) and activity in _NOT_DEVICE_WORK)


def _device_events(prof: Any) -> list[tuple[str, str, float, float]]:
    """``(name, activity type, start_us, end_us)`` of every CUDA kernel, memcpy and memset a
    finished ``torch.profiler.profile`` recorded, times relative to the first event.

    Reads the raw Kineto events (``prof.profiler.kineto_results.events()``: integer
    nanoseconds, no event tree to build); falls back to ``prof.events()`` (FunctionEvents,
    ``time_range`` in microseconds) where the raw results are missing.
    """
    raw = getattr(getattr(prof, "profiler", None), "kineto_results", None)
    if raw is not None:
        spans: list[tuple[str, str, int, int]] = []
        for evt in raw.events():
            activity = _method(evt, "activity_type", "")
            annotation = bool(_method(evt, "is_user_annotation", False))
            if _method(evt, "is_hidden_event", False):
                continue
            if not _is_device_work(evt.device_type(), activity, evt.name(), annotation):
                continue
            start, end = evt.start_ns(), evt.end_ns()
            if end > start:
                spans.append((evt.name(), str(activity), start, end))
        # Subtract a base before going to float: absolute nanoseconds overflow its mantissa.
        base = min((s for _, _, s, _ in spans), default=0)
        return [(n, a, (s - base) / 1000, (e - base) / 1000) for n, a, s, e in spans]
    events = []
    for evt in prof.events():
        activity = getattr(evt, "activity_type", "")
        annotation = bool(getattr(evt, "is_user_annotation", False))
        if not _is_device_work(evt.device_type, activity, evt.name, annotation):
            continue
        start, end = evt.time_range.start, evt.time_range.end
        if end > start:
            events.append((evt.name, str(activity), start, end))
    return events


def device_intervals(prof: Any) -> tuple[list[tuple[float, float]], dict[str, int]]:
    """Intervals (microseconds) of the CUDA kernels, memcpys and memsets a finished
    ``torch.profiler.profile`` recorded, and the count of each activity type kept."""
    counts: dict[str, int] = {}
    intervals = []
    for _, activity, start, end in _device_events(prof):
        intervals.append((start, end))
        counts[activity] = counts.get(activity, 0) + 1
    return intervals, counts


def kernel_totals(prof: Any, top: int = 30) -> list[dict]:
    """The ``top`` device operations by total time: name, count and microseconds."""
    totals: dict[str, list] = {}
    for name, _, start, end in _device_events(prof):
        entry = totals.setdefault(name, [0, 0.0])
        entry[0] += 1
        entry[1] += end - start
    ranked = sorted(totals.items(), key=lambda item: -item[1][1])[:top]
    return [
        {"name": name[:160], "count": count, "total_us": round(us, 1)}
        for name, (count, us) in ranked
    ]


def profile_generate(
    llm: Any, prompts: list[dict], params: Any, device: str, top: int = 30
) -> dict:
    """``llm.generate`` once under the CUDA profiler. Always: ``wall_s``, ``device_ops``
    (kernels, memcpys, memsets) and ``activity_counts``; when device ops were recorded, their
    window ``window_us``, ``busy_fraction`` and ``busy_us`` of it and the ``top`` ops by total
    time; otherwise a ``note`` saying why not."""
    from torch.profiler import ProfilerActivity, profile

    sync_device(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        sync_device(device)
        wall = time.perf_counter() - start
    try:
        intervals, counts = device_intervals(prof)
    except (AttributeError, RuntimeError, TypeError) as e:
        intervals, counts = [], {}
        note = f"could not read the profiler's events: {type(e).__name__}: {e}"
    else:
        note = "the profiler recorded no CUDA kernel, memcpy or memset events"
    result: dict = {"wall_s": wall, "device_ops": len(intervals), "activity_counts": counts}
    if not intervals:
        return {**result, "note": note}
    window = (min(s for s, _ in intervals), max(e for _, e in intervals))
    busy = busy_fraction(intervals, window)
    return {
        **result,
        "window_us": window[1] - window[0],
        "busy_fraction": busy,
        "busy_us": busy * (window[1] - window[0]),
        "top": kernel_totals(prof, top) if top else [],
    }


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
