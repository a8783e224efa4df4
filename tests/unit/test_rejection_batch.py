"""Batched rejection sampling (``rejection_verify_batch`` with ``rejection_randoms``): each
request of a batch gets exactly the one-request reference's tokens for its own key (seed and
first draft position), alone or in any batch, and a large batch keeps the target
distribution (DESIGN invariant 2; the synthetic model of ``rejection_stats.py``)."""

from __future__ import annotations

import random

import pytest
import torch
from rejection_stats import TRIALS, P, Q, V, check_all_positions

from tandem.layers.keyed_random import request_seed
from tandem.worker.spec_decode import verification
from tandem.worker.spec_decode.verification import rejection_verify


def _flat(p_rows, q_rows, drafts_rows):
    """The flat layout of rejection_verify_batch from per-request p [k + 1, V], q [k, V] and
    drafts [k]; the bonus rows get junk q and a junk draft, which must be ignored."""
    target = torch.cat(p_rows)
    draft = torch.cat([torch.cat([q, torch.full((1, q.shape[1]), 0.5)]) for q in q_rows])
    tokens = torch.cat([torch.cat([d, torch.tensor([1])]) for d in drafts_rows])
    return target, draft, tokens


def _random_requests(generator, num_drafts: list[int], vocab: int):
    """Per request p [k + 1, V] and q [k, V] with zeros in both, and drafts drawn from q
    (every other request's first draft has target probability 0)."""
    p_rows, q_rows, drafts_rows = [], [], []
    for index, k in enumerate(num_drafts):
        p = torch.rand((k + 1, vocab), generator=generator) ** 3
        p[p < 0.05] = 0.0
        q = torch.rand((k, vocab), generator=generator) ** 3
        q[q < 0.05] = 0.0
        if k and index % 2:
            p[0, 0], q[0, 0] = 0.0, 1.0
        p, q = p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)
        drafts = (
            torch.multinomial(q, 1, generator=generator).squeeze(1)
            if k
            else (torch.zeros(0, dtype=torch.long))
        )
        if k and index % 2:
            drafts[0] = 0
        p_rows.append(p)
        q_rows.append(q)
        drafts_rows.append(drafts)
    return p_rows, q_rows, drafts_rows


def _randoms(seeds: list[int], first_positions: list[int], num_drafts: list[int], vocab: int):
    return verification.rejection_randoms(
        torch.tensor(seeds), torch.tensor(first_positions), num_drafts, vocab
    )


def test_batch_equals_rejection_verify_row_by_row():
    """Requests of different k (0 to 3, one with q == p) at different positions in one
    batch: each gets exactly rejection_verify's count and candidates for its own key."""
    num_drafts, vocab = [3, 1, 2, 0, 3, 2], 50
    generator = torch.Generator().manual_seed(0)
    outcomes = set()
    for trial in range(25):
        p_rows, q_rows, drafts_rows = _random_requests(generator, num_drafts, vocab)
        q_rows[5] = p_rows[5][:2].clone()  # always accepted; an empty residual
        seeds = [1000 * trial + i for i in range(len(num_drafts))]
        first_positions = [17 * i + trial for i in range(len(num_drafts))]
        uniforms, noise = _randoms(seeds, first_positions, num_drafts, vocab)
        accepted, candidates = verification.rejection_verify_batch(
            *_flat(p_rows, q_rows, drafts_rows), num_drafts, uniforms, noise
        )
        starts = verification.row_starts(num_drafts)
        for i, k in enumerate(num_drafts):
            ref_accepted, ref_candidates = rejection_verify(
                p_rows[i], q_rows[i], drafts_rows[i], seeds[i], first_positions[i]
            )
            assert int(accepted[i]) == int(ref_accepted), (trial, i)
            assert torch.equal(candidates[starts[i] : starts[i + 1]], ref_candidates), (trial, i)
            outcomes.add((k, int(ref_accepted)))
    # Every count from 0 to k occurred for the requests with 3 drafts.
    assert {(3, a) for a in range(4)} <= outcomes


def test_seeded_request_same_tokens_alone_and_in_a_batch():
    """A request's randoms depend on its own key alone, wherever it sits in the batch and
    whoever shares the batch (other seeds, other positions, other draft counts)."""
    vocab = 40
    generator = torch.Generator().manual_seed(3)
    p_rows, q_rows, drafts_rows = _random_requests(generator, [2, 3, 1, 3], vocab)

    def run(order, seeds):
        num_drafts = [len(drafts_rows[i]) for i in order]
        first_positions = [40 + 3 * i for i in order]
        randoms = _randoms(seeds, first_positions, num_drafts, vocab)
        accepted, candidates = verification.rejection_verify_batch(
            *_flat(
                [p_rows[i] for i in order],
                [q_rows[i] for i in order],
                [drafts_rows[i] for i in order],
            ),
            num_drafts,
            *randoms,
        )
        starts = verification.row_starts(num_drafts)
        position = order.index(1)
        return int(accepted[position]), candidates[starts[position] : starts[position + 1]]

    for seed in range(10):
        alone = run([1], [seed])
        for order, seeds in (
            ([0, 1, 2, 3], [seed + 1, seed, 2**62 + seed, 7]),
            ([3, 2, 1], [5, seed, seed]),
            ([1, 0], [seed, seed]),
        ):
            accepted, candidates = run(order, seeds)
            assert accepted == alone[0] and torch.equal(candidates, alone[1]), (seed, order)


@pytest.mark.parametrize("k", [1, 3])
def test_invariant_rejection_sampling_batched_keeps_target_distribution(k):
    """TRIALS requests in one batch (half with k drafts, half with 2, so rows are padded),
    each keyed by a seed drawn as the engine draws unseeded requests' seeds, all at one
    position: every emitted position follows p."""
    generator = torch.Generator().manual_seed(20 + k)
    num_drafts = [k, 2] * (TRIALS // 2)
    p_of = {k: P[[*range(k), 3]], 2: P[[0, 1, 3]]}
    drafts = {
        d: torch.stack(
            [
                torch.multinomial(Q[i], TRIALS // 2, replacement=True, generator=generator)
                for i in range(d)
            ],
            1,
        )
        for d in {k, 2}
    }
    target = torch.cat([p_of[d] for d in num_drafts])
    draft = torch.cat([torch.cat([Q[:d], Q[:1]]) for d in num_drafts])
    tokens = torch.cat(
        [torch.cat([drafts[d][n // 2], torch.tensor([0])]) for n, d in enumerate(num_drafts)]
    )
    source = random.Random(k)
    seeds = [request_seed(None, source) for _ in num_drafts]
    uniforms, noise = _randoms(seeds, [300] * len(num_drafts), num_drafts, V)
    accepted, candidates = verification.rejection_verify_batch(
        target, draft, tokens, num_drafts, uniforms, noise
    )
    starts = verification.row_starts(num_drafts)
    emitted = {d: [] for d in {k, 2}}
    for n, d in enumerate(num_drafts):
        emitted[d].append(candidates[starts[n] : starts[n] + int(accepted[n]) + 1].tolist())
    for d, lists in emitted.items():
        assert all(1 <= len(e) <= d + 1 for e in lists)
        check_all_positions(lists, p_of[d], d)
        rate = sum(len(e) > 1 for e in lists) / len(lists)
        assert abs(rate - 0.5) < 5 * (0.25 / len(lists)) ** 0.5
