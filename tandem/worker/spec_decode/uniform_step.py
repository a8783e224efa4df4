"""One MTP step whose rows the device resolves, so it can be queued before the step in front
of it has been read.

Every row verifies the k drafts of one request: its last known token and drafts, and the
position it starts at, come from the request's device slot (``RequestSlots``), which the
step before wrote in stream order. The step computes on the device, with no host value
that depends on an unread step: positions, KV slots and sequence lengths; the target's
forward (a CUDA graph's replay when one fits); verification, logprobs and the accepted
counts (``sample_step``); the slots' next start and last token; and the next drafts (depth
0 of the MTP head at fixed shape over every verified row, then the later depths). The host
only knows upper bounds of the rows' lengths, for sizing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.device_copy import copy_to, to_device
from tandem.layers.triton_attention import block_table_array
from tandem.worker.input_batch import RowPlan, StepInputs
from tandem.worker.model_runner import ModelRunner
from tandem.worker.ragged_graphs import RaggedBatch
from tandem.worker.request_slots import RequestSlots
from tandem.worker.spec_decode.draft_sampling import DraftSampling
from tandem.worker.spec_decode.slot_rows import Accepted, VerifyRows, accept, verify_rows
from tandem.worker.step_sampler import SamplingRow, StepSample, sample_step, sampling_batch


def resolved_length_bound(
    num_known_tokens: int, num_drafts: int, ahead: bool = True, verified: int | None = None
) -> int:
    """One past the highest position that a resolved row may write, target and MTP head
    together, for a request of ``num_known_tokens`` tokens on the host: the row starts at
    the last known token, or (``ahead``: a step of the request is still unread) at most
    that step's k + 1 tokens past it; it verifies at most ``verified`` drafts (default k:
    the drafts its slot holds), and the head drafts at most k - 1 deeper."""
    start = num_known_tokens - 1 + (num_drafts + 1 if ahead else 0)
    verified = num_drafts if verified is None else verified
    return start + verified + (num_drafts - 1) + 1


def resolved_sampling_rows(
    plans: list[RowPlan], num_drafts: int, draft_probs: torch.Tensor | None = None
) -> list[SamplingRow]:
    """The sampling rows of a resolved step: row b's logits start at ``b * (k + 1)``;
    sampled rows verify against their drafts' distributions ``draft_probs[b]`` (the rows'
    slots' q, gathered)."""
    return [
        SamplingRow(
            index * (num_drafts + 1),
            num_drafts,
            plan.row.request.sampling_params,
            plan.state.seed,
            None,  # the first drawn position is on the device only
            len(plan.state.token_ids) - plan.state.num_prompt_tokens,
            None
            if draft_probs is None or plan.row.request.sampling_params.greedy
            else draft_probs[index],
        )
        for index, plan in enumerate(plans)
    ]


def draft_sampling(
    plans: list[RowPlan], accepted: Accepted, vocab_size: int, device: torch.device
) -> DraftSampling | None:
    """How a resolved step's rows draft (None when every row is greedy): each row's next
    drafts are for the positions after its new last token (``accepted.last_positions`` +
    1)."""
    params = [plan.row.request.sampling_params for plan in plans]
    if all(p.greedy for p in params):
        return None
    seeds = to_device([plan.state.seed for plan in plans], torch.long, device)
    return DraftSampling(
        sampling_batch(params, seeds, vocab_size, device), accepted.last_positions + 2
    )


@dataclass
class UniformInputs:
    """A resolved step's inputs, built on the device from its rows' slots: what its forward
    and its verification take (``uniform_inputs``)."""

    plans: list[RowPlan]
    num_drafts: int  # the drafts each row verifies: rows of num_drafts + 1 tokens
    slot_ids: torch.Tensor  # [B] long
    host_tables: list[list[int]]
    tables: torch.Tensor  # [B, W] int32
    rows: VerifyRows
    bounds: list[int]  # upper bounds of the rows' sequence lengths (sizing only)

    @property
    def query_len(self) -> int:
        return self.num_drafts + 1

    @property
    def num_tokens(self) -> int:
        return len(self.plans) * self.query_len


def uniform_inputs(
    runner: ModelRunner, slots: RequestSlots, plans: list[RowPlan], num_drafts: int
) -> UniformInputs:
    """The inputs of the uniform step of ``plans`` (offsets ``b * (num_drafts + 1)``), each
    row verifying the first ``num_drafts`` of its slot's drafts."""
    device, block_size = runner.device, runner.block_size
    slot_ids = to_device([plan.state.slot for plan in plans], torch.long, device)
    host_tables = [plan.row.block_ids for plan in plans]
    width = max(len(table) for table in host_tables)
    tables = to_device(block_table_array(host_tables, width), torch.int32, device)
    rows = verify_rows(
        slots, slot_ids, tables, block_size, runner.scratch_block, num_drafts=num_drafts
    )
    # The row starts at most the unread step's 1 + (the slots') k tokens past the last
    # known one.
    reach = slots.num_drafts + 1 + num_drafts + 1
    bounds = [
        min(len(plan.state.token_ids) + reach, len(plan.row.block_ids) * block_size)
        for plan in plans
    ]
    return UniformInputs(plans, num_drafts, slot_ids, host_tables, tables, rows, bounds)


def uniform_metadata(runner: ModelRunner, uniform: UniformInputs):
    """The attention metadata of ``uniform``'s rows alone."""
    return runner.backend.build_metadata(
        [uniform.query_len] * len(uniform.plans),
        uniform.bounds,
        uniform.host_tables,
        uniform.rows.slot_mapping,
        runner.block_size,
        runner.device,
        uniform.rows.seq_lens,
    )


def launch_uniform_step(
    runner: ModelRunner,
    slots: RequestSlots,
    plans: list[RowPlan],
    num_drafts: int,
    depth: int,
) -> tuple[StepSample, list[SamplingRow]]:
    """Queue the uniform step of ``plans`` (offsets ``b * (num_drafts + 1)``), each row
    verifying the first ``num_drafts`` of its slot's drafts and the head drafting ``depth``
    for the next step; returns its sample (candidates, emitted counts and logprobs on the
    device) and sampling rows."""
    uniform = uniform_inputs(runner, slots, plans, num_drafts)
    metadata = uniform_metadata(runner, uniform)
    rows = uniform.rows
    hidden = runner.forward_resolved(
        rows.input_ids,
        rows.positions,
        rows.slot_mapping,
        rows.seq_lens,
        uniform.tables,
        metadata,
        uniform.query_len,
    )
    return finish_uniform_step(runner, slots, uniform, hidden, depth, metadata)


def finish_uniform_step(
    runner: ModelRunner,
    slots: RequestSlots,
    uniform: UniformInputs,
    hidden: torch.Tensor,
    depth: int,
    metadata,
) -> tuple[StepSample, list[SamplingRow]]:
    """After the target's forward over ``uniform``'s rows (``hidden``: their hidden states;
    ``metadata``: the rows' own attention metadata, for the head's depth 0): verification,
    the slots' advance, and the head drafting ``depth`` into the slots."""
    k, plans, rows, slot_ids = uniform.num_drafts, uniform.plans, uniform.rows, uniform.slot_ids
    logits = runner.model.compute_logits(hidden)
    sampled = not all(plan.row.request.sampling_params.greedy for plan in plans)
    # A copy: the drafting below writes the slots' next q.
    draft_probs = slots.draft_probs[:, :k].index_select(0, slot_ids) if sampled else None
    sampling_rows = resolved_sampling_rows(plans, k, draft_probs)
    # Each row draws from the position after its last known token (keyed randomness).
    sample = sample_step(sampling_rows, logits, rows.input_ids, positions=rows.start + 1)
    accepted = accept(slots, slot_ids, rows, sample.candidates, emitted=sample.num_emitted)
    drafts, probs = runner.proposer.propose_uniform(
        hidden,
        sample.candidates,
        rows,
        metadata,
        accepted,
        uniform.tables,
        uniform.host_tables,
        depth,
        slot_ids,
        draft_sampling(plans, accepted, runner.arch.vocab_size, runner.device),
    )
    slots.drafts[:, :depth].index_copy_(0, slot_ids, drafts)
    if probs is not None:
        slots.draft_probs[:, :depth].index_copy_(0, slot_ids, probs)
    return sample, sampling_rows


def forward_mixed(
    runner: ModelRunner, uniform: UniformInputs, chunks: StepInputs
) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's hidden states and fed token ids of one forward over ``uniform``'s
    resolved rows (inputs on the device) followed by ``chunks``' rows, prompt chunks whose
    every token the host knows: a step that mixes them reads the weights once. A ragged
    graph's replay when one fits (its buffers take the resolved rows' inputs by device
    copies and their true lengths on the device), else eagerly: an eager forward launches
    layer by layer from Python, which on an 8B model costs the host more than the step."""
    if chunks.draft_index or chunks.pending_index:
        raise ValueError("a mixed step's ragged rows must be prompt chunks (no drafts)")
    device, rows, num_resolved = runner.device, uniform.rows, uniform.num_tokens
    query_lens = [uniform.query_len] * len(uniform.plans) + chunks.query_lens
    batch = RaggedBatch(
        query_lens, uniform.bounds + chunks.seq_lens, uniform.host_tables + chunks.block_tables
    )
    graphs = runner.ragged_graphs
    size = graphs.padded_size(batch) if graphs is not None else None
    if size is not None:
        num_tokens = num_resolved + len(chunks.token_ids)
        buffers = runner.token_buffers
        for buffer, resolved, host in zip(
            buffers,
            (rows.input_ids, rows.positions, rows.slot_mapping),
            (chunks.token_ids, chunks.positions, chunks.slots),
            strict=True,
        ):
            buffer[:num_resolved].copy_(resolved)
            copy_to(buffer[num_resolved:num_tokens], host)
        return graphs.run(batch, size, rows.seq_lens), buffers[0][:num_tokens]

    def joined(resolved: torch.Tensor, host: list[int]) -> torch.Tensor:
        return torch.cat([resolved, to_device(host, resolved.dtype, device)])

    input_ids = joined(rows.input_ids, chunks.token_ids)
    positions = joined(rows.positions, chunks.positions)
    slot_mapping = joined(rows.slot_mapping, chunks.slots)
    metadata = runner.backend.build_metadata(
        query_lens,
        batch.seq_lens,
        batch.block_tables,
        slot_mapping,
        runner.block_size,
        device,
        joined(rows.seq_lens, chunks.seq_lens),
    )
    hidden = runner.model(input_ids, positions, runner.kv_caches, metadata, runner.backend)
    return hidden, input_ids
