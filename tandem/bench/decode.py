"""``tandem bench decode``: decode throughput (output tokens/s) at given batch sizes, with and
without overlap scheduling and MTP, and the fraction of the wall time the GPU sits idle.

Every mode runs its own engine in this process, one after the other, and each engine runs
the same rows (``kind`` in the JSON; :mod:`tandem.bench.decode_runs`): at batch 1, N
different MT-Bench first turns one after the other (``questions``; ``--questions 0``: one,
as ``fixed``); at the larger batch sizes one ``generate`` of that many first turns
(``fixed``); with ``--steady-state-requests`` also many ShareGPT requests at once at the
largest batch size (``steady``). Every request is greedy with EOS ignored. On CUDA the
``fixed`` and ``questions`` rows run a second time under ``torch.profiler`` (CUDA activity
only); the GPU idle fraction is one minus the union of the kernel, memcpy and memset
intervals over the window from the first such event to the last. Profiling slows the host
a little, so that run's wall time is reported beside it. With ``--oracle-corruption`` the
modes are followed by ``mtp+overlap`` with the oracle proposer at each rate
(:mod:`tandem.bench.decode_oracle`).
"""

from __future__ import annotations

import dataclasses
import os

from tandem.bench.decode_engines import EngineSpec, shut_down
from tandem.bench.decode_interleaved import (
    DEFAULT_KV_GB_EACH,
    interleaved_steady,
    summarize_rounds,
)
from tandem.bench.decode_oracle import oracle_fields, oracle_mode, parse_rates, record_rows
from tandem.bench.decode_report import record_run
from tandem.bench.decode_runs import DecodeRows, mtbench_prompts
from tandem.bench.results import result_path, write_json
from tandem.engine_options import draft_schedule

MODE_NAMES = {
    "plain": {"overlap": False, "mtp": False},
    "overlap": {"overlap": True, "mtp": False},
    "mtp": {"overlap": False, "mtp": True},
    "mtp+overlap": {"overlap": True, "mtp": True},
}
_WARMUP_TOKENS = 8


def parse_modes(text: str) -> list[dict]:
    """``"plain,overlap,mtp,mtp+overlap"`` -> mode dicts with ``overlap`` and ``mtp`` flags."""
    modes = []
    for name in (part.strip() for part in text.split(",")):
        if name not in MODE_NAMES:
            raise ValueError(f"unknown mode {name!r}; choose from {sorted(MODE_NAMES)}")
        modes.append(dict(MODE_NAMES[name]))
    return modes


def mode_name(mode: dict) -> str:
    """The name of a mode dict (``plain``, ``overlap``, ``mtp`` or ``mtp+overlap``)."""
    flags = {"overlap": mode["overlap"], "mtp": mode["mtp"]}
    return next(name for name, named in MODE_NAMES.items() if named == flags)


def run_decode_bench(
    model,
    batch_sizes: list[int],
    max_tokens: int,
    modes: list[dict],
    device: str,
    dtype: str | None,
    out_dir: str | None,
    num_speculative_tokens: int = 3,
    speculative_model: str | None = None,
    kv_cache_memory_gb: float | None = None,
    num_questions: int = 16,
    profile_questions: int = 4,
    steady_state_requests: int = 0,
    steady_max_tokens: int = 256,
    oracle_corruptions: list[float] | None = None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    steady_rounds: int = 1,
    fixed_repeats: int = 1,
    draft_schedule: tuple[tuple[int, int], ...] = (),
    profile_steady: bool = False,
) -> dict:
    """Decode throughput and GPU idle fraction of every mode at every batch size.

    One engine per mode (``max_num_seqs = max(batch_sizes)``), warmed up once at the largest
    batch size. Batch size 1 runs ``num_questions`` MT-Bench first turns one after the other
    (``kind: questions``; 0: one ``fixed`` run of the first question); every other batch
    size is one ``generate`` of that many first turns (``kind: fixed``; timed
    ``fixed_repeats`` times, the median reported); all at
    ``temperature`` and ``top_p`` (greedy by default), ``ignore_eos``, ``max_tokens`` each.
    With ``steady_state_requests`` > 0 each engine then runs that many ShareGPT requests at
    once (``kind: steady``, at the largest batch size; output lengths from the dataset,
    capped at ``steady_max_tokens``). On CUDA the questions row profiles its first
    ``profile_questions`` (0: all). Each rate of ``oracle_corruptions`` adds an
    ``mtp+overlap`` engine whose oracle proposer replays plain decoding's outputs (recorded
    on the first mode without MTP, else on an engine built for it) with that share of its
    drafts corrupted. With ``steady_rounds`` > 1 the modes' steady rows instead run in
    alternation, all their engines alive at once (:mod:`tandem.bench.decode_interleaved`;
    ``kind: steady_round``, the summary in ``steady_rounds``; the oracle's engines keep
    their own). ``draft_schedule``: the MTP and oracle engines' (``SpeculativeConfig``).
    ``profile_steady`` (CUDA): each steady row runs once more under the profiler.
    Returns ``{"config": ..., "runs": [...]}`` and writes it as ``decode-<device>-<stamp>.json``
    under ``out_dir`` when one is given.
    """
    import torch

    from tandem import SamplingParams

    if not batch_sizes or min(batch_sizes) < 1:
        raise ValueError(f"batch sizes must be positive, got {batch_sizes}")
    for name, value, least in (
        ("num_questions", num_questions, 0),
        ("profile_questions", profile_questions, 0),
        ("steady_state_requests", steady_state_requests, 0),
        ("steady_rounds", steady_rounds, 1),
        ("fixed_repeats", fixed_repeats, 1),
    ):
        if value < least:
            raise ValueError(f"{name} must be >= {least}, got {value}")
    rates = list(oracle_corruptions or [])
    if any(not 0.0 <= rate <= 1.0 for rate in rates):
        raise ValueError(f"oracle corruption rates must be in [0, 1], got {rates}")
    k = num_speculative_tokens
    rows = DecodeRows(
        batch_sizes,
        SamplingParams(
            temperature=temperature, top_p=top_p, max_tokens=max_tokens, ignore_eos=True
        ),
        device,
        num_questions,
        profile_questions,
        steady_state_requests,
        steady_max_tokens,
        fixed_repeats=fixed_repeats,
        profile_steady=profile_steady,
    )
    engines = EngineSpec(
        model,
        device,
        dtype,
        max(batch_sizes),
        k,
        speculative_model,
        kv_cache_memory_gb,
        tuple(draft_schedule),
    )
    warmup = SamplingParams(temperature=0.0, max_tokens=_WARMUP_TOKENS, ignore_eos=True)
    config = {
        "model": model,
        "device": device,
        "dtype": dtype,
        "batch_sizes": batch_sizes,
        "max_tokens": max_tokens,
        "modes": [mode_name(m) for m in modes],
        "num_speculative_tokens": k,
        "draft_schedule": [list(pair) for pair in draft_schedule],
        "speculative_model": speculative_model,
        "kv_cache_memory_gb": kv_cache_memory_gb,
        "num_questions": num_questions if 1 in batch_sizes else 0,
        "profile_questions": profile_questions,
        "steady_state_requests": steady_state_requests,
        "steady_max_tokens": steady_max_tokens,
        "steady_batch_size": max(batch_sizes) if steady_state_requests else None,
        "steady_rounds": steady_rounds,
        "fixed_repeats": fixed_repeats,
        "profile_steady": profile_steady,
        "oracle_corruptions": rates,
        "temperature": temperature,
        "top_p": top_p,
        "torch_version": torch.__version__,
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        config["gpu"] = torch.cuda.get_device_name(torch.device(device))
    results: dict = {"config": config, "runs": []}
    path = None
    if out_dir:
        path = result_path(out_dir, f"decode-{device.split(':')[0]}")
    recordings = None  # plain decoding's outputs, for the oracle's engines
    for mode in modes + [oracle_mode(rate) for rate in rates]:
        oracle = mode.get("oracle") is not None
        if oracle and recordings is None:  # no mode without MTP recorded them
            llm = engines.build(MODE_NAMES["overlap"])
            rows.sample_steady(llm)
            recordings = record_rows(llm, "overlap", rows, k, results["config"])
            shut_down([llm], device)
            del llm
        llm = engines.build(mode)
        if oracle:
            llm.engine.runner.proposer.set_recordings(recordings)
        # At the largest batch: its chunked prefill mixes prefill and decode rows, whose
        # kernel variants would otherwise compile inside the first timed run.
        llm.generate(mtbench_prompts(llm, max(batch_sizes)), warmup, use_tqdm=False)
        rows.sample_steady(llm)
        proposer = llm.engine.runner.proposer if oracle else None
        unrecorded = proposer.num_unrecorded_requests if oracle else 0
        interleave = steady_rounds > 1 and not oracle
        made_rows = rows.runs(
            llm, k if mode["mtp"] else None, recordings if oracle else None, not interleave
        )
        for made in made_rows:
            run = {"mode": mode_name(mode), **oracle_fields(mode, k), **made}
            if proposer is not None:  # requests that found no recording (should be none)
                run["oracle_unrecorded_requests"] = proposer.num_unrecorded_requests - unrecorded
                unrecorded = proposer.num_unrecorded_requests
            record_run(run, results, path)
        if rates and recordings is None and not mode["mtp"]:
            recordings = record_rows(llm, mode_name(mode), rows, k, results["config"])
        shut_down([llm], device)
        del llm
    if steady_rounds > 1 and rows.steady:
        _interleaved_rows(engines, modes, rows, k, steady_rounds, warmup, results, path)
    if path:
        write_json(results, path)
        results["output_path"] = path
        print(f"wrote {path}")
    return results


def _interleaved_rows(engines, modes, rows, k, rounds, warmup, results, path) -> None:
    """The steady rows of ``modes`` in ``rounds`` alternating rounds, their engines alive
    at once (each with the given KV, or ``DEFAULT_KV_GB_EACH`` on CUDA)."""
    kv_gb = engines.kv_cache_memory_gb
    if kv_gb is None and engines.device.startswith("cuda"):
        kv_gb = DEFAULT_KV_GB_EACH
    spec = dataclasses.replace(engines, kv_cache_memory_gb=kv_gb)
    built = []
    for mode in modes:
        llm = spec.build(mode)
        llm.generate(mtbench_prompts(llm, max(rows.batch_sizes)), warmup, use_tqdm=False)
        built.append((mode_name(mode), llm, k if mode["mtp"] else None))
    made = interleaved_steady(
        built, rows.steady, max(rows.batch_sizes), rows.steady_max_tokens, rounds, rows.params
    )
    for run in made:
        record_run(run, results, path)
    results["steady_rounds"] = summarize_rounds(made, [name for name, _, _ in built])
    results["steady_rounds"]["kv_cache_memory_gb_each"] = kv_gb
    shut_down([llm for _, llm, _ in built], engines.device)
    del built, llm


def add_cli_arguments(parser) -> None:
    """Options of ``tandem bench decode``."""
    parser.add_argument("--model", default=None, help="GGUF file, HF directory or dummy:NAME")
    parser.add_argument("--batch-sizes", default="1,8,64")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument(
        "--modes",
        default="plain,overlap,mtp,mtp+overlap",
        help=f"comma-separated, from {', '.join(MODE_NAMES)}",
    )
    parser.add_argument("--num-speculative-tokens", type=int, default=3)
    parser.add_argument(
        "--draft-schedule",
        type=draft_schedule,
        default=(),
        metavar="ROWS:DRAFTS,...",
        help="the MTP and oracle engines' --speculative-draft-schedule",
    )
    parser.add_argument("--speculative-model", default=None, help="MTP head directory")
    parser.add_argument(
        "--kv-cache-memory-gb",
        type=float,
        default=None,
        help="KV cache size (default: the engine's); too small preempts",
    )
    parser.add_argument(
        "--questions",
        type=int,
        default=16,
        help="batch size 1 decodes this many MT-Bench first turns one after the other "
        "(0: the first one only, as the other batch sizes)",
    )
    parser.add_argument(
        "--profile-questions",
        type=int,
        default=4,
        help="on CUDA, the first this many of those run again under the profiler (0: all)",
    )
    parser.add_argument(
        "--steady-state-requests",
        type=int,
        default=0,
        help="then this many ShareGPT requests at once at the largest batch size "
        "(many more than it, e.g. 8x; 0: no steady-state run)",
    )
    parser.add_argument(
        "--steady-max-tokens",
        type=int,
        default=256,
        help="cap on the steady-state requests' output lengths (the dataset's otherwise)",
    )
    parser.add_argument(
        "--steady-rounds",
        type=int,
        default=1,
        help="above 1: the modes' steady rows run this many rounds in alternation, their "
        "engines alive at once, with the median ratio to the first mode",
    )
    parser.add_argument(
        "--profile-steady",
        action="store_true",
        help="on CUDA, each steady row (not the rounds) runs once more under the profiler",
    )
    parser.add_argument(
        "--fixed-repeats",
        type=int,
        default=1,
        help="each batch size above 1 times its generate this many times and reports the "
        "median (each run's seconds in seconds_each), and as many one-token generates "
        "(first_token_seconds: the decode after them is decode_tokens_per_s)",
    )
    parser.add_argument(
        "--oracle-corruption",
        default=None,
        metavar="RATES",
        help="benchmark only: after the modes, mtp+overlap with drafts replayed from plain "
        "decoding's recorded outputs, this share of them corrupted (comma-separated rates)",
    )
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="every request's (0: greedy)"
    )
    parser.add_argument("--top-p", type=float, default=1.0, help="every request's")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--out-dir", default=os.path.join("benchmarks", "results"))


def main_from_args(args) -> int:
    """Run ``tandem bench decode`` from parsed arguments."""
    run_decode_bench(
        args.model,
        [int(b) for b in args.batch_sizes.split(",")],
        args.max_tokens,
        parse_modes(args.modes),
        args.device,
        args.dtype,
        args.out_dir,
        args.num_speculative_tokens,
        args.speculative_model,
        args.kv_cache_memory_gb,
        num_questions=args.questions,
        profile_questions=args.profile_questions,
        steady_state_requests=args.steady_state_requests,
        steady_max_tokens=args.steady_max_tokens,
        oracle_corruptions=parse_rates(args.oracle_corruption),
        temperature=args.temperature,
        top_p=args.top_p,
        steady_rounds=args.steady_rounds,
        fixed_repeats=args.fixed_repeats,
        draft_schedule=args.draft_schedule,
        profile_steady=args.profile_steady,
    )
    return 0
