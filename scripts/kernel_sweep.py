"""On a GPU: time the Triton paged attention kernel's launch variants (key tile, warps,
pipeline stages) on Llama-3-8B-shaped decode and prefill batches, the 8B's GEMMs at the
same batch sizes, and the top-k/top-p threshold search against a sort of the vocabulary.
Writes JSON.

Usage: python scripts/kernel_sweep.py OUT_DIR [SECTIONS]   (default attention,gemm,sampling)
"""

from __future__ import annotations

import itertools
import json
import sys
import time

import torch
import triton.testing

from tandem.layers.sampling_kernels import filter_threshold, filter_threshold_reference
from tandem.layers.triton_attention import paged_attention

H_Q, H_KV, D, BLOCK = 32, 8, 128, 16
HIDDEN, INTERMEDIATE = 4096, 14336


def make_batch(query_lens: list[int], ctx_lens: list[int], generator: torch.Generator):
    """A ragged batch over a paged cache with shuffled (non-contiguous) block tables."""
    seq_lens = [c + q for c, q in zip(ctx_lens, query_lens, strict=True)]
    blocks_per = [-(-s // BLOCK) for s in seq_lens]
    num_blocks = sum(blocks_per) + 1
    order = torch.randperm(num_blocks - 1, generator=generator) + 1
    width = max(blocks_per)
    table = torch.zeros((len(seq_lens), width), dtype=torch.int32)
    used = 0
    for b, n in enumerate(blocks_per):
        table[b, :n] = order[used : used + n]
        used += n
    k_cache = torch.randn((num_blocks, BLOCK, H_KV, D), dtype=torch.bfloat16, device="cuda")
    v_cache = torch.randn_like(k_cache)
    q = torch.randn((sum(query_lens), H_Q, D), dtype=torch.bfloat16, device="cuda")
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    return {
        "q": q,
        "k_cache": k_cache,
        "v_cache": v_cache,
        "block_tables": table.cuda(),
        "query_start_loc": torch.tensor(starts, dtype=torch.int32, device="cuda"),
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
        "max_query_len": max(query_lens),
        "min_query_len": min(query_lens),
        "kv_bytes": sum(seq_lens) * H_KV * D * 2 * 2,
    }


def cases(generator: torch.Generator) -> dict:
    def ragged(n, mean):
        return torch.randint(mean // 2, mean * 3 // 2, (n,), generator=generator).tolist()

    return {
        "decode_b800_ctx256": ([1] * 800, ragged(800, 256)),
        "decode_b256_ctx700": ([1] * 256, ragged(256, 700)),
        "decode_b64_ctx1500": ([1] * 64, ragged(64, 1500)),
        "mixed_b256_ctx500_plus_2x512": ([1] * 256 + [512, 512], ragged(256, 500) + [0, 256]),
        "prefill_16x700": ([700] * 16, [0] * 16),
    }


def sampling_thresholds() -> dict:
    """The per-row top-k / top-p threshold: the search kernel against the sort-based
    reference, both on the GPU, at the 8B's vocabulary."""
    vocab = 128_256
    timings = {}
    for rows in (64, 256):
        probs = torch.randn((rows, vocab), device="cuda").mul(4).softmax(dim=-1)
        filters = {
            "top_k=50": (torch.full((rows,), 50, device="cuda"), None),
            "top_p=0.9": (None, torch.full((rows,), 0.9, device="cuda")),
            "top_k=50,top_p=0.9": (
                torch.full((rows,), 50, device="cuda"),
                torch.full((rows,), 0.9, device="cuda"),
            ),
        }
        for name, (top_k, top_p) in filters.items():
            same = torch.equal(
                filter_threshold(probs, top_k, top_p, None),
                filter_threshold_reference(probs, top_k, top_p, None),
            )
            kernel = triton.testing.do_bench(
                lambda k=top_k, p=top_p, x=probs: filter_threshold(x, k, p, None)
            )
            sort = triton.testing.do_bench(
                lambda k=top_k, p=top_p, x=probs: filter_threshold_reference(x, k, p, None)
            )
            timings[f"{rows}x{vocab} {name}"] = {
                "kernel_ms": kernel,
                "sort_ms": sort,
                "equal": same,
            }
            print(
                f"threshold {rows}x{vocab} {name}: kernel {kernel:.3f} ms, sort {sort:.3f} ms,"
                f" equal {same}",
                flush=True,
            )
    return timings


def main(out_dir: str, sections: str = "attention,gemm,sampling") -> None:
    generator = torch.Generator().manual_seed(0)
    variants = [
        {"block_n": n, "num_warps": w, "num_stages": s}
        for n, w, s in itertools.product((32, 64, 128), (4, 8), (2, 3, 4))
    ]
    result = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "attention": {},
        "gemm": {},
    }
    for name, (query_lens, ctx_lens) in cases(generator).items():
        if "attention" not in sections:
            break
        batch = make_batch(query_lens, ctx_lens, generator)
        kv_bytes = batch.pop("kv_bytes")
        reference = paged_attention(**batch, scale=D**-0.5)
        rows = []
        for tuning in [None, *variants]:
            try:
                out = paged_attention(**batch, scale=D**-0.5, tuning=tuning)
                error = (out.float() - reference.float()).abs().max().item()
                ms = triton.testing.do_bench(
                    lambda t=tuning, b=batch: paged_attention(**b, scale=D**-0.5, tuning=t),
                    warmup=10,
                    rep=50,
                )
            except Exception as exc:  # noqa: BLE001 (a variant that fails to compile is data)
                rows.append({"tuning": tuning, "error": repr(exc)[:200]})
                continue
            rows.append(
                {
                    "tuning": tuning or "default",
                    "ms": ms,
                    "max_abs_diff": error,
                    "kv_gb_per_s": kv_bytes / ms / 1e6,
                }
            )
        timed = [r for r in rows if "ms" in r]
        best = min(timed, key=lambda r: r["ms"])
        result["attention"][name] = {
            "kv_bytes": kv_bytes,
            "default": timed[0],
            "best": best,
            "variants": rows,
        }
        print(
            f"{name}: default {timed[0]['ms']:.3f} ms ({timed[0]['kv_gb_per_s']:.0f} GB/s), "
            f"best {best['ms']:.3f} ms ({best['kv_gb_per_s']:.0f} GB/s) {best['tuning']}",
            flush=True,
        )
    shapes = {
        "qkv": (HIDDEN, 6144),
        "o": (HIDDEN, HIDDEN),
        "gate_up": (HIDDEN, 2 * INTERMEDIATE),
        "down": (INTERMEDIATE, HIDDEN),
        "lm_head": (HIDDEN, 128256),
    }
    for m in (64, 256, 512, 800, 1024, 8192) if "gemm" in sections else ():
        for name, (k, n) in shapes.items():
            x = torch.randn((m, k), dtype=torch.bfloat16, device="cuda")
            w = torch.randn((n, k), dtype=torch.bfloat16, device="cuda")
            ms = triton.testing.do_bench(
                lambda x=x, w=w: torch.nn.functional.linear(x, w), warmup=10, rep=50
            )
            result["gemm"][f"{name}_m{m}"] = {
                "ms": ms,
                "tflops": 2 * m * k * n / ms / 1e9,
                "weight_gb_per_s": n * k * 2 / ms / 1e6,
            }
        total = sum(result["gemm"][f"{n}_m{m}"]["ms"] for n in shapes if n != "lm_head")
        print(
            f"GEMMs of one layer at M={m}: {total:.3f} ms -> 32 layers {32 * total:.2f} ms",
            flush=True,
        )
    if "sampling" in sections:
        result["sampling"] = sampling_thresholds()
    path = f"{out_dir}/kernel-sweep-h200-{time.strftime('%Y%m%d-%H%M%S')}.json"
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main(*sys.argv[1:3])
