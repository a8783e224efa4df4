"""CUDA graphs of the MTP head's later draft depths.

Depth 0 of a proposal runs eagerly: its rows are each request's kept positions, a ragged
batch. Depths 1..k-1 take one row per drafting request, each on the previous depth's hidden
state and draft token at the next position, so for a greedy batch whose requests all draft
k tokens they are the same work every step: one graph per padded batch size runs them all.
Each depth's position, KV slot and sequence length are computed on the device from the
request's last kept position and its block table, so a replay needs only those two and the
depth-0 results copied into static buffers (no host value changes between the depths).

Padding rows sit at position 0 of a block table that names only the scratch block (the
cache's extra block no request owns): they write there and their drafts are dropped. On the
CPU (tests) ``run`` computes the same chain eagerly.
"""

from __future__ import annotations

from functools import partial

import torch

from tandem.device_copy import copy_to
from tandem.layers.triton_attention import (
    TritonAttentionBackend,
    TritonAttentionMetadata,
    block_table_array,
)
from tandem.worker.cuda_graphs import capture_graph, capture_stream, graph_batch_sizes
from tandem.worker.spec_decode.draft_sampling import DraftSampling, draft_tokens
from tandem.worker.spec_decode.slot_rows import depth_rows


def draft_chain(
    proposer,
    last_positions: torch.Tensor,
    block_tables: torch.Tensor,
    tokens: torch.Tensor,
    hidden: torch.Tensor,
    num_depths: int,
    host_block_tables: list[list[int]] | None = None,
    sampling: DraftSampling | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Draft depths 1..``num_depths`` of one row per request: ``[rows, num_depths]``
    tokens, each depth at the next position after ``last_positions`` (the last kept one) on
    the previous depth's ``tokens`` and ``hidden`` (writes the head's KV at each depth),
    and their distributions ``[rows, num_depths, V]`` for a batch with sampled rows
    (``sampling``; None when every row is greedy). Positions, KV slots and sequence lengths
    are computed on the device. The torch attention backend (whose metadata is shaped on
    the host) also needs the block tables as ``host_block_tables``."""
    block_size = proposer.block_size
    scratch_block = proposer.kv_caches[0].shape[1] - 1  # the cache's extra block
    query_starts = torch.arange(
        last_positions.shape[0] + 1, dtype=torch.int32, device=last_positions.device
    )
    drafts, draft_probs = [], []
    for depth in range(1, num_depths + 1):
        positions, slot_mapping, seq_lens = depth_rows(
            last_positions, block_tables, depth, block_size, scratch_block
        )
        if isinstance(proposer.backend, TritonAttentionBackend):
            metadata = TritonAttentionMetadata(
                slot_mapping=slot_mapping,
                max_query_len=1,
                block_tables=block_tables,
                query_start_loc_device=query_starts,
                seq_lens_device=seq_lens,
            )
        else:  # the torch reference: its metadata is shaped from host values
            rows, width = block_tables.shape
            metadata = proposer.backend.build_metadata(
                [1] * rows,
                [width * block_size] * rows,
                host_block_tables,
                slot_mapping,
                block_size,
                positions.device,
                seq_lens_device=seq_lens,
            )
        layer_index = proposer.head.layer_for_depth(depth)
        layer = proposer.head.layers[layer_index]
        hidden, normed = layer.forward_normed(
            positions,
            proposer.model.embed_tokens(tokens),
            hidden,
            proposer.kv_caches[layer_index],
            metadata,
            proposer.backend,
        )
        logits = proposer.model.model_dtype_logits(normed)
        tokens, probs = draft_tokens(logits, sampling, depth)
        drafts.append(tokens)
        if probs is not None:
            draft_probs.append(probs)
    return torch.stack(drafts, dim=1), torch.stack(draft_probs, dim=1) if draft_probs else None


class DraftGraphRunner:
    """Runs draft depths 1..``num_drafts - 1`` of an MTP proposer for greedy batches.

    ``proposer`` is the :class:`~tandem.worker.spec_decode.proposer.MTPProposer` whose head,
    target model (embedding, lm_head) and MTP KV caches the graphs use; ``scratch_block``
    the cache block padding rows write to.
    """

    def __init__(
        self, proposer, num_drafts: int, max_model_len: int, max_num_seqs: int, scratch_block: int
    ):
        self.proposer = proposer
        self.num_depths = num_drafts - 1
        self.scratch_block = scratch_block
        self.batch_sizes = graph_batch_sizes(max_num_seqs)
        device, block_size = proposer.device, proposer.block_size
        hidden_size = proposer.model.arch.hidden_size
        dtype = proposer.kv_caches[0].dtype
        width = -(-max_model_len // block_size)
        self.last_positions = torch.zeros(max_num_seqs, dtype=torch.long, device=device)
        self.block_tables = torch.full(
            (max_num_seqs, width), scratch_block, dtype=torch.int32, device=device
        )
        self.tokens = torch.zeros(max_num_seqs, dtype=torch.long, device=device)
        self.hidden = torch.zeros((max_num_seqs, hidden_size), dtype=dtype, device=device)
        self.query_starts = torch.arange(max_num_seqs + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.num_replays = 0

    def padded_size(self, num_rows: int) -> int | None:
        """The batch size with a graph for ``num_rows`` drafting rows, None if too many."""
        return next((size for size in self.batch_sizes if size >= num_rows), None)

    def _chain(self, size: int) -> torch.Tensor:
        """Depths 1..num_depths for the first ``size`` rows of the static buffers."""
        drafts, _ = draft_chain(
            self.proposer,
            self.last_positions[:size],
            self.block_tables[:size],
            self.tokens[:size],
            self.hidden[:size],
            self.num_depths,
        )
        return drafts

    def _fill(
        self,
        last_positions: list[int],
        block_tables: list[list[int]],
        size: int,
        tokens: torch.Tensor | None = None,
        hidden: torch.Tensor | None = None,
    ) -> None:
        pad = size - len(last_positions)
        block_size = self.proposer.block_size
        width = -(-(max(last_positions + [0]) + self.num_depths + 1) // block_size)
        copy_to(self.last_positions[:size], last_positions + [0] * pad)
        copy_to(
            self.block_tables[:size, :width],
            block_table_array(block_tables, width, size, pad_block=self.scratch_block),
        )
        if tokens is not None:
            self.tokens[: len(last_positions)].copy_(tokens)
            self.hidden[: len(last_positions)].copy_(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per padded batch size (largest first, one memory pool)."""
        pool = torch.cuda.graph_pool_handle()
        stream = capture_stream(self.proposer.device)
        for size in reversed(self.batch_sizes):
            self._fill([], [], size)
            self.graphs[size] = capture_graph(partial(self._chain, size), pool, stream)
        torch.cuda.synchronize()

    def run(
        self,
        last_positions: list[int],
        block_tables: list[list[int]],
        tokens: torch.Tensor,
        hidden: torch.Tensor,
    ) -> torch.Tensor:
        """Drafts ``[rows, num_depths]`` after depth 0's ``tokens`` [rows] and ``hidden``
        [rows, hidden] for requests whose last kept positions and block tables are given
        (at most the largest batch size: the caller checks ``padded_size``). A view of a
        static buffer, valid until the next call (copy it to keep it); the host never waits
        here."""
        size = self.padded_size(len(last_positions))
        if size is None:
            raise ValueError(
                f"{len(last_positions)} rows: more than the largest draft graph "
                f"({self.batch_sizes[-1]})"
            )
        self._fill(last_positions, block_tables, size, tokens, hidden)
        if not self.graphs:  # not captured (the CPU): the same chain, eagerly
            return self._chain(size)[: len(last_positions)]
        graph, drafts = self.graphs[size]
        graph.replay()
        self.num_replays += 1
        return drafts[: len(last_positions)]

    def run_device(
        self,
        last_positions: torch.Tensor,
        block_tables: torch.Tensor,
        tokens: torch.Tensor,
        hidden: torch.Tensor,
    ) -> torch.Tensor:
        """:meth:`run` for rows whose last kept positions [rows] and block tables
        [rows, width] are device tensors (a step launched before the one in front of it
        was read): device-to-device copies into the static buffers, then the replay."""
        rows, width = block_tables.shape
        size = self.padded_size(rows)
        if size is None:
            raise ValueError(
                f"{rows} rows: more than the largest draft graph ({self.batch_sizes[-1]})"
            )
        self.last_positions[:rows].copy_(last_positions)
        self.last_positions[rows:size].zero_()
        self.block_tables[:rows, :width].copy_(block_tables)
        self.block_tables[rows:size].fill_(self.scratch_block)
        self.tokens[:rows].copy_(tokens)
        self.hidden[:rows].copy_(hidden)
        if not self.graphs:  # not captured (the CPU): the same chain, eagerly
            return self._chain(size)[:rows]
        graph, drafts = self.graphs[size]
        graph.replay()
        self.num_replays += 1
        return drafts[:rows]
