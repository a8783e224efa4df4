"""``tandem train-mtp``: its options and the run (``mtp_distill`` trains the head)."""

from __future__ import annotations

import json

import torch

from tandem.train.mtp_data import build_data
from tandem.train.mtp_distill import TrainConfig, train_mtp


def add_cli_arguments(parser) -> None:
    """Options of ``tandem train-mtp``."""
    parser.add_argument("--model", default=None, help="base model (default: SmolLM2-135M)")
    parser.add_argument("--out", required=True, help="directory for the head")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="float32 or bfloat16")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--eval-every", type=int, default=200)
    parser.add_argument(
        "--time-budget",
        type=float,
        default=None,
        help="stop after this many seconds (the schedule shortens to fit)",
    )
    parser.add_argument("--num-conversations", type=int, default=4000)
    parser.add_argument("--num-self-generated", type=int, default=1000)
    parser.add_argument("--data", default=None, help="token data saved by --save-data")
    parser.add_argument("--save-data", default=None, help="save the packed data and exit")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--num-layers",
        type=int,
        default=1,
        help="MTP layers of a new head (a continued head with fewer grows, copying its last)",
    )
    parser.add_argument(
        "--no-chain-attention",
        dest="chain_attention",
        action="store_false",
        help="train repeated depths with causal attention over their own rows (older heads)",
    )
    parser.add_argument(
        "--init-head",
        default=None,
        help="continue training this head directory instead of starting anew",
    )
    parser.add_argument(
        "--feature-layers",
        type=lambda text: tuple(int(i) for i in text.split(",")),
        default=(),
        help="base layers (comma-separated, ending with the last) the first draft takes fused",
    )
    parser.add_argument(
        "--teacher-temperature",
        type=float,
        default=1.0,
        help="distill from the base's distribution at this temperature (below 1: sharper)",
    )


def main_from_args(args) -> int:
    """Run ``tandem train-mtp``."""
    if args.data:
        data = torch.load(args.data)
    else:
        data = build_data(
            args.model,
            args.num_conversations,
            args.num_self_generated,
            args.seq_len,
            args.device,
            args.seed,
        )
    if args.save_data:
        torch.save(data, args.save_data)
        print(f"saved {tuple(data['train'].shape)} train rows to {args.save_data}")
        return 0
    dtype_name = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    config = TrainConfig(
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        lr=args.lr,
        eval_every=args.eval_every,
        seed=args.seed,
        time_budget_s=args.time_budget,
        init_head=args.init_head,
        num_layers=args.num_layers,
        chain_attention=args.chain_attention,
        teacher_temperature=args.teacher_temperature,
        feature_layers=args.feature_layers,
    )
    _, summary = train_mtp(
        args.model,
        data["train"],
        data["eval"],
        config,
        args.device,
        getattr(torch, dtype_name),
        args.out,
    )
    print(json.dumps(summary["history"][-1]))
    return 0
