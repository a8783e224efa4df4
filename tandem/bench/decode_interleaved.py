"""``tandem bench decode --steady-rounds N``: the steady row of every mode in alternation.

The steady row is bound by the host in every mode, and the lent machine's host speed moves
by up to 2x within minutes (benchmarks/README.md, "The steady row is the host's"): one
steady row per engine, engines built one after the other, cannot resolve a ratio near the
goal. Here every mode's engine is alive at once and the same requests run N rounds, the
modes in order in even rounds and reversed in odd ones (a drift of the host's speed
weighs on every mode alike); each round's ratio to the first mode is taken within the
round, and the summary gives their median, least and greatest.
"""

from __future__ import annotations

import statistics
from typing import Any

from tandem.bench.datasets import BenchRequest
from tandem.bench.decode_runs import steady_run

# KV per engine when none is given on CUDA: every mode's engine is alive at once.
DEFAULT_KV_GB_EACH = 16.0


def interleaved_steady(
    engines: list[tuple[str, Any, int | None]],
    requests: list[BenchRequest],
    batch_size: int,
    max_tokens: int,
    rounds: int,
    sampling: Any = None,
) -> list[dict]:
    """``rounds`` rounds of the steady row on every ``(mode name, engine, drafts or None)``
    (``kind: steady_round``, with its ``round``); in odd rounds the modes run reversed."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    runs = []
    for index in range(rounds):
        for name, llm, k in engines if index % 2 == 0 else engines[::-1]:
            run = steady_run(llm, requests, batch_size, k, max_tokens, None, sampling)
            runs.append({"mode": name, **run, "kind": "steady_round", "round": index})
    return runs


def summarize_rounds(runs: list[dict], modes: list[str]) -> dict:
    """Per mode the median, least and greatest tokens/s over the rounds, and for every
    mode after the first its per-round ratio to the first mode (same round) and their
    median, least and greatest."""
    rates = {m: {r["round"]: r["tokens_per_s"] for r in runs if r["mode"] == m} for m in modes}
    base = modes[0]
    summary: dict = {"base_mode": base, "rounds": len(rates[base]), "tokens_per_s": {}}
    for mode in modes:
        values = list(rates[mode].values())
        summary["tokens_per_s"][mode] = {
            "median": statistics.median(values),
            "min": min(values),
            "max": max(values),
        }
    summary["ratio_to_base"] = {}
    for mode in modes[1:]:
        ratios = [rates[mode][i] / rates[base][i] for i in sorted(rates[base])]
        summary["ratio_to_base"][mode] = {
            "median": statistics.median(ratios),
            "min": min(ratios),
            "max": max(ratios),
            "per_round": ratios,
        }
    return summary
