"""Draft verification on the device: greedy (longest agreeing prefix plus a bonus token) and
rejection sampling, which keeps the target distribution exactly (Leviathan et al.; Chen et
al.). Nothing here reads a value back to the host: the number of accepted drafts stays a
device tensor until the step's one device-to-host copy."""

from __future__ import annotations

import torch


def greedy_verify(target_tokens: torch.Tensor, draft_tokens: torch.Tensor) -> torch.Tensor:
    """Number of accepted drafts: the length of the prefix of ``draft_tokens`` [k] that agrees
    with the target's argmax ``target_tokens`` [k + 1]. The emitted tokens are then
    ``target_tokens[: accepted + 1]`` (the agreeing drafts, then the target's own token)."""
    k = draft_tokens.shape[0]
    agree = (draft_tokens == target_tokens[:k]).long()
    return agree.cumprod(0).sum()


def exact_draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One exact draw per row of (not necessarily normalized) distributions [R, V]."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    # Zero noise happens: never let it lift a zero-probability token.
    return torch.where(probs > 0, probs / noise, -1.0).argmax(dim=-1)


def rejection_verify(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection sampling for one request; returns (accepted count, candidate tokens [k + 1]).

    ``target_probs`` [k + 1, V] are the target's (filtered) distributions at the positions of
    the last token and the k drafts; ``draft_probs`` [k, V] are the distributions the drafts
    were sampled from. Draft i is accepted with probability min(1, p(d)/q(d)); at the first
    rejection a token is drawn from normalize(max(p - q, 0)); if all pass, a bonus token is
    drawn from p at the last position. The emitted tokens are ``candidates[: accepted + 1]``.
    The random numbers drawn do not depend on the outcome (k uniforms, k + 1 draws), so a
    seeded request's stream is the same however its drafts fare.
    """
    k = draft_tokens.shape[0]
    uniforms = torch.rand((k,), generator=generator, device=target_probs.device)
    index = draft_tokens[:, None]
    p = target_probs[:k].gather(1, index).squeeze(1)
    q = draft_probs.gather(1, index).squeeze(1)
    accepted = (uniforms * q < p).long().cumprod(0).sum()  # strict: p = 0 never passes
    residual = (target_probs[:k] - draft_probs).clamp_min(0)
    # p == q numerically leaves no residual mass: any draw from p is then exact.
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    residual = torch.where(empty, target_probs[:k], residual)
    draws = exact_draw(torch.cat([residual, target_probs[k:]]), generator)
    positions = torch.arange(k + 1, device=target_probs.device)
    candidates = torch.where(positions < accepted, torch.cat([draft_tokens, draws[k:]]), draws)
    return accepted, candidates
