"""MTP proposer: after the target's forward pass, run the MTP head over the step's valid
positions (filling its KV cache) and draft k tokens for every request that sampled.

Depth 1 covers every position whose KV the target computed and kept this step; position p
takes the target's hidden state h[p] and the token at p + 1 (known, accepted or just
sampled). Depths 2..k are one row per drafting request, each on the previous depth's hidden
state and draft, at the next position. A sampled draft at depth d for position t draws with
the noise keyed by (request seed, t, ``draft_draw(d)``) (``tandem.layers.keyed_random``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.device_copy import to_device
from tandem.layers.attention import AttentionBackend
from tandem.models.llama import LlamaModel
from tandem.models.mtp import MTPHead
from tandem.sampling_params import SamplingParams
from tandem.worker.spec_decode.draft_graphs import draft_chain
from tandem.worker.spec_decode.draft_sampling import DraftSampling, draft_tokens
from tandem.worker.spec_decode.hidden_cache import HiddenCache
from tandem.worker.spec_decode.slot_rows import Accepted, VerifyRows, table_blocks
from tandem.worker.step_sampler import sampling_batch


@dataclass
class ProposalRow:
    """One scheduled request as the proposer sees it."""

    request_id: str
    positions: list[int]  # positions whose target KV is valid after this step
    hidden_rows: list[int]  # their rows in the target's hidden states
    next_tokens: list[int]  # the token at position + 1 for each
    block_ids: list[int]
    num_drafts: int  # 0 for a request that did not sample (a prefill chunk)


@dataclass
class Proposal:
    """Drafts per request (device tensors [num_drafts]), and for sampled (non-greedy)
    requests the draft distributions [num_drafts, V]."""

    draft_token_ids: dict[str, torch.Tensor]
    draft_probs: dict[str, torch.Tensor]


class MTPProposer:
    """Runs the MTP head of a target model over its paged KV cache."""

    # It drafts after a uniform step on the device alone (``propose_uniform``): such steps
    # can be queued before the one in front of them is read.
    resolves_on_device = True

    def __init__(
        self,
        head: MTPHead,
        model: LlamaModel,
        kv_caches: list[torch.Tensor],
        backend: AttentionBackend,
        block_size: int,
        device: torch.device,
        hidden_caches: list[HiddenCache] | None = None,
    ):
        self.head, self.model, self.kv_caches = head, model, kv_caches
        self.backend, self.block_size, self.device = backend, block_size, device
        self.graphs = None  # a DraftGraphRunner for depths >= 1 of greedy batches (CUDA)
        # PromptDraftGraphs: depth 0 of a ragged step drafted at its launch (CUDA).
        self.prompt_graphs = None
        # A head of several layers: layer L's output at every position, paged as the KV
        # cache (``HiddenCache``, one per layer but the last), which layer L + 1 reads one
        # position later (``stream_later_layers``).
        self.hidden_caches = hidden_caches or []

    def _slot(self, block_ids: list[int], position: int) -> int:
        return block_ids[position // self.block_size] * self.block_size + (
            position % self.block_size
        )

    def _layer_pass(
        self,
        depth: int,
        positions: list[int],
        tokens: torch.Tensor,
        hidden,
        query_lens,
        seq_lens,
        block_tables,
        slots: list[int],
    ) -> torch.Tensor:
        layer_index = self.head.layer_for_depth(depth)
        device = self.device
        metadata = self.backend.build_metadata(
            query_lens,
            seq_lens,
            block_tables,
            to_device(slots, torch.long, device),
            self.block_size,
            device,
        )
        return self.head.layers[layer_index](
            to_device(positions, torch.long, device),
            self.model.embed_tokens(tokens),
            hidden,
            self.kv_caches[layer_index],
            metadata,
            self.backend,
        )

    def stream_later_layers(
        self,
        first: torch.Tensor,
        positions: torch.Tensor,
        embeds: torch.Tensor,
        slot_ids: torch.Tensor,
        previous_slots: torch.Tensor,
        metadata,
    ) -> None:
        """Layers 1.. of a head of several over the rows depth 0 ran (``first``: its outputs),
        so that each keeps KV at every position as the first does: layer L's row at position
        q takes layer L - 1's output at q - 1 (``previous_slots``, -1 at position 0: zeros)
        and the token at q + 1 (``embeds``). Each layer's outputs go to its hidden cache
        first, then the next layer gathers them a position later (the row at a step's first
        position reads what the step before wrote). Device work only: graph-safe."""
        known = (previous_slots >= 0).unsqueeze(1)
        gather = previous_slots.clamp(min=0)
        outputs = first
        for index in range(1, self.head.num_layers):
            cache = self.hidden_caches[index - 1]
            cache.write(slot_ids, outputs)
            inputs = cache.read(gather) * known.to(outputs.dtype)
            outputs = self.head.layers[index](
                positions, embeds, inputs, self.kv_caches[index], metadata, self.backend
            )

    def uniform_later_layers(
        self,
        first: torch.Tensor,
        rows: VerifyRows,
        next_tokens: torch.Tensor,
        metadata,
        block_tables: torch.Tensor,
    ) -> None:
        """``stream_later_layers`` over a uniform step's fixed-shape rows (``rows``, B of
        k + 1 each; ``block_tables`` [B or more, W]): rows past a request's accepted count
        write what the next step overwrites, as depth 0's do. None without a second layer."""
        if not self.hidden_caches:
            return
        batch = rows.start.shape[0]
        previous = (rows.positions - 1).view(batch, -1)
        clamped = previous.clamp(min=0)
        # Past a table's width: the scratch block (the caches' last), as verify_rows does.
        scratch = self.hidden_caches[0].scratch_block
        blocks = table_blocks(block_tables[:batch], clamped // self.block_size, scratch)
        previous_slots = torch.where(
            previous >= 0, blocks * self.block_size + clamped % self.block_size, -1
        ).view(-1)
        self.stream_later_layers(
            first,
            rows.positions,
            self.model.embed_tokens(next_tokens),
            rows.slot_mapping,
            previous_slots,
            metadata,
        )

    def propose(
        self,
        rows: list[ProposalRow],
        target_hidden: torch.Tensor,
        sampling: dict[str, tuple[SamplingParams, int]],
        sampled: tuple[list[int], torch.Tensor] | None = None,
    ) -> Proposal:
        """``sampling`` maps each drafting request to its params and 63-bit key seed; greedy
        requests draft by argmax, the others sample from the filtered draft distribution q
        (keyed by seed, drafted position and depth). ``sampled``: (indices into the rows'
        positions, device tokens), the next tokens that only the device knows yet (drafting
        at a step's launch: those the step samples), in place of ``next_tokens`` there. The
        drafts stay on the device (the next step reads them there)."""
        rows = [r for r in rows if r.positions]
        proposal = Proposal({}, {})
        if not rows:
            return proposal
        device = self.device
        positions = [p for r in rows for p in r.positions]
        hidden_rows = to_device([i for r in rows for i in r.hidden_rows], torch.long, device)
        slot_ids = to_device(
            [self._slot(r.block_ids, p) for r in rows for p in r.positions], torch.long, device
        )
        metadata = self.backend.build_metadata(
            [len(r.positions) for r in rows],
            [r.positions[-1] + 1 for r in rows],
            [r.block_ids for r in rows],
            slot_ids,
            self.block_size,
            device,
        )
        position_ids = to_device(positions, torch.long, device)
        next_ids = to_device([t for r in rows for t in r.next_tokens], torch.long, device)
        if sampled is not None:
            next_ids.index_copy_(0, to_device(sampled[0], torch.long, device), sampled[1])
        embeds = self.model.embed_tokens(next_ids)
        hidden = self.head.layers[0](
            position_ids,
            embeds,
            target_hidden.index_select(0, hidden_rows),
            self.kv_caches[0],
            metadata,
            self.backend,
        )
        if self.hidden_caches:
            previous = [
                self._slot(r.block_ids, p - 1) if p else -1 for r in rows for p in r.positions
            ]
            self.stream_later_layers(
                hidden,
                position_ids,
                embeds,
                slot_ids,
                to_device(previous, torch.long, device),
                metadata,
            )
        drafting = [(i, r) for i, r in enumerate(rows) if r.num_drafts > 0]
        if not drafting:
            return proposal
        ends, total = [], 0
        for r in rows:
            total += len(r.positions)
            ends.append(total - 1)
        hidden = hidden.index_select(
            0, to_device([ends[i] for i, _ in drafting], torch.long, device)
        )
        drafting_rows = [r for _, r in drafting]
        params = [sampling[r.request_id][0] for r in drafting_rows]
        seeds = first_positions = None
        if not all(p.greedy for p in params):
            seeds = to_device(
                [sampling[r.request_id][1] for r in drafting_rows], torch.long, device
            )
            # Depth 0 drafts the token after the last kept position's next token.
            first_positions = to_device(
                [r.positions[-1] + 2 for r in drafting_rows], torch.long, device
            )
        batch = sampling_batch(params, seeds, self.model.arch.vocab_size, device)
        draft_sampling = DraftSampling(batch, first_positions)
        max_depth = max(r.num_drafts for r in drafting_rows)
        # Depths >= 1 by one graph replay when every row drafts greedily to the full depth.
        graphs = self.graphs
        graphed = (
            graphs is not None
            and batch.all_greedy
            and max_depth == graphs.num_depths + 1 > 1
            and all(r.num_drafts == max_depth for r in drafting_rows)
            and graphs.padded_size(len(drafting_rows)) is not None
        )
        tokens_per_depth: list[torch.Tensor] = []
        probs_per_depth: list[torch.Tensor | None] = []
        for depth in range(1 if graphed else max_depth):
            if depth > 0:
                hidden = self._layer_pass(
                    depth,
                    [r.positions[-1] + depth for r in drafting_rows],
                    tokens_per_depth[-1],
                    hidden,
                    [1] * len(drafting_rows),
                    [r.positions[-1] + depth + 1 for r in drafting_rows],
                    [r.block_ids for r in drafting_rows],
                    [self._slot(r.block_ids, r.positions[-1] + depth) for r in drafting_rows],
                )
            layer = self.head.layers[self.head.layer_for_depth(depth)]
            logits = self.model.model_dtype_logits(layer.final_norm(hidden))
            tokens, probs = draft_tokens(logits, draft_sampling, depth)
            tokens_per_depth.append(tokens)
            probs_per_depth.append(probs)
        if graphed:
            drafts = self.graphed_drafts(drafting_rows, tokens_per_depth[0], hidden)
        else:
            drafts = torch.stack(tokens_per_depth, dim=1)  # [rows, max_depth]
        for index, row in enumerate(drafting_rows):
            proposal.draft_token_ids[row.request_id] = drafts[index, : row.num_drafts]
            if not sampling[row.request_id][0].greedy:
                proposal.draft_probs[row.request_id] = torch.stack(
                    [p[index] for p in probs_per_depth[: row.num_drafts]]
                )
        return proposal

    def graphed_drafts(
        self, rows: list[ProposalRow], first: torch.Tensor, hidden: torch.Tensor
    ) -> torch.Tensor:
        """The k drafts [rows, k] of drafting ``rows`` whose greedy depth-0 drafts ``first``
        and depth-0 hidden states ``hidden`` are known: depths 1..k-1 by the draft graphs'
        replay after each row's last kept position (a copy: the graphs' buffers move on)."""
        later = self.graphs.run(
            [r.positions[-1] for r in rows], [r.block_ids for r in rows], first, hidden
        )
        return torch.cat([first.unsqueeze(1), later], dim=1)

    def propose_uniform(
        self,
        target_hidden: torch.Tensor,
        next_tokens: torch.Tensor,
        rows: VerifyRows,
        metadata,
        accepted: Accepted,
        block_tables: torch.Tensor,
        host_block_tables: list[list[int]],
        num_drafts: int,
        slot_ids: torch.Tensor | None = None,
        sampling: DraftSampling | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Drafts ``[rows, num_drafts]`` after a uniform verification step, all on the
        device, and for sampled rows (``sampling``, None for a greedy batch) the
        distributions they were drawn from ``[rows, num_drafts, V]`` (None when every row
        is greedy). Depth 0 runs at fixed shape over every verified row (``rows``'
        positions, ``metadata`` and the target's ``target_hidden`` of the step;
        ``next_tokens`` the token after each position, i.e. the step's candidates), so rows
        past a request's accepted count write MTP KV that the next step overwrites, exactly
        as the target's rejected rows do; each row's kept output (``accepted.kept``) is
        gathered and the later depths chain from it (a CUDA graph when one fits and every
        row is greedy). ``slot_ids`` (the rows' device slots) are for proposers that need
        them (the benchmarks' oracle); unused here."""
        layer_index = self.head.layer_for_depth(0)
        layer = self.head.layers[layer_index]
        hidden = layer(
            rows.positions,
            self.model.embed_tokens(next_tokens),
            target_hidden,
            self.kv_caches[layer_index],
            metadata,
            self.backend,
        )
        self.uniform_later_layers(hidden, rows, next_tokens, metadata, block_tables)
        hidden = hidden.index_select(0, accepted.kept)
        logits = self.model.model_dtype_logits(layer.final_norm(hidden))
        first, first_probs = draft_tokens(logits, sampling, 0)
        if num_drafts == 1:
            return first.unsqueeze(1), None if first_probs is None else first_probs.unsqueeze(1)
        last_positions = accepted.last_positions
        graphs = self.graphs
        if (
            first_probs is None
            and graphs is not None
            and graphs.num_depths == num_drafts - 1
            and graphs.padded_size(first.shape[0]) is not None
        ):
            later = graphs.run_device(last_positions, block_tables, first, hidden)
            return torch.cat([first.unsqueeze(1), later], dim=1), None
        later, later_probs = draft_chain(
            self,
            last_positions,
            block_tables,
            first,
            hidden,
            num_drafts - 1,
            host_block_tables,
            sampling,
        )
        drafts = torch.cat([first.unsqueeze(1), later], dim=1)
        if first_probs is None:
            return drafts, None
        return drafts, torch.cat([first_probs.unsqueeze(1), later_probs], dim=1)
