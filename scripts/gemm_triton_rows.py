"""cuBLAS against Triton GEMMs at the 8B shape's projections and a verification's row counts
(64 x (k + 1)): can a verification step's GEMMs at 128-256 rows run faster than
``F.linear`` runs them? Four weight copies per shape rotate so the weights come from HBM.

Per (shape, rows): cuBLAS ``F.linear`` (the engine's path), cuBLAS on a pre-transposed
weight (``x @ w_t``: another layout, other kernels), and two Triton kernels swept over tile
shapes, warps and pipeline stages (the best config and its µs, and its largest difference
from cuBLAS): ``pointer`` (pointer loads) and ``tma`` (the Hopper bulk tensor copies, through
host-side tensor descriptors). In both the row tiles of one column tile are consecutive
programs, so they run together and share that weight slice through L2.

Usage (on a GPU): OUT=DIR python3 scripts/gemm_triton_rows.py [ROWS,...]
Writes ``$OUT/gemm-triton-rows.json``. ``--smoke``: one small shape, one config each, checked
against ``F.linear`` (the CPU, in Triton's interpreter).
"""

import itertools
import json
import os
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}


def configs() -> list[dict]:
    """Tile shapes, warps and stages that fit the shared memory and the registers."""
    out = []
    for bm, bn, bk, stages, warps in itertools.product(
        (64, 128), (64, 128, 256), (64, 128), (3, 4), (4, 8)
    ):
        if stages * (bm + bn) * bk * 2 > 220_000 or bm * bn // (warps * 32) > 256:
            continue
        out.append(
            {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "num_stages": stages, "num_warps": warps}
        )
    return out


@triton.jit
def _tile_origin(M, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's first row and column: the row tiles of one column tile are
    consecutive programs (they share that weight slice through L2)."""
    pid = tl.program_id(0)
    m_tiles = tl.cdiv(M, BLOCK_M)
    return (pid % m_tiles) * BLOCK_M, (pid // m_tiles) * BLOCK_N


@triton.jit
def _gemm_pointer(
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
    row0, col0 = _tile_origin(M, BLOCK_M, BLOCK_N)
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = col0 + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    x_tile = x_ptr + rows[:, None] * K + ks[None, :]
    w_tile = w_ptr + cols[None, :] * K + ks[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for _ in range(0, K, BLOCK_K):  # K is a multiple of every BLOCK_K here
        acc = tl.dot(tl.load(x_tile, mask=(rows < M)[:, None], other=0.0), tl.load(w_tile), acc)
        x_tile += BLOCK_K
        w_tile += BLOCK_K
    tl.store(
        out_ptr + rows[:, None] * N + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=(rows < M)[:, None],
    )


@triton.jit
def _gemm_tma(
    x_desc,
    w_desc,
    out_desc,
    M,
    N,
    K,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    row0, col0 = _tile_origin(M, BLOCK_M, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):  # rows past M load as zeros; the store clips them
        acc = tl.dot(x_desc.load([row0, k]), w_desc.load([col0, k]).T, acc)
    out_desc.store([row0, col0], acc.to(out_desc.dtype))


def triton_linear(kind: str, x, w, config: dict):
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    bm, bn, bk = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    if kind == "pointer":
        _gemm_pointer[grid](x, w, out, m, n, k, **config)
    else:
        descs = (
            TensorDescriptor.from_tensor(x, [bm, bk]),
            TensorDescriptor.from_tensor(w, [bn, bk]),
            TensorDescriptor.from_tensor(out, [bm, bn]),
        )
        _gemm_tma[grid](*descs, m, n, k, **config)
    return out


def _rotating_us(fn, weights, x) -> float:
    """Microseconds per call, cycling the weight copies (HBM reads)."""
    from triton.testing import do_bench

    state = {"i": 0}

    def call():
        state["i"] = (state["i"] + 1) % len(weights)
        fn(x, weights[state["i"]])

    return do_bench(call, warmup=10, rep=40) * 1000


def smoke() -> None:
    x, w = torch.randn(70, 128), torch.randn(192, 128)
    config = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64}
    for kind in ("pointer", "tma"):
        diff = (triton_linear(kind, x, w, config) - F.linear(x, w)).abs().max().item()
        print(kind, diff)
        assert diff < 1e-3


def main(rows: list[int]) -> None:
    results = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "rows": {},
    }
    for m in rows:
        row = {}
        for name, (k, n) in SHAPES.items():
            ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 64 for _ in range(4)]
            wts = [w.t().contiguous() for w in ws]
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            entry = {
                "cublas_us": _rotating_us(F.linear, ws, x),
                "cublas_transposed_us": _rotating_us(lambda a, b: a @ b, wts, x),
            }
            want = F.linear(x, ws[0]).float()
            for kind in ("pointer", "tma"):
                best = None
                for config in configs():
                    try:
                        us = _rotating_us(
                            lambda a, b, c=config, t=kind: triton_linear(t, a, b, c), ws, x
                        )
                    except Exception as error:  # noqa: BLE001 (a config that does not build)
                        entry.setdefault(f"{kind}_errors", []).append(f"{config}: {error}"[:200])
                        continue
                    if best is None or us < best[0]:
                        best = (us, config)
                if best is not None:
                    diff = (triton_linear(kind, x, ws[0], best[1]).float() - want).abs().max()
                    entry.update(
                        {
                            f"{kind}_us": best[0],
                            f"{kind}_config": best[1],
                            f"{kind}_max_abs_diff": float(diff),
                        }
                    )
            row[name] = entry
            print(
                m,
                name,
                {key: v for key, v in entry.items() if not key.endswith("errors")},
                flush=True,
            )
            del ws, wts
        results["rows"][str(m)] = row
        with open(os.path.join(os.environ.get("OUT", "."), "gemm-triton-rows.json"), "w") as f:
            json.dump(results, f, indent=1)  # after every row count: a cut run keeps its rows


if __name__ == "__main__":
    if "--smoke" in sys.argv:
        smoke()
    else:
        args = [a for a in sys.argv[1:] if not a.startswith("--")]
        main([int(r) for r in args[0].split(",")] if args else [64, 128, 192, 256])
