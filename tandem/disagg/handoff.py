"""A request's worker state handed from a prefill instance to a decode instance: its MTP
drafts (with their distributions when sampled) and the key seed of its random numbers, so
that the decode instance continues the request exactly as the prefill instance would have
(every random number is keyed by seed and position: ``tandem.layers.keyed_random``)."""

from __future__ import annotations

import numpy as np
import torch

from tandem.device_copy import to_device
from tandem.layers.keyed_random import request_seed
from tandem.messages import Handoff
from tandem.worker.input_batch import RequestState
from tandem.worker.step_pipeline import StepPipeline


def export_handoff(pipeline: StepPipeline, request_id: str) -> Handoff:
    """The request's drafts and key seed. Reads the device: call it once the step that
    drafted them has been read."""
    state = pipeline.batch.states.get(request_id)
    if state is None:
        raise RuntimeError(f"request {request_id!r} has no worker state to hand over")
    device_drafts = pipeline.batch.drafts_of(state)
    drafts = device_drafts.tolist() if device_drafts is not None else []
    draft_probs = draft_probs_shape = None
    if state.draft_probs is not None:
        probs = state.draft_probs.float().cpu().contiguous()
        draft_probs, draft_probs_shape = probs.numpy().tobytes(), list(probs.shape)
    return Handoff(drafts, draft_probs, draft_probs_shape, state.seed)


def insert_handoff(
    pipeline: StepPipeline,
    request_id: str,
    token_ids: list[int],
    num_prompt_tokens: int,
    handoff: Handoff,
    seed: int | None,
) -> None:
    """Start the worker state of a request whose prompt KV a prefill instance wrote: every
    prompt position is computed, the first output token is the last of ``token_ids``, and
    the next step verifies the handed-over drafts (copied without a wait: a step may be in
    flight). The request keeps the prefill instance's key seed (its own ``seed``, or one
    drawn here, when the handoff has none). ValueError if the handoff's arrays do not fit
    together."""
    device = pipeline.device
    own_seed = handoff.seed if handoff.seed is not None else seed
    key_seed = request_seed(own_seed, pipeline.batch.seed_source)
    state = RequestState(
        list(token_ids),
        num_prompt_tokens,
        num_prompt_tokens,
        key_seed,
        num_prompt_logprobs=num_prompt_tokens,
    )
    if handoff.drafts and pipeline.runner.proposer is not None:
        state.drafts = to_device(handoff.drafts, torch.long, device)
        if handoff.draft_probs is not None:
            shape = tuple(handoff.draft_probs_shape or ())
            probs = np.frombuffer(handoff.draft_probs, dtype=np.float32)
            if len(shape) != 2 or shape[0] != len(handoff.drafts) or probs.size != np.prod(shape):
                raise ValueError(
                    f"handoff: draft_probs of shape {list(shape)} do not fit "
                    f"{len(handoff.drafts)} drafts ({probs.size} values)"
                )
            state.draft_probs = to_device(
                torch.from_numpy(probs.copy()).view(*shape), torch.float32, device
            )
    pipeline.batch.add_state(request_id, state)
    mtp = pipeline.mtp
    if mtp is not None and state.num_drafts == mtp.slots.num_drafts:
        mtp.fill_slots([state])
