"""Draft verification of one request: greedy prefix matching, and rejection sampling, whose
emitted tokens must follow the target's distribution exactly whatever the drafts were (DESIGN
invariant 2), with its edge cases.

The statistical tests use the synthetic "model" of ``verification_stats.py`` (a vocab of 8
whose target distribution p_j at output position j does not depend on earlier tokens), so
every emitted token j must be distributed as p_j. Each is checked by a chi-square
goodness-of-fit test at significance 0.001 with a fixed seed; negative controls show that the
same check rejects a verifier without the residual correction."""

from __future__ import annotations

import pytest
import torch
from verification_stats import (
    TRIALS,
    P,
    Q,
    V,
    check_all_positions,
    goodness_of_fit,
    position_counts,
    run_trials,
)

from tandem.worker.spec_decode import verification
from tandem.worker.spec_decode.verification import exact_draw, greedy_verify, rejection_verify


def greedy_accept(target_tokens: list[int], draft_tokens: list[int]) -> list[int]:
    """The tokens :func:`greedy_verify` emits, as a host list."""
    target = torch.tensor(target_tokens, dtype=torch.long)
    accepted = greedy_verify(target, torch.tensor(draft_tokens, dtype=torch.long))
    return target_tokens[: int(accepted) + 1]


def rejection_accept(p, q, drafts: list[int], generator) -> list[int]:
    """The tokens :func:`rejection_verify` emits for one request, as a host list."""
    accepted, candidates = rejection_verify(p, q, torch.tensor(drafts, dtype=torch.long), generator)
    return candidates[: int(accepted) + 1].tolist()


def sample_from(probs: torch.Tensor, generator) -> int:
    """One :func:`exact_draw` from a single distribution."""
    return int(exact_draw(probs[None], generator)[0])


# ---- greedy --------------------------------------------------------------------------------


def test_greedy_all_accepted_adds_bonus():
    assert greedy_accept([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]


@pytest.mark.parametrize("mismatch", [0, 1, 2])
def test_greedy_stops_at_first_mismatch(mismatch):
    target = [5, 6, 7, 8]
    drafts = [5, 6, 7]
    drafts[mismatch] = 99
    assert greedy_accept(target, drafts) == target[: mismatch + 1]


def test_greedy_later_agreement_after_mismatch_is_ignored():
    assert greedy_accept([1, 2, 3, 4], [1, 9, 3]) == [1, 2]


def test_greedy_without_drafts_emits_target_token():
    assert greedy_accept([42], []) == [42]


# ---- rejection sampling: exactness (DESIGN invariant 2) --------------------------------------


@pytest.mark.parametrize("k", [1, 3])
def test_invariant_rejection_sampling_keeps_target_distribution(k):
    p, q = P[[*range(k), 3]], Q[:k]  # the bonus position always uses p_3
    emitted = run_trials(rejection_accept, p, q, TRIALS, seed=k)
    assert all(1 <= len(e) <= k + 1 for e in emitted)
    check_all_positions(emitted, p, k)
    # Acceptance of the first draft is sum(min(p0, q0)) = 0.5 (5 sigma of a binomial).
    rate = sum(len(e) > 1 for e in emitted) / TRIALS
    assert abs(rate - 0.5) < 5 * (0.25 / TRIALS) ** 0.5


def test_invariant_rejection_sampling_no_drafts_samples_from_p():
    emitted = run_trials(rejection_accept, P[:1], Q[:0], 5_000)
    assert all(len(e) == 1 for e in emitted)
    check_all_positions(emitted, P[:1], 0)


def _always_accept(p, q, drafts, generator):
    """Broken: emits the raw drafts and the bonus, never rejecting."""
    return [*drafts, sample_from(p[len(drafts)], generator)]


def _replacement_from_p(p, q, drafts, generator):
    """Broken: the right acceptance test, but the replacement is drawn from p instead of
    normalize(max(p - q, 0))."""
    emitted = []
    for i, draft in enumerate(drafts):
        if torch.rand((), generator=generator) * q[i, draft] <= p[i, draft]:
            emitted.append(draft)
            continue
        emitted.append(sample_from(p[i], generator))
        return emitted
    emitted.append(sample_from(p[len(drafts)], generator))
    return emitted


@pytest.mark.parametrize("broken", [_always_accept, _replacement_from_p])
def test_invariant_rejection_sampling_check_rejects_verifier_without_residual_correction(broken):
    """Negative control: the goodness-of-fit check above can fail."""
    emitted = run_trials(broken, P, Q, TRIALS // 2, seed=7)
    fits, why = goodness_of_fit(position_counts(emitted, 0), P[0])
    assert not fits, f"the check failed to reject {broken.__name__}: {why}"


# ---- rejection sampling: edge cases --------------------------------------------------------


def test_draft_equal_to_target_is_always_accepted():
    k = 3
    p = P
    q = P[:k].clone()
    emitted = run_trials(rejection_accept, p, q, 5_000, seed=3)
    assert all(len(e) == k + 1 for e in emitted)  # acceptance rate exactly 1
    check_all_positions(emitted, p, k)


def test_one_hot_drafts_keep_target_distribution():
    """Drafts without a distribution are verified against a one-hot q (as the step sampler
    does): draft i is accepted with probability p_i(d_i), and the output is still p."""
    k = 2
    drafts = [2, 3]  # p0[2] = 0.15, p1[3] = 0.2
    p = P[[0, 1, 3]]
    q = torch.nn.functional.one_hot(torch.tensor(drafts), V).float()
    emitted = run_trials(rejection_accept, p, q, TRIALS, seed=11)
    check_all_positions(emitted, p, k)
    rate = sum(len(e) > 1 for e in emitted) / TRIALS
    expected = float(p[0, 2])
    assert abs(rate - expected) < 5 * (expected * (1 - expected) / TRIALS) ** 0.5


def test_one_hot_draft_with_zero_target_probability_is_always_rejected():
    p = P[[0, 3]]
    q = torch.nn.functional.one_hot(torch.tensor([6]), V).float()  # p0[6] = 0
    emitted = run_trials(rejection_accept, p, q, 5_000, seed=5)
    assert all(len(e) == 1 for e in emitted)
    check_all_positions(emitted, p, 0)  # the replacement is p0 itself


def test_residual_fallback_when_target_never_exceeds_draft():
    """If max(p - q, 0) is all zero (p == q up to rounding), a rejection still emits a draw
    from p rather than failing or emitting a token outside p's support."""
    q = P[:1].clone()
    p = torch.cat([q * 0.5, P[3:4]])  # p <= q everywhere: residual is empty
    emitted = run_trials(rejection_accept, p, q, 2_000, seed=9)
    rejected = [e for e in emitted if len(e) == 1]
    assert 0.4 < len(rejected) / len(emitted) < 0.6
    assert all(p[0, e[0]] > 0 for e in rejected)


def test_zero_probability_draft_rejected_even_when_uniform_is_zero(monkeypatch):
    """torch.rand can return exactly 0.0 (probability 2**-24 per float32 draw). A draft
    whose target probability is 0 (e.g. filtered by top-k/top-p, or a banned end token)
    must still be rejected: with ``u * q <= p`` it is accepted when u == 0."""
    monkeypatch.setattr(verification.torch, "rand", lambda *args, **kwargs: torch.tensor(0.0))
    p = P[[0, 3]]
    q = Q[:1]  # q0[6] = 0.3 while p0[6] = 0
    emitted = rejection_accept(p, q, [6], torch.Generator().manual_seed(0))
    assert p[0, emitted[0]] > 0, f"emitted token 6, which has target probability 0: {emitted}"


def test_sample_from_never_picks_zero_probability_token_on_zero_noise(monkeypatch):
    """CPU ``exponential_`` can return exactly 0 (pytorch/pytorch#22557, about 2**-53 per
    element); probs / noise is then 0 / 0 = NaN, which argmax picks. A zero-probability
    token must never be drawn."""
    original = torch.Tensor.exponential_

    def zero_first(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self[0] = 0.0
        return self

    monkeypatch.setattr(torch.Tensor, "exponential_", zero_first)
    probs = torch.tensor([0.0, 0.5, 0.5, 0.0])
    assert sample_from(probs, torch.Generator().manual_seed(0)) in (1, 2)


def test_sample_from_matches_distribution():
    probs = torch.tensor([0.0, 1.0, 2.0, 0.0, 4.0, 1.0, 0.0, 0.0])  # unnormalized
    generator = torch.Generator().manual_seed(1)
    tokens = [sample_from(probs, generator) for _ in range(8_000)]
    counts = torch.bincount(torch.tensor(tokens), minlength=V)
    fits, why = goodness_of_fit(counts, probs / probs.sum())
    assert fits, why
