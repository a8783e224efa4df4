"""``tandem bench spec``: MTP acceptance on held-out prompts and tokens/s against no
speculation, at given batch sizes, for one head or the several heads of a training study.

Held-out prompts only: MT-Bench's first turns (never used in training), or ShareGPT first
user turns from records at index ``--sharegpt-skip`` (16,000) on, past every conversation
``tandem train-mtp`` and ``scripts/prepare_mtp_data.py`` take (the first 15,200 usable ones
for the shipped head). Per head the JSON gives the mean acceptance length, the per-position
acceptance rates and the tokens the head was trained on (from its ``mtp_config.json``);
``--plot`` draws acceptance length against training tokens for the study.
"""

from __future__ import annotations

import math
import os

from tandem.bench.datasets import SHAREGPT_HELD_OUT_FROM, iter_sharegpt, load_mtbench
from tandem.bench.results import result_path, write_json
from tandem.bench.timing import timed_generate
from tandem.models.mtp_files import head_training_tokens

DATASETS = ("mtbench", "sharegpt")


def first_turns(dataset: str, num_prompts: int, sharegpt_skip: int = SHAREGPT_HELD_OUT_FROM):
    """The first user turns of ``num_prompts`` held-out conversations (texts)."""
    if dataset == "mtbench":
        return [q["turns"][0] for q in load_mtbench()[:num_prompts]]
    if dataset != "sharegpt":
        raise ValueError(f"dataset must be one of {DATASETS}, got {dataset!r}")
    turns = []
    for index, record in enumerate(iter_sharegpt()):
        if index < sharegpt_skip:
            continue
        first = (record.get("conversations") or [{}])[0]
        if first.get("from") == "human" and isinstance(first.get("value"), str):
            if first["value"].strip():
                turns.append(first["value"])
        if len(turns) == num_prompts:
            return turns
    raise ValueError(
        f"ShareGPT has {len(turns)} usable first turns from record {sharegpt_skip} on, "
        f"{num_prompts} asked for"
    )


def category_acceptance(llm, prompts: list, categories: list[str], params, k: int) -> dict:
    """Each category's acceptance: its prompts as one ``generate`` (a category's rows
    together, the batch its size), in first-seen order: ``{category: {"questions": n,
    "mean_acceptance_length": ..., "acceptance_rate_per_position": [...]}}``."""
    by_category: dict[str, list] = {}
    for prompt, category in zip(prompts, categories, strict=True):
        by_category.setdefault(category, []).append(prompt)
    result = {}
    for category, members in by_category.items():
        before = llm.get_metrics()
        timed_generate(llm, members, params, len(members))
        result[category] = {"questions": len(members), **acceptance(before, llm.get_metrics(), k)}
    return result


def acceptance(before: dict, after: dict, k: int) -> dict:
    """Mean acceptance length (1 + accepted per draft run) and per-position rates."""
    drafts = after["spec_decode_num_drafts"] - before["spec_decode_num_drafts"]
    accepted = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
    per_pos = [
        a - b
        for a, b in zip(
            after["spec_decode_num_accepted_tokens_per_pos"],
            before["spec_decode_num_accepted_tokens_per_pos"],
            strict=True,
        )
    ]
    return {
        "num_drafts": drafts,
        "num_accepted_tokens": accepted,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
        "acceptance_rate_per_position": [p / drafts if drafts else None for p in per_pos[:k]],
    }


def run_spec_bench(
    model,
    heads: list[str | None],
    k: int,
    batch_sizes: list[int],
    num_questions: int,
    max_tokens: int,
    device: str,
    dtype: str | None,
    out_dir: str | None,
    dataset: str = "mtbench",
    sharegpt_skip: int = SHAREGPT_HELD_OUT_FROM,
    plot: str | None = None,
    kv_cache_memory_gb: float | None = None,
) -> dict:
    """Greedy runs of the held-out prompts without MTP, then with each head (None: the
    model's own or shipped head); returns and writes the results (a run per head and batch
    size)."""
    from tandem import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    common = {
        "model": model,
        "device": device,
        "dtype": dtype,
        "max_num_seqs": max(batch_sizes),
        "kv_cache_memory_gb": kv_cache_memory_gb,
    }
    config = {
        "model": model,
        "heads": heads,
        "k": k,
        "device": device,
        "dtype": dtype,
        "dataset": dataset,
        "num_questions": num_questions,
        "max_tokens": max_tokens,
    }
    if dataset == "sharegpt":
        config["sharegpt_skip"] = sharegpt_skip
    results: dict = {"config": config, "runs": []}
    base = LLM(**common)
    prompts = [
        {"prompt_token_ids": base.tokenizer.apply_chat_template([{"role": "user", "content": t}])}
        for t in first_turns(dataset, num_questions, sharegpt_skip)
    ]
    timed_generate(base, prompts[:2], params, 2)  # warm-up
    baseline = {b: timed_generate(base, prompts, params, b) for b in batch_sizes}
    base.engine.shutdown()
    del base
    path = result_path(out_dir, f"spec-{dataset}-k{k}-{device.split(':')[0]}") if out_dir else None
    for head in heads:
        tokens, complete = head_training_tokens(head)
        spec = LLM(**common, speculative="mtp", num_speculative_tokens=k, speculative_model=head)
        timed_generate(spec, prompts[:2], params, 2)
        for batch_size in batch_sizes:
            before = spec.get_metrics()
            seconds, generated = timed_generate(spec, prompts, params, batch_size)
            base_seconds, base_tokens = baseline[batch_size]
            run = {
                "head": head,
                "training_tokens": tokens,
                "training_tokens_complete": complete,
                "batch_size": batch_size,
                "tokens_per_s": generated / seconds,
                "baseline_tokens_per_s": base_tokens / base_seconds,
                "speedup": (generated / seconds) / (base_tokens / base_seconds),
                **acceptance(before, spec.get_metrics(), k),
            }
            if dataset == "mtbench" and batch_size == batch_sizes[0]:
                categories = [q.get("category", "?") for q in load_mtbench()[:num_questions]]
                by_category = category_acceptance(spec, prompts, categories, params, k)
                run["acceptance_by_category"] = by_category
            results["runs"].append(run)
            print(
                f"head {head or '(default)'}, batch {batch_size}: {run['tokens_per_s']:.1f} "
                f"tok/s with MTP, {run['baseline_tokens_per_s']:.1f} without "
                f"({run['speedup']:.2f}x); mean acceptance length "
                f"{run['mean_acceptance_length']}, per position "
                f"{run['acceptance_rate_per_position']}"
            )
            for category, entry in run.get("acceptance_by_category", {}).items():
                print(f"  {category}: {entry['mean_acceptance_length']:.3f}")
        spec.engine.shutdown()
        del spec
        if path:
            write_json(results, path)
    if plot:
        plot_study(results, plot)
        results["plot_path"] = plot
    if path:
        write_json(results, path)
        results["output_path"] = path
    return results


def plot_study(results: dict, path: str) -> None:
    """A PNG of mean acceptance length against training tokens, a point per head (at the
    first batch size; a head whose count is partial is drawn hollow)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first = results["runs"][0]["batch_size"]
    runs = [r for r in results["runs"] if r["batch_size"] == first and r["training_tokens"]]
    fig, ax = plt.subplots(figsize=(6, 4))
    placed: list[tuple[float, float, int]] = []  # (log10 tokens, length, line) so far
    logs = [math.log10(r["training_tokens"]) for r in runs]
    right_side = min(logs, default=0) + 0.8 * (max(logs, default=0) - min(logs, default=0))
    for run in runs:
        x, y = run["training_tokens"], run["mean_acceptance_length"]
        face = "C0" if run["training_tokens_complete"] else "none"
        ax.scatter(x, y, color="C0", fc=face)
        # A label near ones already drawn takes the first line below them that is free.
        taken = {
            row for px, py, row in placed if abs(math.log10(x) - px) < 0.2 and abs(y - py) < 0.05
        }
        near = min(set(range(len(taken) + 1)) - taken)
        placed.append((math.log10(x), y, near))
        # Labels of the rightmost points go on their left, inside the axes.
        left = math.log10(x) > right_side
        ax.annotate(
            os.path.basename(str(run["head"]).rstrip("/")),
            (x, y),
            xytext=(-4 if left else 3, 2 - 9 * near),
            textcoords="offset points",
            ha="right" if left else "left",
            fontsize=7,
            # A label moved off its point's line is tied to it by a thin line.
            arrowprops={"arrowstyle": "-", "lw": 0.4, "color": "0.5"} if near else None,
        )
    config = results["config"]
    ax.set_xscale("log")
    ax.set_xlabel("training tokens")
    ax.set_ylabel(f"mean acceptance length (k = {config['k']})")
    ax.set_title(f"{config['dataset']}, {config['num_questions']} first turns, greedy")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_cli_arguments(parser) -> None:
    """Options of ``tandem bench spec``."""
    parser.add_argument("--model", default=None)
    parser.add_argument(
        "--speculative-model",
        default=None,
        help="MTP head directory, or several separated by commas (a training study)",
    )
    parser.add_argument("--num-speculative-tokens", type=int, default=3)
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--num-questions", type=int, default=80)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--dataset", choices=DATASETS, default="mtbench")
    parser.add_argument(
        "--sharegpt-skip",
        type=int,
        default=SHAREGPT_HELD_OUT_FROM,
        help="ShareGPT records before this index are not used (they may have been trained on)",
    )
    parser.add_argument("--plot", default=None, help="PNG of acceptance against training tokens")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None)
    parser.add_argument(
        "--kv-cache-memory-gb",
        type=float,
        default=None,
        help="KV cache size (default: the memory left on the GPU), for runs sharing a GPU",
    )
    parser.add_argument("--out-dir", default=os.path.join("benchmarks", "results"))


def main_from_args(args) -> int:
    heads = args.speculative_model.split(",") if args.speculative_model else [None]
    run_spec_bench(
        args.model,
        heads,
        args.num_speculative_tokens,
        [int(b) for b in args.batch_sizes.split(",")],
        args.num_questions,
        args.max_tokens,
        args.device,
        args.dtype,
        args.out_dir,
        args.dataset,
        args.sharegpt_skip,
        args.plot,
        args.kv_cache_memory_gb,
    )
    return 0
