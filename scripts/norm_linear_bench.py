"""On a GPU: the norms inside the projections (:mod:`tandem.layers.skinny_linear`) against
the unfused chain, at a few rows, timed the way a step's CUDA graph runs them.

Per shape (SmolLM2-135M, the Llama-3-8B shape), row count (1, 4, 16) and op, every layer's
op in one captured function (distinct weights per layer, so they stream from memory as in
a step) replayed by Triton's ``do_bench_cudagraph`` (the gaps between kernels included),
microseconds per layer:

- ``norm+qkv``: RMSNorm with the residual add then the q/k/v GEMM (two launches) against
  ``norm_linear`` (one);
- ``norm+gate_up+silu``: RMSNorm with the residual add, the fused gate-up GEMM and
  SiLU-and-multiply (three launches) against ``norm_linear(..., gated=True)`` (one);
- ``two_norms+eh_proj``: the MTP head's input, two RMSNorms, their concatenation and the
  projection (four launches) against ``two_norm_linear`` (one).

Each fused output is compared with the chain's (the largest difference, bf16). ``--smoke``
runs every case once, untimed, on whatever device there is (the kernels under Triton's
interpreter on the CPU, small shapes). Writes JSON.

Usage: python scripts/norm_linear_bench.py OUT.json [--smoke]
"""

from __future__ import annotations

import argparse
import json
from functools import partial

import torch
import torch.nn.functional as F
import triton.testing

from tandem.layers.fused import rms_norm, silu_mul
from tandem.layers.skinny_linear import norm_linear, two_norm_linear

SHAPES = {  # hidden, q + 2 kv width, intermediate, layers
    "smollm2-135m": (576, 960, 1536, 30),
    "llama3-8b": (4096, 6144, 14336, 32),
}
SMOKE_SHAPES = {"smoke": (64, 96, 128, 2)}
EPS = 1e-5


def _weights(hidden, n_out, k_in, layers, device, dtype):
    return [
        {
            "norm": 1 + 0.1 * torch.randn(hidden, device=device, dtype=dtype),
            "norm2": 1 + 0.1 * torch.randn(hidden, device=device, dtype=dtype),
            "weight": torch.randn(n_out, k_in, device=device, dtype=dtype) / k_in**0.5,
        }
        for _ in range(layers)
    ]


def _chain(op, x, y, weights):
    out = []
    for w in weights:
        if op == "two_norms+eh_proj":
            normed = torch.cat([rms_norm(x, w["norm"], EPS), rms_norm(y, w["norm2"], EPS)], -1)
            out.append(F.linear(normed, w["weight"]))
        else:
            normed, _ = rms_norm(x, w["norm"], EPS, y)
            projected = F.linear(normed, w["weight"])
            if op == "norm+gate_up+silu":
                projected = silu_mul(*projected.chunk(2, dim=-1))
            out.append(projected)
    return out


def _fused(op, x, y, weights):
    out = []
    for w in weights:
        if op == "two_norms+eh_proj":
            out.append(two_norm_linear(x, y, w["norm"], w["norm2"], EPS, w["weight"], True))
        else:
            gated = op == "norm+gate_up+silu"
            projected, _ = norm_linear(
                x, w["norm"], EPS, w["weight"], residual=y, use_triton=True, gated=gated
            )
            out.append(projected)
    return out


def _us_per_layer(fn, layers, device) -> float | None:
    if device.type != "cuda":
        fn()
        return None
    return triton.testing.do_bench_cudagraph(fn, return_mode="min") * 1000 / layers


def cases(shapes, row_counts, device, dtype) -> list[dict]:
    results = []
    for shape, (hidden, qkv, inter, layers) in shapes.items():
        ops = {
            "norm+qkv": (qkv, hidden),
            "norm+gate_up+silu": (2 * inter, hidden),
            "two_norms+eh_proj": (hidden, 2 * hidden),
        }
        for op, (n_out, k_in) in ops.items():
            weights = _weights(hidden, n_out, k_in, layers, device, dtype)
            for rows in row_counts:
                x = torch.randn(rows, hidden, device=device, dtype=dtype)
                y = torch.randn(rows, hidden, device=device, dtype=dtype)
                chain = _chain(op, x, y, weights)
                fused = _fused(op, x, y, weights)
                diff = max(
                    (a.float() - b.float()).abs().max().item()
                    for a, b in zip(chain, fused, strict=True)
                )
                unfused_us = _us_per_layer(partial(_chain, op, x, y, weights), layers, device)
                fused_us = _us_per_layer(partial(_fused, op, x, y, weights), layers, device)
                results.append(
                    {
                        "shape": shape,
                        "op": op,
                        "rows": rows,
                        "unfused_us": unfused_us,
                        "fused_us": fused_us,
                        "max_abs_diff": diff,
                    }
                )
                print(json.dumps(results[-1]), flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.smoke:
        results = cases(SMOKE_SHAPES, (1, 4), device, torch.float32)
    else:
        results = cases(SHAPES, (1, 4, 16), device, torch.bfloat16)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                   "runs": results}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
