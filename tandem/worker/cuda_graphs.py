"""CUDA graphs of the target model's forward pass for decode and verification steps.

A step whose rows all have the same query length ``q`` (decode rows: 1; MTP verification
rows: 1 + k) runs as the replay of a graph captured for its padded batch size (1, 2, 4, 8,
then steps of 16 up to ``max_num_seqs``): one launch instead of hundreds, so the host no
longer limits a small model's step. Prefill chunks and mixed batches run eagerly.

The graph reads static device buffers (token ids, positions, KV slots, sequence lengths,
block tables) that each step fills with non-blocking copies before the replay. Padding rows
are invalid slots: they read and write only a scratch KV block that no request owns (the
cache has one block more than the block manager hands out) and their outputs are dropped.
Attention is the Triton backend, whose launch reads no host value, so it can be captured.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from tandem.device_copy import copy_to
from tandem.layers.triton_attention import (
    TritonAttentionBackend,
    TritonAttentionMetadata,
    block_table_array,
)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Padded batch sizes that get a graph: 1, 2, 4, 8, then steps of 16, and the maximum."""
    sizes = {size for size in (1, 2, 4, 8) if size < max_num_seqs}
    sizes.update(range(16, max_num_seqs, 16))
    sizes.add(max_num_seqs)
    return sorted(sizes)


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """A stream to capture on: torch.cuda.graph's default one is made once per process, on
    the device current then (an earlier engine's), and capturing on it makes that device
    current, so Triton would launch there with this device's tensors."""
    return torch.cuda.Stream(device)


def capture_graph(
    forward, pool, stream: torch.cuda.Stream
) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """Run ``forward`` once eagerly (compiles the kernels and sets up cuBLAS outside the
    capture), then capture it on ``stream`` into ``pool``; returns the graph and the captured
    run's output (static: each replay rewrites it)."""
    forward()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    # thread_local: other threads (NCCL's watchdog under tensor parallelism) may query CUDA
    # while this one captures.
    with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
        output = forward()
    return graph, output


@dataclass
class GraphBatch:
    """One uniform step's rows, as host lists (the runner's flat batch)."""

    token_ids: list[int]
    positions: list[int]
    slots: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    query_len: int


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    hidden: torch.Tensor  # the captured forward's output, [padded tokens, hidden]


class CudaGraphRunner:
    """Captures and replays the model's forward for uniform batches of ``query_lens``."""

    def __init__(
        self,
        model,
        kv_caches: list[torch.Tensor],
        backend: TritonAttentionBackend,
        block_size: int,
        max_model_len: int,
        max_num_seqs: int,
        query_lens: list[int],
        scratch_block: int,
        device: torch.device,
    ):
        self.model = model
        self.kv_caches = kv_caches
        self.backend = backend
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.query_lens = sorted(set(query_lens))
        self.batch_sizes = graph_batch_sizes(max_num_seqs)
        max_tokens = max_num_seqs * self.query_lens[-1]
        width = -(-(max_model_len + self.query_lens[-1]) // block_size)
        self.input_ids = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.slots = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(max_num_seqs, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((max_num_seqs, width), dtype=torch.int32, device=device)
        # Uniform rows: request b's queries start at b * q, the same every step.
        self.query_starts = {
            q: torch.arange(0, (max_num_seqs + 1) * q, q, dtype=torch.int32, device=device)
            for q in self.query_lens
        }
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.num_replays = 0

    # ---- capture -------------------------------------------------------------------------

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per (padded batch size, query length), largest first so the
        smaller graphs reuse the memory pool of the larger ones."""
        pool = torch.cuda.graph_pool_handle()
        stream = capture_stream(self.input_ids.device)
        for q in self.query_lens:
            for size in reversed(self.batch_sizes):
                self._fill(GraphBatch([], [], [], [], [], q), size)
                graph, hidden = capture_graph(partial(self._forward, size, q), pool, stream)
                self.graphs[(size, q)] = _Graph(graph, hidden)
        torch.cuda.synchronize()

    def _metadata(self, size: int, q: int) -> TritonAttentionMetadata:
        return TritonAttentionMetadata(
            slot_mapping=self.slots[: size * q],
            max_query_len=q,
            block_tables=self.block_tables[:size],
            query_start_loc_device=self.query_starts[q][: size + 1],
            seq_lens_device=self.seq_lens[:size],
        )

    def _forward(self, size: int, q: int) -> torch.Tensor:
        tokens = size * q
        return self.model(
            self.input_ids[:tokens],
            self.positions[:tokens],
            self.kv_caches,
            self._metadata(size, q),
            self.backend,
        )

    def _fill(self, batch: GraphBatch, size: int) -> None:
        """Copy the batch into the static buffers, padded on the host to ``size`` rows:
        each padding row holds q positions in the scratch block (an invalid slot)."""
        q = batch.query_len
        pad = size - len(batch.seq_lens)
        scratch = self.scratch_block
        scratch_slots = [scratch * self.block_size + j % self.block_size for j in range(q)]
        width = -(-max(batch.seq_lens + [q]) // self.block_size)
        table = block_table_array(batch.block_tables, width, size, pad_block=scratch)
        copy_to(self.input_ids[: size * q], batch.token_ids + [0] * (pad * q))
        copy_to(self.positions[: size * q], batch.positions + list(range(q)) * pad)
        copy_to(self.slots[: size * q], batch.slots + scratch_slots * pad)
        copy_to(self.seq_lens[:size], batch.seq_lens + [q] * pad)
        copy_to(self.block_tables[:size, :width], table)

    # ---- replay --------------------------------------------------------------------------

    def padded_size(self, query_lens: list[int]) -> int | None:
        """The graph batch size for a step with these rows, or None when it runs eagerly."""
        q = query_lens[0]
        if q not in self.query_starts or any(length != q for length in query_lens):
            return None
        for size in self.batch_sizes:
            if size >= len(query_lens):
                return size
        return None

    def run(
        self, batch: GraphBatch, size: int, fills: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Fill the static buffers from ``batch`` (``fills``: flat indices and token ids
        already on the device, such as drafts, written over their placeholders) and replay
        its graph.
        Returns the hidden states and token ids of the real rows: views of static buffers,
        valid until the next replay. The host never waits here."""
        self._fill(batch, size)
        num_tokens = len(batch.token_ids)
        for index, tokens in fills:
            self.input_ids[index] = tokens
        graph = self.graphs[(size, batch.query_len)]
        graph.graph.replay()
        self.num_replays += 1
        return graph.hidden[:num_tokens], self.input_ids[:num_tokens]

    def run_device(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
        query_len: int,
    ) -> torch.Tensor:
        """:meth:`run` for a uniform step whose inputs are device tensors (rows resolved on
        the device, for a step launched before the one in front of it was read):
        device-to-device copies into the static buffers, padding rows from the host, then
        the replay. Returns the real rows' hidden states (a view of a static buffer)."""
        rows, width = block_tables.shape
        size = self.padded_size([query_len] * rows)
        if size is None:
            raise ValueError(f"{rows} rows of {query_len} tokens have no graph")
        if size > rows:
            self._fill(GraphBatch([], [], [], [], [], query_len), size)  # all rows padding
        num_tokens = rows * query_len
        self.input_ids[:num_tokens].copy_(input_ids)
        self.positions[:num_tokens].copy_(positions)
        self.slots[:num_tokens].copy_(slots)
        self.seq_lens[:rows].copy_(seq_lens)
        self.block_tables[:rows, :width].copy_(block_tables)
        graph = self.graphs[(size, query_len)]
        graph.graph.replay()
        self.num_replays += 1
        return graph.hidden[:num_tokens]
