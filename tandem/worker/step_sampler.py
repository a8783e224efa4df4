"""Sampling for one step, all on the device: plain rows draw one token; rows with drafts
verify them (greedy prefix match, or rejection sampling at temperature > 0, each kind for
all its rows at once) and emit 1 to k + 1 tokens. Every emitted token's logprob comes from
the target's raw logits at its own position. Nothing is read back here; the model runner
copies the results in one go.

Random numbers are keyed by (request seed, position of the token drawn, draw kind)
(:mod:`tandem.layers.keyed_random`): a plain row drawing the token at position t and a row
with drafts whose draw at t is a residual or bonus draw use the same TOKEN noise of t."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.device_copy import to_device
from tandem.layers.argmax import argmax_rows
from tandem.layers.logit_adjustments import AdjustedRow, adjust_logits
from tandem.layers.sampler import (
    LogprobsTensors,
    SamplingBatch,
    apply_filters,
    compute_logprobs,
    sample,
)
from tandem.sampling_params import SamplingParams
from tandem.worker.grammars import allowed_tokens
from tandem.worker.spec_decode.verification import (
    RejectionLayout,
    rejection_randoms,
    rejection_verify_batch,
    row_starts,
)


@dataclass
class SamplingRow:
    """A request that samples this step; its logits rows are consecutive from
    ``logits_start``: the last known token, then one per draft. ``position`` is the position
    of the first token the row draws (its last known token's position + 1; None where only
    the device knows it: ``sample_step`` then takes ``positions``)."""

    logits_start: int
    num_drafts: int
    params: SamplingParams
    seed: int  # the request's 63-bit key seed (keyed_random.request_seed)
    position: int | None
    num_output_tokens: int  # before this step (for min_tokens)
    draft_probs: torch.Tensor | None = None  # [num_drafts, V] when the drafts were sampled
    # The prompt's and the output's tokens before this step (host lists), for a request
    # whose parameters adjust its logits (``SamplingParams.adjusts_logits``).
    history: tuple[list[int], list[int]] | None = None
    # Structured output: [1 + num_drafts, W] int32 token bitmasks (host), one per position.
    token_masks: torch.Tensor | None = None


def sampling_batch(
    params: list[SamplingParams],
    seeds: torch.Tensor | None,
    vocab_size: int,
    device: torch.device,
) -> SamplingBatch:
    """The device tensors of ``params`` (one row each), with the rows' key ``seeds`` [N]
    (None where the batch only filters)."""
    greedy = [p.greedy for p in params]
    # A top_k beyond the vocabulary keeps every token: clamped, so it never overflows a kernel.
    top_k = [min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params]
    top_p = [p.top_p for p in params]
    min_p = [p.min_p for p in params]
    sampled_rows = [i for i, g in enumerate(greedy) if not g]

    def uses(values: list, off: float) -> bool:
        return any(values[i] != off for i in sampled_rows)

    temperature = [1.0 if g else p.temperature for g, p in zip(greedy, params, strict=True)]
    return SamplingBatch(
        temperature=to_device(temperature, torch.float32, device),
        greedy=to_device(greedy, torch.bool, device),
        top_k=to_device(top_k, torch.long, device) if uses(top_k, vocab_size) else None,
        top_p=to_device(top_p, torch.float32, device) if uses(top_p, 1.0) else None,
        min_p=to_device(min_p, torch.float32, device) if uses(min_p, 0.0) else None,
        seeds=seeds,
        all_greedy=not sampled_rows,
    )


@dataclass
class StepSample:
    """Device results of one step's sampling.

    ``candidates[j]`` is the token at logits row j: a row emits its first
    ``num_emitted[i]`` candidates. Logprobs cover ``logprob_rows`` (the logits rows of the
    requests that asked for logprobs), each for its candidate token."""

    candidates: torch.Tensor  # [num logits rows] long
    num_emitted: torch.Tensor  # [num sampling rows] long
    logprob_rows: list[int]
    logprobs: LogprobsTensors | None


def _ban_end_tokens(rows: list[SamplingRow], logits: torch.Tensor) -> torch.Tensor:
    """End tokens cannot be sampled before min_tokens (logprobs stay raw)."""
    banned = [
        (row.logits_start + i, token)
        for row in rows
        for i in range(1 + row.num_drafts)
        if row.num_output_tokens + i < row.params.min_tokens
        for token in row.params.end_token_ids()
    ]
    if not banned:
        return logits
    index = to_device(banned, torch.long, logits.device).unbind(1)
    return logits.index_put(
        index, torch.full((), float("-inf"), device=logits.device, dtype=logits.dtype)
    )


def _adjusted_rows(rows: list[SamplingRow]) -> list[AdjustedRow]:
    """The rows whose logits a bias or a penalty adjusts (each must carry its history)."""
    adjusted = []
    for row in rows:
        if row.params.adjusts_logits:
            if row.history is None:
                raise ValueError("sample_step: a row with a bias or penalty has no history")
            adjusted.append(
                AdjustedRow.of(row.logits_start, row.num_drafts, row.params, *row.history)
            )
    return adjusted


def _apply_token_masks(
    rows: list[SamplingRow], filtered: torch.Tensor, raw: torch.Tensor
) -> torch.Tensor:
    """Tokens a grammar forbids get -inf (a copy: the raw logits stay for logprobs)."""
    masked = [row for row in rows if row.token_masks is not None]
    if not masked:
        return filtered
    if filtered is raw:
        filtered = raw.clone()
    index = to_device(
        [r.logits_start + j for r in masked for j in range(1 + r.num_drafts)],
        torch.long,
        raw.device,
    )
    bitmask = torch.cat([r.token_masks[: 1 + r.num_drafts] for r in masked])
    allowed = allowed_tokens(bitmask.to(raw.device, non_blocking=True), raw.shape[-1])
    rows_logits = filtered.index_select(0, index).masked_fill(~allowed, float("-inf"))
    filtered.index_copy_(0, index, rows_logits)
    return filtered


def _greedy_accepted(
    rows: list[SamplingRow], argmax: torch.Tensor, row_tokens: torch.Tensor
) -> torch.Tensor:
    """Accepted drafts of greedy rows with drafts, all rows at once (padded to max k)."""
    k = max(r.num_drafts for r in rows)
    targets, drafts, valid = [], [], []
    for row in rows:
        last = row.logits_start + row.num_drafts
        targets.append([min(row.logits_start + i, last) for i in range(k)])
        drafts.append([min(row.logits_start + 1 + i, last) for i in range(k)])
        valid.append([i < row.num_drafts for i in range(k)])
    device = argmax.device
    agree = (
        argmax[to_device(targets, torch.long, device)]
        == row_tokens[to_device(drafts, torch.long, device)]
    )
    agree &= to_device(valid, torch.bool, device)
    return agree.long().cumprod(dim=1).sum(dim=1)


def _rejection_sample(
    rows: list[SamplingRow],
    logits: torch.Tensor,
    row_tokens: torch.Tensor,
    seeds: torch.Tensor,
    first_positions: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rejection sampling of all sampled rows with drafts at once (their key ``seeds`` and
    ``first_positions`` on the device); returns (accepted drafts per row, candidate tokens,
    the logits rows they belong to)."""
    device, vocab = logits.device, logits.shape[-1]
    num_drafts = [r.num_drafts for r in rows]
    logits_rows = [r.logits_start + j for r in rows for j in range(r.num_drafts + 1)]
    # The draft checked at each position is the next row's input (unused at the last one).
    next_rows = [
        r.logits_start + min(j + 1, r.num_drafts) for r in rows for j in range(r.num_drafts + 1)
    ]
    index = to_device(logits_rows, torch.long, device)
    batch = sampling_batch(
        [r.params for r in rows for _ in range(r.num_drafts + 1)],
        None,
        vocab,
        device,
    )
    target_probs = apply_filters(logits.index_select(0, index), batch)
    draft_tokens = row_tokens[to_device(next_rows, torch.long, device)]
    draft_probs = torch.zeros_like(target_probs)
    starts = row_starts(num_drafts)
    sampled = [
        (start, r) for start, r in zip(starts[:-1], rows, strict=True) if r.draft_probs is not None
    ]
    if sampled:
        positions = [start + j for start, r in sampled for j in range(r.num_drafts)]
        draft_probs.index_copy_(
            0,
            to_device(positions, torch.long, device),
            torch.cat([r.draft_probs[: r.num_drafts] for _, r in sampled]).to(draft_probs.dtype),
        )
    # Drafts without a distribution: q is one-hot on them.
    one_hot = [
        start + j
        for start, r in zip(starts[:-1], rows, strict=True)
        if r.draft_probs is None
        for j in range(r.num_drafts)
    ]
    if one_hot:
        positions = to_device(one_hot, torch.long, device)
        draft_probs.index_put_((positions, draft_tokens[positions]), torch.ones((), device=device))
    uniforms, noise = rejection_randoms(seeds, first_positions, num_drafts, vocab)
    accepted, tokens = rejection_verify_batch(
        target_probs, draft_probs, draft_tokens, num_drafts, uniforms, noise
    )
    return accepted, tokens, index


def sample_step(
    rows: list[SamplingRow],
    logits: torch.Tensor,
    row_tokens: torch.Tensor,
    positions: torch.Tensor | None = None,
) -> StepSample:
    """Sample and verify every row. ``row_tokens[j]`` is the input token at logits row j (so
    a row's drafts are ``row_tokens[start + 1 : start + 1 + num_drafts]``). ``positions``
    [len(rows)] (long, on the device), when given, are the rows' first drawn positions in
    place of their ``position``."""
    device = logits.device
    vocab = logits.shape[-1]
    filtered = adjust_logits(_ban_end_tokens(rows, logits), _adjusted_rows(rows), row_tokens)
    filtered = _apply_token_masks(rows, filtered, logits)
    candidates = argmax_rows(filtered)
    num_emitted = torch.ones(len(rows), dtype=torch.long, device=device)

    plain = [i for i, r in enumerate(rows) if not r.num_drafts and not r.params.greedy]
    drafted = [i for i, r in enumerate(rows) if r.num_drafts and not r.params.greedy]
    seeds = first_positions = None
    if plain or drafted:
        seeds = to_device([r.seed for r in rows], torch.long, device)
        first_positions = positions if positions is not None else _host_positions(rows, device)

    if plain:
        index = to_device(plain, torch.long, device)
        batch = sampling_batch(
            [rows[i].params for i in plain], seeds.index_select(0, index), vocab, device
        )
        starts = to_device([rows[i].logits_start for i in plain], torch.long, device)
        tokens = sample(
            filtered.index_select(0, starts), batch, first_positions.index_select(0, index)
        )
        candidates.index_copy_(0, starts, tokens)

    greedy = [i for i, r in enumerate(rows) if r.num_drafts and r.params.greedy]
    if greedy:
        accepted = _greedy_accepted([rows[i] for i in greedy], candidates, row_tokens)
        num_emitted.index_copy_(0, to_device(greedy, torch.long, device), accepted + 1)

    if drafted:
        index = to_device(drafted, torch.long, device)
        accepted, tokens, logits_rows = _rejection_sample(
            [rows[i] for i in drafted],
            filtered,
            row_tokens,
            seeds.index_select(0, index),
            first_positions.index_select(0, index),
        )
        candidates.index_copy_(0, logits_rows, tokens)
        num_emitted.index_copy_(0, index, accepted + 1)

    return with_logprobs(rows, logits, candidates, num_emitted)


def with_logprobs(
    rows: list[SamplingRow],
    logits: torch.Tensor,
    candidates: torch.Tensor,
    num_emitted: torch.Tensor,
) -> StepSample:
    """The step's sample, with the logprobs of every candidate of the rows that asked for
    them (from the target's raw ``logits``)."""
    logprob_rows = [
        row.logits_start + j
        for row in rows
        if row.params.logprobs is not None
        for j in range(1 + row.num_drafts)
    ]
    logprobs = None
    if logprob_rows:
        index = to_device(logprob_rows, torch.long, logits.device)
        num_top = max(r.params.logprobs for r in rows if r.params.logprobs is not None)
        logprobs = compute_logprobs(
            logits.index_select(0, index), candidates.index_select(0, index), num_top
        )
    return StepSample(candidates, num_emitted, logprob_rows, logprobs)


def sample_uniform(
    logits: torch.Tensor,
    row_tokens: torch.Tensor,
    batch: SamplingBatch,
    draft_probs: torch.Tensor,
    first_positions: torch.Tensor,
    layout: RejectionLayout,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``sample_step`` for a uniform step with no host value and no end-token ban (a CUDA
    graph records it): R rows of k drafts each, row b's logits at ``b * (k + 1)``, every row
    verified both ways and each keeping its own (``batch.greedy``). ``draft_probs``
    [R, k, V] are the drafts' distributions (read only on sampled rows), ``layout`` is
    ``RejectionLayout.of([k] * R)``. Returns (candidates [R * (k + 1)], emitted counts
    [R]): on every row what ``sample_step`` gives it (filters and random numbers are per
    row)."""
    num_rows, k = draft_probs.shape[0], draft_probs.shape[1]
    query_len = k + 1
    argmax = argmax_rows(logits)
    tokens = row_tokens.view(num_rows, query_len)
    agree = argmax.view(num_rows, query_len)[:, :k] == tokens[:, 1:]
    greedy_accepted = agree.long().cumprod(dim=1).sum(dim=1)
    per_row = SamplingBatch(
        *(
            None if t is None else t.repeat_interleave(query_len)
            for t in (batch.temperature, batch.greedy, batch.top_k, batch.top_p, batch.min_p)
        ),
        seeds=None,
        all_greedy=False,
    )
    target_probs = apply_filters(logits, per_row)
    # The draft checked at each row is the next row's input (unused at the bonus row).
    next_row = torch.arange(1, query_len + 1, device=logits.device).clamp_(max=k)
    draft_tokens = tokens[:, next_row].reshape(-1)
    flat_probs = torch.cat([draft_probs, draft_probs.new_zeros((num_rows, 1, logits.shape[-1]))], 1)
    uniforms, noise = rejection_randoms(batch.seeds, first_positions, layout, logits.shape[-1])
    accepted, sampled = rejection_verify_batch(
        target_probs, flat_probs.view(-1, logits.shape[-1]), draft_tokens, layout, uniforms, noise
    )
    candidates = torch.where(per_row.greedy, argmax, sampled)
    emitted = torch.where(batch.greedy, greedy_accepted, accepted) + 1
    return candidates, emitted


def _host_positions(rows: list[SamplingRow], device: torch.device) -> torch.Tensor:
    """The rows' first drawn positions from the host (each row must know its own)."""
    missing = [i for i, r in enumerate(rows) if r.position is None]
    if missing:
        raise ValueError(f"sample_step: rows {missing} have no position; pass positions")
    return to_device([r.position for r in rows], torch.long, device)
