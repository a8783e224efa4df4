"""Token sampling (greedy, temperature, top-k, top-p, min-p) and logprobs.

Every random number comes from :mod:`tandem.layers.keyed_random`: a row's draw is a function
of its request's seed, the position of the token it draws and the draw's kind, so a request
samples the same tokens alone or in any batch. Logprobs are always the raw ``log_softmax`` of
the model's logits, before any temperature or filtering, as vLLM returns them by default.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.layers.argmax import argmax_rows
from tandem.layers.keyed_random import TOKEN, keyed_exponential
from tandem.layers.sampling_kernels import filter_threshold


@dataclass
class SamplingBatch:
    """Per-row sampling parameters of one step, as device tensors (the worker builds it
    from requests' parameters: ``tandem.worker.step_sampler.sampling_batch``)."""

    temperature: torch.Tensor  # [N] fp32, 1.0 on greedy rows (unused there)
    greedy: torch.Tensor  # [N] bool
    top_k: torch.Tensor | None  # [N] long, vocab size where disabled; None if unused
    top_p: torch.Tensor | None  # [N] fp32; None if unused
    min_p: torch.Tensor | None  # [N] fp32; None if unused
    # [N] long: each row's 63-bit key seed (keyed_random); None where nothing is drawn.
    seeds: torch.Tensor | None
    all_greedy: bool


def apply_filters(
    logits: torch.Tensor, batch: SamplingBatch, use_triton: bool | None = None
) -> torch.Tensor:
    """The distribution each row samples from, in fp32: ``p = softmax(logits / T)``, then
    the tokens that every active filter keeps, renormalized. Each filter keeps the tokens
    with ``p >= t`` for a per-row threshold t, so the result does not depend on the order
    of the vocabulary, and tokens tied at a boundary are all kept or all dropped:

    - top-k: t is the k-th largest p.
    - top-p (on the top-k set, renormalized): t is the largest value whose mass of
      ``{p >= t}`` within the top-k set reaches ``top_p`` times the set's mass. Without ties
      this is the smallest prefix of the sorted tokens that covers top_p; top_p = 1 keeps all.
    - min-p: t is ``min_p * max(p)``.

    The thresholds come from :func:`filter_threshold` (a search over the row where it runs
    as a kernel, no sort); the top-p cut-off at an exact tie of mass and ``top_p`` may
    depend on summation order."""
    probs = (logits.float() / batch.temperature[:, None]).softmax(dim=-1)
    if batch.top_k is None and batch.top_p is None and batch.min_p is None:
        return probs
    threshold = filter_threshold(probs, batch.top_k, batch.top_p, batch.min_p, use_triton)
    kept = probs.masked_fill(probs < threshold[:, None], 0.0)
    # A row whose filters are all off (threshold 0) keeps ``probs`` bit for bit, so a row
    # gets the same distribution whichever filters the other rows of its batch use.
    return torch.where(threshold[:, None] > 0, kept / kept.sum(dim=-1, keepdim=True), probs)


def sample(logits: torch.Tensor, batch: SamplingBatch, positions: torch.Tensor) -> torch.Tensor:
    """One token per row: argmax on greedy rows, an exact draw from the filtered
    distribution elsewhere, keyed by the row's seed and ``positions`` [N] (long, on the
    device: the position of the token each row draws)."""
    greedy_tokens = argmax_rows(logits)
    if batch.all_greedy:
        return greedy_tokens
    sampled = draw(apply_filters(logits, batch), batch.seeds, positions, TOKEN)
    return torch.where(batch.greedy, greedy_tokens, sampled)


def draw(
    probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, kind: int
) -> torch.Tensor:
    """One exact draw per row of (not necessarily normalized) distributions ``probs`` [R, V]
    by :func:`race`, its noise keyed by (seeds[r], positions[r], ``kind``): the same row
    draws the same token alone or in any batch."""
    width = race_width(probs.shape[1])
    return race(probs, keyed_exponential(seeds, positions, kind, width))


def race_width(vocab_size: int) -> int:
    """The number of exponentials that :func:`race` takes per row over ``vocab_size``
    tokens: one per block of tokens, then one per token of a block."""
    block = _race_block(vocab_size)
    return -(-vocab_size // block) + block


def race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """One exact draw per row of ``probs`` [R, V] (not necessarily normalized) from
    independent standard exponentials ``noise`` [R, race_width(V)], in two exponential
    races: among the blocks of B consecutive tokens (B the power of two at or above
    sqrt(V)) weighted by their mass (the first V / B columns of noise), then among the
    chosen block's tokens (the next B columns). A token is drawn with probability
    mass_b / total * p_i / mass_b = p_i / total (the masses summed in fp64), from about
    2 sqrt(V) random numbers instead of V."""
    rows, vocab = probs.shape
    block = _race_block(vocab)
    num_blocks = -(-vocab // block)
    padded = torch.nn.functional.pad(probs, (0, num_blocks * block - vocab))
    blocks = padded.view(rows, num_blocks, block)
    chosen = _race_max(blocks.sum(dim=-1, dtype=torch.float64), noise[:, :num_blocks])
    inside = blocks.gather(1, chosen.view(rows, 1, 1).expand(rows, 1, block)).squeeze(1)
    return chosen * block + _race_max(inside, noise[:, num_blocks : num_blocks + block])


def _race_block(vocab_size: int) -> int:
    block = 1
    while block * block < vocab_size:
        block *= 2
    return block


def _race_max(weights: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Per row the index maximizing weights / noise (an exact draw for exponential noise)."""
    # Zero noise cannot come from keyed_exponential, but never let it lift a zero weight.
    return torch.where(weights > 0, weights / noise, -1.0).argmax(dim=-1)


@dataclass
class LogprobsTensors:
    """Logprobs of chosen tokens and the top-N alternatives, per row."""

    token_logprobs: torch.Tensor  # [N]
    ranks: torch.Tensor  # [N] 1 = most likely
    top_ids: torch.Tensor  # [N, num_top]
    top_logprobs: torch.Tensor  # [N, num_top]

    def tensors(self) -> list[torch.Tensor]:
        """The four tensors, in the order :meth:`from_host` takes them back."""
        return [self.token_logprobs, self.ranks, self.top_ids, self.top_logprobs]

    @staticmethod
    def from_host(lists: list[list]) -> list[tuple[float, int, list[tuple[int, float]]]]:
        """Per row (logprob, rank, top pairs), from the host copies of :meth:`tensors`."""
        token_logprobs, ranks, top_ids, top_logprobs = lists
        return [
            (token_logprobs[i], ranks[i], list(zip(top_ids[i], top_logprobs[i], strict=True)))
            for i in range(len(ranks))
        ]


def compute_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_top: int
) -> LogprobsTensors:
    """Raw log_softmax logprob and rank of ``token_ids`` and the ``num_top`` best tokens."""
    logprobs = logits.float().log_softmax(dim=-1)
    token_logprobs = logprobs.gather(1, token_ids[:, None]).squeeze(1)
    ranks = (logprobs > token_logprobs[:, None]).sum(dim=-1) + 1
    top = logprobs.topk(num_top, dim=-1) if num_top > 0 else None
    empty = logprobs.new_empty((logprobs.shape[0], 0))
    return LogprobsTensors(
        token_logprobs=token_logprobs,
        ranks=ranks,
        top_ids=top.indices if top is not None else empty.long(),
        top_logprobs=top.values if top is not None else empty,
    )
