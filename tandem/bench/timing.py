"""Wall-clock timing shared by the benchmarks: wait for the device around a timed region, and
split timed questions into a fixed part and a part per step."""

from __future__ import annotations

import dataclasses
import statistics
import time


def sync_device(device: str) -> None:
    """Wait for queued GPU work so that wall-clock timings are honest (no-op elsewhere)."""
    if str(device).startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)


def timed_generate(
    llm,
    prompts: list,
    params,
    batch_size: int | None = None,
    use_tqdm: bool = False,
    outputs: list | None = None,
) -> tuple[float, int]:
    """Generate ``prompts`` (all at once, or in waves of ``batch_size``); returns
    (seconds, output tokens), the device synchronized before and after. The outputs are
    appended to ``outputs`` when a list is given."""
    device = llm.config.device
    batch_size = batch_size or len(prompts)
    sync_device(device)
    start = time.perf_counter()
    tokens = 0
    for i in range(0, len(prompts), batch_size):
        wave = llm.generate(prompts[i : i + batch_size], params, use_tqdm=use_tqdm)
        tokens += sum(len(o.outputs[0].token_ids) for o in wave)
        if outputs is not None:
            outputs.extend(wave)
    sync_device(device)
    return time.perf_counter() - start, tokens


def fixed_and_per_step(per_question: list[dict]) -> dict | None:
    """The least-squares line through the questions' (steps, seconds): ``fixed_ms``, what a
    question costs besides its steps (its start and end: the prompt's step, the step in
    flight when it ends, the host's work around them), and ``per_step_ms``; None when the
    questions do not differ in steps (plain decoding of a fixed length)."""
    points = [(entry["num_steps"], entry["seconds"]) for entry in per_question]
    if len({steps for steps, _ in points}) < 2:
        return None
    mean_steps = sum(steps for steps, _ in points) / len(points)
    mean_seconds = sum(seconds for _, seconds in points) / len(points)
    spread = sum((steps - mean_steps) ** 2 for steps, _ in points)
    slope = sum((steps - mean_steps) * (sec - mean_seconds) for steps, sec in points) / spread
    return {
        "fixed_ms": 1e3 * (mean_seconds - slope * mean_steps),
        "per_step_ms": 1e3 * slope,
        "questions": len(points),
    }


def decode_after_first_tokens(
    llm, prompts: list[dict], params, seconds: float, tokens: int, repeats: int
) -> dict:
    """The decode alone, as TPOT counts it: the same prompts generated ``repeats`` times for
    one token each (their prefill and first token; the median is ``first_token_seconds``),
    and the tokens after each request's first over the seconds past that
    (``decode_tokens_per_s``). Both modes pay the same prefill, which the whole generate's
    tok/s counts in. ``params``: one SamplingParams for every prompt, or a list (one each);
    nothing is timed when no request asks for a second token."""
    per_request = params if isinstance(params, list) else [params]
    if all(p.max_tokens is None or p.max_tokens < 2 for p in per_request):
        return {}
    one = [dataclasses.replace(p, max_tokens=1) for p in per_request]
    first_token = one if isinstance(params, list) else one[0]
    each = [timed_generate(llm, prompts, first_token)[0] for _ in range(repeats)]
    first_seconds = statistics.median(each)
    decode_seconds = seconds - first_seconds  # None below: noise outran the decode
    return {
        "first_token_seconds": first_seconds,
        "first_token_seconds_each": each,
        "decode_tokens_per_s": (tokens - len(prompts)) / decode_seconds
        if decode_seconds > 0
        else None,
    }
