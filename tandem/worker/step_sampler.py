"""Sampling for one step: plain rows draw one token; rows with drafts verify them (greedy
prefix match, or rejection sampling at temperature > 0) and emit 1 to k + 1 tokens. Every
emitted token's logprob comes from the target's raw logits at its own position."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.core.scheduler import ScheduledRequest
from tandem.layers.sampler import SamplingBatch, apply_filters, compute_logprobs, sample
from tandem.request import TokenLogprobs
from tandem.worker.spec.verification import greedy_accept, rejection_accept


@dataclass
class SamplingRow:
    """A request that samples this step; its logits rows are consecutive from
    ``logits_start``: the last known token, then one per draft."""

    row: ScheduledRequest
    logits_start: int
    generator: torch.Generator | None
    draft_probs: torch.Tensor | None = None  # [k, V] when the drafts were sampled

    @property
    def drafts(self) -> list[int]:
        return self.row.draft_token_ids

    @property
    def params(self):
        return self.row.request.sampling_params


def _ban_end_tokens(rows: list[SamplingRow], logits: torch.Tensor) -> torch.Tensor:
    """End tokens cannot be sampled before min_tokens (logprobs stay raw)."""
    banned = [
        (row.logits_start + i, token)
        for row in rows
        for i in range(1 + len(row.drafts))
        if row.row.request.num_output_tokens + i < row.params.min_tokens
        for token in row.params.end_token_ids()
    ]
    if not banned:
        return logits
    index = torch.tensor(banned, device=logits.device).unbind(1)
    return logits.index_put(index, logits.new_tensor(float("-inf")))


def sample_step(
    rows: list[SamplingRow], logits: torch.Tensor, default_generator: torch.Generator | None
) -> tuple[list[list[int]], list[list[TokenLogprobs] | None]]:
    """Tokens emitted per row and, for rows that want them, their logprobs."""
    device = logits.device
    vocab = logits.shape[-1]
    candidates = _ban_end_tokens(rows, logits)
    emitted: list[list[int]] = [[] for _ in rows]

    plain = [i for i, r in enumerate(rows) if not r.drafts]
    if plain:
        batch = SamplingBatch.build([rows[i].params for i in plain],
                                    [rows[i].generator for i in plain], vocab, device)
        starts = torch.tensor([rows[i].logits_start for i in plain], device=device)
        tokens = sample(candidates.index_select(0, starts), batch, default_generator).tolist()
        for i, token in zip(plain, tokens, strict=True):
            emitted[i] = [token]

    greedy_argmax = None
    for i, row in enumerate(rows):
        if not row.drafts:
            continue
        span = slice(row.logits_start, row.logits_start + len(row.drafts) + 1)
        if row.params.greedy:
            if greedy_argmax is None:
                greedy_argmax = candidates.argmax(dim=-1).tolist()
            emitted[i] = greedy_accept(greedy_argmax[span], row.drafts)
            continue
        span_len = len(row.drafts) + 1
        batch = SamplingBatch.build([row.params] * span_len, [None] * span_len, vocab, device)
        target_probs = apply_filters(candidates[span], batch)
        draft_probs = row.draft_probs
        if draft_probs is None:  # drafts without a distribution: q is one-hot on them
            draft_probs = torch.nn.functional.one_hot(
                torch.tensor(row.drafts, device=device), vocab
            ).to(target_probs.dtype)
        emitted[i] = rejection_accept(
            target_probs, draft_probs[: len(row.drafts)], row.drafts,
            row.generator if row.generator is not None else default_generator,
        )
    return emitted, _logprobs(rows, logits, emitted)


def _logprobs(rows, logits, emitted) -> list[list[TokenLogprobs] | None]:
    wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    result: list[list[TokenLogprobs] | None] = [None] * len(rows)
    if not wanted:
        return result
    positions = [rows[i].logits_start + j for i in wanted for j in range(len(emitted[i]))]
    tokens = [t for i in wanted for t in emitted[i]]
    num_top = max(rows[i].params.logprobs for i in wanted)
    entries = compute_logprobs(
        logits.index_select(0, torch.tensor(positions, device=logits.device)),
        torch.tensor(tokens, device=logits.device), num_top,
    ).to_lists()
    offset = 0
    for i in wanted:
        top_n = rows[i].params.logprobs
        result[i] = [
            (token, logprob, rank, top[:top_n])
            for token, (logprob, rank, top) in zip(
                emitted[i], entries[offset : offset + len(emitted[i])], strict=True
            )
        ]
        offset += len(emitted[i])
    return result
