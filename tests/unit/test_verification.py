"""Draft verification: greedy prefix matching, and rejection sampling, whose emitted tokens
must follow the target's distribution exactly whatever the drafts were (DESIGN invariant 2).

The statistical tests use a synthetic "model" over a vocab of 8 whose target distribution p_j
at output position j does not depend on earlier tokens, so every emitted token j (over the
trials that reach it) must be distributed as p_j (``rejection_stats.py``). Each is checked
by a chi-square goodness-of-fit test at significance 0.001 with a fixed seed; negative
controls show that the same check rejects a verifier without the residual correction. The
batched verifier's tests are in ``test_rejection_batch.py``.

The verifier's random numbers are keyed (``tandem.layers.keyed_random``): every trial is a
request with its own key (seed and first draft position), as requests are in the engine."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from rejection_stats import TRIALS, P, Q, V, check_all_positions, goodness_of_fit, position_counts

from tandem.layers import sampler
from tandem.layers.keyed_random import ACCEPT, TOKEN, keyed_uniform
from tandem.layers.sampler import draw
from tandem.worker.spec_decode import verification
from tandem.worker.spec_decode.verification import greedy_verify, rejection_verify


def greedy_accept(target_tokens: list[int], draft_tokens: list[int]) -> list[int]:
    """The tokens :func:`greedy_verify` emits, as a host list."""
    target = torch.tensor(target_tokens, dtype=torch.long)
    accepted = greedy_verify(target, torch.tensor(draft_tokens, dtype=torch.long))
    return target_tokens[: int(accepted) + 1]


def rejection_accept(p, q, drafts: list[int], key: tuple[int, int]) -> list[int]:
    """The tokens :func:`rejection_verify` emits for one request keyed (seed, first draft
    position), as a host list."""
    drafts_tensor = torch.tensor(drafts, dtype=torch.long)
    accepted, candidates = rejection_verify(p, q, drafts_tensor, *key)
    return candidates[: int(accepted) + 1].tolist()


def _key_tensors(seed: int, position: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor([seed]), torch.tensor([position])


def sample_from(probs: torch.Tensor, seed: int, position: int) -> int:
    """One keyed :func:`draw` (TOKEN noise of (seed, position)) from a single distribution."""
    return int(draw(probs[None], *_key_tensors(seed, position), TOKEN)[0])


def uniform_at(seed: int, position: int) -> float:
    """The keyed acceptance uniform of (seed, position)."""
    return float(keyed_uniform(*_key_tensors(seed, position), ACCEPT, 1)[0, 0])


Verifier = Callable[[torch.Tensor, torch.Tensor, list[int], tuple[int, int]], list[int]]


def run_trials(verify: Verifier, p: torch.Tensor, q: torch.Tensor, trials: int, seed: int = 0):
    """Each trial draws d_i ~ q_i independently and verifies them as a request of its own
    key (seed ``seed * trials + trial``, its first draft at position 100 + trial % 7);
    returns the emitted lists."""
    k = q.shape[0]
    generator = torch.Generator().manual_seed(seed)
    drafts = (
        torch.stack(
            [
                torch.multinomial(q[i], trials, replacement=True, generator=generator)
                for i in range(k)
            ],
            dim=1,
        ).tolist()
        if k
        else [[] for _ in range(trials)]
    )
    return [
        verify(p, q, d, (seed * trials + trial, 100 + trial % 7)) for trial, d in enumerate(drafts)
    ]


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


def _always_accept(p, q, drafts, key):
    """Broken: emits the raw drafts and the bonus, never rejecting."""
    seed, first = key
    return [*drafts, sample_from(p[len(drafts)], seed, first + len(drafts))]


def _replacement_from_p(p, q, drafts, key):
    """Broken: the right acceptance test, but the replacement is drawn from p instead of
    normalize(max(p - q, 0))."""
    seed, first = key
    emitted = []
    for i, draft in enumerate(drafts):
        if uniform_at(seed, first + i) * q[i, draft] <= p[i, draft]:
            emitted.append(draft)
            continue
        emitted.append(sample_from(p[i], seed, first + i))
        return emitted
    emitted.append(sample_from(p[len(drafts)], seed, first + len(drafts)))
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
    """Keyed uniforms lie in the open interval (0, 1), but the acceptance test must not
    rely on it: a draft whose target probability is 0 (e.g. filtered by top-k/top-p, or a
    banned end token) must still be rejected with u == 0 (``u * q <= p`` accepts it)."""
    monkeypatch.setattr(
        verification, "keyed_uniform", lambda seeds, *args: torch.zeros((len(seeds), 1))
    )
    p = P[[0, 3]]
    q = Q[:1]  # q0[6] = 0.3 while p0[6] = 0
    emitted = rejection_accept(p, q, [6], (0, 10))
    assert p[0, emitted[0]] > 0, f"emitted token 6, which has target probability 0: {emitted}"


def test_sample_from_never_picks_zero_probability_token_on_zero_noise(monkeypatch):
    """Keyed exponentials are never 0, but the race must not rely on it: with zero noise
    probs / noise is 0 / 0 = NaN for a zero-probability token (or block), which argmax
    picks. A zero-probability token must never be drawn."""
    monkeypatch.setattr(
        sampler, "keyed_exponential", lambda seeds, positions, kind, width: torch.zeros(1, width)
    )
    probs = torch.tensor([0.0, 0.5, 0.5, 0.0])
    assert sample_from(probs, 0, 0) in (1, 2)


def test_sample_from_matches_distribution():
    """Keyed draws over one request's positions (one seed, 8,000 positions)."""
    probs = torch.tensor([0.0, 1.0, 2.0, 0.0, 4.0, 1.0, 0.0, 0.0])  # unnormalized
    positions = torch.arange(8_000)
    tokens = draw(probs.expand(8_000, -1), torch.ones_like(positions), positions, TOKEN)
    counts = torch.bincount(tokens, minlength=V)
    fits, why = goodness_of_fit(counts, probs / probs.sum())
    assert fits, why
