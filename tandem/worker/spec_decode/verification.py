"""Draft verification on the device: greedy (longest agreeing prefix plus a bonus token) and
rejection sampling, which keeps the target distribution exactly (Leviathan et al.; Chen et
al.): :func:`rejection_verify` for one request (the reference), and
:func:`rejection_verify_batch` for every sampled request of a step at once. Nothing here
reads a value back to the host: the number of accepted drafts stays a device tensor until
the step's one device-to-host copy.

The random numbers are keyed (:mod:`tandem.layers.keyed_random`): for a request whose first
draft is for position t, draft i's acceptance uniform is ACCEPT at t + i, and the draw at
row i (the residual after a rejection of draft i, or the bonus draw at i = k) uses the TOKEN
noise at t + i, the same numbers that a plain sample at t + i uses."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.device_copy import to_device
from tandem.layers.keyed_random import ACCEPT, TOKEN, keyed_exponential, keyed_uniform
from tandem.layers.sampler import race, race_width


def greedy_verify(target_tokens: torch.Tensor, draft_tokens: torch.Tensor) -> torch.Tensor:
    """Number of accepted drafts: the length of the prefix of ``draft_tokens`` [k] that agrees
    with the target's argmax ``target_tokens`` [k + 1]. The emitted tokens are then
    ``target_tokens[: accepted + 1]`` (the agreeing drafts, then the target's own token)."""
    k = draft_tokens.shape[0]
    agree = (draft_tokens == target_tokens[:k]).long()
    return agree.cumprod(0).sum()


def rejection_verify(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    seed: int,
    first_position: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection sampling for one request; returns (accepted count, candidate tokens [k + 1]).

    ``target_probs`` [k + 1, V] are the target's (filtered) distributions at the positions of
    the last token and the k drafts; ``draft_probs`` [k, V] are the distributions the drafts
    were sampled from; the first draft is for position ``first_position``. Draft i is
    accepted with probability min(1, p(d)/q(d)); at the first rejection a token is drawn from
    normalize(max(p - q, 0)); if all pass, a bonus token is drawn from p at the last
    position. The emitted tokens are ``candidates[: accepted + 1]``. The random numbers are
    keyed by (``seed``, position) (the module docstring) and do not depend on the outcome.
    """
    k = draft_tokens.shape[0]
    device = target_probs.device
    seeds = torch.full((k + 1,), seed, dtype=torch.long, device=device)
    offsets = torch.arange(k + 1, device=device)
    positions = first_position + offsets
    uniforms = keyed_uniform(seeds[:k], positions[:k], ACCEPT, 1)[:, 0]
    index = draft_tokens[:, None]
    p = target_probs[:k].gather(1, index).squeeze(1)
    q = draft_probs.gather(1, index).squeeze(1)
    accepted = (uniforms * q < p).long().cumprod(0).sum()  # strict: p = 0 never passes
    residual = (target_probs[:k] - draft_probs).clamp_min(0)
    # p == q numerically leaves no residual mass: any draw from p is then exact.
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    residual = torch.where(empty, target_probs[:k], residual)
    noise = keyed_exponential(seeds, positions, TOKEN, race_width(target_probs.shape[1]))
    draws = race(torch.cat([residual, target_probs[k:]]), noise)
    candidates = torch.where(offsets < accepted, torch.cat([draft_tokens, draws[k:]]), draws)
    return accepted, candidates


@dataclass
class RejectionLayout:
    """The flat layout of R requests' rows in :func:`rejection_verify_batch` (request i
    owns k_i + 1 consecutive rows), as device tensors built once from the host's counts:
    a CUDA graph's replay reuses them (``RejectionLayout.of`` reads no device value)."""

    max_drafts: int
    owner: torch.Tensor  # [T] long: the request of each row
    offset: torch.Tensor  # [T] long: the row's index within its request
    is_bonus: torch.Tensor  # [T] bool: the request's last row
    padded: torch.Tensor  # [R, max k] long: row of draft j (clamped to the request's last)
    valid: torch.Tensor  # [R, max k] bool: j < k_i

    @staticmethod
    def of(num_drafts: list[int], device) -> RejectionLayout:
        """The layout of requests with ``num_drafts`` drafts each."""
        max_drafts = max(num_drafts, default=0)
        starts = row_starts(num_drafts)
        padded = [
            [start + min(j, k) for j in range(max_drafts)]
            for start, k in zip(starts[:-1], num_drafts, strict=True)
        ]
        return RejectionLayout(
            max_drafts,
            to_device(
                [i for i, k in enumerate(num_drafts) for _ in range(k + 1)], torch.long, device
            ),
            to_device([j for k in num_drafts for j in range(k + 1)], torch.long, device),
            to_device([j == k for k in num_drafts for j in range(k + 1)], torch.bool, device),
            to_device(padded, torch.long, device).view(len(num_drafts), max_drafts),
            to_device(
                [[j < k for j in range(max_drafts)] for k in num_drafts], torch.bool, device
            ).view(len(num_drafts), max_drafts),
        )


def _layout(num_drafts: list[int] | RejectionLayout, device) -> RejectionLayout:
    return (
        num_drafts
        if isinstance(num_drafts, RejectionLayout)
        else RejectionLayout.of(num_drafts, device)
    )


def rejection_randoms(
    seeds: torch.Tensor,
    first_positions: torch.Tensor,
    num_drafts: list[int] | RejectionLayout,
    vocab_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The random numbers of :func:`rejection_verify_batch` for R requests, keyed by each
    one's seed ``seeds`` [R] and the position of its first draft ``first_positions`` [R]
    (long, on the device): uniforms [R, max k] fp64 (row i uses its first k_i) and
    exponential noise [sum(k_i + 1), race_width(V)] (k_i + 1 rows per request). Each request gets
    exactly what :func:`rejection_verify` draws for it, alone or in any batch. ``num_drafts``:
    each request's k_i, or their layout."""
    device = seeds.device
    layout = _layout(num_drafts, device)
    max_drafts, owner = layout.max_drafts, layout.owner
    noise = keyed_exponential(
        seeds.index_select(0, owner),
        first_positions.index_select(0, owner) + layout.offset,
        TOKEN,
        race_width(vocab_size),
    )
    steps = torch.arange(max_drafts, device=device)
    uniforms = keyed_uniform(
        seeds[:, None].expand(-1, max_drafts).reshape(-1),
        (first_positions[:, None] + steps).reshape(-1),
        ACCEPT,
        1,
    )
    return uniforms.view(seeds.shape[0], max_drafts), noise


def rejection_verify_batch(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    num_drafts: list[int] | RejectionLayout,
    uniforms: torch.Tensor,
    noise: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rejection_verify` for R requests at once, given their random numbers (from
    :func:`rejection_randoms`); returns (accepted counts [R], candidate tokens [T]).

    Request i owns k_i + 1 consecutive rows of the flat layout (T = sum(k_i + 1)): its
    positions before each draft, then the bonus position. Per row: ``target_probs`` [T, V]
    the target's filtered distribution, ``draft_probs`` [T, V] the draft distribution and
    ``draft_tokens`` [T] the draft checked there (both ignored on bonus rows). Drafts past a
    request's own k_i are never accepted. ``num_drafts``: each request's k_i, or their
    layout. With the same random numbers, each request's
    count and k_i + 1 candidates equal :func:`rejection_verify`'s."""
    # The flat layout's maps, built on the host (no device value is read).
    layout = _layout(num_drafts, target_probs.device)
    index = draft_tokens[:, None]
    p = target_probs.gather(1, index).squeeze(1)
    q = draft_probs.gather(1, index).squeeze(1)
    passes = (uniforms * q[layout.padded] < p[layout.padded]) & layout.valid
    accepted = passes.long().cumprod(dim=1).sum(dim=1)
    residual = (target_probs - draft_probs).clamp_min(0)
    # Bonus rows draw from p itself, as do rows where p == q leaves no residual mass.
    from_target = (residual.sum(dim=-1, keepdim=True) <= 0) | layout.is_bonus[:, None]
    draws = race(torch.where(from_target, target_probs, residual), noise)
    emits_draft = layout.offset < accepted[layout.owner]
    return accepted, torch.where(emits_draft, draft_tokens, draws)


def row_starts(num_drafts: list[int]) -> list[int]:
    """The first row of each request in the flat layout of :func:`rejection_verify_batch`
    (k_i + 1 rows per request), then the total number of rows."""
    starts = [0]
    for k in num_drafts:
        starts.append(starts[-1] + k + 1)
    return starts
