"""The lines ``tandem bench decode`` prints, one per run as it finishes, and the JSON it
rewrites after each (:mod:`tandem.bench.decode`)."""

from __future__ import annotations

from tandem.bench.results import write_json


def print_run(run: dict) -> None:
    """One line per run: its mode, batch size and kind, tok/s, GPU idle and acceptance."""
    idle = run["gpu_idle_fraction"]
    kind = run.get("kind", "fixed")
    if kind == "questions":
        kind = f"{run['num_questions']} questions one by one"
    elif kind.startswith("steady"):
        round_name = f" round {run['round']}" if "round" in run else ""
        kind = f"steady{round_name}, {run['num_requests']} ShareGPT requests"
    mode = run["mode"]
    timed = len(run.get("seconds_each", []))
    repeats = f", the median of {timed}" if timed > 1 else ""
    if run.get("proposer") == "oracle":
        mode += f" oracle {run['oracle_corruption']:.2f}"
    decode = run.get("decode_tokens_per_s")
    decode = "" if decode is None else f"; after the first tokens {decode:.1f} tok/s"
    line = (
        f"{mode:>11} batch {run['batch_size']:>4} ({kind}): "
        f"{run['tokens_per_s']:9.1f} tok/s "
        f"({run['output_tokens']} tokens in {run['seconds']:.3f} s{repeats}{decode}), GPU idle "
        + ("n/a" if idle is None else f"{idle:.1%}")
    )
    if run.get("gpu_idle_by_gap"):
        line += f" (waiting for the host {run['gpu_idle_by_gap']['host']:.1%}"
        line += f"; unprofiled, est. {run['gpu_idle_unprofiled_estimate']:.1%})"
    if run.get("mean_acceptance_length") is not None:
        line += f", mean acceptance length {run['mean_acceptance_length']:.3f}"
    if run.get("expected_acceptance_length") is not None:
        line += f" (expected {run['expected_acceptance_length']:.3f}"
        line += f", recording match {run.get('recording_match', 0.0):.1%})"
    print(line, flush=True)


def record_run(run: dict, results: dict, path: str | None) -> None:
    """Add ``run`` to the results, print its line and write the JSON so far (a run cut
    short still leaves the numbers of the rows before)."""
    results["runs"].append(run)
    print_run(run)
    if path:
        write_json(results, path)
