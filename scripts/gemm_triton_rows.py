"""cuBLAS against an autotuned Triton GEMM at the 8B shape's projections and a verification's
row counts (64 x (k + 1)): can a verification step's GEMMs at 128-256 rows run faster than
``F.linear`` runs them? Four weight copies per shape rotate so the weights come from HBM.

Per (shape, rows): cuBLAS ``F.linear`` (the engine's path), cuBLAS on a pre-transposed
weight (``x @ w_t``, another layout, other kernels), the Triton kernel at its best config
(and that config), and the Triton output's largest difference from cuBLAS's.

Usage (on a GPU): OUT=DIR python3 scripts/gemm_triton_rows.py [ROWS,...]
Writes ``$OUT/gemm-triton-rows.json``.
"""

import json
import os
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.testing import do_bench

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
ROWS = [int(r) for r in sys.argv[1].split(",")] if len(sys.argv) > 1 else [64, 128, 192, 256]


def _configs():
    out = []
    for bm in (64, 128):
        for bn in (64, 128, 256):
            for bk in (64, 128):
                for stages in (3, 4):
                    for warps in (4, 8):
                        if stages * (bm + bn) * bk * 2 > 220_000:
                            continue
                        if bm * bn // (warps * 32) > 256:  # fp32 accumulators a thread
                            continue
                        kw = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}
                        out.append(triton.Config(kw, num_stages=stages, num_warps=warps))
    return out


@triton.autotune(configs=_configs(), key=["M", "N", "K"])
@triton.jit
def _gemm(
    x_ptr,
    w_ptr,
    out_ptr,
    M,
    N,
    K,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # The row tiles of one column tile are consecutive programs: they run together and
    # share that weight slice through L2, so the weights stream from HBM once.
    pid = tl.program_id(0)
    m_tiles = tl.cdiv(M, BLOCK_M)
    pid_m = pid % m_tiles
    pid_n = pid // m_tiles
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    x_tile = x_ptr + rows[:, None] * K + ks[None, :]
    w_tile = w_ptr + cols[None, :] * K + ks[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for _ in range(0, K, BLOCK_K):  # K is a multiple of every BLOCK_K here
        x = tl.load(x_tile, mask=(rows < M)[:, None], other=0.0)
        w = tl.load(w_tile)
        acc = tl.dot(x, w, acc)
        x_tile += BLOCK_K
        w_tile += BLOCK_K
    tl.store(
        out_ptr + rows[:, None] * N + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=(rows < M)[:, None],
    )


def triton_linear(x, w):
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)

    def grid(meta):
        return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)

    _gemm[grid](x, w, out, m, n, k)
    return out


def _rotating(fn, weights, x):
    """Microseconds per call, cycling the weight copies (HBM reads)."""
    state = {"i": 0}

    def call():
        state["i"] = (state["i"] + 1) % len(weights)
        fn(x, weights[state["i"]])

    return do_bench(call, warmup=50, rep=200) * 1000


def main():
    out_dir = os.environ.get("OUT", ".")
    results = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "rows": {},
    }
    for m in ROWS:
        row = {}
        for name, (k, n) in SHAPES.items():
            ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 64 for _ in range(4)]
            wts = [w.t().contiguous() for w in ws]
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            cublas = _rotating(F.linear, ws, x)
            cublas_t = _rotating(lambda a, b: a @ b, wts, x)
            tri = _rotating(triton_linear, ws, x)
            diff = (triton_linear(x, ws[0]).float() - F.linear(x, ws[0]).float()).abs().max()
            best = _gemm.best_config
            row[name] = {
                "cublas_us": round(cublas, 1),
                "cublas_transposed_us": round(cublas_t, 1),
                "triton_us": round(tri, 1),
                "triton_config": str(best),
                "triton_max_abs_diff": float(diff),
            }
            print(m, name, row[name], flush=True)
            del ws, wts
        results["rows"][str(m)] = row
    with open(os.path.join(out_dir, "gemm-triton-rows.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
