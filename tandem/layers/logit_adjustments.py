"""Logit bias and the presence, frequency and repetition penalties, on the device.

As vLLM applies them: the bias is added first; then the repetition penalty divides the
positive logits (multiplies the negative ones) of every token seen in the prompt or the
output; then ``frequency_penalty * count`` and ``presence_penalty * (count > 0)`` are
subtracted, counts over the output only. A row verifying drafts adjusts the logits at each
of its positions with the output as it would be there: the known output, plus the drafts
before that position (the logits at draft position j decide only when drafts 1..j are
accepted, and then they are output). So greedy verification and rejection sampling stay
exact against the adjusted distribution. Logprobs stay the raw ones (the caller keeps the
raw logits for them).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from tandem.device_copy import to_device


@dataclass
class AdjustedRow:
    """One request's logits rows to adjust: ``1 + num_drafts`` consecutive rows from
    ``logits_start``; the prompt's and the output's known tokens (host lists) before the
    first of them; the request's bias and penalties."""

    logits_start: int
    num_drafts: int
    prompt_ids: list[int]
    output_ids: list[int]
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None

    @classmethod
    def of(cls, logits_start: int, num_drafts: int, params, prompt_ids, output_ids):
        """The row of a request whose sampling parameters are ``params`` (anything with
        SamplingParams' four fields)."""
        return cls(
            logits_start,
            num_drafts,
            prompt_ids,
            output_ids,
            params.presence_penalty,
            params.frequency_penalty,
            params.repetition_penalty,
            params.logit_bias,
        )


def adjust_logits(
    logits: torch.Tensor, rows: list[AdjustedRow], row_tokens: torch.Tensor
) -> torch.Tensor:
    """``logits`` [N, V] with ``rows``' rows adjusted (module docstring), in fp32 (a new
    tensor; the other rows keep their values). ``row_tokens[j]`` is the input token at
    logits row j, so a row's drafts are ``row_tokens[start + 1 : start + 1 + num_drafts]``
    (on the device: never read here)."""
    if not rows:
        return logits
    device, vocab = logits.device, logits.shape[-1]
    targets = [r.logits_start + j for r in rows for j in range(1 + r.num_drafts)]
    index = to_device(targets, torch.long, device)
    # Which request each adjusted logits row belongs to: per-request tensors are built once
    # and spread over the request's 1 + num_drafts rows on the device.
    owner = to_device(
        [i for i, r in enumerate(rows) for _ in range(1 + r.num_drafts)], torch.long, device
    )
    values = logits.index_select(0, index).float()
    counts = _output_counts(rows, owner, row_tokens, vocab, device)

    def column(name: str) -> torch.Tensor:
        per_request = to_device([getattr(r, name) for r in rows], torch.float32, device)
        return per_request.index_select(0, owner)[:, None]

    bias = _entries(rows, lambda r: (r.logit_bias or {}).items(), vocab, device)
    if bias is not None:
        values += bias.index_select(0, owner)
    if any(r.repetition_penalty != 1.0 for r in rows):
        seen = counts > 0
        prompt = _entries(rows, lambda r: ((t, 1.0) for t in set(r.prompt_ids)), vocab, device)
        if prompt is not None:
            seen |= prompt.index_select(0, owner) > 0
        penalty = column("repetition_penalty")
        scaled = torch.where(values > 0, values / penalty, values * penalty)
        values = torch.where(seen, scaled, values)
    values = values - column("frequency_penalty") * counts
    values = values - column("presence_penalty") * (counts > 0).float()
    adjusted = logits.to(torch.float32, copy=True)
    adjusted.index_copy_(0, index, values)
    return adjusted


def _entries(rows: list[AdjustedRow], items, vocab: int, device) -> torch.Tensor | None:
    """[len(rows), V] fp32 on the device holding ``items(row)``'s (token, value) pairs per
    request (None when there are none); only the pairs cross to the device."""
    entries = [(i, token, value) for i, r in enumerate(rows) for token, value in items(r)]
    if not entries:
        return None
    at, tokens, values = zip(*entries, strict=True)
    table = torch.zeros((len(rows), vocab), dtype=torch.float32, device=device)
    table[to_device(at, torch.long, device), to_device(tokens, torch.long, device)] = to_device(
        values, torch.float32, device
    )
    return table


def _output_counts(
    rows: list[AdjustedRow],
    owner: torch.Tensor,
    row_tokens: torch.Tensor,
    vocab: int,
    device: torch.device,
) -> torch.Tensor:
    """[adjusted rows, V] fp32: each adjusted logits row's output token counts (its
    request's known output, then the row's drafts before its position, gathered on the
    device)."""
    known = _entries(rows, lambda r: Counter(r.output_ids).items(), vocab, device)
    if known is None:
        counts = torch.zeros((owner.shape[0], vocab), dtype=torch.float32, device=device)
    else:
        counts = known.index_select(0, owner)
    drafted = []  # (adjusted row, index in row_tokens of a draft before it)
    target = 0
    for r in rows:
        for j in range(1, 1 + r.num_drafts):
            drafted += [(target + j, r.logits_start + i) for i in range(1, j + 1)]
        target += 1 + r.num_drafts
    if drafted:
        at, source = zip(*drafted, strict=True)
        draft_tokens = row_tokens.index_select(0, to_device(source, torch.long, device))
        counts.index_put_(
            (to_device(at, torch.long, device), draft_tokens),
            torch.ones(len(at), dtype=torch.float32, device=device),
            accumulate=True,
        )
    return counts
