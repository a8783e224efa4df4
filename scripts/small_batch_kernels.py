"""On a GPU: two batch-1 kernels of SmolLM2's MTP step that another launch could drop or
shorten, each timed the way a step's CUDA graph runs it (many launches captured in one
graph, the replay timed: the gaps between kernels included):

- paged attention, 9 query and 3 KV heads of 64, one request with 1 or 4 query rows over
  contexts of 128 to 4,096 keys: the split count the engine picks (flash-decoding: the
  split kernel and its combination, two launches) against one split (one launch); and the
  layer's whole attention, the rotation-and-store kernel then the attention launch,
  against the attention launch that rotates and stores itself (``new_keys``);
- the vocabulary argmax of 1, 4 and 64 rows of 49,152 logits: the bf16 logits cast to
  fp32, then torch's argmax, against torch's argmax of the bf16 logits (the same token: the
  cast is exact and keeps the order) and ``argmax.argmax_rows`` (one Triton launch).

Each variant's output is checked against the engine's way (attention within bf16 rounding,
argmax equal). ``--smoke`` runs every case once, untimed, on whatever device there is
(the attention under Triton's interpreter on the CPU). Writes JSON.

Usage: python scripts/small_batch_kernels.py OUT.json [--smoke]
"""

from __future__ import annotations

import argparse
import json
from functools import partial

import torch
import triton.testing

from tandem.layers.argmax import argmax_rows
from tandem.layers.fused_rotary import rotary_store_kv
from tandem.layers.rotary import RotaryEmbedding
from tandem.layers.triton_attention import NewKeys, num_kv_splits, paged_attention

H_Q, H_KV, HEAD_DIM, BLOCK = 9, 3, 64, 16
VOCAB = 49_152
CONTEXTS = (128, 256, 512, 1024, 2048, 4096)


def graph_us(fn, device: torch.device) -> float | None:
    """Microseconds per call of ``fn`` replayed from a CUDA graph of many calls (Triton's
    ``do_bench_cudagraph``: the gaps between kernels included); None off CUDA, where
    ``fn`` runs once."""
    if device.type != "cuda":
        fn()
        return None
    return triton.testing.do_bench_cudagraph(fn, return_mode="min") * 1000


def attention_cases(device: torch.device, dtype: torch.dtype, contexts) -> list[dict]:
    rows = []
    rotary = RotaryEmbedding(HEAD_DIM, max(contexts) + 8, 10000.0, None).to(device)
    for query_len in (1, 4):
        for context in contexts:
            seq_len = context + query_len
            blocks = -(-seq_len // BLOCK)
            k_cache = torch.randn((blocks + 1, BLOCK, H_KV, HEAD_DIM), dtype=dtype, device=device)
            v_cache = torch.randn_like(k_cache)
            args = (
                torch.randn((query_len, H_Q, HEAD_DIM), dtype=dtype, device=device),
                k_cache,
                v_cache,
                torch.arange(1, blocks + 1, dtype=torch.int32, device=device).unsqueeze(0),
                torch.tensor([0, query_len], dtype=torch.int32, device=device),
                torch.tensor([seq_len], dtype=torch.int32, device=device),
                query_len,
                HEAD_DIM**-0.5,
            )
            engine_splits = num_kv_splits(1, H_KV, 16)  # the engine's choice on CUDA
            attend = partial(paged_attention, *args)
            reference = attend(num_splits=engine_splits)
            row = {"query_len": query_len, "context": context, "engine_splits": engine_splits}
            for splits in sorted({engine_splits, 1}):
                out = attend(num_splits=splits)
                row[f"max_abs_diff_splits_{splits}"] = (out - reference).abs().max().item()
                run = partial(attend, num_splits=splits)
                row[f"us_splits_{splits}"] = graph_us(run, device)
            row.update(_layer_attention(args, rotary, engine_splits, device))
            rows.append(row)
    return rows


def _layer_attention(args, rotary, splits: int, device: torch.device) -> dict:
    """A layer's attention from the projection's unrotated queries and keys: the rotation
    kernel (which stores the keys and values) then the attention launch, against the one
    launch that rotates and stores itself; outputs and caches compared."""
    q, k_cache, v_cache, tables, starts, seq_lens, query_len, scale = args
    context = int(seq_lens[0]) - query_len
    qk = torch.randn((query_len, H_Q + H_KV, HEAD_DIM), dtype=q.dtype, device=device)
    v = torch.randn((query_len, H_KV, HEAD_DIM), dtype=q.dtype, device=device)
    positions = torch.arange(context, context + query_len, device=device)
    slots = positions + BLOCK  # block i holds positions of logical block i - 1
    rest = (tables, starts, seq_lens, query_len, scale)
    options = {"num_splits": splits}
    caches = [(k_cache.clone(), v_cache.clone()) for _ in range(2)]

    def two_launches(k_cache=caches[0][0], v_cache=caches[0][1]):
        q = rotary_store_kv(qk, v, positions, rotary.cos, rotary.sin, k_cache, v_cache, slots, H_Q)
        return paged_attention(q, k_cache, v_cache, *rest, **options)

    new_keys = NewKeys(qk[:, H_Q:], v, rotary.cos, rotary.sin, slots)
    rotating = partial(
        paged_attention, qk[:, :H_Q], *caches[1], *rest, **options, new_keys=new_keys
    )
    out_two, out_one = two_launches(), rotating()
    return {
        "rotating_max_abs_diff": (out_one - out_two).abs().max().item(),
        "rotating_same_caches": all(torch.equal(a, b) for a, b in zip(*caches, strict=True)),
        "us_rotate_then_attend": graph_us(two_launches, device),
        "us_rotating": graph_us(rotating, device),
    }


def _cast_then_argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.float().argmax(dim=-1)


def argmax_cases(device: torch.device, num_rows) -> list[dict]:
    rows = []
    for count in num_rows:
        logits = torch.randn((count, VOCAB), device=device).to(torch.bfloat16)
        logits[:, 7] = logits[:, 3] = logits.max() + 1  # a tie: the first index wins
        engine = logits.float().argmax(dim=-1)
        bf16 = logits.argmax(dim=-1)
        one_launch = argmax_rows(logits, use_triton=True)
        rows.append(
            {
                "rows": count,
                "same_tokens": bool(torch.equal(engine, bf16)),
                "same_tokens_one_launch": bool(torch.equal(engine, one_launch)),
                "us_cast_then_argmax": graph_us(partial(_cast_then_argmax, logits), device),
                "us_bf16_argmax": graph_us(partial(torch.argmax, logits, dim=-1), device),
                "us_one_launch_argmax": graph_us(partial(argmax_rows, logits, True), device),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    results = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "attention": attention_cases(device, dtype, CONTEXTS[:2] if args.smoke else CONTEXTS),
        "argmax": argmax_cases(device, (1, 4) if args.smoke else (1, 4, 64)),
    }
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    for section in ("attention", "argmax"):
        for row in results[section]:
            print(section, row)


if __name__ == "__main__":
    main()
