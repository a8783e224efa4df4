"""The Llama-3-8B shape's GEMMs (bf16, cuBLAS through ``torch.nn.functional.linear``) at 64,
128, 192 and 256 rows: a decode step of batch 64 runs them at 64 rows, a verification step
at 64 x (k + 1). Four weight copies per shape rotate so that the weights are read from HBM,
not L2; each shape is timed over 100 launches with CUDA events. Writes
``$OUT/gemm-m-h200.json``: per row count, microseconds per GEMM and the whole step's GEMM
time (32 layers of q/k/v, o, gate/up and down, and the LM head).

Usage (on a GPU): OUT=DIR python3 scripts/gemm_rows_bench.py
"""

import json
import os

import torch

torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
shapes = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
lm = (4096, 128256)
res = {}
for M in (64, 128, 192, 256):
    tot = 0.0
    row = {}
    for name, (k, n) in list(shapes.items()) + [("lm_head", lm)]:
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
        x = torch.randn(M, k, device="cuda", dtype=torch.bfloat16)
        for _ in range(5):
            for w in ws:
                torch.nn.functional.linear(x, w)
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(True), torch.cuda.Event(True)
        s.record()
        for _ in range(25):
            for w in ws:
                torch.nn.functional.linear(x, w)
        e.record()
        torch.cuda.synchronize()
        us = s.elapsed_time(e) * 1000 / 100
        row[name] = round(us, 1)
        tot += us * (32 if name != "lm_head" else 1)
        del ws
    row["step_gemm_ms"] = round(tot / 1000, 3)
    res[M] = row
    print(M, row, flush=True)
json.dump(res, open(os.environ["OUT"] + "/gemm-m-h200.json", "w"), indent=1)
