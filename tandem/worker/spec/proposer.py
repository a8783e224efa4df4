"""MTP proposer: after the target's forward pass, run the MTP head over the step's valid
positions (filling its KV cache) and draft k tokens for every request that sampled.

Depth 1 covers every position whose KV the target computed and kept this step; position p
takes the target's hidden state h[p] and the token at p + 1 (known, accepted or just
sampled). Depths 2..k are one row per drafting request, each on the previous depth's hidden
state and draft, at the next position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.layers.attention import AttentionBackend
from tandem.layers.sampler import SamplingBatch, apply_filters, draw
from tandem.models.llama import LlamaModel
from tandem.models.mtp import MTPHead
from tandem.sampling_params import SamplingParams


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
    """Drafts per request, and for sampled (non-greedy) requests the draft distributions."""

    draft_token_ids: dict[str, list[int]]
    draft_probs: dict[str, torch.Tensor]


class MTPProposer:
    """Runs the MTP head of a target model over its paged KV cache."""

    def __init__(self, head: MTPHead, model: LlamaModel, kv_caches: list[torch.Tensor],
                 backend: AttentionBackend, block_size: int, device: torch.device):
        self.head, self.model, self.kv_caches = head, model, kv_caches
        self.backend, self.block_size, self.device = backend, block_size, device

    def _slot(self, block_ids: list[int], position: int) -> int:
        return block_ids[position // self.block_size] * self.block_size + (
            position % self.block_size
        )

    def _layer_pass(self, depth: int, positions, tokens, hidden, query_lens, seq_lens,
                    block_tables, slots) -> torch.Tensor:
        layer_index = self.head.layer_for_depth(depth)
        device = self.device
        slot_tensor = torch.tensor(slots, dtype=torch.long, device=device)
        metadata = self.backend.build_metadata(query_lens, seq_lens, block_tables, slot_tensor,
                                               self.block_size, device)
        embeds = self.model.embed_tokens(torch.tensor(tokens, device=device))
        return self.head.layers[layer_index](
            torch.tensor(positions, device=device), embeds, hidden,
            self.kv_caches[layer_index], metadata, self.backend,
        )

    def propose(
        self,
        rows: list[ProposalRow],
        target_hidden: torch.Tensor,
        sampling: dict[str, tuple[SamplingParams, torch.Generator | None]],
        default_generator: torch.Generator | None,
    ) -> Proposal:
        """``sampling`` maps each drafting request to its params and generator; greedy
        requests draft by argmax, the others sample from the filtered draft distribution q."""
        rows = [r for r in rows if r.positions]
        proposal = Proposal({}, {})
        if not rows:
            return proposal
        positions = [p for r in rows for p in r.positions]
        hidden_rows = torch.tensor([i for r in rows for i in r.hidden_rows], device=self.device)
        hidden = self._layer_pass(
            0, positions, [t for r in rows for t in r.next_tokens],
            target_hidden.index_select(0, hidden_rows),
            [len(r.positions) for r in rows], [r.positions[-1] + 1 for r in rows],
            [r.block_ids for r in rows],
            [self._slot(r.block_ids, p) for r in rows for p in r.positions],
        )
        drafting = [(i, r) for i, r in enumerate(rows) if r.num_drafts > 0]
        if not drafting:
            return proposal
        ends = torch.tensor([len(r.positions) for r in rows], device=self.device).cumsum(0) - 1
        hidden = hidden.index_select(0, ends[[i for i, _ in drafting]])
        drafting_rows = [r for _, r in drafting]
        batch = SamplingBatch.build(
            [sampling[r.request_id][0] for r in drafting_rows],
            [sampling[r.request_id][1] for r in drafting_rows],
            self.model.arch.vocab_size, self.device,
        )
        max_depth = max(r.num_drafts for r in drafting_rows)
        drafts: list[list[int]] = [[] for _ in drafting_rows]
        probs_per_depth: list[torch.Tensor | None] = []
        for depth in range(max_depth):
            if depth > 0:
                hidden = self._layer_pass(
                    depth,
                    [r.positions[-1] + depth for r in drafting_rows],
                    [d[-1] for d in drafts],
                    hidden,
                    [1] * len(drafting_rows),
                    [r.positions[-1] + depth + 1 for r in drafting_rows],
                    [r.block_ids for r in drafting_rows],
                    [self._slot(r.block_ids, r.positions[-1] + depth) for r in drafting_rows],
                )
            layer = self.head.layers[self.head.layer_for_depth(depth)]
            logits = self.model.compute_logits(layer.final_norm(hidden))
            tokens = logits.argmax(dim=-1)
            probs = None
            if not batch.all_greedy:
                probs = apply_filters(logits, batch)
                sampled = draw(probs, batch.generators, default_generator)
                tokens = torch.where(batch.greedy, tokens, sampled)
            probs_per_depth.append(probs)
            for draft, token in zip(drafts, tokens.tolist(), strict=True):
                draft.append(token)
        for index, (row, draft) in enumerate(zip(drafting_rows, drafts, strict=True)):
            proposal.draft_token_ids[row.request_id] = draft[: row.num_drafts]
            if not bool(batch.greedy[index]):
                proposal.draft_probs[row.request_id] = torch.stack(
                    [p[index] for p in probs_per_depth[: row.num_drafts]]
                )
        return proposal
