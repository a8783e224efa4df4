"""One PNG of a head study measured over several `tandem bench spec` runs (one dataset).

Usage: head_study_plot.py OUT.png SPEC.json [SPEC.json ...] [--tokens HEAD=N ...]

The runs of all the JSONs (the first batch size of each) are drawn together; ``--tokens``
sets a head's training tokens where its config's count is partial (a head continued from
one whose count it lacks), from the runs its lineage records."""

import argparse
import json

from tandem.bench.spec import plot_study

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("specs", nargs="+")
parser.add_argument("--tokens", action="append", default=[], help="HEAD=N")
args = parser.parse_args()
tokens = dict(item.rsplit("=", 1) for item in args.tokens)
merged: dict = {"config": None, "runs": []}
for path in args.specs:
    with open(path) as f:
        results = json.load(f)
    merged["config"] = merged["config"] or results["config"]
    first = results["runs"][0]["batch_size"]
    for run in results["runs"]:
        if run["batch_size"] == first:
            if run["head"] in tokens:
                run = {**run, "training_tokens": int(tokens[run["head"]])}
                run["training_tokens_complete"] = True
            merged["runs"].append(run)
plot_study(merged, args.out)
print(f"{len(merged['runs'])} heads -> {args.out}")
