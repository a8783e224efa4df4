"""Model runner: turns a scheduled step into one forward pass, samples, computes logprobs.

It owns the model, the paged KV cache, the persistent input buffers and the per-request
sampling generators. It never changes a request's lifecycle; the scheduler does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.config import EngineConfig
from tandem.core.scheduler import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from tandem.layers.attention import TorchAttentionBackend
from tandem.layers.sampler import compute_logprobs
from tandem.models.loader import ModelFiles, load_model
from tandem.models.mtp import load_mtp_head
from tandem.worker.spec.proposer import MTPProposer, ProposalRow
from tandem.worker.step_sampler import SamplingRow, sample_step


@dataclass
class StepInputs:
    """Host-side description of one step's flat batch."""

    token_ids: list[int]
    positions: list[int]
    slots: list[int]
    query_lens: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    # (row, flat index of its last known token; its drafts follow it)
    sample_rows: list[tuple[ScheduledRequest, int]]
    row_offsets: list[int]  # flat index of each scheduled row's first token
    # (row, flat indices whose logits predict prompt tokens, those prompt tokens)
    prompt_rows: list[tuple[ScheduledRequest, list[int], list[int]]]


def kv_cache_bytes_per_block(arch, block_size: int, dtype: torch.dtype,
                             num_extra_layers: int = 0) -> int:
    """Bytes that one KV block takes over all layers (keys and values), MTP layers too."""
    element = torch.empty((), dtype=dtype).element_size()
    layers = arch.num_layers + num_extra_layers
    return 2 * layers * block_size * arch.num_kv_heads * arch.head_dim * element


class ModelRunner:
    """Runs the model for the scheduler's steps on one device."""

    def __init__(
        self,
        config: EngineConfig,
        files: ModelFiles,
        max_model_len: int,
        num_blocks: int,
        mtp_source: str | None = None,
        use_mtp: bool = False,
    ):
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = getattr(torch, config.resolved_dtype_name())
        self.block_size = config.cache.block_size
        self.max_model_len = max_model_len
        self.model = load_model(files, max_model_len, self.dtype, self.device, config.seed)
        self.arch = self.model.arch
        self.backend = TorchAttentionBackend()
        cache_shape = (2, num_blocks, self.block_size, self.arch.num_kv_heads, self.arch.head_dim)
        self.kv_caches = [
            torch.zeros(cache_shape, dtype=self.dtype, device=self.device)
            for _ in range(self.arch.num_layers)
        ]
        self.default_generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self._generators: dict[str, torch.Generator] = {}
        self._draft_probs: dict[str, torch.Tensor] = {}
        self.proposer = None
        if use_mtp:
            mtp_head = load_mtp_head(mtp_source, files, self.model.rotary, config.seed)
            mtp_head = mtp_head.to(device=self.device, dtype=self.dtype).eval()
            mtp_caches = [torch.zeros(cache_shape, dtype=self.dtype, device=self.device)
                          for _ in range(mtp_head.num_layers)]
            self.proposer = MTPProposer(mtp_head, self.model, mtp_caches, self.backend,
                                        self.block_size, self.device)
        max_tokens = config.scheduler.max_num_batched_tokens
        self._input_ids = torch.zeros(max_tokens, dtype=torch.long, device=self.device)
        self._positions = torch.zeros(max_tokens, dtype=torch.long, device=self.device)
        self._slots = torch.zeros(max_tokens, dtype=torch.long, device=self.device)

    # ---- per-request state ---------------------------------------------------------------

    def _generator(self, row: ScheduledRequest) -> torch.Generator | None:
        seed = row.request.sampling_params.seed
        if seed is None:
            return None
        request_id = row.request.request_id
        if request_id not in self._generators:
            self._generators[request_id] = torch.Generator(device=self.device).manual_seed(seed)
        return self._generators[request_id]

    # ---- one step ------------------------------------------------------------------------

    def _prepare(self, step: SchedulerOutput) -> StepInputs:
        inputs = StepInputs([], [], [], [], [], [], [], [], [])
        block_size = self.block_size
        for row in step.scheduled:
            request = row.request
            start, end = row.start, row.end
            offset = len(inputs.token_ids)
            inputs.row_offsets.append(offset)
            known_end = min(end, request.num_tokens)
            inputs.token_ids += request.all_token_ids()[start:known_end] + row.draft_token_ids
            inputs.positions += range(start, end)
            blocks = row.block_ids
            inputs.slots += [blocks[p // block_size] * block_size + p % block_size
                             for p in range(start, end)]
            inputs.query_lens.append(row.num_new_tokens)
            inputs.seq_lens.append(end)
            inputs.block_tables.append(blocks)
            # Positions before len(prompt_logprobs) were reported already (before a preemption).
            first = max(start, len(request.prompt_logprobs))
            prompt_end = min(end, request.num_prompt_tokens - 1)
            if request.wants_prompt_logprobs and first < prompt_end:
                indices = list(range(offset + first - start, offset + prompt_end - start))
                targets = request.prompt_token_ids[first + 1 : prompt_end + 1]
                inputs.prompt_rows.append((row, indices, targets))
            if row.samples:
                inputs.sample_rows.append((row, offset + known_end - 1 - start))
        return inputs

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput) -> ModelRunnerOutput:
        for request_id in step.finished_request_ids:
            self._generators.pop(request_id, None)
            self._draft_probs.pop(request_id, None)
        output = ModelRunnerOutput()
        if step.is_empty:
            return output
        inputs = self._prepare(step)
        num_tokens = len(inputs.token_ids)
        input_ids = self._input_ids[:num_tokens]
        positions = self._positions[:num_tokens]
        slots = self._slots[:num_tokens]
        input_ids.copy_(torch.tensor(inputs.token_ids), non_blocking=True)
        positions.copy_(torch.tensor(inputs.positions), non_blocking=True)
        slots.copy_(torch.tensor(inputs.slots), non_blocking=True)
        metadata = self.backend.build_metadata(
            inputs.query_lens, inputs.seq_lens, inputs.block_tables, slots,
            self.block_size, self.device,
        )
        hidden = self.model(input_ids, positions, self.kv_caches, metadata, self.backend)

        sampling_rows: list[SamplingRow] = []
        logits_rows: list[int] = []
        for row, index in inputs.sample_rows:
            sampling_rows.append(SamplingRow(
                row, len(logits_rows), self._generator(row),
                self._draft_probs.pop(row.request.request_id, None),
            ))
            logits_rows += range(index, index + 1 + len(row.draft_token_ids))
        num_sampling = len(logits_rows)
        logits_rows += [i for _, indices, _ in inputs.prompt_rows for i in indices]
        emitted: dict[str, list[int]] = {}
        if logits_rows:
            rows = torch.tensor(logits_rows, device=self.device)
            logits = self.model.compute_logits(hidden.index_select(0, rows))
            if sampling_rows:
                tokens, logprobs = sample_step(
                    sampling_rows, logits[:num_sampling], self.default_generator
                )
                for sampling_row, row_tokens, row_logprobs in zip(
                    sampling_rows, tokens, logprobs, strict=True
                ):
                    request_id = sampling_row.row.request.request_id
                    emitted[request_id] = output.sampled_token_ids[request_id] = row_tokens
                    if row_logprobs is not None:
                        output.logprobs[request_id] = row_logprobs
            if inputs.prompt_rows:
                self._prompt_logprobs(inputs, logits[num_sampling:], output)
        if self.proposer is not None:
            self._propose(step, inputs, hidden, emitted, output)
        return output

    def _propose(self, step, inputs: StepInputs, hidden, emitted, output) -> None:
        """Run the MTP head over the step's kept positions and draft the next tokens."""
        k = self.config.speculative.num_speculative_tokens
        rows: list[ProposalRow] = []
        sampling = {}
        for row, offset in zip(step.scheduled, inputs.row_offsets, strict=True):
            request = row.request
            request_id = request.request_id
            known = request.all_token_ids()
            new_tokens = emitted.get(request_id, [])
            # Kept positions: the known tokens computed here plus the accepted drafts.
            num_kept = min(row.end, request.num_tokens) - row.start + max(len(new_tokens) - 1, 0)
            kept = list(range(row.start, row.start + num_kept))
            following = known + new_tokens
            num_drafts = 0
            if new_tokens:
                # Drafts beyond the context would have no KV slot.
                num_drafts = max(0, min(k, self.max_model_len - 1 - (kept[-1] + 1)))
                sampling[request_id] = (request.sampling_params, self._generator(row))
            rows.append(ProposalRow(
                request_id, kept, [offset + p - row.start for p in kept],
                [following[p + 1] for p in kept], row.block_ids, num_drafts,
            ))
        proposal = self.proposer.propose(rows, hidden, sampling, self.default_generator)
        output.draft_token_ids.update(proposal.draft_token_ids)
        self._draft_probs.update(proposal.draft_probs)

    def _prompt_logprobs(self, inputs: StepInputs, logits: torch.Tensor, output):
        targets = [t for _, _, row_targets in inputs.prompt_rows for t in row_targets]
        num_top = max(row.request.sampling_params.prompt_logprobs for row, _, _ in inputs.prompt_rows)
        target_ids = torch.tensor(targets, device=self.device)
        logprobs = compute_logprobs(logits, target_ids, num_top).to_lists()
        offset = 0
        for row, indices, row_targets in inputs.prompt_rows:
            top_n = row.request.sampling_params.prompt_logprobs
            entries = []
            for target, (logprob, rank, top) in zip(
                row_targets, logprobs[offset : offset + len(indices)], strict=True
            ):
                entries.append((target, logprob, rank, top[:top_n]))
            output.prompt_logprobs[row.request.request_id] = entries
            offset += len(indices)
