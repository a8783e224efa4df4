"""Time one fp32 linear layer (SmolLM2's 576 -> 1536) on the CPU at 1, 2, 4, 8, 16 rows:
the cost of verifying k + 1 tokens instead of decoding one."""

import time

import torch

weight = torch.randn(1536, 576)
for rows in (1, 2, 4, 8, 16):
    x = torch.randn(rows, 576)
    for _ in range(50):
        torch.nn.functional.linear(x, weight)
    start = time.perf_counter()
    for _ in range(2000):
        torch.nn.functional.linear(x, weight)
    print(f"{rows:2d} rows: {(time.perf_counter() - start) / 2000 * 1e6:7.1f} us")
