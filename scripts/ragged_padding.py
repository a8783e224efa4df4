"""How many padding tokens the ragged graphs would run in the steady rows, per list of padded
sizes, on the CPU. The steady workload of ``bench decode`` (256 ShareGPT requests at their
own lengths up to 256 tokens, 64 at a time, 2,048-token steps) runs through ``dummy:tiny``
given the 8B shape's context (8,192), so the same requests are drawn: plain decoding with
overlap, then MTP with overlap and the oracle proposer at rate 0 (every draft accepted, as in
the H100 runs) at k = 1 and 2. Every ragged forward (prompt chunks, alone or beside decode
or verification rows) asks ``padded_size`` for a graph; a recorder in the graphs' place
notes its token count and answers none (the step runs eagerly, as it does on the CPU
anyway). The MTP engines' steps go whole, as the 8B shape's do (``split_steps`` off), and
the runs take the steps the H100's did (981 and 336 against 980 and 336 at k = 2). Counts,
not times: on a GPU a ragged step's GEMMs run over the padded count, so ``padded / real`` is
what the graphs' padding multiplies the ragged steps' GEMM work by where the rows are many
enough for the GEMMs to grow with them (the 8B shape's, past ~128 rows).

Usage: .venv/bin/python scripts/ragged_padding.py OUT.json [--requests 256]
"""

from __future__ import annotations

import argparse
import json
import subprocess

from tandem import LLM
from tandem.bench.decode_oracle import record_continuations
from tandem.bench.decode_runs import steady_requests, steady_run
from tandem.worker.ragged_graphs import ragged_token_sizes

CONTEXT = 8192  # the 8B shape's, so the steady requests are the ones its rows draw
BUDGET = 2048  # max_num_batched_tokens, the default
MODES = (("plain, overlap", None), ("oracle k = 1, overlap", 1), ("oracle k = 2, overlap", 2))


class PaddingRecorder:
    """Stands where the runner's ragged graphs would: notes each ragged batch's token count
    and answers that no graph fits. A batch of rows all ``uniform`` long (one token, or
    1 + k) is left out: on a GPU the uniform decode graphs take it first (``cuda_graphs``),
    on the CPU, without them, it comes here."""

    def __init__(self, uniform: tuple[int, ...]):
        self.uniform = uniform
        self.token_counts: list[int] = []

    def padded_size(self, batch) -> None:
        lens = batch.query_lens
        if not (lens[0] in self.uniform and all(length == lens[0] for length in lens)):
            self.token_counts.append(sum(lens))
        return None


def padding(token_counts: list[int], sizes: list[int]) -> dict:
    """The padded tokens of ``token_counts`` under ``sizes`` (the smallest size that fits)."""
    padded = [next(size for size in sizes if size >= count) for count in token_counts]
    real = sum(token_counts)
    return {
        "graphs": len(sizes),
        "real_tokens": real,
        "padded_tokens": sum(padded),
        "padded_over_real": sum(padded) / real if real else None,
    }


def powers_of_two(max_tokens: int) -> list[int]:
    """The sizes before four a doubling (main to 6c052f3): 16, 32, ... and ``max_tokens``."""
    sizes = [16]
    while sizes[-1] * 2 < max_tokens:
        sizes.append(sizes[-1] * 2)
    return sizes + [max_tokens]


def size_lists() -> dict[str, list[int]]:
    return {
        "powers of two (before)": powers_of_two(BUDGET),
        "four a doubling past 128 (ragged_token_sizes)": ragged_token_sizes(BUDGET),
    }


def engine(k: int | None, seqs: int) -> LLM:
    extra = {}
    if k is not None:
        extra = {"speculative": "oracle", "num_speculative_tokens": k, "oracle_corruption": 0.0}
    return LLM(
        "dummy:tiny",
        device="cpu",
        max_num_seqs=seqs,
        max_num_batched_tokens=BUDGET,
        max_model_len=CONTEXT,
        overlap=True,
        **extra,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    recorder_engine = engine(None, args.batch)  # its own: no prefix hits in the runs after
    requests = steady_requests(recorder_engine, args.requests, args.max_tokens)
    prompts = [{"prompt_token_ids": list(r.prompt)} for r in requests]
    lengths = [r.output_len + 2 for r in requests]
    recordings, _ = record_continuations(recorder_engine, prompts, lengths)
    recorder_engine.engine.shutdown()
    results = {
        "commit": commit,
        "requests": len(requests),
        "mean_prompt_tokens": sum(r.prompt_len for r in requests) / len(requests),
        "requested_output_tokens": sum(r.output_len for r in requests),
        "modes": [],
    }
    for name, k in MODES:
        llm = engine(k, args.batch)
        if k is not None:
            llm.engine.runner.proposer.set_recordings(recordings)
        recorder = PaddingRecorder((1,) if k is None else (1, 1 + k))
        llm.engine.runner.ragged_graphs = recorder
        llm.engine.pipeline.split_steps = False  # steps go whole, as on the 8B shape
        run = steady_run(llm, requests, args.batch, k, args.max_tokens, recordings if k else None)
        entry = {
            "mode": name,
            "steps": run["num_steps"],
            "ragged_forwards": len(recorder.token_counts),
            "mean_acceptance_length": run.get("mean_acceptance_length"),
            "recording_match": run.get("recording_match"),
            "token_counts": recorder.token_counts,
            "padding": {
                label: padding(recorder.token_counts, sizes)
                for label, sizes in size_lists().items()
            },
        }
        results["modes"].append(entry)
        print(json.dumps({key: v for key, v in entry.items() if key != "token_counts"}), flush=True)
        llm.engine.shutdown()
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
