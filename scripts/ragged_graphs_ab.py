"""The ragged steps' CUDA graphs (``tandem/worker/ragged_graphs.py``) on a GPU, in one process:

1. fp32: the engine with graphs against the eager one, plain and MTP (``--mtp-head``, k = 3),
   16 prompts of 50-300 tokens chunked by a 512-token step budget, 32 tokens each: equal
   tokens, the largest logprob difference, and how often the ragged graphs replayed.
2. bf16, batch 64, steady state: ``--requests`` prompts of 20-300 tokens asking for 20-256
   tokens each (``ignore_eos``), all submitted at once; plain decoding with overlap, then the
   oracle proposer (k = 3, corruption 0.456: acceptance length about 2) with overlap on the
   plain run's outputs; each engine timed with its ragged graphs on and off, alternating,
   twice.

The prompts are random token ids, so any model works, a dummy one too (``--tokenizer``
then names a tokenizer directory, since a dummy model has none). Writes JSON after each
stage.

Usage: python scripts/ragged_graphs_ab.py MODEL OUT.json [--tokenizer DIR] [--requests 192]
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from tandem import LLM, SamplingParams


def _check(build, engine: dict, prompts: list[dict]) -> dict:
    """Graphs against eager (fp32) for one engine kind."""
    runs = {}
    for eager in (False, True):
        started = time.perf_counter()
        llm = build(
            dtype="float32",
            kv_cache_memory_gb=2,
            max_num_batched_tokens=512,
            enforce_eager=eager,
            **engine,
        )
        built = time.perf_counter() - started
        params = SamplingParams(temperature=0.0, max_tokens=32, logprobs=2)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        ragged = llm.engine.runner.ragged_graphs
        runs[eager] = (outputs, ragged.num_replays if ragged else 0, built)
        llm.engine.shutdown()
        del llm
        torch.cuda.empty_cache()
    (graphed, replays, graphed_s), (eager, eager_replays, eager_s) = runs[False], runs[True]
    worst = 0.0
    for got, want in zip(graphed, eager, strict=True):
        for got_entry, want_entry in zip(
            got.outputs[0].logprobs, want.outputs[0].logprobs, strict=False
        ):
            for token, entry in want_entry.items():
                if token in got_entry:
                    worst = max(worst, abs(got_entry[token].logprob - entry.logprob))
    return {
        "same_tokens": sum(
            g.outputs[0].token_ids == e.outputs[0].token_ids
            for g, e in zip(graphed, eager, strict=True)
        ),
        "of": len(graphed),
        "max_logprob_diff": worst,
        "ragged_replays": replays,
        "eager_ragged_replays": eager_replays,
        "build_s_graphs": graphed_s,
        "build_s_eager": eager_s,
    }


def _timed(llm: LLM, prompts: list[dict], params: list[SamplingParams]) -> tuple[dict, list]:
    before = llm.get_metrics()
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    after = llm.get_metrics()
    steps = after["num_steps"] - before["num_steps"]
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    acceptance = None
    drafts = after.get("spec_decode_num_drafts", 0) - before.get("spec_decode_num_drafts", 0)
    if drafts:
        accepted = after["spec_decode_num_accepted_tokens"] - before.get(
            "spec_decode_num_accepted_tokens", 0
        )
        acceptance = 1 + accepted / drafts
    row = {
        "seconds": seconds,
        "steps": steps,
        "tokens": tokens,
        "tok_s": tokens / seconds,
        "ms_per_step": 1000 * seconds / steps,
        "acceptance": acceptance,
    }
    return row, outputs


def _alternate(llm: LLM, name: str, prompts, params) -> tuple[dict, list]:
    """Ragged graphs on, then off, twice, on one engine."""
    graphs = llm.engine.runner.ragged_graphs
    warm = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)] * 64
    llm.generate(prompts[:64], warm[: len(prompts[:64])], use_tqdm=False)
    rows: dict[str, list] = {}
    outputs: list = []
    for _ in range(2):
        for on in (True, False):
            llm.engine.runner.ragged_graphs = graphs if on else None
            row, outputs = _timed(llm, prompts, params)
            rows.setdefault(f"{name}_ragged_{'on' if on else 'off'}", []).append(row)
            print(name, "on" if on else "off", row, flush=True)
    llm.engine.runner.ragged_graphs = graphs
    return rows, outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("out")
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--requests", type=int, default=192)
    parser.add_argument("--mtp-head", default="dummy", help="speculative_model of the check")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    results: dict = {
        "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "model": args.model,
    }

    def save() -> None:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)

    def build(**options) -> LLM:
        return LLM(model=args.model, tokenizer=args.tokenizer, device=args.device, **options)

    rng = random.Random(0)
    vocab = 500 if "tiny" in args.model else 40000
    prompts = [
        {"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(rng.randrange(50, 300))]}
        for _ in range(16)
    ]
    mtp = {"speculative": "mtp", "num_speculative_tokens": 3, "speculative_model": args.mtp_head}
    for name, engine in (("plain", {}), ("mtp", mtp)):
        results[f"check_{name}"] = _check(build, engine, prompts)
        print(name, results[f"check_{name}"], flush=True)
        save()

    requests = [
        ([rng.randrange(3, vocab) for _ in range(rng.randrange(20, 300))], rng.randrange(20, 256))
        for _ in range(args.requests)
    ]
    steady = [{"prompt_token_ids": ids} for ids, _ in requests]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in requests]
    common = {
        "kv_cache_memory_gb": 16 if args.device.startswith("cuda") else 0.05,
        "max_num_seqs": 64,
        "overlap": True,
    }
    llm = build(**common)
    results["steady_plain"], outputs = _alternate(llm, "plain", steady, params)
    recordings = {
        tuple(p["prompt_token_ids"]): list(o.outputs[0].token_ids)
        for p, o in zip(steady, outputs, strict=True)
    }
    save()
    llm.engine.shutdown()
    del llm
    torch.cuda.empty_cache()
    llm = build(speculative="oracle", num_speculative_tokens=3, oracle_corruption=0.456, **common)
    llm.engine.runner.proposer.set_recordings(recordings)
    results["steady_oracle"], _ = _alternate(llm, "oracle", steady, params)
    save()
    llm.engine.shutdown()


if __name__ == "__main__":
    main()
