"""``tandem bench decode --oracle-corruption``: MTP's speed at a known acceptance length on a
model without a trained MTP head (the 8B shape's random weights).

Plain decoding first records each prompt's greedy output (a few tokens past what the rows
ask for, so drafts near the end come from the recording too); then ``mtp+overlap`` runs with
the oracle proposer (``tandem.worker.spec_decode.oracle_proposer``), which drafts the
recorded tokens, each corrupted at the given rate. Each row reports the expected acceptance
length beside the measured one, and ``recording_match``: the share of output tokens inside
the prefix each output shares with its recording (below 1, the engine's greedy output left
the recorded one, e.g. a bf16 tie broken differently at another batch shape, and the
measured acceptance falls below the expected).
"""

from __future__ import annotations

import time
from typing import Any

from tandem.bench.datasets import BenchRequest
from tandem.bench.decode_runs import DecodeRows, mtbench_prompts
from tandem.worker.spec_decode.oracle_proposer import expected_acceptance_length


def parse_rates(text: str | None) -> list[float]:
    """``"0.19,0.46"`` -> [0.19, 0.46]; each in [0, 1]. None or empty: no oracle runs."""
    if not text:
        return []
    rates = [float(part) for part in text.split(",") if part.strip()]
    bad = [rate for rate in rates if not 0.0 <= rate <= 1.0]
    if bad:
        raise ValueError(f"oracle corruption rates must be in [0, 1], got {bad}")
    return rates


def oracle_mode(rate: float) -> dict:
    """The mode dict of an ``mtp+overlap`` run with the oracle at corruption ``rate``."""
    return {"overlap": True, "mtp": True, "oracle": rate}


def oracle_fields(mode: dict, k: int) -> dict:
    """What a run's JSON says about its proposer (``mtp``, ``oracle`` or none)."""
    if not mode["mtp"]:
        return {"proposer": None}
    rate = mode.get("oracle")
    if rate is None:
        return {"proposer": "mtp"}
    return {
        "proposer": "oracle",
        "oracle_corruption": rate,
        "expected_acceptance_length": expected_acceptance_length(rate, k),
    }


def recorded_prompts(
    llm: Any,
    num_mtbench: int,
    max_tokens: int,
    steady: list[BenchRequest] | None,
    k: int,
) -> tuple[list[dict], list[int]]:
    """Every prompt the rows run (the first ``num_mtbench`` MT-Bench first turns at
    ``max_tokens``, the steady-state requests at their own lengths), each once, with the
    tokens to record for it: the most any row asks of it, plus ``k``."""
    wanted: dict[tuple[int, ...], int] = {}
    for prompt in mtbench_prompts(llm, num_mtbench):
        key = tuple(prompt["prompt_token_ids"])
        wanted[key] = max(wanted.get(key, 0), max_tokens)
    for req in steady or []:
        key = tuple(req.prompt)
        wanted[key] = max(wanted.get(key, 0), req.output_len)
    prompts = [{"prompt_token_ids": list(key)} for key in wanted]
    return prompts, [tokens + k for tokens in wanted.values()]


def record_continuations(
    llm: Any, prompts: list[dict], lengths: list[int]
) -> tuple[dict[tuple[int, ...], list[int]], dict]:
    """Greedy outputs of ``prompts`` (``lengths`` tokens each, EOS ignored) on ``llm``, a
    plain engine: prompt ids -> tokens, and how the recording ran."""
    from tandem import SamplingParams

    params = [
        SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=length) for length in lengths
    ]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    recordings = {
        tuple(prompt["prompt_token_ids"]): output.outputs[0].token_ids
        for prompt, output in zip(prompts, outputs, strict=True)
    }
    info = {
        "num_prompts": len(prompts),
        "recorded_tokens": sum(len(tokens) for tokens in recordings.values()),
        "seconds": time.perf_counter() - start,
    }
    return recordings, info


def record_rows(llm: Any, engine: str, rows: DecodeRows, k: int, config: dict) -> dict:
    """Plain decoding's outputs of every prompt the rows run, recorded on ``llm`` (a plain
    engine, ``engine`` its mode's name); how the recording ran goes into ``config``."""
    num_mtbench = max(rows.batch_sizes)
    if 1 in rows.batch_sizes:
        num_mtbench = max(num_mtbench, rows.num_questions)
    prompts, lengths = recorded_prompts(llm, num_mtbench, rows.params.max_tokens, rows.steady, k)
    recordings, info = record_continuations(llm, prompts, lengths)
    config["oracle_recording"] = {"engine": engine, **info}
    return recordings
