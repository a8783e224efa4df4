"""Draft verification: greedy (longest agreeing prefix plus a bonus token) and rejection
sampling, which keeps the target distribution exactly (Leviathan et al.; Chen et al.)."""

from __future__ import annotations

import torch


def greedy_accept(target_tokens: list[int], draft_tokens: list[int]) -> list[int]:
    """Tokens to emit: the drafts that agree with the target's argmax, then the target's
    own token at the first disagreement (or after the last draft)."""
    emitted: list[int] = []
    for draft, target in zip(draft_tokens, target_tokens, strict=False):
        if draft != target:
            break
        emitted.append(draft)
    emitted.append(target_tokens[len(emitted)])
    return emitted


def sample_from(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One exact draw from a (not necessarily normalized) distribution over the vocab."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    # Zero noise happens: never let it lift a zero-probability token.
    return int(torch.where(probs > 0, probs / noise, -1.0).argmax())


def rejection_accept(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_tokens: list[int],
    generator: torch.Generator | None,
) -> list[int]:
    """Tokens to emit for one request.

    ``target_probs`` [k + 1, V] are the target's (filtered) distributions at the positions of
    the last token and the k drafts; ``draft_probs`` [k, V] are the distributions the drafts
    were sampled from. Draft i is accepted with probability min(1, p(d)/q(d)); at the first
    rejection a token is drawn from normalize(max(p - q, 0)); if all pass, a bonus token is
    drawn from p at the last position.
    """
    emitted: list[int] = []
    for i, draft in enumerate(draft_tokens):
        p, q = target_probs[i, draft], draft_probs[i, draft]
        u = torch.rand((), generator=generator, device=target_probs.device)
        if u * q < p:  # strict: a token with p = 0 is never accepted
            emitted.append(draft)
            continue
        residual = (target_probs[i] - draft_probs[i]).clamp_min(0)
        if residual.sum() <= 0:  # p == q numerically: any draw from p is exact
            residual = target_probs[i]
        emitted.append(sample_from(residual, generator))
        return emitted
    emitted.append(sample_from(target_probs[len(draft_tokens)], generator))
    return emitted
