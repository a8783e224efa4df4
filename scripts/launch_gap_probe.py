"""The spacing a CUDA graph leaves between back-to-back small kernels, with and without
programmatic dependent launch (PDL: the next kernel starts while the one before finishes,
and waits for its results with ``gdc_wait`` before reading them).

A chain of COUNT tiny Triton kernels, each adding one to the vector the one before wrote,
captured in one graph; the median replay time per kernel, once launched plainly and once
with ``launch_pdl=True``; the same chain as torch ``add`` kernels for reference. The final
vector is checked (COUNT added to every element), so a race shows as a wrong sum. Then
COUNT / 2 pairs of a cuBLAS GEMM (4 x 576 by an identity 576 x 576, bf16) and the Triton
kernel on its output, the kernel launched plainly and with PDL: whether a kernel after a
cuBLAS GEMM starts sooner with PDL.

Usage: python scripts/launch_gap_probe.py OUT.json [--count 300] [--size 576]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import triton
import triton.language as tl


@triton.jit
def _add_one(src, dst, n, PDL: tl.constexpr, BLOCK: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()  # the previous kernel's writes are visible past here
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    value = tl.load(src + offsets, mask=mask)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(dst + offsets, value + 1, mask=mask)


def _gemm_chain(kind, x, y, weights, block):
    """GEMM, then the Triton kernel on its output, per weight: x -> x @ I -> + 1."""
    n = x.numel()
    pdl = kind == "gemm+triton+pdl"
    extra = {"launch_pdl": True} if pdl else {}
    for weight in weights:
        torch.mm(x, weight, out=y)
        _add_one[(triton.cdiv(n, block),)](y, x, n, PDL=pdl, BLOCK=block, **extra)


def _time_gemm(kind, pairs, rows=4, width=576, block=1024):
    """Per (GEMM, kernel) pair, with the GEMM's weights an identity (exact in bf16)."""
    eye = torch.eye(width, device="cuda", dtype=torch.bfloat16)
    weights = [eye.clone() for _ in range(pairs)]  # distinct copies: streamed, not cached
    x = torch.zeros(rows, width, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    median = _replay_median(lambda: _gemm_chain(kind, x, y, weights, block), x.zero_, pairs)
    correct = bool((x == pairs).all().item())
    return {"kind": kind, "us_per_pair": median, "sum_correct": correct}


def _replay_median(chain, reset, count: int) -> float:
    """``chain()`` captured in a CUDA graph (after a warm-up on a side stream): the median
    of five replays, each after ``reset()``, in us per one of its ``count`` launches; then
    one more replay after ``reset()``, for the caller to check what it computed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        chain()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    times = []
    for _ in range(5):
        reset()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / count)
    reset()
    graph.replay()
    torch.cuda.synchronize()
    return statistics.median(times)


def _chain(kind, buffers, count, block):
    n = buffers[0].numel()
    for i in range(count):
        src, dst = buffers[i % 2], buffers[(i + 1) % 2]
        if kind == "torch":
            torch.add(src, 1, out=dst)
        else:
            pdl = kind == "triton+pdl"
            extra = {"launch_pdl": True} if pdl else {}
            _add_one[(triton.cdiv(n, block),)](src, dst, n, PDL=pdl, BLOCK=block, **extra)


def _time(kind, count, size, block=1024):
    buffers = [torch.zeros(size, device="cuda") for _ in range(2)]
    median = _replay_median(lambda: _chain(kind, buffers, count, block), buffers[0].zero_, count)
    correct = bool((buffers[count % 2] == count).all().item())
    return {"kind": kind, "us_per_kernel": median, "sum_correct": correct}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--count", type=int, default=300)
    parser.add_argument("--size", type=int, default=576)
    args = parser.parse_args()
    runs = []
    for size in (args.size, 1 << 20):
        for kind in ("torch", "triton", "triton+pdl"):
            try:
                run = _time(kind, args.count, size)
            except Exception as error:  # an older triton without PDL: say so
                run = {"kind": kind, "error": f"{type(error).__name__}: {error}"}
            run["size"] = size
            runs.append(run)
            print(json.dumps(run), flush=True)
    for kind in ("gemm+triton", "gemm+triton+pdl"):
        try:
            run = _time_gemm(kind, args.count // 2)
        except Exception as error:
            run = {"kind": kind, "error": f"{type(error).__name__}: {error}"}
        runs.append(run)
        print(json.dumps(run), flush=True)
    result = {"device": torch.cuda.get_device_name(), "triton": triton.__version__, "runs": runs}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
