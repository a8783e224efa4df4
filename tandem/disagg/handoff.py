"""A request's worker state handed from a prefill instance to a decode instance: its MTP
drafts (with their distributions when sampled) and the key seed of its random numbers, so
that the decode instance continues the request exactly as the prefill instance would have
(every random number is keyed by seed and position: ``tandem.layers.keyed_random``). The
prefill side queues the drafts' copies behind the step that drafted them and picks them up
once they have completed: the host never waits for them (one wait per step, the step's)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tandem.device_copy import DeviceReader, PendingRead, to_device
from tandem.layers.keyed_random import request_seed
from tandem.messages import Handoff
from tandem.worker.input_batch import RequestState
from tandem.worker.step_pipeline import StepPipeline


@dataclass
class HandoffExport:
    """A handoff whose drafts (and their distributions) are on their way to the host: the
    copies are queued behind the step that drafted them, and nobody waits for them."""

    read: PendingRead
    probs_shape: list[int] | None  # [num_drafts, V] of sampled drafts' q, else None
    seed: int


def start_handoff_export(pipeline: StepPipeline, request_id: str) -> HandoffExport:
    """Queue the copies of the request's drafts, their q when sampled, and note its key
    seed (no wait: the device may be running the next step). Call it once the step that
    drafted them has been read."""
    state = pipeline.batch.states.get(request_id)
    if state is None:
        raise RuntimeError(f"request {request_id!r} has no worker state to hand over")
    device_drafts = pipeline.batch.drafts_of(state)
    # Copies: the slot's storage is reused once the request is dropped.
    tensors = [device_drafts.clone() if device_drafts is not None else torch.zeros(0)]
    probs_shape = None
    if state.draft_probs is not None:
        tensors.append(state.draft_probs.float().flatten())
        probs_shape = list(state.draft_probs.shape)
    return HandoffExport(pipeline.reader.start(tensors), probs_shape, state.seed)


def finish_handoff_export(export: HandoffExport) -> Handoff | None:
    """The handoff, once its copies have completed (None before: ask again later)."""
    if not DeviceReader.is_done(export.read):
        return None
    host = DeviceReader.take(export.read)
    draft_probs = None
    if export.probs_shape is not None:
        draft_probs = np.asarray(host[1], dtype=np.float32).tobytes()
    return Handoff([int(t) for t in host[0]], draft_probs, export.probs_shape, export.seed)


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
