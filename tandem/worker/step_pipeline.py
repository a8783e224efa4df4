"""The step pipeline: launch a step's device work, read its results, and (overlap scheduling)
launch the next step before reading the one in flight. All of overlap lives here.

``launch`` queues a step (inputs, forward, sampling and verification, logprobs, the copies
of the results to the host) without waiting; ``read`` waits once for a launched step's
results and applies them to the worker's request states. ``execute`` is launch-then-read;
``step_ahead`` launches the new step and reads the previous one; ``read_in_flight`` reads
the last launched step at the end of a run. The host waits for the device only inside
``read`` (DESIGN.md invariant 6).

Plain decoding always launches ahead: a decode row's input token is the unread step's
sample, filled in on the device. With an MTP head a step has up to four parts: the rows
the device can resolve (``spec_decode/mtp_steps.py``: a row verifies k drafts from its
request's device slot) go ahead as one resolved step that drafts at launch, and prompt
chunks (new prompts, or later chunks of prompts that emitted nothing yet) as a ragged step
that drafts at launch too (their next rows can then go ahead as well); after the step in
front is read, the rows it made resolvable go as a second resolved step, the others (a
sampled or near-the-end row) as a ragged step. The parts are read with one wait. Each part
reads the weights once: for a model over ``SPLIT_STEP_MAX_WEIGHT_BYTES`` a step goes whole,
ahead if each of its rows can go ahead (resolved rows and prompt chunks then share one
forward, each kind verified or sampled and drafted as when alone), else after the read.
"""

from __future__ import annotations

import itertools
import time

import torch

from tandem.device_copy import DeviceReader, to_device
from tandem.step import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from tandem.worker import step_results
from tandem.worker.grammars import RowGrammars
from tandem.worker.input_batch import PLACEHOLDER, InputBatch, StepInputs
from tandem.worker.launched_step import LaunchedStep
from tandem.worker.model_runner import ModelRunner, on_runner_device
from tandem.worker.request_slots import RequestSlots
from tandem.worker.spec_decode.mtp_steps import MTPSteps
from tandem.worker.spec_decode.uniform_step import forward_mixed
from tandem.worker.step_sampler import SamplingRow, StepSample, sample_step

# Splitting an MTP step into parts reads the weights once more per part; below this size
# that read costs less than the host's wait that launching rows ahead saves (SmolLM2-135M,
# 0.27 GB: ~0.06 ms on an H200); above it (an 8B model, 16 GB: ~3.4 ms) it costs more.
SPLIT_STEP_MAX_WEIGHT_BYTES = 2 * 2**30


def weight_bytes(module: torch.nn.Module) -> int:
    """The bytes of ``module``'s parameters (on this rank)."""
    return sum(p.numel() * p.element_size() for p in module.parameters())


class StepPipeline:
    """Launches and reads the steps of one model runner (see the module docstring)."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.device = runner.device
        num_drafts = runner.config.speculative.num_speculative_tokens
        slots = None
        if runner.proposer is not None:  # room for every running request and the ones ending
            capacity = RequestSlots.initial_capacity(runner.config.scheduler.max_num_seqs)
            slots = RequestSlots(num_drafts, runner.arch.vocab_size, runner.device, capacity)
        # Every rank seeds alike, so all sample the same tokens from the same full logits.
        self.batch = InputBatch(
            runner.device, runner.block_size, runner.max_model_len, slots, runner.config.seed
        )
        # Whether an MTP step whose rows are not all resolvable ahead goes in parts.
        self.split_steps = weight_bytes(runner.model) <= SPLIT_STEP_MAX_WEIGHT_BYTES
        # With an MTP head: which steps the device resolves, their launch, and drafting.
        self.mtp = MTPSteps(runner, self.batch, not self.split_steps) if slots else None
        self.reader = DeviceReader(self.device)
        self.grammars = RowGrammars(runner.config.model, runner.arch.vocab_size, self.reader)
        # The host's time in launch (preparing, queueing steps); of it, in MTP ragged parts.
        self.launch_seconds = self.ragged_launch_seconds = 0.0
        self._launched: LaunchedStep | None = None  # overlap: the step queued, not yet read
        # MTP steps resolved on the device, and those queued before the read of the one in front.
        self.num_resolved_steps = self.num_launched_ahead = 0
        self.num_prompts_ahead = 0  # steps whose prompt chunks went before the read
        self.num_parts_after_read = 0  # MTP steps with a part that waited for the read
        self.num_mixed_steps = 0  # MTP steps of resolved rows and prompt chunks, one forward
        self.num_read_first = 0  # plain decoding: steps launched after the read (penalties)

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and read its results (no overlap)."""
        launched = self._timed_launch(step)
        return self.read(launched) if launched is not None else ModelRunnerOutput()

    @on_runner_device
    @torch.inference_mode()
    def step_ahead(self, step: SchedulerOutput) -> ModelRunnerOutput | None:
        """Overlap scheduling: queue ``step``'s device work, then read the step launched by
        the previous call and return its output (None when there was none). The new step
        is queued before the read, so the device never waits for the host's bookkeeping,
        unless it depends on the host's view of the previous one: with MTP, the rows that
        the device resolves go first and the others follow the read (the module
        docstring)."""
        previous, self._launched = self._launched, None
        if self.mtp is not None and not step.is_empty:
            return self._step_ahead_mtp(step, previous)
        output = None
        # A row that reads its output (a bias, a grammar) needs the step in front read first.
        if previous is not None and (step.is_empty or step.reads_output):
            self.num_read_first += not step.is_empty
            output, previous = self.read(previous), None
        self._launched = self._timed_launch(step)
        if previous is not None:
            output = self.read(previous)
        return output

    def _step_ahead_mtp(
        self, step: SchedulerOutput, previous: LaunchedStep | None
    ) -> ModelRunnerOutput | None:
        """``step_ahead`` with an MTP head: the rows the device can resolve from their slots
        go before ``previous`` is read as one resolved step, prompt chunks (``_joins``) as
        a ragged one; after the read, the rows it made resolvable go as a second resolved
        step, the rest (sampled or near-the-end rows) as a ragged one, all chained on the
        first (``LaunchedStep.rest``) and read together. Without ``split_steps`` a step
        goes whole: ahead if each of its rows can go ahead (resolved rows and prompt chunks
        then share one forward: ``_launch_mixed``), else after the read."""
        resolvable = self.mtp.row_resolvable
        ready = [row for row in step.scheduled if resolvable(row, previous is not None)]
        ready_ids = {id(row) for row in ready}
        joining = [r for r in step.scheduled if id(r) not in ready_ids and self._joins(r)]
        mixed = False
        if not self.split_steps:  # one part: ahead only if every row can go ahead
            if len(ready) + len(joining) < len(step.scheduled):
                ready, joining = [], []
            mixed = bool(ready and joining)
        finished = step.finished_request_ids  # dropped by the first part launched
        parts: list[LaunchedStep | None] = []
        if joining and previous is not None:
            previous.keep_hidden()
        if mixed:
            parts.append(self._timed_launch(step, resolved_rows=ready))
            finished = []
        else:
            for rows, resolved in ((ready, True), (joining, False)):
                if rows:
                    parts.append(self._timed_launch(SchedulerOutput(rows, finished), resolved))
                    finished = []
        if previous is not None:
            self.num_launched_ahead += bool(ready)
            self.num_prompts_ahead += bool(joining)
        output = self.read(previous) if previous is not None else None
        taken = {id(row) for row in ready + joining}
        later = [row for row in step.scheduled if id(row) not in taken]
        self.num_parts_after_read += previous is not None and bool(later)
        resolved_now, ragged = [], []
        for row in later:
            (resolved_now if resolvable(row, False) else ragged).append(row)
        if not self.split_steps and ragged:
            resolved_now, ragged = [], later
        # Parts so far (resolved; prompts drafted at launch) keep no hidden states to lose.
        for rows, resolved in ((resolved_now, True), (ragged, False)):
            if rows:
                parts.append(self._timed_launch(SchedulerOutput(rows, finished), resolved))
                finished = []
        launched = [part for part in parts if part is not None]
        for part, after in itertools.pairwise(launched):
            while part.rest is not None:  # a mixed step's chunks part
                part = part.rest
            part.rest = after
            after.output = launched[0].output
        self._launched = launched[0] if launched else None
        return output

    def _joins(self, row) -> bool:
        """Whether ``row`` is a prompt chunk that can go before the read: it admits a request
        this worker holds no state of, or it goes on with a prompt while no step of it that
        samples is in flight (launches move a chunk's start on) and reports no prompt
        logprobs (their start moves at the read); it reads no output (a bias, a grammar)."""
        request, state = row.request, self.batch.states.get(row.request.request_id)
        if request.sampling_params.reads_output:
            return False
        if row.reset_token_ids is not None or state is None:
            return row.reset_token_ids is not None and state is None
        in_prompt = row.end <= state.num_prompt_tokens and row.start == state.num_computed
        return in_prompt and not row.follow_up and not request.wants_prompt_logprobs

    @on_runner_device
    @torch.inference_mode()
    def read_in_flight(self) -> ModelRunnerOutput | None:
        """Read the step launched last, if any (the end of an overlapped run)."""
        previous, self._launched = self._launched, None
        return self.read(previous) if previous is not None else None

    def _timed_launch(
        self,
        step: SchedulerOutput,
        resolvable: bool | None = None,
        resolved_rows: list[ScheduledRequest] | None = None,
    ) -> LaunchedStep | None:
        started = time.perf_counter()
        try:
            return self.launch(step, resolvable, resolved_rows)
        finally:
            elapsed = time.perf_counter() - started
            self.launch_seconds += elapsed
            self.ragged_launch_seconds += elapsed if resolvable is False else 0.0

    def discard_launched(self) -> None:
        """After a fault: forget the launched step, unread (its requests have failed; the
        caller drops them), once its device work has ended."""
        self._launched = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def drop_requests(self, request_ids: list[str]) -> None:
        """Forget ended requests; their device slots are freed once no launched step can
        still touch them."""
        self.batch.drop(request_ids)
        if self._launched is None:
            self.batch.free_released_slots()

    def launch(
        self,
        step: SchedulerOutput,
        resolvable: bool | None = None,
        resolved_rows: list[ScheduledRequest] | None = None,
    ) -> LaunchedStep | None:
        """Queue one step's device work (forward, sampling, logprobs) without waiting;
        ``resolvable``: whether the MTP side can resolve it (asked when None);
        ``resolved_rows``: those of its rows the MTP side resolves while the others, prompt
        chunks, go in the same forward (``_launch_mixed``)."""
        self.batch.drop(step.finished_request_ids)
        if step.is_empty:
            return None
        begun = self.reader.begin()
        if resolved_rows:
            return self._launch_mixed(step, resolved_rows, begun)
        if resolvable is None:
            resolvable = self.mtp is not None and self.mtp.resolvable(step, ahead=False)
        if resolvable:
            return self._resolved_part(*self.mtp.launch_resolved(step), begun)
        inputs = self._prepare_ragged(step)
        if not inputs.plans:  # every row past the context's end: nothing to compute
            return LaunchedStep(inputs, [], [], None, None, None, None, ModelRunnerOutput(), False)
        hidden, input_ids = self.runner.forward(inputs)
        return self._finish_ragged(inputs, hidden, input_ids, begun)

    def _prepare_ragged(self, step: SchedulerOutput) -> StepInputs:
        inputs = self.batch.prepare(step)
        if self.mtp is not None:  # their slots are stale until this step drafts for them
            for plan in inputs.plans:
                plan.state.slot_ready = False
        return inputs

    def _launch_mixed(
        self, step: SchedulerOutput, resolved_rows: list[ScheduledRequest], begun
    ) -> LaunchedStep:
        """Queue an MTP step of rows the device resolves and of prompt chunks (its other
        rows) as one forward, which reads the weights once (``forward_mixed``: the resolved
        rows' inputs built on the device from their slots, the chunks' on the host); then
        each kind's verification or sampling and drafting, as when it goes alone. Returns
        the resolved part with the chunks' part chained on it."""
        taken = {id(row) for row in resolved_rows}
        chunks = [row for row in step.scheduled if id(row) not in taken]
        inputs = self._prepare_ragged(SchedulerOutput(chunks, []))
        uniform, depth = self.mtp.mixed_inputs(SchedulerOutput(resolved_rows, []))
        hidden, input_ids = forward_mixed(self.runner, uniform, inputs)
        split = uniform.num_tokens
        finished = self.mtp.finish_mixed(uniform, hidden[:split], depth)
        resolved = self._resolved_part(*finished, begun)
        ragged = self._finish_ragged(inputs, hidden[split:], input_ids[split:], None)
        resolved.rest, ragged.output = ragged, resolved.output
        self.num_mixed_steps += 1
        return resolved

    def _finish_ragged(
        self, inputs: StepInputs, hidden: torch.Tensor, input_ids: torch.Tensor, begun
    ) -> LaunchedStep:
        """After a ragged step's forward (``hidden``, the fed ``input_ids``): its sampling
        and verification, prompt logprobs, the copies of its results to the host, drafting
        at launch where no row verifies drafts, and the states' advance."""
        sampling_plans = [plan for plan in inputs.plans if plan.samples]
        sampling_rows: list[SamplingRow] = []
        logits_rows: list[int] = []
        drafts = self.grammars.read_drafts(sampling_plans, self.batch)
        for plan in sampling_plans:
            state, params = plan.state, plan.row.request.sampling_params
            end = plan.start + plan.num_known  # the position its first draw is for
            sampling_rows.append(
                SamplingRow(
                    len(logits_rows),
                    plan.num_drafts,
                    params,
                    state.seed,
                    end,
                    len(state.token_ids) - state.num_prompt_tokens,
                    self.batch.draft_probs_of(state, params.greedy),
                    state.history(end) if params.adjusts_logits else None,
                    self.grammars.masks(plan, params, end, drafts.get(id(plan), [])),
                )
            )
            first = plan.offset + plan.num_known - 1
            logits_rows += range(first, first + 1 + plan.num_drafts)
        num_sampling = len(logits_rows)
        logits_rows += [i for _, indices, _ in inputs.prompt_rows for i in indices]
        reads: list[torch.Tensor] = []
        sample = prompt_logprobs = None
        if logits_rows:
            rows = to_device(logits_rows, torch.long, self.device)
            logits = self.runner.model.compute_logits(hidden.index_select(0, rows))
            if sampling_rows:
                sample = sample_step(
                    sampling_rows,
                    logits[:num_sampling],
                    input_ids.index_select(0, rows[:num_sampling]),
                )
                reads += [sample.candidates, sample.num_emitted]
                if sample.logprobs is not None:
                    reads += sample.logprobs.tensors()
            if inputs.prompt_rows:
                prompt_logprobs = step_results.prompt_logprobs(
                    inputs, logits[num_sampling:], self.device
                )
                reads += prompt_logprobs.tensors()
        launched = LaunchedStep(
            inputs,
            sampling_plans,
            sampling_rows,
            sample,
            prompt_logprobs,
            self.reader.start(reads, begun) if reads else None,
            hidden,
            ModelRunnerOutput(),
            self.runner.proposer is None,
        )
        if self.mtp is not None and not any(plan.num_drafts for plan in inputs.plans):
            self.mtp.draft_at_launch(launched)  # no row verifies drafts: all rows are known
        self._advance(launched)
        return launched

    def _resolved_part(
        self, plans: list, sample: StepSample, sampling_rows: list[SamplingRow], begun
    ) -> LaunchedStep:
        """The launched part of rows the device resolved (``mtp_steps.launch_resolved``)."""
        reads = [sample.candidates, sample.num_emitted]
        if sample.logprobs is not None:
            reads += sample.logprobs.tensors()
        inputs = StepInputs(plans, [], [], [], [], [], [], [], [], [], [], [])
        self.num_resolved_steps += 1
        return LaunchedStep(
            inputs,
            plans,
            sampling_rows,
            sample,
            None,
            self.reader.start(reads, begun),
            None,
            ModelRunnerOutput(),
            advanced=False,
            resolved=True,
        )

    def _advance(self, launched: LaunchedStep) -> None:
        """Move the request states on at launch, so that the next step can be prepared before
        this one is read: a row that emits nothing (a prompt chunk short of the prompt's
        end) always; with plain decoding (exactly one token per sampling row) every row."""
        sampled = {id(plan) for plan in launched.sampling_plans}
        for plan in launched.inputs.plans:
            if id(plan) not in sampled:
                plan.state.num_computed += plan.num_known
        if not launched.advanced:
            return
        for plan, row in zip(launched.sampling_plans, launched.sampling_rows, strict=True):
            state = plan.state
            state.num_computed = len(state.token_ids)
            plan.placeholder = len(state.token_ids)
            state.token_ids.append(PLACEHOLDER)
            state.pending_token = (launched.sample.candidates, row.logits_start)

    def read(self, launched: LaunchedStep) -> ModelRunnerOutput:
        """Wait for a launched step once, read its results and apply them."""
        parts = [launched]
        while parts[-1].rest is not None:
            parts.append(parts[-1].rest)
        pending = [part.reads for part in parts if part.reads is not None]
        hosts = iter(self.reader.read_all(pending) if pending else [])
        for part in parts:
            self._apply(part, next(hosts) if part.reads is not None else [], launched.output)
        self.batch.free_released_slots()
        return launched.output

    def _apply(self, launched: LaunchedStep, host: list, output: ModelRunnerOutput) -> None:
        """Apply one launched part's read results to the request states and ``output``."""
        emitted = step_results.emit(launched, host, output)
        if launched.prompt_logprobs is not None:
            step_results.report_prompt_logprobs(launched.inputs, host[-4:], output)
        if self.mtp is not None:
            self.mtp.after_read(launched, emitted, output)
