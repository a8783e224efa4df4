"""Continuous-batching scheduler: FCFS, chunked prefill, preemption by recompute.

Plain Python (no torch). A scheduled step is {request: number of new tokens} plus draft
tokens: prefill, chunked prefill and decode are one shape. The scheduler owns every request's
lifecycle (its request table: ``request_table.py``); the model runner only computes. A fault
while scheduling a request or applying its results fails that request alone.
"""

from __future__ import annotations

from tandem.config import SchedulerConfig
from tandem.core.kv_cache import BlockManager
from tandem.core.request_table import RequestTable
from tandem.request import Request, RequestStatus, TokenLogprobs
from tandem.step import ModelRunnerOutput, RequestUpdate, ScheduledRequest, SchedulerOutput


class Scheduler(RequestTable):
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
        super().__init__(block_manager)
        self.max_model_len = max_model_len
        self.num_preemptions = 0

    # ---- PD: requests whose prompt's KV comes from elsewhere -----------------------------

    def admit_remote(self) -> list[Request]:
        """Reserve the prompt's blocks of waiting remote-prefill requests (in order, while
        blocks and sequence slots last); returns the requests now ready to receive KV."""
        admitted = []
        while self.waiting_remote and (
            len(self.running) + len(self.receiving) < self.config.max_num_seqs
        ):
            request = self.waiting_remote[0]
            if not self.block_manager.allocate_slots(request, request.num_prompt_tokens):
                break
            self.waiting_remote.popleft()
            request.status = RequestStatus.WAITING_FOR_KV
            self.receiving[request.request_id] = request
            admitted.append(request)
        return admitted

    def insert_remote(
        self,
        request_id: str,
        token_id: int,
        logprobs: list[TokenLogprobs],
        prompt_logprobs: list[TokenLogprobs],
        num_drafts: int,
        num_cached_tokens: int,
    ) -> RequestUpdate | None:
        """The prompt's KV has arrived with the first token: the request runs from here
        (its next step verifies ``num_drafts`` drafts) unless that token already ends it.
        Returns its update, or None when it is no longer waiting for KV."""
        request = self.receiving.pop(request_id, None)
        if request is None:
            return None
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = request.num_prompt_tokens
        request.num_cached_tokens = num_cached_tokens
        self.running.append(request)
        self.block_manager.cache_full_blocks(request, request.num_computed_tokens)
        request.prompt_logprobs.extend(prompt_logprobs)
        new_tokens, new_logprobs = self._append_tokens(request, [token_id], logprobs)
        if not request.is_finished:
            request.num_draft_tokens = num_drafts
        return RequestUpdate(
            request_id,
            new_tokens,
            new_logprobs,
            list(prompt_logprobs),
            request.finish_reason,
            request.stop_reason,
            request.num_cached_tokens,
        )

    def release_held(self, request_id: str) -> None:
        """Free the blocks of a finished request that a KV transfer was using."""
        request = self.held.pop(request_id, None)
        if request is not None:
            self.block_manager.free(request)

    # ---- scheduling ----------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """The next step. With overlap scheduling one step may still be in flight: a request
        that samples there gets a follow-up row whose inputs the model runner resolves."""
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted = False

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            try:
                index, budget, preempted = self._schedule_running(
                    request, index, budget, scheduled, preempted
                )
            except Exception as error:  # noqa: BLE001 (a fault fails only its request)
                self.fail_request(request.request_id, error)
                if request in self.running[index : index + 1]:
                    index += 1  # not removed: never retry it in this step

        while (
            not preempted
            and self.waiting
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            request = self.waiting[0]
            try:
                budget = self._admit(request, budget, scheduled)
            except Exception as error:  # noqa: BLE001 (a fault fails only its request)
                self.fail_request(request.request_id, error)
                budget = budget if request not in self.waiting[:1] else None
            if budget is None:
                break

        finished_ids, self._finished_ids = self._finished_ids, []
        return SchedulerOutput(scheduled=scheduled, finished_request_ids=finished_ids)

    def _schedule_running(
        self,
        request: Request,
        index: int,
        budget: int,
        scheduled: list[ScheduledRequest],
        preempted: bool,
    ) -> tuple[int, int, bool]:
        """Give the running request at ``index`` its row if it has work and blocks (other
        requests may be preempted for them); returns the next index, budget and whether
        anything was preempted."""
        follow_up = request.num_in_flight > 0 and request.in_flight_samples
        if follow_up and self._ends_in_flight(request):
            return index + 1, budget, preempted  # its sampling row in flight finishes it
        if follow_up:
            num_new, num_alloc = self._follow_up_tokens(request, budget)
        else:
            num_new = num_alloc = self._num_new_tokens(request, budget)
        if num_new <= 0:
            return index + 1, budget, preempted
        while not self.block_manager.allocate_slots(
            request, num_alloc, num_lookahead_tokens=self._lookahead(request, num_alloc)
        ):
            # A request with a row in flight is never preempted: its results are coming.
            victim = next((r for r in reversed(self.running) if not r.num_in_flight), None)
            if victim is None:
                return index + 1, budget, preempted  # wait for the step in flight
            self._preempt(victim)
            preempted = True
            if victim is request:
                return index, budget, preempted
        scheduled.append(self._row(request, num_new, follow_up))
        return index + 1, budget - num_new, preempted

    def _admit(
        self, request: Request, budget: int, scheduled: list[ScheduledRequest]
    ) -> int | None:
        """Admit the first waiting request if its blocks fit; returns the budget left, or
        None when it must wait."""
        hit_blocks, num_hit_tokens = self.block_manager.get_computed_blocks(request)
        num_new = min(request.num_tokens - num_hit_tokens, budget)
        lookahead = self._lookahead(request, num_new, num_hit_tokens)
        if not self.block_manager.allocate_slots(request, num_new, hit_blocks, lookahead):
            return None
        self.waiting.popleft()
        request.num_computed_tokens = num_hit_tokens
        request.num_cached_tokens = num_hit_tokens
        request.num_draft_tokens = 0
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        scheduled.append(self._row(request, num_new, follow_up=False, admitted=True))
        return budget - num_new

    def _ends_in_flight(self, request: Request) -> bool:
        """The sampling row in flight emits at least one token, which reaches max_tokens
        or the context."""
        return (
            request.num_output_tokens + 1 >= request.max_tokens
            or request.num_tokens + 1 >= self.max_model_len
        )

    def _num_new_tokens(self, request: Request, budget: int) -> int:
        """Known tokens not yet computed, plus the drafts to verify, within the budget."""
        num_new = request.num_tokens - request.num_computed_tokens + request.num_draft_tokens
        return min(num_new, budget, self.max_model_len - request.num_computed_tokens)

    def _follow_up_tokens(self, request: Request, budget: int) -> tuple[int, int]:
        """(tokens to budget, tokens to allocate after the computed ones) for the row that
        follows a sampling row still in flight. That row ends at ``in_flight_end`` and
        keeps at most all its drafts, so this one computes positions below
        ``in_flight_end + 1 + k`` (within the context)."""
        k = self.num_speculative_tokens
        end = min(request.in_flight_end + 1 + k, self.max_model_len)
        return min(1 + k, budget), max(0, end - request.num_computed_tokens)

    def _lookahead(self, request: Request, num_new: int, num_computed: int | None = None) -> int:
        """Slots beyond this step for the MTP head's deeper drafts (within the context)."""
        if num_computed is None:
            num_computed = request.num_computed_tokens
        room = self.max_model_len - (num_computed + num_new)
        return max(0, min(self.num_speculative_tokens, room))

    def _row(
        self, request: Request, num_new: int, follow_up: bool, admitted: bool = False
    ) -> ScheduledRequest:
        row = ScheduledRequest(
            request,
            num_new,
            list(self.block_manager.block_ids(request.request_id)),
            start=request.num_computed_tokens,
        )
        if admitted:
            row.reset_token_ids = request.all_token_ids()
            row.reset_num_computed = request.num_computed_tokens
        request.num_in_flight += 1
        if follow_up:
            request.in_flight_end += num_new  # an upper bound: fewer drafts may run
            row.follow_up = True
            return row
        end = request.num_computed_tokens + num_new
        request.in_flight_end = end
        request.in_flight_samples = row.samples = end >= request.num_tokens
        if not request.in_flight_samples:
            # A prompt chunk's progress is certain: count it now, so that the next chunk
            # can be scheduled while this one runs.
            request.num_computed_tokens = end
        return row

    def _preempt(self, request: Request) -> None:
        """Free a running request's blocks; it recomputes from scratch when readmitted."""
        self.running.remove(request)
        self.block_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_draft_tokens = 0
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
            request.num_in_flight -= 1
            if request.is_finished:
                continue  # finished or aborted while the step ran: its results are dropped
            try:
                update = self._apply_row(request, runner_output)
            except Exception as error:  # noqa: BLE001 (a fault fails only its request)
                self.fail_request(request.request_id, error)
                continue
            if update is not None:
                updates.append(update)
        return updates

    def _apply_row(
        self, request: Request, runner_output: ModelRunnerOutput
    ) -> RequestUpdate | None:
        """Advance one request by its row's results; its update, if it has news."""
        request_id = request.request_id
        sampled = runner_output.sampled_token_ids.get(request_id, [])
        if sampled:
            # KV stays valid for the known tokens and the accepted drafts: every new
            # token but the last (whose KV the next step computes).
            request.num_computed_tokens = request.num_tokens + len(sampled) - 1
            self._count_drafts(
                runner_output.num_verified_drafts.get(request_id, 0), len(sampled) - 1
            )
            if request.num_in_flight:
                # The follow-up row in flight starts here and runs at most 1 + k tokens.
                request.in_flight_end = min(
                    request.in_flight_end,
                    request.num_computed_tokens + 1 + self.num_speculative_tokens,
                )
        # Before any stop check: finishing frees the blocks.
        self.block_manager.cache_full_blocks(request, request.num_computed_tokens)
        new_prompt_logprobs = runner_output.prompt_logprobs.get(request_id, [])
        request.prompt_logprobs.extend(new_prompt_logprobs)
        new_tokens, new_logprobs = self._append_tokens(
            request, sampled, runner_output.logprobs.get(request_id, [])
        )
        if sampled and not request.is_finished:
            request.num_draft_tokens = runner_output.num_drafts.get(request_id, 0)
        if not (new_tokens or new_prompt_logprobs or request.is_finished):
            return None
        return RequestUpdate(
            request_id=request_id,
            new_token_ids=new_tokens,
            new_logprobs=new_logprobs,
            new_prompt_logprobs=new_prompt_logprobs,
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
            num_cached_tokens=request.num_cached_tokens,
        )

    def _append_tokens(
        self, request: Request, sampled: list[int], sampled_logprobs: list[TokenLogprobs]
    ) -> tuple[list[int], list[TokenLogprobs]]:
        """Append sampled tokens (and their logprobs) up to the first that stops it."""
        new_tokens: list[int] = []
        new_logprobs: list[TokenLogprobs] = []
        for position, token_id in enumerate(sampled):
            request.output_token_ids.append(token_id)
            new_tokens.append(token_id)
            if position < len(sampled_logprobs):
                request.output_logprobs.append(sampled_logprobs[position])
                new_logprobs.append(sampled_logprobs[position])
            if self._check_stop(request, token_id):
                break
        return new_tokens, new_logprobs

    def _count_drafts(self, num_drafts: int, num_accepted: int) -> None:
        if not num_drafts:
            return
        self.spec_num_drafts += 1
        self.spec_num_draft_tokens += num_drafts
        self.spec_num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.spec_accepted_per_pos[position] += 1

    def _check_stop(self, request: Request, token_id: int) -> bool:
        if (
            token_id in request.end_token_ids
            and request.num_output_tokens >= request.sampling_params.min_tokens
        ):
            request.stop_reason = token_id
            self._finish(request, RequestStatus.FINISHED_STOPPED)
            return True
        if request.num_output_tokens >= request.max_tokens or (
            request.num_tokens >= self.max_model_len
        ):
            self._finish(request, RequestStatus.FINISHED_LENGTH)
            return True
        return False
