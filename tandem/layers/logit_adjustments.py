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
            list(prompt_ids),
            list(output_ids),
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
    values = logits.index_select(0, index).float()
    counts = _output_counts(rows, row_tokens, len(targets), vocab, device)
    params = _expanded(rows)

    def column(name: str) -> torch.Tensor:
        return to_device([getattr(p, name) for p in params], torch.float32, device)[:, None]

    bias = [
        (i, token, value)
        for i, p in enumerate(params)
        for token, value in (p.logit_bias or {}).items()
    ]
    if bias:
        at_rows, at_tokens, amounts = zip(*bias, strict=True)
        values.index_put_(
            (to_device(at_rows, torch.long, device), to_device(at_tokens, torch.long, device)),
            to_device(amounts, torch.float32, device),
            accumulate=True,
        )
    if any(p.repetition_penalty != 1.0 for p in params):
        seen = counts > 0
        prompt = [(i, t) for i, r in enumerate(_expanded(rows)) for t in set(r.prompt_ids)]
        if prompt:
            seen[tuple(to_device(prompt, torch.long, device).unbind(1))] = True
        penalty = column("repetition_penalty")
        scaled = torch.where(values > 0, values / penalty, values * penalty)
        values = torch.where(seen, scaled, values)
    values = values - column("frequency_penalty") * counts
    values = values - column("presence_penalty") * (counts > 0).float()
    adjusted = logits.to(torch.float32, copy=True)
    adjusted.index_copy_(0, index, values)
    return adjusted


def _expanded(rows: list[AdjustedRow]) -> list[AdjustedRow]:
    """Each row repeated once per logits row it owns."""
    return [r for r in rows for _ in range(1 + r.num_drafts)]


def _output_counts(
    rows: list[AdjustedRow],
    row_tokens: torch.Tensor,
    num_targets: int,
    vocab: int,
    device: torch.device,
) -> torch.Tensor:
    """[num_targets, V] fp32: each adjusted logits row's output token counts (the known
    output, then the row's drafts before its position, gathered on the device)."""
    counts = torch.zeros((num_targets, vocab), dtype=torch.float32, device=device)
    known = []  # (target, token, count)
    drafted = []  # (target, index in row_tokens of a draft before it)
    target = 0
    for r in rows:
        tally = Counter(r.output_ids).items()
        for j in range(1 + r.num_drafts):
            known += [(target + j, token, n) for token, n in tally]
            drafted += [(target + j, r.logits_start + i) for i in range(1, j + 1)]
        target += 1 + r.num_drafts
    if known:
        at, tokens, n = zip(*known, strict=True)
        counts.index_put_(
            (to_device(at, torch.long, device), to_device(tokens, torch.long, device)),
            to_device(n, torch.float32, device),
        )
    if drafted:
        at, source = zip(*drafted, strict=True)
        draft_tokens = row_tokens.index_select(0, to_device(source, torch.long, device))
        counts.index_put_(
            (to_device(at, torch.long, device), draft_tokens),
            torch.ones(len(at), dtype=torch.float32, device=device),
            accumulate=True,
        )
    return counts
