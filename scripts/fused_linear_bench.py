"""A decoder layer's projections at a few rows, unfused (RMSNorm kernel, cuBLAS GEMM,
SiLU-and-multiply kernel) against :mod:`tandem.layers.skinny_linear`'s fused kernels, each
chain captured in a CUDA graph over every layer of the model's shape (distinct weights per
layer, so the weights stream from memory as in a real step) and timed by its replays.

Per shape and row count: microseconds per layer for ``unfused`` (norm, qkv GEMM, o_proj GEMM,
norm with residual, gate-up GEMM, SiLU-and-multiply, down GEMM: 7 kernels) and ``fused``
(norm+qkv, o_proj by cuBLAS, norm+gate-up, SiLU+down: 4 kernels), the largest difference
between their outputs, and the weights' bytes over the run's time (GB/s).

With ``--sweep``, instead: each fused op alone (norm+qkv, norm+gate-up, SiLU+down) over
the layers at 4 rows, for every tiling of a grid (BLOCK_N, BLOCK_K, warps, stages), against
its unfused kernels (the norm or SiLU kernel and the cuBLAS GEMM) in the same graph form.

Usage: python scripts/fused_linear_bench.py OUT.json [--rows 1,4,16] [--sweep]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics

import torch
import torch.nn.functional as F

from tandem.layers import skinny_linear
from tandem.layers.fused import rms_norm, silu_mul
from tandem.layers.skinny_linear import norm_linear, silu_mul_linear

SHAPES = {  # hidden, q + 2 kv width, intermediate, layers
    "smollm2-135m": (576, 960, 1536, 30),
    "llama3-8b": (4096, 6144, 14336, 32),
}
EPS = 1e-5


def _layers(hidden, qkv, inter, count, device):
    def weight(*shape):
        return torch.randn(*shape, device=device, dtype=torch.bfloat16) / shape[-1] ** 0.5

    return [
        {
            "n1": 1 + 0.1 * torch.randn(hidden, device=device, dtype=torch.bfloat16),
            "n2": 1 + 0.1 * torch.randn(hidden, device=device, dtype=torch.bfloat16),
            "qkv": weight(qkv, hidden),
            "o": weight(hidden, hidden),  # the queries' width is the hidden size
            "gate_up": weight(2 * inter, hidden),
            "down": weight(hidden, inter),
        }
        for _ in range(count)
    ]


def _unfused(x, layers):
    residual = x
    for w in layers:
        normed, residual = rms_norm(x, w["n1"], EPS, residual)
        attn = F.linear(F.linear(normed, w["qkv"])[:, : w["o"].shape[1]], w["o"])
        normed, residual = rms_norm(attn, w["n2"], EPS, residual)
        gate, up = F.linear(normed, w["gate_up"]).chunk(2, dim=-1)
        x = F.linear(silu_mul(gate, up), w["down"])
    return x, residual


def _fused(x, layers):
    residual = x
    for w in layers:
        qkv, residual = norm_linear(x, w["n1"], EPS, w["qkv"], residual=residual)
        attn = F.linear(qkv[:, : w["o"].shape[1]], w["o"])
        gate_up, residual = norm_linear(attn, w["n2"], EPS, w["gate_up"], residual=residual)
        x = silu_mul_linear(gate_up, w["down"])
    return x, residual


def _time_graph(fn, x, layers, replays=200):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn(x, layers)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(x, layers)
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / replays)
    return statistics.median(times), out


def _sweep(shape, rows=4):
    hidden, qkv, inter, count = SHAPES[shape]
    device = torch.device("cuda")
    torch.manual_seed(0)
    layers = _layers(hidden, qkv, inter, count, device)
    x = torch.randn(rows, hidden, device=device, dtype=torch.bfloat16)
    gate_up_in = torch.randn(rows, 2 * inter, device=device, dtype=torch.bfloat16)
    ops = {  # name: (unfused chain, fused chain taking a tiling)
        "norm+qkv": (
            lambda: [F.linear(rms_norm(x, w["n1"], EPS, x)[0], w["qkv"]) for w in layers],
            lambda cfg: [
                skinny_linear.launch_with(
                    x, w["qkv"], None, 2, x, torch.empty_like(x), w["n1"], EPS, **cfg
                )
                for w in layers
            ],
        ),
        "norm+gate_up": (
            lambda: [F.linear(rms_norm(x, w["n2"], EPS, x)[0], w["gate_up"]) for w in layers],
            lambda cfg: [
                skinny_linear.launch_with(
                    x, w["gate_up"], None, 2, x, torch.empty_like(x), w["n2"], EPS, **cfg
                )
                for w in layers
            ],
        ),
        "silu+down": (
            lambda: [F.linear(silu_mul(*gate_up_in.chunk(2, dim=-1)), w["down"]) for w in layers],
            lambda cfg: [
                skinny_linear.launch_with(gate_up_in, w["down"], None, 3, **cfg) for w in layers
            ],
        ),
    }
    runs = []
    for op, (unfused, fused) in ops.items():
        base_us, _ = _time_graph(lambda *_, unfused=unfused: unfused(), None, None)
        best = None
        for block_n, block_k, warps, stages in itertools.product(
            (16, 32, 64), (128, 256, 512), (4, 8), (1, 3)
        ):
            cfg = dict(block_n=block_n, block_k=block_k, num_warps=warps, num_stages=stages)
            try:
                us, _ = _time_graph(
                    lambda *_, cfg=cfg, fused=fused: fused(cfg), None, None, replays=50
                )
            except Exception as error:  # a tiling the chip cannot hold (shared memory)
                print(op, cfg, type(error).__name__, flush=True)
                continue
            run = {
                "shape": shape,
                "op": op,
                "rows": rows,
                **cfg,
                "fused_us": us / count,
                "unfused_us": base_us / count,
            }
            runs.append(run)
            if best is None or us < best["fused_us"] * count:
                best = run
        print(json.dumps(best), flush=True)
    return runs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--rows", default="1,4,16")
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args()
    if args.sweep:
        runs = [run for shape in SHAPES for run in _sweep(shape)]
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "runs": runs}, f, indent=1)
        return
    device = torch.device("cuda")
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "runs": []}
    for name, (hidden, qkv, inter, count) in SHAPES.items():
        torch.manual_seed(0)
        layers = _layers(hidden, qkv, inter, count, device)
        weight_bytes = sum(t.numel() * t.element_size() for w in layers for t in w.values())
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, hidden, device=device, dtype=torch.bfloat16)
            unfused_us, (ref, ref_res) = _time_graph(_unfused, x, layers)
            fused_us, (got, got_res) = _time_graph(_fused, x, layers)
            scale = ref.float().abs().max().item()
            run = {
                "shape": name,
                "rows": rows,
                "layers": count,
                "unfused_us_per_layer": unfused_us / count,
                "fused_us_per_layer": fused_us / count,
                "speedup": unfused_us / fused_us,
                "unfused_weight_gb_s": weight_bytes / unfused_us / 1e3,
                "fused_weight_gb_s": weight_bytes / fused_us / 1e3,
                "max_abs_diff_over_max": (got.float() - ref.float()).abs().max().item() / scale,
                "residual_max_abs_diff": (got_res.float() - ref_res.float()).abs().max().item(),
            }
            results["runs"].append(run)
            print(json.dumps(run), flush=True)
        del layers
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
