"""Continuous-batching scheduler: FCFS, chunked prefill, preemption by recompute.

Plain Python (no torch). A scheduled step is {request: number of new tokens} plus draft
tokens: prefill, chunked prefill and decode are one shape. The scheduler owns every request's
lifecycle; the model runner only computes.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from tandem.config import SchedulerConfig
from tandem.core.kv_cache import BlockManager
from tandem.request import Request, RequestStatus, TokenLogprobs


@dataclass
class ScheduledRequest:
    """One row of a step: compute ``num_new_tokens`` tokens after the computed ones."""

    request: Request
    num_new_tokens: int
    block_ids: list[int]
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def start(self) -> int:
        """Position of the first token computed in this step."""
        return self.request.num_computed_tokens

    @property
    def end(self) -> int:
        return self.request.num_computed_tokens + self.num_new_tokens

    @property
    def samples(self) -> bool:
        """True when the step reaches the last known token, so a new token is sampled."""
        return self.end >= self.request.num_tokens


@dataclass
class SchedulerOutput:
    """What the model runner executes in one step."""

    scheduled: list[ScheduledRequest]
    # Requests that finished since the previous step: the runner drops their state.
    finished_request_ids: list[str] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class ModelRunnerOutput:
    """What the model runner produced for one step, keyed by request id."""

    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # Drafts proposed for each request's next step (speculative decoding).
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class RequestUpdate:
    """New results of one request after a step (what the engine core sends out)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs]
    new_prompt_logprobs: list[TokenLogprobs]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0


class Scheduler:
    """Decides which requests run in each step and applies each step's results."""

    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        max_model_len: int,
        num_speculative_tokens: int = 0,
    ):
        self.config = config
        self.num_speculative_tokens = num_speculative_tokens
        # Speculative decoding counters, in vLLM's terms.
        self.spec_num_drafts = 0
        self.spec_num_draft_tokens = 0
        self.spec_num_accepted_tokens = 0
        self.spec_accepted_per_pos = [0] * num_speculative_tokens
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_ids: list[str] = []
        self.num_preemptions = 0

    # ---- admission and abort -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort_request(self, request_id: str) -> Request | None:
        """Finish a request as aborted and free its blocks; unknown ids are ignored."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        self._finish(request, RequestStatus.FINISHED_ABORTED)
        return request

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ---- scheduling ----------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        scheduled_ids: set[str] = set()
        preempted = False

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = self._num_new_tokens(request, budget)
            if num_new <= 0:
                index += 1
                continue
            while not self.block_manager.allocate_slots(
                request, num_new, num_lookahead_tokens=self._lookahead(request, num_new)
            ):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            else:
                scheduled.append(self._row(request, num_new))
                scheduled_ids.add(request.request_id)
                budget -= num_new
                index += 1

        while (
            not preempted
            and self.waiting
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            request = self.waiting[0]
            hit_blocks, num_hit_tokens = self.block_manager.get_computed_blocks(request)
            num_new = min(request.num_tokens - num_hit_tokens, budget)
            lookahead = self._lookahead(request, num_new, num_hit_tokens)
            if not self.block_manager.allocate_slots(request, num_new, hit_blocks, lookahead):
                break
            self.waiting.popleft()
            request.num_computed_tokens = num_hit_tokens
            request.num_cached_tokens = num_hit_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append(self._row(request, num_new))
            budget -= num_new

        finished_ids, self._finished_ids = self._finished_ids, []
        return SchedulerOutput(scheduled=scheduled, finished_request_ids=finished_ids)

    def _num_new_tokens(self, request: Request, budget: int) -> int:
        """Known tokens not yet computed, plus the drafts to verify, within the budget."""
        num_new = request.num_tokens - request.num_computed_tokens + len(request.draft_token_ids)
        return min(num_new, budget, self.max_model_len - request.num_computed_tokens)

    def _lookahead(self, request: Request, num_new: int, num_computed: int | None = None) -> int:
        """Slots beyond this step for the MTP head's deeper drafts (within the context)."""
        if num_computed is None:
            num_computed = request.num_computed_tokens
        room = self.max_model_len - (num_computed + num_new)
        return max(0, min(self.num_speculative_tokens, room))

    def _row(self, request: Request, num_new: int) -> ScheduledRequest:
        # Drafts that do not fit the step's token budget are dropped.
        num_drafts = max(0, request.num_computed_tokens + num_new - request.num_tokens)
        drafts = request.draft_token_ids[:num_drafts]
        request.draft_token_ids = []
        return ScheduledRequest(
            request, num_new, self.block_manager.block_ids(request.request_id), drafts
        )

    def _preempt(self, request: Request) -> None:
        """Free a running request's blocks; it recomputes from scratch when readmitted."""
        self.running.remove(request)
        self.block_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.draft_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    # ---- results -------------------------------------------------------------------------

    def update_from_output(
        self, output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[RequestUpdate]:
        """Advance each scheduled request by the step's results and apply stop conditions."""
        updates: list[RequestUpdate] = []
        for row in output.scheduled:
            request = row.request
            if request.is_finished:
                continue  # aborted while the step ran
            request_id = request.request_id
            sampled = runner_output.sampled_token_ids.get(request_id, [])
            if sampled:
                # KV stays valid for the known tokens and the accepted drafts: every new
                # token but the last (whose KV the next step computes).
                request.num_computed_tokens = request.num_tokens + len(sampled) - 1
                self._count_drafts(row, len(sampled) - 1)
            else:
                request.num_computed_tokens += row.num_new_tokens
            # Before any stop check: finishing frees the blocks.
            self.block_manager.cache_full_blocks(request, request.num_computed_tokens)
            new_prompt_logprobs = runner_output.prompt_logprobs.get(request_id, [])
            request.prompt_logprobs.extend(new_prompt_logprobs)
            new_tokens: list[int] = []
            new_logprobs: list[TokenLogprobs] = []
            sampled_logprobs = runner_output.logprobs.get(request_id, [])
            for position, token_id in enumerate(sampled):
                request.output_token_ids.append(token_id)
                new_tokens.append(token_id)
                if position < len(sampled_logprobs):
                    request.output_logprobs.append(sampled_logprobs[position])
                    new_logprobs.append(sampled_logprobs[position])
                if self._check_stop(request, token_id):
                    break
            if not request.is_finished:
                request.draft_token_ids = runner_output.draft_token_ids.get(request_id, [])
            if new_tokens or new_prompt_logprobs or request.is_finished:
                updates.append(
                    RequestUpdate(
                        request_id=request_id,
                        new_token_ids=new_tokens,
                        new_logprobs=new_logprobs,
                        new_prompt_logprobs=new_prompt_logprobs,
                        finish_reason=request.finish_reason,
                        stop_reason=request.stop_reason,
                        num_cached_tokens=request.num_cached_tokens,
                    )
                )
        return updates

    def _count_drafts(self, row: ScheduledRequest, num_accepted: int) -> None:
        if not row.draft_token_ids:
            return
        self.spec_num_drafts += 1
        self.spec_num_draft_tokens += len(row.draft_token_ids)
        self.spec_num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.spec_accepted_per_pos[position] += 1

    def _check_stop(self, request: Request, token_id: int) -> bool:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens and token_id in params.end_token_ids():
            request.stop_reason = token_id
            self._finish(request, RequestStatus.FINISHED_STOPPED)
            return True
        if request.num_output_tokens >= request.max_tokens or (
            request.num_tokens >= self.max_model_len
        ):
            self._finish(request, RequestStatus.FINISHED_LENGTH)
            return True
        return False

    def finish_request(self, request_id: str, status: RequestStatus, stop_reason=None) -> None:
        """End a request from outside the step loop (a stop string matched, an error)."""
        request = self.requests.get(request_id)
        if request is not None:
            request.stop_reason = stop_reason
            self._finish(request, status)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if request.is_finished:
            return
        request.status = status
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._finished_ids.append(request.request_id)
        self.block_manager.free(request)
        self.requests.pop(request.request_id, None)
