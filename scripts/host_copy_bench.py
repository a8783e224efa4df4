"""Host time of one host-to-device copy as the engine makes them (``tandem.device_copy``),
against the earlier way (a pageable host tensor first, then a pinned copy of it), for the
sizes a step copies (a few ids to a batch's block tables). CUDA only. The two ways of
``to_device`` are checked to give equal tensors first.

``--count-calls`` instead counts the calls a step makes, on any device: SmolLM2 with MTP
k = 3 (overlap on) generating 24 tokens for 8 prompts, under cProfile, after a warm-up run.

Usage: python3 scripts/host_copy_bench.py OUT.json [--iters 2000]
       python3 scripts/host_copy_bench.py OUT.json --count-calls [--device cpu]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import time
from functools import partial

import numpy as np
import torch

from tandem.device_copy import copy_to, to_device


def _host_before(values, dtype):
    """The earlier host tensor: a numpy array shared, a list into a pageable tensor."""
    if isinstance(values, torch.Tensor):
        return values
    if isinstance(values, np.ndarray):
        return torch.from_numpy(values)
    return torch.tensor(values, dtype=dtype)


def to_device_before(values, dtype, device):
    """The earlier ``to_device``: a pageable tensor, then a pinned copy, then the copy."""
    return _host_before(values, dtype).to(dtype).pin_memory().to(device, non_blocking=True)


def copy_to_before(destination, values):
    """The earlier ``copy_to``."""
    host = _host_before(values, destination.dtype).to(destination.dtype).pin_memory()
    destination.copy_(host, non_blocking=True)


def per_call_us(before, now, iters: int) -> tuple[float, float]:
    """The mean host microseconds of a call of each, over ``iters`` calls a round: the
    median of five rounds, the two ways' rounds alternated."""
    rounds: dict = {before: [], now: []}
    for _ in range(5):
        for fn in (before, now):
            start = time.perf_counter()
            for _ in range(iters):
                fn()
            rounds[fn].append((time.perf_counter() - start) / iters * 1e6)
    return sorted(rounds[before])[2], sorted(rounds[now])[2]


def count_calls(device: str) -> dict:
    """The ``to_device`` and ``copy_to`` calls and the engine steps of one generate."""
    from tandem import LLM, SamplingParams

    llm = LLM(speculative="mtp", num_speculative_tokens=3, device=device)
    prompts = [f"Question {i}: tell me about the number {i}." for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=24)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up: graphs, caches
    profile = cProfile.Profile()
    profile.enable()
    llm.generate(prompts, params, use_tqdm=False)
    profile.disable()
    calls = {"to_device": 0, "copy_to": 0, "steps": 0}
    for (path, _, name), (_, num_calls, *_) in pstats.Stats(profile).stats.items():
        if path.endswith("device_copy.py") and name in calls:
            calls[name] += num_calls
        elif path.endswith("engine_core.py") and name == "step":
            calls["steps"] += num_calls
    return {"device": device, "torch": torch.__version__, **calls}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--count-calls", action="store_true")
    parser.add_argument("--device", default="cpu", help="with --count-calls")
    args = parser.parse_args()
    if args.count_calls:
        result = count_calls(args.device)
        print(result)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        return
    device = torch.device("cuda")
    rows = []
    for size in (1, 8, 64, 256, 4096):
        values = list(range(size))
        array = np.arange(size, dtype=np.int32)
        destination = torch.empty(size, dtype=torch.int32, device=device)
        cases = {
            "to_device list": (
                partial(to_device_before, values, torch.int64, device),
                partial(to_device, values, torch.int64, device),
            ),
            "to_device numpy": (
                partial(to_device_before, array, torch.int32, device),
                partial(to_device, array, torch.int32, device),
            ),
            "copy_to list": (
                partial(copy_to_before, destination, values),
                partial(copy_to, destination, values),
            ),
        }
        for name, (before, now) in cases.items():
            if name.startswith("to_device"):
                assert torch.equal(before().cpu(), now().cpu()), name
            before_us, now_us = per_call_us(before, now, args.iters)
            row = {"case": name, "size": size, "before_us": before_us, "now_us": now_us}
            rows.append(row)
            print(f"{name:16s} {size:5d}: {row['before_us']:7.2f} -> {row['now_us']:7.2f} µs")
        torch.cuda.synchronize()
    result = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "iters": args.iters,
        "rows": rows,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
