"""The MTP side of the step pipeline: which steps the device can resolve (and so launch
before the step in front of them is read), their launch, and drafting for the ragged steps.
A ragged step whose rows verify no drafts (prompt chunks, rows without drafts) emits exactly
one token per sampling row, so its head rows are known at launch: it drafts then, the
sampled tokens gathered on the device, and fills the slots of rows with a full k drafts, so
that their next step launches before it is read. A ragged step that verifies drafts keeps
a number of positions per row that only its read tells (the accepted counts): it drafts
after the read."""

from __future__ import annotations

import torch

from tandem.device_copy import to_device
from tandem.layers.sampler import LogprobsTensors
from tandem.step import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from tandem.worker.input_batch import InputBatch, RequestState, RowPlan, StepInputs
from tandem.worker.launched_step import LaunchedStep
from tandem.worker.model_runner import ModelRunner, on_runner_device
from tandem.worker.spec_decode.proposer import Proposal, ProposalRow
from tandem.worker.spec_decode.step_graphs import ResolvedStepGraphs, graph_family
from tandem.worker.spec_decode.uniform_step import (
    UniformInputs,
    finish_uniform_step,
    launch_uniform_step,
    resolved_length_bound,
    resolved_sampling_rows,
    uniform_inputs,
    uniform_metadata,
)
from tandem.worker.step_sampler import SamplingRow, StepSample


class MTPSteps:
    """Resolved launches and drafting for one step pipeline with an MTP head."""

    def __init__(self, runner: ModelRunner, batch: InputBatch, mixed_steps: bool):
        """``mixed_steps``: whether steps of resolved rows and prompt chunks go as one
        forward (steps whole), so that the step graphs without the forward are captured."""
        self.runner = runner
        self.batch = batch
        self.slots = batch.slots
        self.device = runner.device
        bind_batch = getattr(runner.proposer, "bind_batch", None)
        if bind_batch is not None:  # a proposer that reads the requests' states (the oracle)
            bind_batch(batch)
        # Whole resolved steps as CUDA graphs (families: step_graphs.graph_family).
        self.step_graphs: ResolvedStepGraphs | None = None
        if runner.uses_cuda_graphs:
            self.step_graphs = ResolvedStepGraphs(
                runner, self.slots, runner.config.scheduler.max_num_seqs, mixed_steps
            )
            self.capture()

    @on_runner_device
    def capture(self) -> None:
        """Capture the resolved steps' graphs (on the runner's device)."""
        self.step_graphs.capture()

    def resolvable(self, step: SchedulerOutput, ahead: bool) -> bool:
        """Whether every row of ``step`` can be resolved on the device (``row_resolvable``)."""
        return not step.is_empty and all(self.row_resolvable(row, ahead) for row in step.scheduled)

    def row_resolvable(self, row: ScheduledRequest, ahead: bool) -> bool:
        """Whether the device can resolve ``row``: the verification of the drafts in the
        slot of a request (greedy or sampled) whose slot is ready (a full k, or as many as
        the draft schedule drafted), with no end-token ban to apply (min_tokens met) and
        nothing that reads the output (a bias, penalty, grammar), and room for its writes
        within its blocks and the context; ``ahead``: a step in front of it is still
        unread, so the room must hold however many drafts that step accepts."""
        if not getattr(self.runner.proposer, "resolves_on_device", False):
            return False
        k = self.slots.num_drafts
        state = self.batch.states.get(row.request.request_id)
        params = row.request.sampling_params
        if row.reset_token_ids is not None or state is None:
            return False
        # A step in flight that emits one token (drafted at launch) leaves no doubt.
        num_known = len(state.token_ids) + state.one_token_in_flight
        if (
            row.num_new_tokens < state.slot_depth + 1
            or not state.slot_ready
            or num_known - state.num_prompt_tokens < params.min_tokens
            or params.reads_output  # a bias, penalty or grammar: the host-read path
        ):
            return False
        limit = min(self.runner.max_model_len, len(row.block_ids) * self.runner.block_size)
        ahead = ahead and not state.one_token_in_flight
        return resolved_length_bound(num_known, k, ahead, state.slot_depth) <= limit

    def launch_resolved(
        self, step: SchedulerOutput
    ) -> tuple[list[RowPlan], StepSample, list[SamplingRow]]:
        """Queue ``step`` (``resolvable``) as a uniform step resolved on the device. Its rows
        verify the drafts the draft schedule gives a step of their number
        (``SpeculativeConfig.drafts_for``), or fewer where a row's slot holds fewer, and
        the head drafts the schedule's number for the next step."""
        plans, num_drafts, depth = self._resolved_plans(step)
        graphed = self._graphed(plans, num_drafts, depth)
        if graphed is not None:
            return plans, *graphed
        sample, sampling_rows = launch_uniform_step(
            self.runner, self.slots, plans, num_drafts, depth
        )
        return plans, sample, sampling_rows

    def _graphed(
        self,
        plans: list[RowPlan],
        num_drafts: int,
        depth: int,
        hidden: torch.Tensor | None = None,
    ) -> tuple[StepSample, list[SamplingRow]] | None:
        """The resolved step of ``plans`` as a step graph's replay (``hidden``: after a
        forward shared with prompt chunks, the graph without the forward), or None where
        no graph holds it (the eager step runs)."""
        graphs = self.step_graphs
        params = [plan.row.request.sampling_params for plan in plans]
        family = graph_family(params, self.runner.arch.vocab_size)
        size = None if graphs is None else graphs.padded_size(len(plans))
        if family is None or size is None or (num_drafts, depth) not in graphs.shapes[size]:
            return None
        if hidden is not None and not graphs.mixed:  # steps in parts: none captured
            return None
        outputs = graphs.run(
            [plan.state.slot for plan in plans],
            [plan.row.block_ids for plan in plans],
            num_drafts,
            depth,
            family,
            params,
            [plan.state.seed for plan in plans],
            hidden,
        )
        sampling_rows = resolved_sampling_rows(plans, num_drafts)
        candidates, emitted = outputs[0], outputs[1]
        if not any(p.logprobs is not None for p in params):
            return StepSample(candidates, emitted, [], None), sampling_rows
        # Every candidate's logprobs (the API's largest top-N; each row reports its own N).
        logprobs = LogprobsTensors(*outputs[2:])
        sample = StepSample(candidates, emitted, list(range(len(candidates))), logprobs)
        return sample, sampling_rows

    def _resolved_plans(self, step: SchedulerOutput) -> tuple[list[RowPlan], int, int]:
        """The plans of ``step``'s resolved rows, the drafts they verify, and the depth the
        head drafts for their next step (``launch_resolved``)."""
        states = [self.batch.states[row.request.request_id] for row in step.scheduled]
        depth = self.runner.config.speculative.drafts_for(len(states))
        num_drafts = min([depth] + [state.slot_depth for state in states])
        for state in states:
            state.slot_depth = depth
        query_len = num_drafts + 1
        plans = [
            RowPlan(row, state, -1, 1, num_drafts, index * query_len)  # start: on the device
            for index, (row, state) in enumerate(zip(step.scheduled, states, strict=True))
        ]
        return plans, num_drafts, depth

    def mixed_inputs(self, step: SchedulerOutput) -> tuple[UniformInputs, int]:
        """The device-built inputs of ``step``'s rows (``resolvable``) when they share a
        forward with prompt chunks (``StepPipeline._launch_mixed``), and the head's depth."""
        plans, num_drafts, depth = self._resolved_plans(step)
        return uniform_inputs(self.runner, self.slots, plans, num_drafts), depth

    def finish_mixed(
        self, uniform: UniformInputs, hidden: torch.Tensor, depth: int
    ) -> tuple[list[RowPlan], StepSample, list[SamplingRow]]:
        """After the shared forward (``hidden``: the resolved rows' part): verification, the
        slots' advance and drafting, as ``launch_resolved`` does (a step graph's replay
        without its forward where one holds the rows, else eagerly)."""
        graphed = self._graphed(uniform.plans, uniform.num_drafts, depth, hidden)
        if graphed is not None:
            return uniform.plans, *graphed
        metadata = uniform_metadata(self.runner, uniform)
        sample, sampling_rows = finish_uniform_step(
            self.runner, self.slots, uniform, hidden, depth, metadata
        )
        return uniform.plans, sample, sampling_rows

    def after_read(self, launched: LaunchedStep, emitted: dict, output: ModelRunnerOutput) -> None:
        """A launched part was read (``emitted``: the tokens each request got): record its
        drafts, or (a ragged part that verified drafts) draft now."""
        if launched.resolved:
            self.after_resolved_read(launched.inputs.plans, output)
        elif launched.drafted is not None:  # not a partial chunk's: its later one may be out
            emitting = [plan for plan in launched.inputs.plans if plan.request_id in emitted]
            self.after_drafted_read(emitting, launched.drafted, output)
        else:
            self.draft_after_read(launched.inputs, launched.hidden, emitted, output)

    def draft_at_launch(self, launched: LaunchedStep) -> None:
        """Draft for a ragged step whose rows verify no drafts, as it is launched (the
        module docstring): every row keeps its known positions, the last next token of a
        sampling row is the token this step samples (gathered on the device); rows with a
        full k drafts get their slots written (start, that token, drafts). The drafts go to
        ``launched.drafted``; its hidden states are no longer needed."""
        k = self.slots.num_drafts
        inputs, sampling_plans = launched.inputs, launched.sampling_plans
        first_rows = {
            id(plan): row.logits_start
            for plan, row in zip(sampling_plans, launched.sampling_rows, strict=True)
        }
        rows: list[ProposalRow] = []
        sampling, fill, gather = {}, [], []
        num_positions = 0
        for plan in inputs.plans:
            samples = id(plan) in first_rows  # the token after its last is this step's sample
            rows.append(self._head_row(plan, plan.num_known, samples, sampling))
            num_positions += plan.num_known
            if samples:
                fill.append(num_positions - 1)
                gather.append(first_rows[id(plan)])
        sampled = None
        if gather:  # the rows' samples in order (a prompt step's candidates already are)
            sampled = (fill, self._rows(launched.sample.candidates, gather))
        proposer = self.runner.proposer
        graphs = getattr(proposer, "prompt_graphs", None)
        if graphs is not None and graphs.applies(rows, launched.hidden, sampling):
            proposal = graphs.propose(rows, launched.hidden, sampled)
        else:
            proposal = proposer.propose(rows, launched.hidden, sampling, sampled)
        launched.drafted, launched.hidden = proposal, None
        drafts = proposal.draft_token_ids
        full = [
            (index, plan)
            for index, plan in enumerate(sampling_plans)
            if plan.request_id in drafts and drafts[plan.request_id].shape[0] == k
        ]
        if full:
            self.slots.write(
                [plan.state.slot for _, plan in full],
                [plan.start + plan.num_known for _, plan in full],
                self._rows(sampled[1], [index for index, _ in full]),
                torch.stack([drafts[plan.request_id] for _, plan in full]),
                {
                    plan.state.slot: proposal.draft_probs[plan.request_id]
                    for _, plan in full
                    if plan.request_id in proposal.draft_probs
                },
            )
            for _, plan in full:
                plan.state.slot_ready = plan.state.one_token_in_flight = True
                plan.state.slot_depth = k

    def _rows(self, tensor: torch.Tensor, indices: list[int]) -> torch.Tensor:
        """``tensor``'s rows at ``indices``: the tensor as it stands where they are all of
        its rows in order (no copy of host-built indices), else a gather."""
        if indices == list(range(tensor.shape[0])):
            return tensor
        return tensor.index_select(0, to_device(indices, torch.long, self.device))

    def after_drafted_read(
        self, plans: list[RowPlan], proposal: Proposal, output: ModelRunnerOutput
    ) -> None:
        """A step drafted at its launch was read: its requests' drafts, as
        ``draft_after_read`` leaves them (the slots of full ones were filled at launch)."""
        for plan in plans:
            plan.state.one_token_in_flight = False
        self._record_drafts(proposal, output)

    def _record_drafts(self, proposal: Proposal, output: ModelRunnerOutput) -> list[RequestState]:
        """Give the requests still here their drafts (and q) and report them; returns the
        states with a full k drafts."""
        full = []
        for request_id, drafts in proposal.draft_token_ids.items():
            state = self.batch.states.get(request_id)
            if state is None:  # it ended, and was dropped, while this step ran
                continue
            state.drafts = drafts
            state.draft_probs = proposal.draft_probs.get(request_id)
            output.num_drafts[request_id] = int(drafts.shape[0])
            if drafts.shape[0] == self.slots.num_drafts:
                full.append(state)
        return full

    def after_resolved_read(self, plans: list[RowPlan], output: ModelRunnerOutput) -> None:
        """A resolved step was read: each request's drafts for its next step are in its
        slot, as many as the last step to write it drafted (those that would pass the
        context's end dropped, as at a ragged read)."""
        max_model_len = self.runner.max_model_len
        for plan in plans:
            state = plan.state
            num_drafts = max(0, min(state.slot_depth, max_model_len - len(state.token_ids)))
            state.drafts = state.draft_probs = None
            state.slot_drafts = num_drafts
            state.slot_ready = num_drafts == state.slot_depth
            output.num_drafts[plan.request_id] = num_drafts

    def draft_after_read(self, inputs: StepInputs, hidden, emitted, output) -> None:
        """After a step that was not resolved on the device has been read: run the MTP
        head over its kept positions (ragged rows the host now knows) and draft the next
        tokens; requests with a full k drafts get their slots filled."""
        rows: list[ProposalRow] = []
        sampling = {}
        for plan in inputs.plans:
            new_tokens = emitted.get(plan.request_id, [])
            # Kept positions: the known tokens computed here plus the accepted drafts.
            num_kept = plan.num_known + max(len(new_tokens) - 1, 0)
            rows.append(self._head_row(plan, num_kept, bool(new_tokens), sampling))
        proposal = self.runner.proposer.propose(rows, hidden, sampling)
        for plan in inputs.plans:
            plan.state.slot_ready = False
        self.fill_slots(self._record_drafts(proposal, output))

    def _head_row(self, plan: RowPlan, num_kept: int, drafts: bool, sampling: dict) -> ProposalRow:
        """The head's rows for ``plan``'s first ``num_kept`` positions, each with the token
        after it (0 where only the device knows it yet: the sample of a step drafted at its
        launch); ``drafts``: the row drafts, as many as the context leaves KV slots for, and
        its params and key seed go into ``sampling``."""
        state = plan.state
        kept = list(range(plan.start, plan.start + num_kept))
        next_tokens = state.token_ids[plan.start + 1 : plan.start + num_kept + 1]
        next_tokens += [0] * (num_kept - len(next_tokens))
        num_drafts = 0
        if drafts:
            k = self.slots.num_drafts
            num_drafts = max(0, min(k, self.runner.max_model_len - 1 - (kept[-1] + 1)))
            sampling[plan.request_id] = (plan.row.request.sampling_params, state.seed)
        hidden_rows = [plan.offset + p - plan.start for p in kept]
        return ProposalRow(
            plan.request_id, kept, hidden_rows, next_tokens, plan.row.block_ids, num_drafts
        )

    def fill_slots(self, states: list[RequestState]) -> None:
        """Write requests' next start, last token and k drafts into their device slots
        (from the host's now complete view), so their next step can be resolved there."""
        if not states:
            return
        self.slots.write(
            [state.slot for state in states],
            [len(state.token_ids) - 1 for state in states],
            [state.token_ids[-1] for state in states],
            torch.stack([state.drafts for state in states]),
            {state.slot: state.draft_probs for state in states if state.draft_probs is not None},
        )
        for state in states:
            state.slot_ready, state.slot_depth = True, self.slots.num_drafts
