"""How the MTP head picks its drafts: greedy requests take the head's argmax; sampled ones
draw from the head's filtered distribution q (their own temperature, top-k, top-p, min-p),
which rejection sampling then needs to stay exact, so q is kept with the drafts.

A sampled draft at depth d for the token at position t draws with the noise keyed by
(request seed, t, ``draft_draw(d)``) (``tandem.layers.keyed_random``), so a request drafts
the same tokens whichever path (ragged rows known to the host, or rows resolved on the
device) runs its head, alone or in any batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.layers.argmax import argmax_rows
from tandem.layers.keyed_random import draft_draw
from tandem.layers.sampler import SamplingBatch, apply_filters, draw


@dataclass
class DraftSampling:
    """The sampling of a batch of drafting rows: their parameters as device tensors, and
    the position each row's depth-0 draft is for ([rows] long, on the device; depth d
    drafts the token at ``first_positions + d``)."""

    batch: SamplingBatch
    first_positions: torch.Tensor


def draft_tokens(
    logits: torch.Tensor, sampling: DraftSampling | None, depth: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The drafts of one depth from the head's ``logits`` [rows, V] (fp32 or the model's
    dtype: the argmax and the fp32 filters are the same from either), and the
    distributions they were drawn from [rows, V] (None when every row is greedy: q is then
    one-hot on the draft)."""
    tokens = argmax_rows(logits)
    if sampling is None or sampling.batch.all_greedy:
        return tokens, None
    batch = sampling.batch
    probs = apply_filters(logits, batch)
    sampled = draw(probs, batch.seeds, sampling.first_positions + depth, draft_draw(depth))
    return torch.where(batch.greedy, tokens, sampled), probs


def one_hot_probs(drafts: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The distribution q of drafts chosen without one (deterministic drafts): one-hot on
    each draft, fp32 (``[..., V]`` for drafts ``[...]``)."""
    return torch.nn.functional.one_hot(drafts, vocab_size).float()
