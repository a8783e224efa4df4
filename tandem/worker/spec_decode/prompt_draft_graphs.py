"""CUDA graphs of the MTP head's first draft depth over a ragged step drafted at its launch.

A ragged step whose rows verify no drafts (a joining prompt's chunk, rows without drafts)
drafts as it is launched (``MTPSteps.draft_at_launch``): the head's depth 0 runs over every
position the step computes, each on the target's hidden state there and the token after it.
Launched from Python that is dozens of launches and host-built attention metadata for a few
microseconds of device work each, and in steady-state serving a prompt joins every other
step: it was most of a steady MTP step's launch time on the host (benchmarks/README.md,
"Steady rounds").

Its rows are the ragged step's rows (the same positions, KV slots, sequence lengths and block
tables), so it reads the buffers the target's ragged graph (``ragged_graphs.py``) was just
replayed with, and is captured once per padded token count as that graph is: the head over
the padded tokens (padding tokens write the head's KV to the scratch block, as the target's
do), then the final norm, the logits and their argmax at each row's last token (a static
index per row, as many rows as the size's tokens can hold; padding rows read token 0 and
are dropped). Depths 1..k-1 then replay the draft graphs (``draft_graphs.py``). It serves
greedy drafting rows of a one-layer head whose rows all draft k tokens; anything else runs
``MTPProposer.propose``. On the CPU (tests) ``propose`` computes the same function eagerly.
"""

from __future__ import annotations

from functools import partial

import torch

from tandem.device_copy import copy_to, to_device
from tandem.layers.argmax import argmax_rows
from tandem.worker.cuda_graphs import capture_graph, capture_stream
from tandem.worker.ragged_graphs import RaggedGraphRunner
from tandem.worker.spec_decode.proposer import MTPProposer, Proposal, ProposalRow


class PromptDraftGraphs:
    """The head's depth 0 over ragged steps as graph replays (module docstring), one per
    padded size of ``ragged``."""

    def __init__(self, proposer: MTPProposer, ragged: RaggedGraphRunner, num_drafts: int):
        if proposer.head.num_layers != 1:  # later layers read hidden caches: ``propose``
            raise ValueError(
                f"prompt draft graphs need a one-layer head, not {proposer.head.num_layers}"
            )
        self.proposer, self.ragged, self.num_drafts = proposer, ragged, num_drafts
        model = proposer.model
        device = ragged.input_ids.device
        max_tokens = ragged.sizes[-1]
        # The target's output: its final hidden state, with the head's fused features after.
        width = model.arch.hidden_size * (2 if model.draft_features else 1)
        dtype = model.embed_tokens.weight.dtype
        self.next_ids = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.target_hidden = torch.zeros((max_tokens, width), dtype=dtype, device=device)
        self.row_ends = torch.zeros(ragged.max_rows, dtype=torch.long, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor]]]
        self.graphs = {}
        self.num_replays = 0

    @torch.inference_mode()
    def capture(self) -> None:
        """One graph per padded size, largest first, in one memory pool (the ragged graphs'
        buffers hold a batch of padding only, as their own capture left them)."""
        pool = torch.cuda.graph_pool_handle()
        stream = capture_stream(self.next_ids.device)
        for size in reversed(self.ragged.sizes):
            self.graphs[size] = capture_graph(partial(self.forward, size), pool, stream)
        torch.cuda.synchronize()

    def forward(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The captured function: the head's layer over the first ``size`` tokens, then
        the last token of each row's hidden state [rows, H] and greedy draft [rows], for
        as many rows as ``size`` tokens can hold (at most ``max_rows``)."""
        proposer = self.proposer
        layer = proposer.head.layers[0]
        hidden = layer(
            self.ragged.positions[:size],
            proposer.model.embed_tokens(self.next_ids[:size]),
            self.target_hidden[:size],
            proposer.kv_caches[0],
            self.ragged.metadata(size),
            proposer.backend,
        )
        last = hidden.index_select(0, self.row_ends[: min(size, self.ragged.max_rows)])
        logits = proposer.model.model_dtype_logits(layer.final_norm(last))
        return last, argmax_rows(logits)

    def applies(self, rows: list[ProposalRow], target_hidden: torch.Tensor, sampling) -> bool:
        """Whether the ragged graph's buffers hold exactly these rows (``target_hidden`` is
        its last output and every row is one of its rows whole) and the drafting rows are
        greedy, each drafting k tokens, few enough for the draft graphs."""
        ragged, proposer = self.ragged, self.proposer
        batch = ragged.last_batch
        if batch is None or ragged.last_output is not target_hidden:
            return False
        if len(rows) != len(batch.query_lens):
            return False
        start = 0
        for row, query_len, seq_len in zip(rows, batch.query_lens, batch.seq_lens, strict=True):
            # A row's positions and hidden rows run consecutively (``MTPSteps._head_row``):
            # their count and ends tell whether they are the batch row's.
            if (
                len(row.positions) != query_len
                or row.positions[-1] + 1 != seq_len
                or row.hidden_rows[0] != start
                or row.hidden_rows[-1] != start + query_len - 1
            ):
                return False
            start += query_len
        drafting = [row for row in rows if row.num_drafts > 0]
        if any(
            row.num_drafts != self.num_drafts or not sampling[row.request_id][0].greedy
            for row in drafting
        ):
            return False
        if self.num_drafts == 1 or not drafting:
            return True
        graphs = proposer.graphs
        return graphs is not None and graphs.padded_size(len(drafting)) is not None

    def propose(
        self,
        rows: list[ProposalRow],
        target_hidden: torch.Tensor,
        sampled: tuple[list[int], torch.Tensor] | None,
    ) -> Proposal:
        """``MTPProposer.propose`` for rows that ``applies`` accepts: the head's KV at every
        row position, and the drafting rows' k drafts (device tensors). The host never
        waits here, and its work is per row: within a row each position's next token is
        the step's own next input token, copied on the device; only the rows' last
        positions take theirs from the host (or from ``sampled``)."""
        ragged, num_tokens = self.ragged, target_hidden.shape[0]
        size = ragged.padded_size(ragged.last_batch)
        ends, end = [], -1
        for row in rows:
            end += len(row.positions)
            ends.append(end)
        copy_to(self.row_ends, ends + [0] * (self.row_ends.shape[0] - len(ends)))
        self.next_ids[: num_tokens - 1].copy_(ragged.input_ids[1:num_tokens])
        device, row_ends = self.next_ids.device, self.row_ends[: len(rows)]
        if sampled is not None and sampled[0] == ends:  # every row's last: the step's sample
            self.next_ids.index_copy_(0, row_ends, sampled[1])
        else:
            last_tokens = to_device([row.next_tokens[-1] for row in rows], torch.long, device)
            self.next_ids.index_copy_(0, row_ends, last_tokens)
            if sampled is not None:
                self.next_ids.index_copy_(0, to_device(sampled[0], torch.long, device), sampled[1])
        self.target_hidden[:num_tokens].copy_(target_hidden)
        if self.graphs:
            graph, (last, tokens) = self.graphs[size]
            graph.replay()
        else:  # not captured (the CPU): the same function, eagerly
            last, tokens = self.forward(size)
        self.num_replays += 1
        proposal = Proposal({}, {})
        drafting = [index for index, row in enumerate(rows) if row.num_drafts > 0]
        if not drafting:
            return proposal
        if len(drafting) == len(rows):  # every row: the graph's first rows (copied below)
            first, hidden = tokens[: len(rows)], last[: len(rows)]
        else:
            index = to_device(drafting, torch.long, self.next_ids.device)
            first, hidden = tokens.index_select(0, index), last.index_select(0, index)
        if self.num_drafts > 1:  # the draft graphs copy their inputs; their drafts are new
            drafts = self.proposer.graphed_drafts([rows[i] for i in drafting], first, hidden)
        else:  # not a view of the graph's buffers, which the next replay overwrites
            drafts = first.unsqueeze(1).clone()
        for row_index, draft in zip(drafting, drafts, strict=True):
            proposal.draft_token_ids[rows[row_index].request_id] = draft
        return proposal
