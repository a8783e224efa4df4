"""Which cuBLAS path runs a verification step's GEMMs fastest? The 8B shape's projections at
64 x (k + 1) rows through ``F.linear`` as the engine calls it, against other ways to ask
cuBLAS for the same product: the cuBLASLt backend (``preferred_blas_library``), PyTorch's
TunableOp (each shape tuned once, then replayed), the output columns in two GEMMs (other
tiles, another wave count), the rows padded to 256, and the weights stored transposed
([in, out], ``x @ w``: cuBLAS's other operand layout and its kernels), plain and tuned.
Four weight copies per shape rotate so that the weights come from HBM; each path is timed
over 100 launches with CUDA events and checked against ``F.linear`` (its largest absolute
difference).

Usage (on a GPU): OUT=DIR python3 scripts/gemm_cublas_paths.py [ROWS,...]
Writes ``$OUT/gemm-cublas-paths.json`` after every row count.
"""

import contextlib
import json
import os
import sys

import torch
import torch.nn.functional as F

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
PADDED_ROWS = 256


@contextlib.contextmanager
def _blas(library: str):
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(library)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(before)


@contextlib.contextmanager
def _tunable():
    tunable = torch.cuda.tunable
    if hasattr(tunable, "write_file_on_exit"):  # not in every torch
        tunable.write_file_on_exit(False)
    tunable.enable(True)
    tunable.tuning_enable(True)
    try:
        yield
    finally:
        tunable.enable(False)


def _split(x, w):
    half = w.shape[0] // 2
    return torch.cat([F.linear(x, w[:half]), F.linear(x, w[half:])], dim=1)


def _split_only(x, w):  # the two GEMMs without the concatenation (what fused outputs cost)
    half = w.shape[0] // 2
    F.linear(x, w[:half])
    return F.linear(x, w[half:])


def _padded(x, w):
    rows = torch.zeros(PADDED_ROWS, x.shape[1], device=x.device, dtype=x.dtype)
    rows[: x.shape[0]] = x
    return F.linear(rows, w)[: x.shape[0]]


def _timed_us(fn, x, weights) -> float:
    for _ in range(3):  # warm-up (and TunableOp's tuning)
        for w in weights:
            fn(x, w)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(25):
        for w in weights:
            fn(x, w)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (25 * len(weights))


def main(rows: list[int]) -> None:
    paths = {
        "linear": (F.linear, contextlib.nullcontext),
        "cublaslt": (F.linear, lambda: _blas("cublaslt")),
        "tunable": (F.linear, _tunable),
        "two_gemms": (_split, contextlib.nullcontext),
        "two_gemms_no_cat": (_split_only, contextlib.nullcontext),
        "padded_256": (_padded, contextlib.nullcontext),
        "weights_in_out": (torch.mm, contextlib.nullcontext),
        "weights_in_out_tunable": (torch.mm, _tunable),
    }
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": {}}
    for m in rows:
        row = {}
        for name, (k, n) in SHAPES.items():
            weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            want = F.linear(x, weights[0]).float()
            entry = {}
            transposed = [w.t().contiguous() for w in weights]  # [in, out], for torch.mm
            for path, (fn, context) in paths.items():
                if path == "padded_256" and m >= PADDED_ROWS:
                    continue
                stored = transposed if path.startswith("weights_in_out") else weights
                with context():
                    entry[f"{path}_us"] = round(_timed_us(fn, x, stored), 2)
                    if path != "two_gemms_no_cat":
                        diff = (fn(x, stored[0]).float() - want).abs().max().item()
                        entry[f"{path}_max_abs_diff"] = diff
            row[name] = entry
            print(m, name, entry, flush=True)
            del weights, transposed
        results["rows"][str(m)] = row
        with open(os.path.join(os.environ.get("OUT", "."), "gemm-cublas-paths.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    main([int(r) for r in args[0].split(",")] if args else [64, 128, 192, 256])
