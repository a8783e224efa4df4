"""CUDA graphs of whole resolved MTP steps: one graph per padded batch size replays the
target's verification forward, greedy verification, the slots' update and the MTP head's
drafting, so a resolved step costs the host two small copies and one replay instead of
hundreds of launches.

The graph reads two static buffers that the host fills each step with non-blocking copies:
the rows' slot ids and block tables. Everything else comes from the device slots
(``RequestSlots``) and is computed on the device, as in ``uniform_step``. Padding rows name
the slots' scratch slot, whose state is reset at the start of every step, and a block table
of the scratch block only: they write nothing any request owns, and their outputs are
dropped. Greedy rows without logprobs only (the others take the eager resolved step). On the
CPU (tests) ``run`` computes the same step eagerly from the same buffers, with Triton's
interpreter.
"""

from __future__ import annotations

from functools import partial

import torch

from tandem.device_copy import copy_to
from tandem.layers.triton_attention import TritonAttentionMetadata, block_table_array
from tandem.worker.cuda_graphs import capture_graph, capture_stream, graph_batch_sizes
from tandem.worker.model_runner import ModelRunner
from tandem.worker.request_slots import RequestSlots
from tandem.worker.spec_decode.draft_graphs import draft_chain
from tandem.worker.spec_decode.slot_rows import accept, verify_rows


class ResolvedStepGraphs:
    """Captures and replays whole resolved MTP steps for greedy batches."""

    def __init__(self, runner: ModelRunner, slots: RequestSlots, max_num_seqs: int):
        self.runner = runner
        self.slots = slots
        self.num_drafts = slots.num_drafts
        self.query_len = slots.num_drafts + 1
        self.batch_sizes = graph_batch_sizes(max_num_seqs)
        device, block_size = runner.device, runner.block_size
        self.scratch_block = runner.scratch_block
        self.generation = slots.generation  # the slots' storage the graphs were captured on
        width = -(-(runner.max_model_len + 2 * self.query_len) // block_size)
        self.slot_ids = torch.full((max_num_seqs,), slots.scratch, dtype=torch.long, device=device)
        self.block_tables = torch.full(
            (max_num_seqs, width), self.scratch_block, dtype=torch.int32, device=device
        )
        self.query_starts = torch.arange(
            0, (max_num_seqs + 1) * self.query_len, self.query_len, dtype=torch.int32, device=device
        )
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.num_replays = 0

    def padded_size(self, num_rows: int) -> int | None:
        """The batch size with a graph for ``num_rows`` rows; None if too many, or if the
        slots' storage has grown since the capture."""
        if self.graphs and self.slots.generation != self.generation:
            return None
        return next((size for size in self.batch_sizes if size >= num_rows), None)

    def _step(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The resolved step of the first ``size`` rows of the static buffers: candidates
        [size * (k + 1)] and emitted counts [size] (the slots are updated in place)."""
        runner, slots = self.runner, self.slots
        q = self.query_len
        slot_ids, tables = self.slot_ids[:size], self.block_tables[:size]
        rows = verify_rows(slots, slot_ids, tables, runner.block_size, self.scratch_block)
        metadata = TritonAttentionMetadata(
            slot_mapping=rows.slot_mapping,
            max_query_len=q,
            min_query_len=q,
            block_tables=tables,
            query_start_loc_device=self.query_starts[: size + 1],
            seq_lens_device=rows.seq_lens,
        )
        hidden = runner.model(
            rows.input_ids, rows.positions, runner.kv_caches, metadata, runner.backend
        )
        candidates = runner.model.compute_logits(hidden).argmax(dim=-1)
        accepted = accept(slots, slot_ids, rows, candidates)
        drafts = self._draft(hidden, candidates, rows, metadata, accepted, tables, slot_ids)
        slots.drafts.index_copy_(0, slot_ids, drafts)
        return candidates, accepted.emitted

    def _draft(
        self, hidden, candidates, rows, metadata, accepted, tables, slot_ids
    ) -> torch.Tensor:
        """The MTP head's drafts after the verification (``propose_uniform``'s steps, with
        the later depths chained inline: a graph cannot replay another inside it)."""
        proposer = self.runner.proposer
        if getattr(proposer, "uniform_in_graph", False):  # no head (the benchmarks' oracle)
            drafts, _ = proposer.propose_uniform(
                hidden, candidates, rows, metadata, accepted, tables, [], self.num_drafts, slot_ids
            )
            return drafts
        layer_index = proposer.head.layer_for_depth(0)
        layer = proposer.head.layers[layer_index]
        head_hidden = layer(
            rows.positions,
            proposer.model.embed_tokens(candidates),
            hidden,
            proposer.kv_caches[layer_index],
            metadata,
            proposer.backend,
        )
        head_hidden = head_hidden.index_select(0, accepted.kept)
        first = proposer.model.compute_logits(layer.final_norm(head_hidden)).argmax(dim=-1)
        if self.num_drafts == 1:
            return first.unsqueeze(1)
        later, _ = draft_chain(
            proposer, accepted.last_positions, tables, first, head_hidden, self.num_drafts - 1
        )
        return torch.cat([first.unsqueeze(1), later], dim=1)

    def _fill(self, slot_ids: list[int], block_tables: list[list[int]], size: int) -> None:
        """The rows' slots and block tables into the static buffers (padding rows: the
        scratch slot and block)."""
        pad = size - len(slot_ids)
        width = max([len(table) for table in block_tables] + [1])
        width = min(width, self.block_tables.shape[1])
        copy_to(self.slot_ids[:size], slot_ids + [self.slots.scratch] * pad)
        copy_to(
            self.block_tables[:size, :width],
            block_table_array(block_tables, width, size, pad_block=self.scratch_block),
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per padded batch size (largest first, one memory pool)."""
        pool = torch.cuda.graph_pool_handle()
        stream = capture_stream(self.runner.device)
        for size in reversed(self.batch_sizes):
            self._fill([], [], size)
            self.graphs[size] = capture_graph(partial(self._step, size), pool, stream)
        torch.cuda.synchronize()

    def run(
        self, slot_ids: list[int], block_tables: list[list[int]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The resolved step of these rows (their slots and block tables): candidates
        [rows * (k + 1)] and emitted counts [rows], views of static buffers valid until the
        next replay (copies queued behind the replay read them in time). The host never
        waits here."""
        rows = len(slot_ids)
        size = self.padded_size(rows)
        if size is None:
            raise ValueError(f"{rows} rows: more than the largest step graph")
        self._fill(slot_ids, block_tables, size)
        if not self.graphs:  # not captured (the CPU): the same step, eagerly
            candidates, emitted = self._step(size)
        else:
            graph, (candidates, emitted) = self.graphs[size]
            graph.replay()
            self.num_replays += 1
        return candidates[: rows * self.query_len], emitted[:rows]
