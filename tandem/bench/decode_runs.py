"""The runs of ``tandem bench decode`` on one engine, each a row of its JSON (``kind``):

- ``fixed``: one ``generate`` of ``batch_size`` MT-Bench first turns, ``max_tokens`` each.
- ``questions``: batch 1 over N different MT-Bench first turns, one ``generate`` after the
  other, so the acceptance length is many questions' and not one's.
- ``steady``: many more ShareGPT requests than ``max_num_seqs``, all submitted at once, each
  asking for its own reference completion's length: finished rows are replaced at once, so
  the batch stays full (no tail of a few long rows at low occupancy).

Every request is greedy with EOS ignored. :mod:`tandem.bench.decode` puts them together.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from tandem.bench.datasets import BenchRequest, load_mtbench, load_sharegpt
from tandem.bench.decode_counts import HOST_CLOCKS, counter_delta, snapshot, spec_fields
from tandem.bench.device_profile import profile_generate
from tandem.bench.spec import acceptance
from tandem.bench.timing import decode_after_first_tokens, fixed_and_per_step, timed_generate

_CONTEXT_MARGIN = 8  # tokens kept free at the context's end (tokenization drift, drafts)


def fold_ids(llm: Any, ids: list[int]) -> list[int]:
    """Token ids for ``llm``: a dummy model borrows a tokenizer whose ids can exceed its
    vocabulary; those are folded into it (random weights: only the work's shape matters)."""
    vocab = getattr(getattr(llm.engine, "arch", None), "vocab_size", None)
    if vocab and llm.model_path.startswith("dummy:"):
        return [t % vocab for t in ids]
    return ids


def mtbench_prompts(llm: Any, count: int) -> list[dict]:
    """``count`` token-id prompts: the MT-Bench first turns in order (chat template
    applied), cycled past the 80 questions."""
    questions = load_mtbench()
    prompts = []
    for i in range(count):
        turn = questions[i % len(questions)]["turns"][0]
        ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": turn}])
        prompts.append({"prompt_token_ids": fold_ids(llm, ids)})
    return prompts


def profiled_generate(
    llm: Any,
    prompts: list[dict],
    params: Any,
    device: str,
    timed_s: float | None = None,
    batch_size: int | None = None,
) -> dict:
    """Run the prompts once more under the CUDA profiler (in waves of ``batch_size``, one
    ``generate`` each); returns the GPU idle numbers and the device operations that took
    the most time, with their counts (what a step launches). The profiler's tracing widens
    the gaps between kernels (the profiled run is slower), so ``timed_s``, when given, the
    same prompts' seconds without it, gives a second figure: ``gpu_idle_unprofiled_estimate``,
    one minus the traced device busy time over those seconds (it takes the kernels'
    traced durations as their own and counts the generates' host work around the steps
    as idle; below 0, the traced kernels outlasted the unprofiled run and it says nothing)."""
    profiled = profile_generate(llm, prompts, params, device, top=40, batch_size=batch_size)
    result: dict = {
        "profile_wall_s": profiled["wall_s"],
        "profile_device_events": profiled["device_ops"],
        "profiler_activity_counts": profiled["activity_counts"],
    }
    if "note" in profiled:
        return {
            **result,
            "gpu_idle_fraction": None,
            "profile_window_s": None,
            "profiler_note": profiled["note"],
        }
    if "within_waves" in profiled:  # each generate's own window: the gaps between left out
        within = profiled["within_waves"]
        result["gpu_idle_within_requests"] = within["idle_fraction"]
        result["gpu_idle_within_requests_host"] = within["host_fraction"]
        result["gpu_host_gaps_within_requests"] = within["host_gaps"]
    elif "within_waves_note" in profiled:
        result["gpu_idle_within_requests_note"] = profiled["within_waves_note"]
    if timed_s:
        result["gpu_idle_unprofiled_estimate"] = 1.0 - profiled["busy_us"] / 1e6 / timed_s
    return {
        **result,
        "gpu_idle_fraction": 1.0 - profiled["busy_fraction"],
        # The idle split: back-to-back launch spacing, short gaps, waits for the host.
        "gpu_idle_by_gap": profiled["idle_by_gap"],
        "profile_window_s": profiled["window_us"] / 1e6,
        "profile_busy_s": profiled["busy_us"] / 1e6,
        "top_device_ops": profiled["top"],
    }


def _timed(llm: Any, prompts: list[dict], params: Any, recordings: dict | None, tally: list):
    """``timed_generate``; with ``recordings`` (prompt ids -> a plain run's tokens) it also
    adds to ``tally`` [tokens in the prefix each output shares with its recording, all
    output tokens]: below 1, the engine's greedy output left the recorded one."""
    if recordings is None:
        return timed_generate(llm, prompts, params)
    outputs: list = []
    seconds, tokens = timed_generate(llm, prompts, params, outputs=outputs)
    for prompt, output in zip(prompts, outputs, strict=True):
        got = output.outputs[0].token_ids
        want = recordings.get(tuple(prompt["prompt_token_ids"]), [])
        shared = min(len(got), len(want))
        tally[0] += next((i for i in range(shared) if got[i] != want[i]), shared)
        tally[1] += len(got)
    return seconds, tokens


def _match_field(tally: list) -> dict:
    """The recordings' agreement with a run's outputs (nothing when none was checked)."""
    return {"recording_match": tally[0] / tally[1]} if tally[1] else {}


def fixed_run(
    llm: Any,
    batch_size: int,
    params: Any,
    k: int | None,
    device: str,
    recordings: dict | None = None,
    repeats: int = 1,
) -> dict:
    """One ``generate`` of ``batch_size`` MT-Bench prompts (``kind: fixed``), timed
    ``repeats`` times: ``seconds`` is the median (each in ``seconds_each``), the counts and
    acceptance are the first generate's; ``k`` is the number of drafts when the engine
    speculates (None: it does not); with ``recordings`` the outputs are checked against
    them (``recording_match``, over every repeat). ``decode_tokens_per_s`` leaves out the
    prefill and first tokens (``decode_after_first_tokens``)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    prompts = mtbench_prompts(llm, batch_size)
    tally = [0, 0]
    before = snapshot(llm)
    first, tokens = _timed(llm, prompts, params, recordings, tally)
    after = snapshot(llm)
    seconds_each = [first]
    seconds_each += [_timed(llm, prompts, params, recordings, tally)[0] for _ in range(repeats - 1)]
    seconds = statistics.median(seconds_each)
    run: dict = {
        "kind": "fixed",
        **decode_after_first_tokens(llm, prompts, params, seconds, tokens, repeats),
        "batch_size": batch_size,
        "max_tokens": params.max_tokens,
        "output_tokens": tokens,
        "seconds": seconds,
        "seconds_each": seconds_each,
        "tokens_per_s": tokens / seconds,
        "num_steps": counter_delta(before, after, "num_steps"),
        "num_preemptions": counter_delta(before, after, "num_preemptions"),
        **spec_fields(before, after, k),
        **_match_field(tally),
    }
    if device.startswith("cuda"):
        run.update(profiled_generate(llm, prompts, params, device, seconds))
    else:
        run["gpu_idle_fraction"] = None
    return run


def questions_run(
    llm: Any,
    num_questions: int,
    params: Any,
    k: int | None,
    device: str,
    profile_questions: int = 0,
    recordings: dict | None = None,
) -> dict:
    """Batch 1 over the first ``num_questions`` MT-Bench first turns, one ``generate``
    each (``kind: questions``): tokens/s is all their tokens over all their seconds, the
    mean acceptance length is over all their drafts, and each question's is listed. On
    CUDA the first ``profile_questions`` (0: all) run again, one by one, under the profiler
    for the GPU idle fraction."""
    if num_questions < 1:
        raise ValueError(f"num_questions must be >= 1, got {num_questions}")
    questions = load_mtbench()
    prompts = mtbench_prompts(llm, num_questions)
    first = snapshot(llm)
    per_question = []
    tally = [0, 0]
    for index, prompt in enumerate(prompts):
        before = snapshot(llm)
        seconds, tokens = _timed(llm, [prompt], params, recordings, tally)
        after = snapshot(llm)
        entry = {
            "question_id": questions[index % len(questions)].get("question_id"),
            "output_tokens": tokens,
            "seconds": seconds,
            "num_steps": counter_delta(before, after, "num_steps"),
            **{name: after["pipeline"][name] - before["pipeline"][name] for name in HOST_CLOCKS},
        }
        if k:
            entry["mean_acceptance_length"] = acceptance(before, after, k)["mean_acceptance_length"]
        per_question.append(entry)
    last = snapshot(llm)
    tokens = sum(entry["output_tokens"] for entry in per_question)
    seconds = sum(entry["seconds"] for entry in per_question)
    run: dict = {
        "kind": "questions",
        "batch_size": 1,
        "max_tokens": params.max_tokens,
        "num_questions": num_questions,
        "output_tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "num_steps": counter_delta(first, last, "num_steps"),
        "num_preemptions": counter_delta(first, last, "num_preemptions"),
        **spec_fields(first, last, k),
        **_match_field(tally),
        "per_question": per_question,
    }
    if k:
        run["acceptance_length_per_question"] = [e["mean_acceptance_length"] for e in per_question]
    run["per_question_fit"] = fixed_and_per_step(per_question)
    if device.startswith("cuda"):
        profiled = num_questions if profile_questions < 1 else min(profile_questions, num_questions)
        run["profiled_questions"] = profiled
        run["profile_scope"] = (
            f"the {profiled} questions' sequence run again under the profiler"
            if profiled == num_questions
            else f"the first {profiled} of the {num_questions} questions, run again one by one"
        )
        timed = sum(entry["seconds"] for entry in per_question[:profiled])
        run.update(profiled_generate(llm, prompts[:profiled], params, device, timed, 1))
    else:
        run["gpu_idle_fraction"] = None
    return run


def steady_requests(
    llm: Any, num_requests: int, max_tokens: int, max_prompt_len: int = 1024, seed: int = 0
) -> list[BenchRequest]:
    """``num_requests`` ShareGPT requests for ``llm``: each a conversation's first human turn
    (chat template applied, token ids) asking for its reference completion's length,
    capped at ``max_tokens`` and at what the context leaves after the prompt."""
    context = llm.engine.max_model_len
    overhead = len(llm.tokenizer.apply_chat_template([{"role": "user", "content": "x"}]))
    max_prompt_len = min(max_prompt_len, context // 2)
    reqs = load_sharegpt(
        num_requests,
        llm.tokenizer,
        seed=seed,
        max_prompt_len=max_prompt_len,
        max_total_len=context - overhead - _CONTEXT_MARGIN,
        max_output_len=max_tokens,
    )
    requests = []
    for req in reqs:
        ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": req.prompt}])
        output_len = min(req.output_len, context - len(ids) - _CONTEXT_MARGIN)
        requests.append(BenchRequest(fold_ids(llm, ids), len(ids), output_len))
    return requests


def steady_run(
    llm: Any,
    requests: list[BenchRequest],
    batch_size: int,
    k: int | None,
    max_tokens: int,
    recordings: dict | None = None,
    sampling: Any = None,
    first_tokens: bool = True,
    profile: bool = False,
) -> dict:
    """Every request submitted at once to ``llm`` (whose ``max_num_seqs`` is
    ``batch_size``), each with its own output length as ``max_tokens`` (``kind: steady``;
    ``max_tokens`` is the cap the lengths were held to, reported); ``sampling``: the
    SamplingParams whose temperature and top-p they take (greedy when None).
    ``first_tokens``: the same requests also generate one token each, timed
    (``first_token_seconds``: their prefill, in waves of ``batch_size``, not interleaved
    with decoding as in the run), and ``decode_tokens_per_s`` counts the tokens after each
    request's first over the seconds past that. ``profile`` (CUDA): the run once more under
    the profiler (``profiled_generate``'s fields). Each of the three starts from an empty
    prefix cache: cached, a prompt's prefill would shrink to its last partial block."""
    from tandem import SamplingParams

    prompts = [{"prompt_token_ids": list(r.prompt)} for r in requests]
    base = sampling if sampling is not None else SamplingParams(temperature=0.0)
    params = [dataclasses.replace(base, ignore_eos=True, max_tokens=r.output_len) for r in requests]
    tally = [0, 0]
    # Each run meets its prompts as new traffic would, outside the prefix cache (a round
    # before it, or its own one-token generate, would have left them there).
    llm.reset_prefix_cache()
    before = snapshot(llm)
    seconds, tokens = _timed(llm, prompts, params, recordings, tally)
    after = snapshot(llm)
    num_steps = counter_delta(before, after, "num_steps")
    run = {
        "kind": "steady",
        "batch_size": batch_size,
        "num_requests": len(requests),
        "dataset": "sharegpt",
        "max_tokens": max_tokens,
        "longest_output_tokens": max(r.output_len for r in requests),
        "requested_output_tokens": sum(r.output_len for r in requests),
        "mean_prompt_tokens": sum(r.prompt_len for r in requests) / len(requests),
        "output_tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "num_steps": num_steps,
        "output_tokens_per_step": tokens / num_steps if num_steps else None,
        "num_preemptions": counter_delta(before, after, "num_preemptions"),
        # Prompt tokens the run found cached: blocks its own requests share (a chat
        # template's system prompt), as they would in serving.
        "prefix_cache_hit_tokens": counter_delta(before, after, "prefix_cache_hits"),
        **spec_fields(before, after, k),
        **_match_field(tally),
        "gpu_idle_fraction": None,  # not profiled
    }
    if first_tokens:
        llm.reset_prefix_cache()
        run.update(decode_after_first_tokens(llm, prompts, params, seconds, tokens, 1))
    if profile and str(llm.config.device).startswith("cuda"):
        llm.reset_prefix_cache()
        run.update(profiled_generate(llm, prompts, params, str(llm.config.device), seconds))
    return run


@dataclass
class DecodeRows:
    """The rows every engine runs (see the module docstring)."""

    batch_sizes: list[int]
    params: Any  # SamplingParams of the fixed and questions rows
    device: str
    num_questions: int
    profile_questions: int
    steady_state_requests: int
    steady_max_tokens: int
    steady: list[BenchRequest] | None = None  # sampled with the first engine, then kept
    fixed_repeats: int = 1  # timed generates a fixed row takes the median of
    profile_steady: bool = False  # the steady row once more under the profiler (CUDA)

    def sample_steady(self, llm: Any) -> None:
        """The steady rows' ShareGPT requests, sampled once for every mode."""
        if self.steady_state_requests and self.steady is None:
            self.steady = steady_requests(llm, self.steady_state_requests, self.steady_max_tokens)

    def runs(
        self, llm: Any, k: int | None, recordings: dict | None = None, steady: bool = True
    ) -> Iterator[dict]:
        """The rows of one engine, as they finish (``k``: its drafts, None without;
        ``steady``: False leaves the steady row to the interleaved rounds)."""
        params, device = self.params, self.device
        for batch_size in self.batch_sizes:
            if batch_size == 1 and self.num_questions > 0:
                yield questions_run(
                    llm, self.num_questions, params, k, device, self.profile_questions, recordings
                )
            else:
                yield fixed_run(llm, batch_size, params, k, device, recordings, self.fixed_repeats)
        if self.steady and steady:
            yield steady_run(
                llm,
                self.steady,
                max(self.batch_sizes),
                k,
                self.steady_max_tokens,
                recordings,
                self.params,
                profile=self.profile_steady,
            )
