"""The command-line options of every command that starts an engine (``tandem serve``,
``tandem generate``), and the engine options they map to."""

from __future__ import annotations

import argparse


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Options shared by every command that starts an engine."""
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--dtype", default=None, help="float32, bfloat16 or float16")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument(
        "--kv-cache-memory-gb",
        type=float,
        default=None,
        help="KV cache size (default: 1 GB on the CPU; on CUDA the memory "
        "left under --gpu-memory-utilization)",
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="fraction of the GPU's memory the engine may use",
    )
    parser.add_argument(
        "--enforce-eager", action="store_true", help="no CUDA graphs: run every step eagerly"
    )
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--speculative",
        choices=["auto", "mtp", "none"],
        default="auto",
        help="speculative decoding: auto (MTP on CUDA when the model has a head; off on the "
        "CPU, where it is slower), mtp, or none",
    )
    parser.add_argument("--no-speculative", dest="speculative", action="store_const", const="none")
    parser.add_argument("--num-speculative-tokens", type=int, default=3)
    parser.add_argument(
        "--speculative-draft-schedule",
        type=draft_schedule,
        default=(),
        metavar="ROWS:DRAFTS,...",
        help="fewer drafts for larger batches, e.g. 32:2,64:1: a step of at least 32 rows "
        "verifies 2 drafts per request, of 64 or more 1 (default: "
        "--num-speculative-tokens at every batch size)",
    )
    parser.add_argument(
        "--speculative-model",
        default=None,
        help="MTP head directory (from tandem train-mtp) or 'dummy'",
    )
    parser.add_argument(
        "--no-overlap",
        action="store_true",
        help="run scheduling and the model in turn (overlap is on by default)",
    )
    parser.add_argument(
        "--attention-backend",
        choices=["torch", "triton"],
        default=None,
        help="paged attention: the torch reference or the Triton kernel "
        "(default: triton on CUDA, torch on the CPU)",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="shard the model over N processes, one per rank (GPU r for "
        "rank r); tandem serve starts them, tandem generate and the "
        "benchmarks run under torchrun",
    )


def draft_schedule(text: str) -> tuple[tuple[int, int], ...]:
    """``--speculative-draft-schedule``'s value: comma-separated ``ROWS:DRAFTS`` pairs."""
    pairs = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        rows, sep, drafts = item.partition(":")
        if not sep or not rows.strip().isdigit() or not drafts.strip().isdigit():
            raise argparse.ArgumentTypeError(
                f"expected ROWS:DRAFTS pairs such as 32:2,64:1, got {item!r}"
            )
        pairs.append((int(rows), int(drafts)))
    return tuple(pairs)


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The options of :func:`tandem.llm.engine_config` that ``args`` set."""
    return {
        "device": args.device,
        "dtype": args.dtype,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_model_len": args.max_model_len,
        "kv_cache_memory_gb": args.kv_cache_memory_gb,
        "enable_prefix_caching": not args.no_prefix_caching,
        "seed": args.seed,
        "speculative": None if args.speculative == "none" else args.speculative,
        "num_speculative_tokens": args.num_speculative_tokens,
        "speculative_model": args.speculative_model,
        "speculative_draft_schedule": args.speculative_draft_schedule,
        "overlap": not args.no_overlap,
        "attention_backend": args.attention_backend,
        "enforce_eager": args.enforce_eager,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "tensor_parallel_size": args.tensor_parallel_size,
    }
