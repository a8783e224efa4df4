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
from tandem.layers.sampler import SamplingBatch, compute_logprobs, sample
from tandem.models.loader import ModelFiles, load_model
from tandem.request import TokenLogprobs


@dataclass
class StepInputs:
    """Host-side description of one step's flat batch."""

    token_ids: list[int]
    positions: list[int]
    slots: list[int]
    query_lens: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    sample_rows: list[tuple[ScheduledRequest, int]]  # (row, flat index of its last token)
    # (row, flat indices whose logits predict prompt tokens, those prompt tokens)
    prompt_rows: list[tuple[ScheduledRequest, list[int], list[int]]]


def kv_cache_bytes_per_block(arch, block_size: int, dtype: torch.dtype) -> int:
    """Bytes that one KV block takes over all layers (keys and values)."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * arch.num_layers * block_size * arch.num_kv_heads * arch.head_dim * element


class ModelRunner:
    """Runs the model for the scheduler's steps on one device."""

    def __init__(
        self, config: EngineConfig, files: ModelFiles, max_model_len: int, num_blocks: int
    ):
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = getattr(torch, config.resolved_dtype_name())
        self.block_size = config.cache.block_size
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
        inputs = StepInputs([], [], [], [], [], [], [], [])
        block_size = self.block_size
        for row in step.scheduled:
            request = row.request
            start, end = row.start, row.end
            offset = len(inputs.token_ids)
            inputs.token_ids += request.all_token_ids()[start:end]
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
                inputs.sample_rows.append((row, offset + row.num_new_tokens - 1))
        return inputs

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput) -> ModelRunnerOutput:
        for request_id in step.finished_request_ids:
            self._generators.pop(request_id, None)
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

        sample_indices = [index for _, index in inputs.sample_rows]
        prompt_indices = [i for _, indices, _ in inputs.prompt_rows for i in indices]
        rows = torch.tensor(sample_indices + prompt_indices, device=self.device)
        if rows.numel() == 0:
            return output
        logits = self.model.compute_logits(hidden[rows])
        if sample_indices:
            self._sample(inputs, logits[: len(sample_indices)], output)
        if prompt_indices:
            self._prompt_logprobs(inputs, logits[len(sample_indices) :], output)
        return output

    def _sample(self, inputs: StepInputs, logits: torch.Tensor, output: ModelRunnerOutput):
        rows = [row for row, _ in inputs.sample_rows]
        params = [row.request.sampling_params for row in rows]
        # End tokens cannot be sampled before min_tokens (logprobs stay raw).
        banned = [
            (i, token)
            for i, row in enumerate(rows)
            if row.request.num_output_tokens < params[i].min_tokens
            for token in params[i].end_token_ids()
        ]
        batch = SamplingBatch.build(
            params, [self._generator(row) for row in rows], logits.shape[-1], self.device, banned
        )
        token_ids = sample(logits, batch, self.default_generator)
        wants = [p.logprobs is not None for p in params]
        logprobs = None
        if any(wants):
            num_top = max(p.logprobs for p in params if p.logprobs is not None)
            logprobs = compute_logprobs(logits, token_ids, num_top).to_lists()
        token_list = token_ids.tolist()
        for i, row in enumerate(rows):
            request_id = row.request.request_id
            output.sampled_token_ids[request_id] = [token_list[i]]
            if logprobs is not None and wants[i]:
                logprob, rank, top = logprobs[i]
                entry: TokenLogprobs = (token_list[i], logprob, rank, top[: params[i].logprobs])
                output.logprobs[request_id] = [entry]

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
