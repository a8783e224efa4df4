"""Wall-clock timing shared by the benchmarks: wait for the device around a timed region."""

from __future__ import annotations

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
