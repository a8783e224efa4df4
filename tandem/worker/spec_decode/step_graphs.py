"""CUDA graphs of whole resolved MTP steps: one graph per padded batch size replays the
target's verification forward, the verification, the slots' update and the MTP head's
drafting, so a resolved step costs the host a few small copies and one replay instead of
hundreds of launches. A second graph per shape (``mixed``) replays the same step without the
forward, from hidden states copied into a static buffer: the resolved rows of a step whose
forward they shared with prompt chunks (``StepPipeline._launch_mixed``).

The graph reads static buffers that the host fills each step with non-blocking copies: the
rows' slot ids and block tables, and for sampled batches the rows' sampling parameters and
key seeds. Everything else comes from the device slots (``RequestSlots``) and is computed on
the device, as in ``uniform_step``. Padding rows name the slots' scratch slot, whose state
is reset at the start of every step, and a block table of the scratch block only: they write
nothing any request owns, and their outputs are dropped.

Three families of graphs: ``greedy`` (greedy rows without logprobs: argmax verification);
``sampled`` and ``sampled_top_p`` (any mix of greedy and sampled rows, with or without
logprobs: every row verified both ways by ``sample_uniform``, rejection sampling against the
drafts' q kept in the slots, the head's drafts sampled with each row's own parameters, and
the logprobs of every candidate with the API's largest top-N). Filters a family does not
hold (top-k) take the eager resolved step. On the CPU (tests) ``run`` computes the same
step eagerly from the same buffers, with Triton's interpreter.
"""

from __future__ import annotations

from functools import partial
from itertools import product

import torch

from tandem.device_copy import copy_to
from tandem.layers.argmax import argmax_rows
from tandem.layers.sampler import SamplingBatch, compute_logprobs
from tandem.layers.triton_attention import TritonAttentionMetadata, block_table_array
from tandem.sampling_params import MAX_LOGPROBS, SamplingParams
from tandem.worker.cuda_graphs import capture_graph, capture_stream, graph_batch_sizes
from tandem.worker.model_runner import ModelRunner
from tandem.worker.request_slots import RequestSlots
from tandem.worker.spec_decode.draft_graphs import draft_chain
from tandem.worker.spec_decode.draft_sampling import DraftSampling
from tandem.worker.spec_decode.slot_rows import accept, verify_rows
from tandem.worker.spec_decode.verification import RejectionLayout
from tandem.worker.step_sampler import sample_uniform

FAMILIES = ("greedy", "sampled", "sampled_top_p")


def graph_family(params: list[SamplingParams], vocab_size: int) -> str | None:
    """The family of graphs that runs a resolved step of rows with these parameters (None:
    the eager resolved step)."""
    if all(p.greedy and p.logprobs is None for p in params):
        return "greedy"
    sampled = [p for p in params if not p.greedy]
    if any(0 < p.top_k < vocab_size for p in sampled):
        return None
    return "sampled_top_p" if any(p.top_p < 1.0 for p in sampled) else "sampled"


def step_shapes(spec, batch_sizes: list[int]) -> dict[int, list[tuple[int, int]]]:
    """Per padded batch size, the (drafts verified, drafts drafted) pairs its resolved steps
    can have under ``spec``'s draft schedule (``SpeculativeConfig.drafts_for``): a step of
    n rows drafts ``drafts_for(n)`` and verifies as many, or fewer where a row's slot holds
    fewer (drafted by a larger step before); one pair, (k, k), without a schedule."""
    shapes, previous = {}, 0
    depths = {spec.num_speculative_tokens} | {drafts for _, drafts in spec.draft_schedule}
    for size in batch_sizes:
        drafted = {spec.drafts_for(n) for n in range(previous + 1, size + 1)}
        shapes[size] = sorted((v, d) for d in drafted for v in depths if v <= d)
        previous = size
    return shapes


class ResolvedStepGraphs:
    """Captures and replays whole resolved MTP steps (the families above), and with
    ``mixed`` the same steps without their forward."""

    def __init__(
        self, runner: ModelRunner, slots: RequestSlots, max_num_seqs: int, mixed: bool = True
    ):
        """``mixed``: also the graphs without the forward (for mixed steps)."""
        self.runner = runner
        self.mixed = mixed
        self.slots = slots
        self.batch_sizes = graph_batch_sizes(max_num_seqs)
        self.shapes = step_shapes(runner.config.speculative, self.batch_sizes)
        device, block_size = runner.device, runner.block_size
        self.scratch_block = runner.scratch_block
        self.generation = slots.generation  # the slots' storage the graphs were captured on
        # A row starts at most the unread step's k + 1 tokens past its last known one.
        width = -(-(runner.max_model_len + 2 * (slots.num_drafts + 1)) // block_size)
        self.slot_ids = torch.full((max_num_seqs,), slots.scratch, dtype=torch.long, device=device)
        self.block_tables = torch.full(
            (max_num_seqs, width), self.scratch_block, dtype=torch.int32, device=device
        )
        # Per query length (drafts verified + 1), each row's first flat index.
        self.query_starts = {
            v + 1: torch.arange(
                0, (max_num_seqs + 1) * (v + 1), v + 1, dtype=torch.int32, device=device
            )
            for v in {v for pairs in self.shapes.values() for v, _ in pairs}
        }
        # The sampled families' parameters (padding rows: greedy, temperature 1).
        self.temperature = torch.ones(max_num_seqs, dtype=torch.float32, device=device)
        self.greedy = torch.ones(max_num_seqs, dtype=torch.bool, device=device)
        self.top_p = torch.ones(max_num_seqs, dtype=torch.float32, device=device)
        self.min_p = torch.zeros(max_num_seqs, dtype=torch.float32, device=device)
        self.seeds = torch.zeros(max_num_seqs, dtype=torch.long, device=device)
        self.layouts = {
            (size, v): RejectionLayout.of([v] * size, device)
            for size, pairs in self.shapes.items()
            for v in {v for v, _ in pairs}
        }
        # The target's hidden states of a mixed step's resolved rows (the graphs' input).
        self.mixed_hidden: torch.Tensor | None = None
        if mixed:
            rows = max(size * (v + 1) for size, pairs in self.shapes.items() for v, _ in pairs)
            self.mixed_hidden = torch.zeros(
                (rows, runner.arch.hidden_size), dtype=runner.dtype, device=device
            )
        # (family, padded size, drafts verified, drafts drafted, mixed): graph and outputs.
        self.graphs: dict[tuple[str, int, int, int, bool], tuple[torch.cuda.CUDAGraph, tuple]]
        self.graphs = {}
        self.num_replays = 0

    def padded_size(self, num_rows: int) -> int | None:
        """The batch size with a graph for ``num_rows`` rows; None if too many, or if the
        slots' storage has grown since the capture."""
        if self.graphs and self.slots.generation != self.generation:
            return None
        return next((size for size in self.batch_sizes if size >= num_rows), None)

    def _verify(self, size: int, num_drafts: int, mixed: bool):
        """The first ``size`` rows' verification rows (``num_drafts`` drafts each),
        attention metadata and the target's hidden states (its forward's, or with ``mixed``
        those copied into ``mixed_hidden``) and logits (in the model's dtype)."""
        runner, q = self.runner, num_drafts + 1
        slot_ids, tables = self.slot_ids[:size], self.block_tables[:size]
        rows = verify_rows(
            self.slots, slot_ids, tables, runner.block_size, self.scratch_block, num_drafts=q - 1
        )
        metadata = TritonAttentionMetadata(
            slot_mapping=rows.slot_mapping,
            max_query_len=q,
            min_query_len=q,
            block_tables=tables,
            query_start_loc_device=self.query_starts[q][: size + 1],
            seq_lens_device=rows.seq_lens,
        )
        if mixed:
            hidden = self.mixed_hidden[: size * q]
        else:
            hidden = runner.model(
                rows.input_ids, rows.positions, runner.kv_caches, metadata, runner.backend
            )
        return rows, metadata, hidden, runner.model.model_dtype_logits(hidden)

    def _step(
        self, size: int, num_drafts: int, depth: int, mixed: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The greedy resolved step of the first ``size`` rows of the static buffers, each
        verifying ``num_drafts`` drafts and drafting ``depth``: candidates
        [size * (num_drafts + 1)] and emitted counts [size] (the slots are updated in
        place; ``mixed``: from ``mixed_hidden``, without the forward)."""
        slot_ids, tables = self.slot_ids[:size], self.block_tables[:size]
        rows, metadata, hidden, logits = self._verify(size, num_drafts, mixed)
        candidates = argmax_rows(logits)
        accepted = accept(self.slots, slot_ids, rows, candidates)
        drafts = self._draft(hidden, candidates, rows, metadata, accepted, tables, slot_ids, depth)
        self.slots.drafts[:, :depth].index_copy_(0, slot_ids, drafts)
        return candidates, accepted.emitted

    def _sampled_step(
        self, size: int, top_p: bool, num_drafts: int, depth: int, mixed: bool
    ) -> tuple[torch.Tensor, ...]:
        """The resolved step of the first ``size`` rows with their sampling parameters
        (``sample_uniform``; top-p only in the ``top_p`` family), ``num_drafts`` and
        ``depth`` and ``mixed`` as in ``_step``: candidates, emitted counts, and the four logprobs
        tensors of every candidate (top ``MAX_LOGPROBS``)."""
        slots = self.slots
        slot_ids, tables = self.slot_ids[:size], self.block_tables[:size]
        rows, metadata, hidden, logits = self._verify(size, num_drafts, mixed)
        logits = logits.float()
        batch = SamplingBatch(
            self.temperature[:size],
            self.greedy[:size],
            None,
            self.top_p[:size] if top_p else None,
            self.min_p[:size],
            self.seeds[:size],
            all_greedy=False,
        )
        draft_probs = slots.draft_probs[:, :num_drafts].index_select(0, slot_ids)
        candidates, emitted = sample_uniform(
            logits,
            rows.input_ids,
            batch,
            draft_probs,
            rows.start + 1,
            self.layouts[size, num_drafts],
        )
        accepted = accept(slots, slot_ids, rows, candidates, emitted=emitted)
        drafts, probs = self.runner.proposer.propose_uniform(
            hidden,
            candidates,
            rows,
            metadata,
            accepted,
            tables,
            [],
            depth,
            slot_ids,
            DraftSampling(batch, accepted.last_positions + 2),
        )
        slots.drafts[:, :depth].index_copy_(0, slot_ids, drafts)
        slots.draft_probs[:, :depth].index_copy_(0, slot_ids, probs)
        logprobs = compute_logprobs(logits, candidates, MAX_LOGPROBS)
        return (candidates, emitted, *logprobs.tensors())

    def _draft(
        self, hidden, candidates, rows, metadata, accepted, tables, slot_ids, depth
    ) -> torch.Tensor:
        """The MTP head's ``depth`` drafts after the verification (``propose_uniform``'s
        steps, with the later depths chained inline: a graph cannot replay another inside
        it)."""
        proposer = self.runner.proposer
        if getattr(proposer, "uniform_in_graph", False):  # no head (the benchmarks' oracle)
            drafts, _ = proposer.propose_uniform(
                hidden, candidates, rows, metadata, accepted, tables, [], depth, slot_ids
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
        proposer.uniform_later_layers(head_hidden, rows, candidates, metadata, tables)
        head_hidden = head_hidden.index_select(0, accepted.kept)
        first = argmax_rows(proposer.model.model_dtype_logits(layer.final_norm(head_hidden)))
        if depth == 1:
            return first.unsqueeze(1)
        later, _ = draft_chain(
            proposer, accepted.last_positions, tables, first, head_hidden, depth - 1
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

    def _fill_sampling(self, params: list[SamplingParams], seeds: list[int], size: int) -> None:
        """The rows' sampling parameters and key seeds into the static buffers (padding
        rows greedy)."""
        pad = size - len(params)
        copy_to(
            self.temperature[:size],
            [1.0 if p.greedy else p.temperature for p in params] + [1.0] * pad,
        )
        copy_to(self.greedy[:size], [p.greedy for p in params] + [True] * pad)
        copy_to(self.top_p[:size], [p.top_p for p in params] + [1.0] * pad)
        copy_to(self.min_p[:size], [p.min_p for p in params] + [0.0] * pad)
        copy_to(self.seeds[:size], list(seeds) + [0] * pad)

    def _function(self, family: str, size: int, num_drafts: int, depth: int, mixed: bool):
        if family == "greedy":
            return partial(self._step, size, num_drafts, depth, mixed)
        top_p = family == "sampled_top_p"
        return partial(self._sampled_step, size, top_p, num_drafts, depth, mixed)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per family, padded batch size and its (drafts verified, drafts
        drafted) pairs (``step_shapes``), with the forward and, if ``mixed``, without;
        largest first, one memory pool."""
        pool = torch.cuda.graph_pool_handle()
        stream = capture_stream(self.runner.device)
        for family in FAMILIES:
            for size in reversed(self.batch_sizes):
                kinds = (False, True) if self.mixed else (False,)
                for (num_drafts, depth), mixed in product(self.shapes[size], kinds):
                    self._fill([], [], size)
                    self._fill_sampling([], [], size)
                    function = self._function(family, size, num_drafts, depth, mixed)
                    key = (family, size, num_drafts, depth, mixed)
                    self.graphs[key] = capture_graph(function, pool, stream)
        torch.cuda.synchronize()

    def run(
        self,
        slot_ids: list[int],
        block_tables: list[list[int]],
        num_drafts: int,
        depth: int,
        family: str = "greedy",
        params: list[SamplingParams] | None = None,
        seeds: list[int] | None = None,
        hidden: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """The resolved step of these rows (their slots and block tables, and for a sampled
        ``family`` their sampling ``params`` and key ``seeds``), each verifying
        ``num_drafts`` drafts and drafting ``depth`` (a pair of ``shapes``); with
        ``hidden`` (the target's hidden states of the rows' verification tokens, from a
        forward they shared with other rows) everything after the forward: candidates
        [rows * (num_drafts + 1)] and emitted counts [rows], then for a sampled family the
        four logprobs tensors of every candidate; views of static buffers valid until the
        next replay (copies queued behind the replay read them in time). The host never
        waits here."""
        rows = len(slot_ids)
        size = self.padded_size(rows)
        if size is None:
            raise ValueError(f"{rows} rows: more than the largest step graph")
        if (num_drafts, depth) not in self.shapes[size]:
            raise ValueError(f"no step graph verifies {num_drafts} and drafts {depth} at {size}")
        mixed = hidden is not None
        if mixed and not self.mixed:
            raise ValueError("these step graphs hold no mixed steps (mixed=False)")
        if mixed and len(hidden) != rows * (num_drafts + 1):
            raise ValueError(f"{len(hidden)} hidden states for {rows} rows of {num_drafts + 1}")
        self._fill(slot_ids, block_tables, size)
        if family != "greedy":
            self._fill_sampling(params, seeds, size)
        if mixed:  # padding rows read stale hidden states: their outputs are dropped
            self.mixed_hidden[: len(hidden)].copy_(hidden)
        if not self.graphs:  # not captured (the CPU): the same step, eagerly
            outputs = self._function(family, size, num_drafts, depth, mixed)()
        else:
            graph, outputs = self.graphs[family, size, num_drafts, depth, mixed]
            graph.replay()
            self.num_replays += 1
        num_logits = rows * (num_drafts + 1)
        return (outputs[0][:num_logits], outputs[1][:rows], *(t[:num_logits] for t in outputs[2:]))
