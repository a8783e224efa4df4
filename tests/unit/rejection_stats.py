"""Shared by the rejection sampling tests (``test_verification.py``, ``test_rejection_batch.py``):
a synthetic "model" over a vocab of 8 whose target distribution p_j at output position j does
not depend on earlier tokens, so every emitted token j (over the trials that reach it) must
be distributed as p_j; and the chi-square goodness-of-fit check at significance 0.001."""

from __future__ import annotations

import torch

V = 8
TRIALS = 20_000

# Chi-square critical values at significance 0.001, by degrees of freedom (standard table).
CHI2_CRITICAL_0001 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}


def dist(values: list[float]) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.float32)
    assert t.shape == (V,) and abs(float(t.sum()) - 1.0) < 1e-6
    return t


# Target p_j per output position (k + 1 = 4 of them) and draft q_j per draft position.
# q puts mass where p is 0 (q0[6], q1[4]) and p where q is 0 (p0[5], p1[1], p2[0..1]);
# acceptance rates sum(min(p, q)) are 0.5, 0.6, 0.5.
P = torch.stack(
    [
        dist([0.30, 0.20, 0.15, 0.10, 0.10, 0.15, 0.00, 0.00]),
        dist([0.05, 0.05, 0.40, 0.20, 0.00, 0.10, 0.10, 0.10]),
        dist([0.10, 0.10, 0.10, 0.30, 0.10, 0.10, 0.10, 0.10]),
        dist([0.05, 0.15, 0.25, 0.00, 0.25, 0.15, 0.10, 0.05]),
    ]
)
Q = torch.stack(
    [
        dist([0.10, 0.30, 0.05, 0.05, 0.20, 0.00, 0.30, 0.00]),
        dist([0.20, 0.00, 0.20, 0.20, 0.25, 0.05, 0.05, 0.05]),
        dist([0.00, 0.00, 0.05, 0.05, 0.10, 0.10, 0.30, 0.40]),
    ]
)


def position_counts(emitted: list[list[int]], j: int) -> torch.Tensor:
    tokens = [e[j] for e in emitted if len(e) > j]
    return torch.bincount(torch.tensor(tokens, dtype=torch.long), minlength=V)


def goodness_of_fit(counts: torch.Tensor, p: torch.Tensor) -> tuple[bool, str]:
    """(fits, why) for observed ``counts`` against ``p`` at significance 0.001: categories
    with p == 0 must never occur; the rest (expected counts >= 5) give the statistic, with
    df = number of categories with p > 0, minus 1."""
    n = int(counts.sum())
    assert n > 0
    impossible = [t for t in range(V) if p[t] == 0 and counts[t] > 0]
    if impossible:
        return False, f"tokens {impossible} with p = 0 were emitted ({counts.tolist()})"
    support = [t for t in range(V) if p[t] > 0]
    expected = {t: n * float(p[t]) for t in support}
    # The distributions here keep every expected count >= 5; the check would be invalid
    # otherwise (categories would have to be merged).
    assert min(expected.values()) >= 5, f"too few samples ({n}) for a chi-square test"
    stat = sum((float(counts[t]) - e) ** 2 / e for t, e in expected.items())
    df = len(support) - 1
    critical = CHI2_CRITICAL_0001[df]
    return stat <= critical, f"chi2 = {stat:.2f} (df {df}, critical {critical}), n = {n}"


def check_all_positions(emitted, p: torch.Tensor, k: int) -> None:
    for j in range(k + 1):
        fits, why = goodness_of_fit(position_counts(emitted, j), p[j])
        assert fits, f"emitted token {j} is not distributed as p_{j}: {why}"
