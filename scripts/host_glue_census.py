"""On the CPU: the host's work around the CUDA graphs of an MTP step, with the GPU's graph
path simulated. The graph runners (ragged, prompt drafts, draft chain, resolved steps) are
built but not captured, so their captured functions run eagerly, timed apart and left out;
what remains is the glue the host runs on a GPU too: building inputs, the small copies and
eager ops between the replays, drafting's bookkeeping. (The uniform decode graphs have no
eager form: steps that would take them run eagerly and are not counted here.)

Per step kind (``prompt``: a joining prompt's ragged step, drafted at its launch;
``resolved``: an MTP step resolved on the device; ``mixed``: resolved rows and prompt chunks in
one forward), the host's microseconds per launch
outside the graphs' functions, the same per named part of it (``PARTS``; parts nest, each
timed whole), and the device ops it dispatches there (a second pass under a dispatch
counter, views not counted). The H200's host measured about 1.4-2.4x these CPU
figures for both kinds (benchmarks/README.md): compare runs of this script with each other,
in one call, not with a GPU.

Usage: python scripts/host_glue_census.py OUT.json [--model dummy:tiny] [--requests 40]
       [--max-tokens 24]
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton attention on the CPU

import argparse
import collections
import functools
import json
import time

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tandem import LLM, SamplingParams
from tandem.worker import (
    cuda_graphs,
    input_batch,
    model_runner,
    ragged_graphs,
    request_slots,
    step_pipeline,
)
from tandem.worker.spec_decode import (
    draft_graphs,
    mtp_steps,
    prompt_draft_graphs,
    proposer,
    step_graphs,
)

GRAPH_FUNCTIONS = [  # what a replay runs: timed apart, not glue
    (ragged_graphs.RaggedGraphRunner, "forward"),
    (prompt_draft_graphs.PromptDraftGraphs, "forward"),
    (draft_graphs.DraftGraphRunner, "_chain"),
    (step_graphs.ResolvedStepGraphs, "_step"),
    (step_graphs.ResolvedStepGraphs, "_sampled_step"),
]
PARTS = [  # named parts of a launch, each timed less the graphs' functions inside it
    (input_batch.InputBatch, "prepare"),
    (model_runner.ModelRunner, "forward"),
    (step_pipeline, "sample_step"),
    (mtp_steps.MTPSteps, "draft_at_launch"),
    (prompt_draft_graphs.PromptDraftGraphs, "propose"),
    (proposer.MTPProposer, "graphed_drafts"),
    (draft_graphs.DraftGraphRunner, "run"),
    (request_slots.RequestSlots, "write"),
    (mtp_steps.MTPSteps, "launch_resolved"),
]
VIEWS = ("slice", "detach", "alias", "unsqueeze", "view", "unbind", "lift_fresh", "resolve_")


class Census:
    """Per step kind: the host's time in launches less the graphs' functions in them (also
    per named part), the launches, and (while counting) the device ops dispatched outside
    those functions."""

    def __init__(self):
        self.kind, self.depth = "other", 0
        self.graph_seconds = 0.0
        self.glue = collections.Counter()
        self.parts = collections.defaultdict(collections.Counter)
        self.launches = collections.Counter()
        self.ops = collections.Counter()

    def launch(self, fn):
        @functools.wraps(fn)
        def wrapper(pipeline, step, resolvable=None, resolved_rows=None):
            kind = "resolved" if resolvable else "prompt" if resolvable is False else "other"
            self.kind = "mixed" if resolved_rows else kind
            start, graphs = time.perf_counter(), self.graph_seconds
            try:
                return fn(pipeline, step, resolvable, resolved_rows)
            finally:
                spent = time.perf_counter() - start - (self.graph_seconds - graphs)
                self.glue[self.kind] += spent
                self.launches[self.kind] += 1
                self.kind = "other"

        return wrapper

    def part(self, fn, label: str):
        """``fn`` timed as part ``label`` of the launch it runs in (parts nest: each is
        timed whole, less the graphs' functions)."""

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            start, graphs = time.perf_counter(), self.graph_seconds
            try:
                return fn(*args, **kwargs)
            finally:
                spent = time.perf_counter() - start - (self.graph_seconds - graphs)
                self.parts[self.kind][label] += spent

        return wrapper

    def graph(self, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            self.depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.depth -= 1
                if not self.depth:
                    self.graph_seconds += time.perf_counter() - start

        return wrapper


def _generate(llm, prompts, params) -> None:
    """Generate, and stop the census if a request failed (a failed launch ends only its
    requests: counted on, it would leave a kind out silently)."""
    for output in llm.generate(prompts, params, use_tqdm=False):
        reason = output.outputs[0].finish_reason
        if reason != "length":
            raise SystemExit(f"request {output.request_id} ended with {reason!r}, not 'length'")


class _CountOps(TorchDispatchMode):
    def __init__(self, census):
        super().__init__()
        self.census = census

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func).split(".")[1] if "." in str(func) else str(func)
        if not self.census.depth and not name.startswith(VIEWS):
            self.census.ops[self.census.kind] += 1
        return func(*args, **(kwargs or {}))


def _simulate_graphs(census: Census) -> None:
    """The GPU's graph path on the CPU: runners built, nothing captured, graphs' functions
    timed apart."""
    model_runner.ModelRunner.uses_cuda_graphs = property(lambda self: True)
    for cls in (
        cuda_graphs.CudaGraphRunner,
        ragged_graphs.RaggedGraphRunner,
        draft_graphs.DraftGraphRunner,
        prompt_draft_graphs.PromptDraftGraphs,
        step_graphs.ResolvedStepGraphs,
    ):
        cls.capture = lambda self: None
    for cls, name in GRAPH_FUNCTIONS:
        setattr(cls, name, census.graph(getattr(cls, name)))
    for owner, name in PARTS:
        label = f"{owner.__qualname__}.{name}" if isinstance(owner, type) else name
        setattr(owner, name, census.part(getattr(owner, name), label))
    step_pipeline.StepPipeline.launch = census.launch(step_pipeline.StepPipeline.launch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("--model", default="dummy:tiny")
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args()
    census = Census()
    _simulate_graphs(census)
    torch.set_num_threads(1)
    head = {"speculative_model": "dummy"} if args.model.startswith("dummy:") else {}
    llm = LLM(model=args.model, device="cpu", speculative="mtp", num_speculative_tokens=3,
              overlap=True, max_num_seqs=1, attention_backend="triton", dtype="float32",
              **head)  # fmt: skip
    llm.engine.runner.graphs = None  # the uniform graphs have no eager form
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(1, 500, 100).tolist()} for _ in range(4)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    _generate(llm, prompts, params)  # warm-up
    census.glue.clear()
    census.parts.clear()
    census.launches.clear()
    runs = [{"prompt_token_ids": rng.integers(1, 500, 100).tolist()} for _ in range(args.requests)]
    for prompt in runs:
        _generate(llm, [prompt], params)
    launches, glue = dict(census.launches), dict(census.glue)
    parts = {kind: dict(spent) for kind, spent in census.parts.items()}
    census.launches.clear()
    with _CountOps(census):
        for prompt in runs[:4]:
            _generate(llm, [prompt], params)
    counted = dict(census.launches)
    results = {
        "model": args.model,
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "kinds": {
            kind: {
                "launches": launches[kind],
                "glue_us_per_launch": 1e6 * glue[kind] / launches[kind],
                "ops_per_launch": census.ops[kind] / counted.get(kind, 1),
                "parts_us_per_launch": {
                    label: 1e6 * spent / launches[kind]
                    for label, spent in sorted(parts.get(kind, {}).items(), key=lambda p: -p[1])
                },
            }
            for kind in ("prompt", "resolved", "mixed")
            if launches.get(kind)
        },
    }
    llm.engine.shutdown()
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(json.dumps(results["kinds"]))


if __name__ == "__main__":
    main()
