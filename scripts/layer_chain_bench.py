"""On a GPU: whole decoder layers at batch 1 as a step's CUDA graph runs them, with the
attention's output projection by cuBLAS (as the engine runs it) against the Triton GEMM of
:func:`tandem.layers.skinny_linear.linear`, with and without programmatic dependent launch
at its two edges (the split attention's combination before it, the norm-and-gate-up kernel
after it: ``tandem.layers.dependent_launch``).

SmolLM2-135M's shapes, its 30 layers with distinct weights (streamed from memory as in a
step), one request of 320 cached tokens and 1 query row (plain decoding) or 4 (a
verification at k = 3). A layer is the engine's fused chain at a few rows: the norm with
the residual add inside the q/k/v GEMM, the paged attention over the cache (its key splits
and their combination), the output projection, the norm inside the gate-up GEMM with
SiLU-and-multiply, the down projection by cuBLAS. Variants:

- ``cublas``: the output projection by cuBLAS (the engine today);
- ``triton``: by the Triton GEMM, launched plainly;
- ``triton_pdl``: by the Triton GEMM, which waits on the combination with PDL, and the
  gate-up kernel after it waits on it with PDL, both loading their weight's first tile
  before they wait (what the engine would run);
- ``triton_pdl_no_prefetch``: the same without that early load.

Per variant and row count: microseconds per layer from Triton's ``do_bench_cudagraph`` (the
gaps between kernels included) and the largest difference of the last layer's output from
the ``cublas`` variant's (the GEMMs' sums run in another order). ``--smoke`` runs every case
once, untimed, on whatever device there is (the kernels under Triton's interpreter on the
CPU, fp32, small shapes). Writes JSON.

Usage: python scripts/layer_chain_bench.py OUT.json [--smoke]
"""

from __future__ import annotations

import argparse
import contextlib
import json
from functools import partial

import torch
import torch.nn.functional as F
import triton.testing

from tandem.layers import skinny_linear
from tandem.layers.skinny_linear import linear, norm_linear
from tandem.layers.triton_attention import paged_attention

SHAPES = {  # hidden, heads, kv heads, head dim, intermediate, layers, cached tokens
    "smollm2-135m": (576, 9, 3, 64, 1536, 30, 320),
}
SMOKE_SHAPES = {"smoke": (64, 4, 2, 16, 128, 2, 40)}
VARIANTS = ("cublas", "triton", "triton_pdl", "triton_pdl_no_prefetch")
EPS = 1e-5
BLOCK_SIZE = 16


def _layers(shape, rows, device, dtype):
    hidden, heads, kv_heads, head_dim, inter, layers, context = shape
    qkv = (heads + 2 * kv_heads) * head_dim
    blocks = -(-(context + rows) // BLOCK_SIZE)

    def weight(n_out, k_in):
        return torch.randn(n_out, k_in, device=device, dtype=dtype) / k_in**0.5

    def norm():
        return 1 + 0.1 * torch.randn(hidden, device=device, dtype=dtype)

    cache = (blocks, BLOCK_SIZE, kv_heads, head_dim)
    return [
        {
            "norm1": norm(),
            "qkv": weight(qkv, hidden),
            "o": weight(hidden, heads * head_dim),
            "norm2": norm(),
            "gate_up": weight(2 * inter, hidden),
            "down": weight(hidden, inter),
            "k_cache": torch.randn(cache, device=device, dtype=dtype),
            "v_cache": torch.randn(cache, device=device, dtype=dtype),
        }
        for _ in range(layers)
    ]


def _chain(variant, shape, hidden_in, residual_in, layers, metadata):
    """The layers' fused chain (the module docstring); returns the last hidden states."""
    _, heads, _, head_dim, _, _, _ = shape
    tables, starts, seq_lens = metadata
    rows = hidden_in.shape[0]
    hidden, residual = hidden_in, residual_in
    for w in layers:
        qkv, residual = norm_linear(hidden, w["norm1"], EPS, w["qkv"], residual=residual)
        q = qkv[:, : heads * head_dim].view(rows, heads, head_dim)
        attended = paged_attention(
            q,
            w["k_cache"],
            w["v_cache"],
            tables,
            starts,
            seq_lens,
            rows,
            head_dim**-0.5,
            after_triton=True,
        ).reshape(rows, heads * head_dim)
        pdl = variant.startswith("triton_pdl")
        if variant == "cublas":
            projected = F.linear(attended, w["o"])
        else:
            projected = linear(attended, w["o"], after_triton=pdl, use_triton=True)
        gated, residual = norm_linear(
            projected, w["norm2"], EPS, w["gate_up"], residual=residual, gated=True,
            after_triton=pdl,
        )  # fmt: skip
        hidden = F.linear(gated, w["down"])
    return hidden


@contextlib.contextmanager
def _prefetch(prefetch: bool | None):
    """The skinny kernels' weight prefetch as given (None: the default, when they wait)."""
    launch = skinny_linear._launch
    skinny_linear._launch = partial(launch, prefetch=prefetch)
    try:
        yield
    finally:
        skinny_linear._launch = launch


def _us_per_layer(fn, layers, device) -> float | None:
    if device.type != "cuda":
        fn()
        return None
    return triton.testing.do_bench_cudagraph(fn, return_mode="min") * 1000 / layers


def cases(shapes, row_counts, device, dtype) -> list[dict]:
    results = []
    for name, shape in shapes.items():
        hidden_size, _, _, _, _, num_layers, context = shape
        for rows in row_counts:
            layers = _layers(shape, rows, device, dtype)
            blocks = layers[0]["k_cache"].shape[0]
            metadata = (
                torch.arange(blocks, device=device, dtype=torch.int32).view(1, blocks),
                torch.tensor([0, rows], device=device, dtype=torch.int32),
                torch.tensor([context + rows], device=device, dtype=torch.int32),
            )
            x = torch.randn(rows, hidden_size, device=device, dtype=dtype)
            r = torch.randn(rows, hidden_size, device=device, dtype=dtype)
            reference = _chain("cublas", shape, x, r, layers, metadata)
            for variant in VARIANTS:
                prefetch = None if variant != "triton_pdl_no_prefetch" else False
                with _prefetch(prefetch):
                    out = _chain(variant, shape, x, r, layers, metadata)
                    run = partial(_chain, variant, shape, x, r, layers, metadata)
                    us = _us_per_layer(run, num_layers, device)
                results.append(
                    {
                        "shape": name,
                        "rows": rows,
                        "variant": variant,
                        "us_per_layer": us,
                        "max_abs_diff": (out.float() - reference.float()).abs().max().item(),
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
        results = cases(SHAPES, (1, 4), device, torch.bfloat16)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    with open(args.out, "w") as f:
        json.dump({"device": name, "runs": results}, f, indent=1)


if __name__ == "__main__":
    main()
