"""The batch's inputs: the worker's own state of each request, and the flat inputs of a step.

With overlap scheduling the worker runs a step ahead of the scheduler, so each scheduled
row's inputs (its first position, known tokens, drafts, a token a launched step has not
reported yet) are resolved here from the worker's per-request state, not from the
scheduler's view.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch

from tandem.layers.keyed_random import request_seed
from tandem.step import ScheduledRequest, SchedulerOutput
from tandem.worker.request_slots import RequestSlots


@dataclass
class RequestState:
    """The worker's own view of one request, kept across steps."""

    token_ids: list[int]  # prompt and every token the worker emitted
    num_prompt_tokens: int
    num_computed: int  # positions whose KV is valid
    seed: int  # the 63-bit key of every random number the request draws (keyed_random)
    drafts: torch.Tensor | None = None  # [num_drafts] on the device, for the next step
    draft_probs: torch.Tensor | None = None  # [num_drafts, V] for sampled drafts
    num_prompt_logprobs: int = 0  # prompt logprobs reported so far (survives preemption)
    # Plain decoding advances the state when a step is launched: its sampled token is a
    # PLACEHOLDER in token_ids until the step is read, and lives on the device meanwhile
    # as pending_token = (candidates tensor of that step, index).
    pending_token: tuple[torch.Tensor, int] | None = None
    # With an MTP head: the request's device slot (RequestSlots), and whether it holds the
    # request's next start, last token and a full k drafts (a step can then be resolved
    # on the device).
    slot: int = -1
    slot_ready: bool = False
    # Drafts that stayed in the slot after a resolved step (``drafts`` is then None): the
    # first ``slot_drafts`` of the slot's drafts.
    slot_drafts: int = 0
    # How many drafts the last step to write the slot drafted into it: k, or fewer where
    # the speculative draft schedule drafts fewer at a large batch. A resolved step
    # verifies at most as many (the slot's later columns are an older step's).
    slot_depth: int = 0
    # Its unread step emits exactly one token and filled its slot at launch (a prompt
    # drafted then): the slot's start is len(token_ids), not a bound.
    one_token_in_flight: bool = False
    # Structured output: the request's grammar matcher and how many output tokens it took.
    matcher: Any = None
    matcher_len: int = 0

    @property
    def num_drafts(self) -> int:
        return self.slot_drafts if self.drafts is None else int(self.drafts.shape[0])

    def history(self, end: int) -> tuple[list[int], list[int]]:
        """The prompt's tokens and the output's before index ``end`` of ``token_ids`` (what
        a logit bias or penalty reads); every one must be known to the host."""
        prompt = self.token_ids[: self.num_prompt_tokens]
        output = self.token_ids[self.num_prompt_tokens : end]
        if PLACEHOLDER in output:
            raise RuntimeError("a penalized row was launched before its last token was read")
        return prompt, output


PLACEHOLDER = -1  # a token sampled by a launched step that the host has not read yet


@dataclass
class RowPlan:
    """What this step computes for one scheduled row."""

    row: ScheduledRequest
    state: RequestState
    start: int  # first position computed
    num_known: int  # known tokens fed (the rest of the row are drafts)
    num_drafts: int
    offset: int  # flat index of the row's first token
    placeholder: int = -1  # index in token_ids of the token this row samples (launched ahead)

    @property
    def end(self) -> int:
        return self.start + self.num_known + self.num_drafts

    @property
    def samples(self) -> bool:
        return self.start + self.num_known == len(self.state.token_ids)

    @property
    def request_id(self) -> str:
        return self.row.request.request_id


@dataclass
class StepInputs:
    """Host-side description of one step's flat batch."""

    plans: list[RowPlan]
    token_ids: list[int]
    positions: list[int]
    slots: list[int]
    query_lens: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    draft_index: list[int]  # flat indices whose tokens are drafts (filled on the device)
    drafts: list[torch.Tensor]
    # Flat indices whose tokens a launched, unread step sampled, and where they are.
    pending_index: list[int]
    pending_sources: list[tuple[torch.Tensor, int]]
    # (plan, flat indices whose logits predict prompt tokens, those prompt tokens)
    prompt_rows: list[tuple[RowPlan, list[int], list[int]]]


class InputBatch:
    """The per-request states of one worker and the step inputs built from them."""

    def __init__(
        self,
        device: torch.device,
        block_size: int,
        max_model_len: int,
        slots: RequestSlots | None = None,
        seed: int = 0,
    ):
        self.device = device
        # Key seeds of unseeded requests, drawn at admission (the engine's seed makes a run
        # reproducible; every tensor-parallel rank sees the requests in the same order).
        self.seed_source = random.Random(seed)
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.states: dict[str, RequestState] = {}
        self.slots = slots
        # Slots of dropped requests, freed once no launched step can touch them.
        self.released_slots: list[int] = []

    def add_state(self, request_id: str, state: RequestState) -> RequestState:
        """Keep ``state`` for ``request_id`` (with a device slot when there are slots)."""
        if self.slots is not None and state.slot < 0:
            state.slot = self.slots.assign()
        self.states[request_id] = state
        return state

    def state_for(self, row: ScheduledRequest) -> RequestState:
        """The request's state; a row that (re)admits a request resets it from the
        scheduler's snapshot (the key seed and reported prompt logprobs carry over)."""
        request = row.request
        state = self.states.get(request.request_id)
        if row.reset_token_ids is None:
            if state is None:
                raise RuntimeError(f"request {request.request_id!r} has no runner state")
            return state
        if state is None:
            seed = request_seed(request.sampling_params.seed, self.seed_source)
            state = self.add_state(
                request.request_id, RequestState([], request.num_prompt_tokens, 0, seed)
            )
        state.token_ids = list(row.reset_token_ids)  # the runner's own copy, grown in place
        state.num_computed = row.reset_num_computed
        state.drafts = state.draft_probs = state.pending_token = None
        state.slot_ready, state.slot_drafts, state.one_token_in_flight = False, 0, False
        return state

    def drop(self, request_ids: list[str]) -> None:
        """Forget ended requests; their slots wait in ``released_slots`` until the caller
        knows no launched step holds them (``free_released_slots``)."""
        for request_id in request_ids:
            state = self.states.pop(request_id, None)
            if state is not None and state.slot >= 0:
                self.released_slots.append(state.slot)

    def drafts_of(self, state: RequestState) -> torch.Tensor | None:
        """The request's drafts for its next step (a device tensor), wherever they are."""
        if state.drafts is None and state.slot_drafts:
            return self.slots.drafts[state.slot, : state.slot_drafts]
        return state.drafts

    def draft_probs_of(self, state: RequestState, greedy: bool) -> torch.Tensor | None:
        """The distributions [num_drafts, V] the request's drafts were drawn from (None
        for a greedy request: q is one-hot on its drafts), wherever they are."""
        if greedy:
            return None
        if state.drafts is None and state.slot_drafts:
            return self.slots.draft_probs[state.slot, : state.slot_drafts]
        return state.draft_probs

    def free_released_slots(self) -> None:
        """Give the dropped requests' slots back (no launched step holds them now)."""
        if self.slots is not None:
            for slot in self.released_slots:
                self.slots.release(slot)
        self.released_slots = []

    def prepare(self, step: SchedulerOutput) -> StepInputs:
        """The flat inputs of ``step``: per row, its known tokens and drafts, positions, KV
        slots, and the positions whose logits score prompt tokens (prompt logprobs)."""
        inputs = StepInputs([], [], [], [], [], [], [], [], [], [], [], [])
        block_size = self.block_size
        for row in step.scheduled:
            state = self.state_for(row)
            start = state.num_computed
            # A follow-up row of a request that the step in front of it took to the end of
            # the context: the scheduler ends it there, so nothing past the end is computed.
            if start >= self.max_model_len:
                continue
            num_known = min(
                row.num_new_tokens, len(state.token_ids) - start, self.max_model_len - start
            )
            num_drafts = 0
            if start + num_known == len(state.token_ids):
                num_drafts = min(state.num_drafts, row.num_new_tokens - num_known)
            plan = RowPlan(row, state, start, num_known, num_drafts, len(inputs.token_ids))
            end = plan.end
            if end > len(row.block_ids) * block_size:
                raise RuntimeError(
                    f"request {plan.request_id!r}: no KV slot for position "
                    f"{end - 1} ({len(row.block_ids)} blocks)"
                )
            inputs.plans.append(plan)
            known = state.token_ids[start : start + num_known]
            if known and known[-1] == PLACEHOLDER:
                inputs.pending_index.append(len(inputs.token_ids) + len(known) - 1)
                inputs.pending_sources.append(state.pending_token)
                known = [*known[:-1], 0]
            inputs.token_ids += known
            if num_drafts:
                inputs.draft_index += range(
                    len(inputs.token_ids), len(inputs.token_ids) + num_drafts
                )
                inputs.drafts.append(self.drafts_of(state)[:num_drafts])
                inputs.token_ids += [0] * num_drafts
            inputs.positions += range(start, end)
            blocks = row.block_ids
            inputs.slots += [
                blocks[p // block_size] * block_size + p % block_size for p in range(start, end)
            ]
            inputs.query_lens.append(end - start)
            inputs.seq_lens.append(end)
            inputs.block_tables.append(blocks)
            # Positions before num_prompt_logprobs were reported already (before a preemption).
            first = max(start, state.num_prompt_logprobs)
            prompt_end = min(end, state.num_prompt_tokens - 1)
            if row.request.wants_prompt_logprobs and first < prompt_end:
                indices = list(range(plan.offset + first - start, plan.offset + prompt_end - start))
                targets = state.token_ids[first + 1 : prompt_end + 1]
                inputs.prompt_rows.append((plan, indices, targets))
        return inputs
