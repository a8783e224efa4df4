"""CUDA graphs of the target model's forward pass for ragged steps.

A step whose rows differ in length (a prompt chunk beside decode or verification rows, a
prefill alone, rows near the context's end with fewer drafts) has no uniform graph
(``cuda_graphs.py``). Launched layer by layer from Python, such a step costs a small model
far more host time than device time: in steady-state serving a prompt joins every few steps,
and those eager steps were most of the host's time (benchmarks/README.md). Here the whole
forward is captured once per padded token count (16, 32, 64, 128, then four sizes per
doubling: 160, 192, 224, 256, 320, ... up to ``max_num_batched_tokens``) and replayed for any
ragged batch that fits.

This works because the attention launcher reads no device value and its grid depends on
sizes alone: the graph runs over ``max_num_seqs`` request rows and ``size`` tokens. A batch
of ``rows`` requests and ``n`` tokens fills the first ``rows`` entries of the static query
starts, sequence lengths and block tables; the rows past them have zero query rows (their
programs return at once) and the ``size - n`` padding tokens belong to no request, write
their keys and values only to the scratch block (an invalid slot no request owns) and their
outputs are dropped. The attention runs in its mixed mode (rows that fit the 16-row tile in
one launch, longer rows in another, no key splits), which is what an eager step with a
prompt chunk runs too.

The returned hidden states are a view of the graph's static output: valid until the graph
of the same size is replayed again. The MTP pipeline drafts from a ragged step's hidden
states at that step's read, before it launches any later ragged step.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from tandem.device_copy import copy_to
from tandem.layers.attention import query_start_locations
from tandem.layers.triton_attention import TritonAttentionMetadata, block_table_array
from tandem.worker.cuda_graphs import capture_graph, capture_stream

SMALLEST_SIZE = 16
# From here on each doubling of the token count is split in SIZES_PER_OCTAVE graph sizes:
# past ~128 rows a step's GEMMs grow with its rows (the 8B shape's are compute-bound past
# ~200), so padding 520 tokens to 1,024 nearly doubled such a step's device time
# (scripts/ragged_padding.py: 1.33 padded tokens a real one in the steady rows, 1.07 now).
FINE_FROM = 128
SIZES_PER_OCTAVE = 4


def ragged_token_sizes(max_tokens: int) -> list[int]:
    """Padded token counts that get a graph: powers of two from 16 to ``FINE_FROM``, then
    ``SIZES_PER_OCTAVE`` evenly spaced sizes per doubling, and ``max_tokens``."""
    sizes = []
    size = SMALLEST_SIZE
    while size < max_tokens:
        step = size // SIZES_PER_OCTAVE if size >= FINE_FROM else size
        sizes.extend(range(size, min(2 * size, max_tokens), step))
        size *= 2
    sizes.append(max_tokens)
    return sizes


def ragged_outputs_bytes(max_tokens: int, hidden_size: int, dtype: torch.dtype) -> int:
    """Device memory the captured graphs' outputs hold in their pool: each graph keeps its
    hidden states (``size`` rows) alive, beside the largest forward's working memory."""
    return sum(ragged_token_sizes(max_tokens)) * hidden_size * dtype.itemsize


@dataclass
class RaggedBatch:
    """One ragged step's requests (host lists); its tokens are already in the runner's
    input buffers."""

    query_lens: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]


class RaggedGraphRunner:
    """Captures and replays the model's forward for ragged batches (module docstring) of
    ``runner`` (a ModelRunner whose KV cache is allocated): its model, cache, attention
    backend and scratch block, its scheduler limits, and its token buffers (``input_ids``,
    ``positions``, ``slots``: the runner writes a step's tokens there, this class pads them)."""

    def __init__(self, runner):
        self.model = runner.model
        self.kv_caches = runner.kv_caches
        self.backend = runner.backend
        self.block_size = block_size = runner.block_size
        scheduler = runner.config.scheduler
        self.max_rows = scheduler.max_num_seqs
        max_tokens = scheduler.max_num_batched_tokens
        self.sizes = ragged_token_sizes(max_tokens)
        self.input_ids, self.positions, self.slots = runner.token_buffers
        device = self.input_ids.device
        self.width = -(-runner.max_model_len // block_size)
        self.query_starts = torch.zeros(self.max_rows + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(self.max_rows, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(
            (self.max_rows, self.width), dtype=torch.int32, device=device
        )
        # Padding tokens' slots: the scratch block, position by position.
        scratch = runner.scratch_block * block_size
        self.scratch_slots = torch.tensor(
            [scratch + j % block_size for j in range(max_tokens)], dtype=torch.long, device=device
        )
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.num_replays = 0
        # What the buffers hold since the last ``run``: its batch and returned view (the
        # head's depth 0 of a step drafted at launch reuses them: prompt_draft_graphs).
        self.last_batch: RaggedBatch | None = None
        self.last_output: torch.Tensor | None = None

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per padded size, largest first (the smaller ones reuse the
        memory pool of the larger), over a batch of padding only."""
        pool = torch.cuda.graph_pool_handle()
        stream = capture_stream(self.input_ids.device)
        self.query_starts.zero_()
        self.seq_lens.zero_()
        for size in reversed(self.sizes):
            self.slots[:size].copy_(self.scratch_slots[:size])
            self.graphs[size] = capture_graph(partial(self.forward, size), pool, stream)
        torch.cuda.synchronize()

    def metadata(self, size: int) -> TritonAttentionMetadata:
        """The attention metadata every replay of size ``size`` reads (mixed mode)."""
        return TritonAttentionMetadata(
            slot_mapping=self.slots[:size],
            max_query_len=size,
            min_query_len=1,
            block_tables=self.block_tables,
            query_start_loc_device=self.query_starts,
            seq_lens_device=self.seq_lens,
        )

    def forward(self, size: int) -> torch.Tensor:
        """The captured function: the model over the first ``size`` tokens of the buffers
        (run eagerly, it is what a replay computes; the tests compare the two paths)."""
        return self.model(
            self.input_ids[:size],
            self.positions[:size],
            self.kv_caches,
            self.metadata(size),
            self.backend,
        )

    def padded_size(self, batch: RaggedBatch) -> int | None:
        """The graph size for ``batch``, or None when none fits (it runs eagerly)."""
        if len(batch.query_lens) > self.max_rows:
            return None
        if max(batch.seq_lens) > self.width * self.block_size:
            return None
        num_tokens = sum(batch.query_lens)
        return next((size for size in self.sizes if size >= num_tokens), None)

    def prepare(
        self, batch: RaggedBatch, size: int, first_seq_lens: torch.Tensor | None = None
    ) -> None:
        """Fill the request buffers from ``batch`` and pad its tokens (already in the
        token buffers) to ``size``; no wait. ``first_seq_lens``: the first rows' true
        lengths, on the device only (``batch.seq_lens`` holds upper bounds for them)."""
        rows = len(batch.query_lens)
        starts = query_start_locations(batch.query_lens)
        num_tokens = starts[-1]
        starts += [num_tokens] * (self.max_rows - rows)
        seq_lens = np.zeros(self.max_rows, dtype=np.int32)
        seq_lens[:rows] = batch.seq_lens
        width = -(-max(batch.seq_lens) // self.block_size)
        copy_to(self.query_starts, np.asarray(starts, dtype=np.int32))
        copy_to(self.seq_lens, seq_lens)
        if first_seq_lens is not None:
            self.seq_lens[: first_seq_lens.shape[0]].copy_(first_seq_lens)
        copy_to(self.block_tables[:rows, :width], block_table_array(batch.block_tables, width))
        self.slots[num_tokens:size].copy_(self.scratch_slots[: size - num_tokens])

    def run(
        self, batch: RaggedBatch, size: int, first_seq_lens: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Pad ``batch`` to ``size`` and replay its graph; returns the real tokens' hidden
        states (a view of the graph's static output). The host never waits here.
        ``first_seq_lens``: see ``prepare``."""
        self.prepare(batch, size, first_seq_lens)
        if not self.graphs:  # not captured (the CPU): the same function, eagerly
            hidden = self.forward(size)
        else:
            graph, hidden = self.graphs[size]
            graph.replay()
        self.num_replays += 1
        self.last_batch = batch
        self.last_output = hidden[: sum(batch.query_lens)]
        return self.last_output
