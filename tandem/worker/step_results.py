"""A read step's results applied on the host: the tokens each row emitted (into the request
states and the step's output, with their logprobs), and the prompt logprobs of rows that
asked for them (computed on the device at launch, reported at the read)."""

from __future__ import annotations

import torch

from tandem.device_copy import to_device
from tandem.layers.sampler import LogprobsTensors, compute_logprobs
from tandem.step import ModelRunnerOutput
from tandem.worker.input_batch import PLACEHOLDER, StepInputs
from tandem.worker.launched_step import LaunchedStep


def emit(launched: LaunchedStep, host: list, output: ModelRunnerOutput) -> dict[str, list[int]]:
    """Apply the tokens of a read part (``host``: its read results) to its request states
    and ``output``; returns the tokens each request got."""
    emitted: dict[str, list[int]] = {}
    sample = launched.sample
    if sample is None:
        return emitted
    candidates, num_emitted = host[0], host[1]
    logprobs = {}
    if sample.logprobs is not None:
        entries = LogprobsTensors.from_host(host[2:6])
        logprobs = dict(zip(sample.logprob_rows, entries, strict=True))
    for plan, sampling_row, count in zip(
        launched.sampling_plans, launched.sampling_rows, num_emitted, strict=True
    ):
        first = sampling_row.logits_start
        tokens = candidates[first : first + count]
        request_id = plan.request_id
        emitted[request_id] = output.sampled_token_ids[request_id] = tokens
        if plan.num_drafts:
            output.num_verified_drafts[request_id] = plan.num_drafts
        top_n = sampling_row.params.logprobs
        if top_n is not None:
            output.logprobs[request_id] = [
                (
                    token,
                    logprobs[first + j][0],
                    logprobs[first + j][1],
                    logprobs[first + j][2][:top_n],
                )
                for j, token in enumerate(tokens)
            ]
        state = plan.state
        if launched.advanced:
            # The placeholder stays where it was unless the request was reset since.
            if state.token_ids[plan.placeholder : plan.placeholder + 1] == [PLACEHOLDER]:
                state.token_ids[plan.placeholder] = tokens[0]
            if state.pending_token is not None and state.pending_token[0] is sample.candidates:
                state.pending_token = None
            continue
        state.num_computed = len(state.token_ids) + count - 1
        state.token_ids.extend(tokens)
        state.drafts = state.draft_probs = None
        state.slot_drafts = 0
    return emitted


def prompt_logprobs(
    inputs: StepInputs, logits: torch.Tensor, device: torch.device
) -> LogprobsTensors:
    """The logprobs (and the largest top-N asked) of the prompt tokens that ``inputs``'
    prompt rows predict, from their ``logits``."""
    targets = [t for _, _, row_targets in inputs.prompt_rows for t in row_targets]
    num_top = max(
        plan.row.request.sampling_params.prompt_logprobs for plan, _, _ in inputs.prompt_rows
    )
    return compute_logprobs(logits, to_device(targets, torch.long, device), num_top)


def report_prompt_logprobs(inputs: StepInputs, host: list[list], output) -> None:
    """Put the read prompt logprobs (``host``) into ``output``, each row's own top-N, and
    note how many of its prompt's logprobs each request has had."""
    entries = LogprobsTensors.from_host(host)
    offset = 0
    for plan, indices, row_targets in inputs.prompt_rows:
        top_n = plan.row.request.sampling_params.prompt_logprobs
        output.prompt_logprobs[plan.request_id] = [
            (target, logprob, rank, top[:top_n])
            for target, (logprob, rank, top) in zip(
                row_targets, entries[offset : offset + len(indices)], strict=True
            )
        ]
        plan.state.num_prompt_logprobs = plan.start + indices[-1] - plan.offset + 1
        offset += len(indices)
