"""Model runner: turns a scheduled step into one forward pass, samples, computes logprobs.

It owns the model, the paged KV cache, the persistent input buffers and the per-request
sampling generators. It never changes a request's lifecycle; the scheduler does.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch

from tandem.config import EngineConfig
from tandem.core.scheduler import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from tandem.layers.attention import AttentionBackend, TorchAttentionBackend
from tandem.layers.sampler import LogprobsTensors, compute_logprobs
from tandem.layers.triton_attention import TritonAttentionBackend
from tandem.models.loader import ModelFiles, load_model
from tandem.models.mtp import load_mtp_head
from tandem.models.tensor_parallel import (
    check_process_group,
    shard_model,
    shard_mtp_head,
    validate_tensor_parallel,
)
from tandem.transfer import DeviceReader, PendingRead, copy_to, to_device
from tandem.worker.cuda_graphs import CudaGraphRunner, GraphBatch
from tandem.worker.spec.draft_graphs import DraftGraphRunner
from tandem.worker.spec.proposer import MTPProposer, ProposalRow
from tandem.worker.step_sampler import SamplingRow, StepSample, sample_step


@dataclass
class RequestState:
    """The runner's own view of one request, kept across steps: with overlap scheduling the
    runner is a step ahead of the scheduler, so it resolves each row's inputs from here."""

    token_ids: list[int]  # prompt and every token this runner emitted
    num_prompt_tokens: int
    num_computed: int  # positions whose KV is valid
    generator: torch.Generator | None
    drafts: torch.Tensor | None = None  # [num_drafts] on the device, for the next step
    draft_probs: torch.Tensor | None = None  # [num_drafts, V] for sampled drafts
    num_prompt_logprobs: int = 0  # prompt logprobs reported so far (survives preemption)
    # Plain decoding advances the state when a step is launched: its sampled token is a
    # PLACEHOLDER in token_ids until the step is read, and lives on the device meanwhile
    # as pending_token = (candidates tensor of that step, index).
    pending_token: tuple[torch.Tensor, int] | None = None

    @property
    def num_drafts(self) -> int:
        return 0 if self.drafts is None else int(self.drafts.shape[0])


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


@dataclass
class LaunchedStep:
    """A step whose device work is queued and whose results the host has not read yet."""

    inputs: StepInputs
    sampling_plans: list[RowPlan]
    sampling_rows: list[SamplingRow]
    sample: StepSample | None
    prompt_logprobs: LogprobsTensors | None
    reads: PendingRead | None  # the step's results on their way to the host
    hidden: torch.Tensor
    output: ModelRunnerOutput
    advanced: bool  # request states were advanced at launch (plain decoding)


def _attention_backend(name: str) -> AttentionBackend:
    return TritonAttentionBackend() if name == "triton" else TorchAttentionBackend()


def kv_cache_bytes_per_block(
    arch, block_size: int, dtype: torch.dtype, num_extra_layers: int = 0
) -> int:
    """Bytes that one KV block takes over all layers (keys and values), MTP layers too."""
    element = torch.empty((), dtype=dtype).element_size()
    layers = arch.num_layers + num_extra_layers
    return 2 * layers * block_size * arch.num_kv_heads * arch.head_dim * element


def on_runner_device(method):
    """Run ``method`` with the runner's GPU as CUDA's current device: Triton launches its
    kernels there, whatever the tensors' device (an engine on cuda:1, another on cuda:0)."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        if self.device.type != "cuda":
            return method(self, *args, **kwargs)
        with torch.cuda.device(self.device):
            return method(self, *args, **kwargs)

    return wrapper


class ModelRunner:
    """Runs the model for the scheduler's steps on one device.

    Built in two stages: the constructor loads the weights (and the MTP head), so the
    engine can size the KV cache from the memory left; ``allocate_kv_cache`` then creates
    the cache and, on CUDA, captures the CUDA graphs."""

    def __init__(
        self,
        config: EngineConfig,
        files: ModelFiles,
        max_model_len: int,
        mtp_source: str | None = None,
        use_mtp: bool = False,
    ):
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = getattr(torch, config.resolved_dtype_name())
        self.block_size = config.cache.block_size
        self.max_model_len = max_model_len
        rank, world_size = config.parallel.rank, config.parallel.tensor_parallel_size
        if world_size > 1:  # fail before loading: the shapes must split, the ranks connect
            validate_tensor_parallel(files.arch, world_size, files.path)
            check_process_group(rank, world_size)
        self.model = load_model(files, max_model_len, self.dtype, self.device, config.seed)
        self.backend = _attention_backend(config.resolved_attention_backend())
        # Every rank seeds alike, so all sample the same tokens from the same full logits.
        self.default_generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self.states: dict[str, RequestState] = {}
        self._launched: LaunchedStep | None = None  # overlap: the step queued, not yet read
        self.reader = DeviceReader(self.device)
        self.launch_seconds = 0.0  # the host's time in launch (preparing, queueing steps)
        self.mtp_head = None
        if use_mtp:
            mtp_head = load_mtp_head(mtp_source, files, self.model.rotary, config.seed)
            self.mtp_head = mtp_head.to(device=self.device, dtype=self.dtype).eval()
        if world_size > 1:
            shard_model(self.model, rank, world_size, model_name=files.path)
            if self.mtp_head is not None:
                shard_mtp_head(self.mtp_head, rank, world_size)
        if self.device.type == "cuda":
            self.model.fuse_gate_up()  # one GEMM per MLP input on the GPU
            # Hand the replaced weights' memory back: the KV cache is sized from what is free.
            torch.cuda.empty_cache()
        # This rank's shapes (its KV heads alone with tensor parallelism): the cache's.
        self.arch = self.model.arch
        self.kv_caches: list[torch.Tensor] = []
        self.proposer: MTPProposer | None = None
        self.graphs: CudaGraphRunner | None = None
        max_tokens = config.scheduler.max_num_batched_tokens
        self._input_ids = torch.zeros(max_tokens, dtype=torch.long, device=self.device)
        self._positions = torch.zeros(max_tokens, dtype=torch.long, device=self.device)
        self._slots = torch.zeros(max_tokens, dtype=torch.long, device=self.device)

    @on_runner_device
    def allocate_kv_cache(self, num_blocks: int, max_model_len: int) -> None:
        """Create the paged KV cache (``num_blocks`` blocks for requests plus one scratch
        block for CUDA graphs' padding rows) and capture the graphs unless eager."""
        self.max_model_len = max_model_len
        cache_shape = (
            2,
            num_blocks + 1,
            self.block_size,
            self.arch.num_kv_heads,
            self.arch.head_dim,
        )
        self.kv_caches = [
            torch.zeros(cache_shape, dtype=self.dtype, device=self.device)
            for _ in range(self.arch.num_layers)
        ]
        k = self.config.speculative.num_speculative_tokens
        if self.mtp_head is not None:
            mtp_caches = [
                torch.zeros(cache_shape, dtype=self.dtype, device=self.device)
                for _ in range(self.mtp_head.num_layers)
            ]
            self.proposer = MTPProposer(
                self.mtp_head, self.model, mtp_caches, self.backend, self.block_size, self.device
            )
        if self.uses_cuda_graphs:
            query_lens = [1, 1 + k] if self.mtp_head is not None else [1]
            self.graphs = CudaGraphRunner(
                self.model,
                self.kv_caches,
                self.backend,
                self.block_size,
                max_model_len,
                self.config.scheduler.max_num_seqs,
                query_lens,
                num_blocks,
                self.device,
            )
            self.graphs.capture()
            if self.proposer is not None and k > 1:
                self.proposer.graphs = DraftGraphRunner(
                    self.proposer, k, max_model_len, self.config.scheduler.max_num_seqs, num_blocks
                )
                self.proposer.graphs.capture()
        if self.device.type == "cuda":
            self._warm_up_eager_steps(scratch_block=num_blocks)

    def release(self) -> None:
        """Drop the KV cache and the CUDA graphs and return their memory to the device."""
        self.graphs = None
        self.proposer = None
        self.kv_caches = []
        self.states.clear()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @property
    def uses_cuda_graphs(self) -> bool:
        """Graphs need CUDA and the Triton backend (whose launches read no host value)."""
        return (
            self.device.type == "cuda"
            and not self.config.enforce_eager
            and isinstance(self.backend, TritonAttentionBackend)
        )

    @torch.inference_mode()
    @on_runner_device
    def profile_peak_bytes(self) -> int:
        """Device memory a full step needs beyond the weights: a dry run of the largest
        prefill (``max_num_batched_tokens`` tokens) and its logits, measured on CUDA."""
        tokens = self.config.scheduler.max_num_batched_tokens
        blocks = -(-tokens // self.block_size)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        caches = [
            torch.zeros(
                (2, blocks, self.block_size, self.arch.num_kv_heads, self.arch.head_dim),
                dtype=self.dtype,
                device=self.device,
            )
            for _ in range(self.arch.num_layers)
        ]
        slots = torch.arange(tokens, device=self.device)
        metadata = self.backend.build_metadata(
            [tokens], [tokens], [list(range(blocks))], slots, self.block_size, self.device
        )
        hidden = self.model(
            self._input_ids[:tokens],
            torch.arange(tokens, device=self.device),
            caches,
            metadata,
            self.backend,
        )
        rows = min(
            tokens,
            self.config.scheduler.max_num_seqs
            * (1 + self.config.speculative.num_speculative_tokens),
        )
        self.model.compute_logits(hidden[:rows]).softmax(-1)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        del caches, hidden
        torch.cuda.empty_cache()
        return peak

    @torch.inference_mode()
    def _warm_up_eager_steps(self, scratch_block: int) -> None:
        """Run a prefill alone and a prefill beside a decode row (their keys and values
        written to the scratch block only), so that the kernels of such eager steps are
        compiled now rather than in the first step that serves them."""
        block_size = self.block_size
        for query_lens in ([2 * block_size], [1, 2 * block_size]):
            positions = [p for length in query_lens for p in range(length)]
            slots = to_device(
                [scratch_block * block_size + p % block_size for p in positions],
                torch.long,
                self.device,
            )
            tables = [[scratch_block] * -(-length // block_size) for length in query_lens]
            metadata = self.backend.build_metadata(
                query_lens, query_lens, tables, slots, block_size, self.device
            )
            hidden = self.model(
                self._input_ids[: len(positions)],
                to_device(positions, torch.long, self.device),
                self.kv_caches,
                metadata,
                self.backend,
            )
            self.model.compute_logits(hidden[-1:])

    # ---- per-request state ---------------------------------------------------------------

    def _state(self, row: ScheduledRequest) -> RequestState:
        """The request's state; a row that (re)admits a request resets it from the
        scheduler's snapshot (the generator and reported prompt logprobs carry over)."""
        request = row.request
        state = self.states.get(request.request_id)
        if row.reset_token_ids is None:
            if state is None:
                raise RuntimeError(f"request {request.request_id!r} has no runner state")
            return state
        if state is None:
            seed = request.sampling_params.seed
            generator = None
            if seed is not None:
                generator = torch.Generator(device=self.device).manual_seed(seed)
            state = RequestState([], request.num_prompt_tokens, 0, generator)
            self.states[request.request_id] = state
        state.token_ids = list(row.reset_token_ids)  # the runner's own copy, grown in place
        state.num_computed = row.reset_num_computed
        state.drafts = state.draft_probs = state.pending_token = None
        return state

    def drop_requests(self, request_ids: list[str]) -> None:
        """Forget ended requests (no step that holds them may be in flight)."""
        for request_id in request_ids:
            self.states.pop(request_id, None)

    # ---- PD: a request's state handed from a prefill instance to a decode instance ------

    @on_runner_device
    def export_handoff(self, request_id: str) -> dict:
        """What the decode instance needs beyond the KV to continue a request exactly as
        this instance would: its MTP drafts (and their distributions when sampled) and its
        sampling generator's state. Reads the device; call once the step is done."""
        state = self.states.get(request_id)
        if state is None:
            raise RuntimeError(f"request {request_id!r} has no runner state to hand over")
        handoff: dict = {
            "drafts": [],
            "draft_probs": None,
            "draft_probs_shape": None,
            "generator_state": None,
        }
        if state.drafts is not None:
            handoff["drafts"] = state.drafts.tolist()
        if state.draft_probs is not None:
            probs = state.draft_probs.float().cpu().contiguous()
            handoff["draft_probs"] = probs.numpy().tobytes()
            handoff["draft_probs_shape"] = list(probs.shape)
        if state.generator is not None:
            handoff["generator_state"] = state.generator.get_state().numpy().tobytes()
        return handoff

    @on_runner_device
    def insert_handoff(
        self,
        request_id: str,
        token_ids: list[int],
        num_prompt_tokens: int,
        handoff: dict,
        seed: int | None,
    ) -> None:
        """Start the state of a request whose prompt KV a prefill instance wrote: every
        prompt position is computed, the first output token is the last of ``token_ids``,
        and the next step verifies the handed-over drafts."""
        import numpy as np

        generator = None
        if seed is not None:
            generator = torch.Generator(device=self.device)
            if handoff.get("generator_state") is not None:
                data = np.frombuffer(handoff["generator_state"], dtype=np.uint8).copy()
                generator.set_state(torch.from_numpy(data))
            else:
                generator.manual_seed(seed)
        state = RequestState(
            list(token_ids),
            num_prompt_tokens,
            num_prompt_tokens,
            generator,
            num_prompt_logprobs=num_prompt_tokens,
        )
        drafts = handoff.get("drafts") or []
        if drafts and self.proposer is not None:
            # Copied without a wait: a step may be in flight.
            state.drafts = to_device(drafts, torch.long, self.device)
            if handoff.get("draft_probs") is not None:
                probs = np.frombuffer(handoff["draft_probs"], dtype=np.float32).copy()
                state.draft_probs = to_device(
                    torch.from_numpy(probs).view(*handoff["draft_probs_shape"]),
                    torch.float32,
                    self.device,
                )
        self.states[request_id] = state

    # ---- one step ------------------------------------------------------------------------

    def _prepare(self, step: SchedulerOutput) -> StepInputs:
        inputs = StepInputs([], [], [], [], [], [], [], [], [], [], [], [])
        block_size = self.block_size
        for row in step.scheduled:
            state = self._state(row)
            start = state.num_computed
            num_known = min(row.num_new_tokens, len(state.token_ids) - start)
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
                inputs.drafts.append(state.drafts[:num_drafts])
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

    @on_runner_device
    @torch.inference_mode()
    def execute(self, step: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and read its results (no overlap)."""
        launched = self._timed_launch(step)
        return self.finish(launched) if launched is not None else ModelRunnerOutput()

    @on_runner_device
    @torch.inference_mode()
    def step_ahead(self, step: SchedulerOutput) -> ModelRunnerOutput | None:
        """Overlap scheduling: queue ``step``'s device work, then read the step launched by
        the previous call and return its output (None when there was none). With plain
        decoding the new step is queued before the read, so the device never waits for the
        host's bookkeeping; with MTP the new step's drafts and positions depend on the
        previous step's accepted tokens, so that step is read first."""
        previous, self._launched = self._launched, None
        output = None
        if previous is not None and (self.proposer is not None or step.is_empty):
            output, previous = self.finish(previous), None
        self._launched = self._timed_launch(step)
        if previous is not None:
            output = self.finish(previous)
        return output

    @on_runner_device
    @torch.inference_mode()
    def flush(self) -> ModelRunnerOutput | None:
        """Read the step launched last, if any (the end of an overlapped run)."""
        previous, self._launched = self._launched, None
        return self.finish(previous) if previous is not None else None

    def _timed_launch(self, step: SchedulerOutput) -> LaunchedStep | None:
        started = time.perf_counter()
        try:
            return self.launch(step)
        finally:
            self.launch_seconds += time.perf_counter() - started

    def launch(self, step: SchedulerOutput) -> LaunchedStep | None:
        """Queue one step's device work (forward, sampling, logprobs) without waiting."""
        for request_id in step.finished_request_ids:
            self.states.pop(request_id, None)
        if step.is_empty:
            return None
        begun = self.reader.begin()
        inputs = self._prepare(step)
        hidden, input_ids = self._forward(inputs)
        sampling_plans = [plan for plan in inputs.plans if plan.samples]
        sampling_rows: list[SamplingRow] = []
        logits_rows: list[int] = []
        for plan in sampling_plans:
            state = plan.state
            sampling_rows.append(
                SamplingRow(
                    len(logits_rows),
                    plan.num_drafts,
                    plan.row.request.sampling_params,
                    state.generator,
                    len(state.token_ids) - state.num_prompt_tokens,
                    state.draft_probs,
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
            logits = self.model.compute_logits(hidden.index_select(0, rows))
            if sampling_rows:
                sample = sample_step(
                    sampling_rows,
                    logits[:num_sampling],
                    input_ids.index_select(0, rows[:num_sampling]),
                    self.default_generator,
                )
                reads += [sample.candidates, sample.num_emitted]
                if sample.logprobs is not None:
                    reads += sample.logprobs.tensors()
            if inputs.prompt_rows:
                prompt_logprobs = self._prompt_logprobs(inputs, logits[num_sampling:])
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
            self.proposer is None,
        )
        if launched.advanced:
            self._advance(launched)
        return launched

    def _advance(self, launched: LaunchedStep) -> None:
        """Plain decoding emits exactly one token per sampling row, so the request states
        move on at launch: the next step can be prepared before this one is read."""
        sampled = {id(plan) for plan in launched.sampling_plans}
        for plan in launched.inputs.plans:
            if id(plan) not in sampled:
                plan.state.num_computed += plan.num_known
        for plan, row in zip(launched.sampling_plans, launched.sampling_rows, strict=True):
            state = plan.state
            state.num_computed = len(state.token_ids)
            plan.placeholder = len(state.token_ids)
            state.token_ids.append(PLACEHOLDER)
            state.pending_token = (launched.sample.candidates, row.logits_start)

    def finish(self, launched: LaunchedStep) -> ModelRunnerOutput:
        """Wait for a launched step once, read its results and apply them."""
        host = self.reader.read(launched.reads) if launched.reads is not None else []
        output = launched.output
        emitted = self._emit(launched, host, output)
        if launched.prompt_logprobs is not None:
            self._report_prompt_logprobs(launched.inputs, host[-4:], output)
        if not launched.advanced:
            for plan in launched.inputs.plans:
                if plan.request_id not in emitted:
                    plan.state.num_computed += plan.num_known
        if self.proposer is not None:
            self._propose(launched.inputs, launched.hidden, emitted, output)
        return output

    def _forward(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's hidden states and the fed token ids (drafts filled in on the
        device): by a CUDA graph's replay when the batch is uniform, else eagerly."""
        fills = []  # (flat indices, token ids) written on the device after the copy
        if inputs.drafts:
            fills.append(
                (to_device(inputs.draft_index, torch.long, self.device), torch.cat(inputs.drafts))
            )
        if inputs.pending_index:
            source = inputs.pending_sources[0][0]  # one launched step at a time
            fills.append(
                (
                    to_device(inputs.pending_index, torch.long, self.device),
                    source.index_select(
                        0,
                        to_device(
                            [index for _, index in inputs.pending_sources], torch.long, self.device
                        ),
                    ),
                )
            )
        size = self.graphs.padded_size(inputs.query_lens) if self.graphs is not None else None
        if size is not None:
            batch = GraphBatch(
                inputs.token_ids,
                inputs.positions,
                inputs.slots,
                inputs.seq_lens,
                inputs.block_tables,
                inputs.query_lens[0],
            )
            return self.graphs.run(batch, size, fills)
        num_tokens = len(inputs.token_ids)
        input_ids = self._input_ids[:num_tokens]
        positions = self._positions[:num_tokens]
        slots = self._slots[:num_tokens]
        copy_to(input_ids, inputs.token_ids)
        copy_to(positions, inputs.positions)
        copy_to(slots, inputs.slots)
        for index, tokens in fills:
            input_ids[index] = tokens
        metadata = self.backend.build_metadata(
            inputs.query_lens,
            inputs.seq_lens,
            inputs.block_tables,
            slots,
            self.block_size,
            self.device,
        )
        return self.model(input_ids, positions, self.kv_caches, metadata, self.backend), input_ids

    def _emit(self, launched: LaunchedStep, host: list, output) -> dict[str, list[int]]:
        """Apply the step's tokens to the request states and the output."""
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
        return emitted

    def _propose(self, inputs: StepInputs, hidden, emitted, output) -> None:
        """Run the MTP head over the step's kept positions and draft the next tokens."""
        k = self.config.speculative.num_speculative_tokens
        rows: list[ProposalRow] = []
        sampling = {}
        for plan in inputs.plans:
            request_id = plan.request_id
            state = plan.state
            new_tokens = emitted.get(request_id, [])
            # Kept positions: the known tokens computed here plus the accepted drafts.
            num_kept = plan.num_known + max(len(new_tokens) - 1, 0)
            kept = list(range(plan.start, plan.start + num_kept))
            num_drafts = 0
            if new_tokens:
                # Drafts beyond the context would have no KV slot.
                num_drafts = max(0, min(k, self.max_model_len - 1 - (kept[-1] + 1)))
                sampling[request_id] = (plan.row.request.sampling_params, state.generator)
            rows.append(
                ProposalRow(
                    request_id,
                    kept,
                    [plan.offset + p - plan.start for p in kept],
                    [state.token_ids[p + 1] for p in kept],
                    plan.row.block_ids,
                    num_drafts,
                )
            )
        proposal = self.proposer.propose(rows, hidden, sampling, self.default_generator)
        for request_id, drafts in proposal.draft_token_ids.items():
            state = self.states[request_id]
            state.drafts = drafts
            state.draft_probs = proposal.draft_probs.get(request_id)
            output.num_drafts[request_id] = int(drafts.shape[0])

    def _prompt_logprobs(self, inputs: StepInputs, logits: torch.Tensor) -> LogprobsTensors:
        targets = [t for _, _, row_targets in inputs.prompt_rows for t in row_targets]
        num_top = max(
            plan.row.request.sampling_params.prompt_logprobs for plan, _, _ in inputs.prompt_rows
        )
        return compute_logprobs(logits, to_device(targets, torch.long, self.device), num_top)

    def _report_prompt_logprobs(self, inputs: StepInputs, host: list[list], output) -> None:
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
