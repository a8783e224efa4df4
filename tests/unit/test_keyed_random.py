"""Keyed randomness (``tandem.layers.keyed_random``): every random number of sampling is a
pure function of (request seed, position, draw kind, column).

- The bits equal a pure-Python reference of the hash (plain integers, no tensors), so the
  CPU and CUDA, which run the same overflow-free integer ops, agree by construction.
- Uniforms are uniform on (0, 1) and exponentials exponential (chi-square and
  Kolmogorov-Smirnov at significance 0.001), and numbers at adjacent positions, seeds,
  draw kinds and columns are independent (chi-square over a 16 x 16 grid of pairs, and
  their correlation).
- ``sample_step`` draws the same tokens for a row alone or in any batch, with or without
  drafts, whether its position comes from the host or the device; a plain sample at
  position t and a verification's residual or bonus draw at t use the same TOKEN noise.
- The worker keys unseeded requests with seeds drawn from the engine's seed.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from tandem.layers.keyed_random import (
    ACCEPT,
    MASK32,
    TOKEN,
    draft_draw,
    keyed_bits,
    keyed_exponential,
    keyed_uniform,
    request_seed,
)
from tandem.layers.sampler import draw
from tandem.sampling_params import SamplingParams
from tandem.worker.step_sampler import SamplingRow, sample_step

Z_0001 = 3.090232  # the standard normal's upper 0.001 quantile


def chi2_critical(df: int) -> float:
    """The chi-square critical value at significance 0.001 (Wilson-Hilferty; 330.5 at
    df = 255, where the table gives 330.52)."""
    h = 2 / (9 * df)
    return df * (1 - h + Z_0001 * math.sqrt(h)) ** 3


# ---- the hash against a pure-Python reference -------------------------------------------


def _mix32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & MASK32
    x ^= x >> 15
    x = (x * 0x846CA68B) & MASK32
    return x ^ (x >> 16)


def reference_bits(seed: int, position: int, draw: int, column: int) -> int:
    """The module docstring's hash, on Python integers."""
    lanes = []
    for start in (0x6A09E667, 0xBB67AE85):
        h = _mix32(start ^ draw)
        for word in (seed & MASK32, seed >> 32, position):
            h = _mix32(h ^ word)
        lanes.append(h)
    return _mix32(_mix32(column ^ lanes[0]) ^ lanes[1])


KEYS = [
    (0, 0, TOKEN),
    (1, 0, TOKEN),
    (0, 1, ACCEPT),
    (2**32 - 1, 17, draft_draw(0)),
    (2**32, 17, draft_draw(3)),
    (2**63 - 1, 2**32 - 1, MASK32),
    (0x1234_5678_9ABC_DEF0, 2**31 + 5, ACCEPT),
]
COLUMNS = [0, 1, 2, 255, 65_535, 151_935]


@pytest.mark.parametrize("seed, position, draw", KEYS)
def test_cpu_values_equal_the_pure_python_reference(seed, position, draw):
    width = COLUMNS[-1] + 1
    bits = keyed_bits(torch.tensor([seed]), torch.tensor([position]), draw, width)[0]
    uniforms = keyed_uniform(torch.tensor([seed]), torch.tensor([position]), draw, width)[0]
    noise = keyed_exponential(torch.tensor([seed]), torch.tensor([position]), draw, width)[0]
    for column in COLUMNS:
        expected = reference_bits(seed, position, draw, column)
        assert int(bits[column]) == expected, column
        u = (expected + 0.5) / 2**32
        assert float(uniforms[column]) == u  # exact in float64
        assert float(noise[column]) == pytest.approx(-math.log(u), rel=1e-6)


@pytest.mark.gpu
def test_cuda_draws_equal_the_cpu_draws_bit_for_bit():
    seeds = torch.randint(0, 2**63 - 1, (64,), generator=torch.Generator().manual_seed(1))
    positions = torch.randint(0, 2**20, (64,), generator=torch.Generator().manual_seed(2))
    cpu = keyed_bits(seeds, positions, TOKEN, 4096)
    cuda = keyed_bits(seeds.cuda(), positions.cuda(), TOKEN, 4096).cpu()
    assert torch.equal(cpu, cuda)


def test_draws_are_deterministic_and_do_not_depend_on_the_batch():
    """A row's numbers depend on its own key only: not on the other rows, their order, or
    how many columns are asked for."""
    seeds = torch.tensor([5, 2**40 + 3, 5, 0, 9])
    positions = torch.tensor([0, 8, 1, 70_000, 8])
    batch = keyed_bits(seeds, positions, TOKEN, 300)
    assert torch.equal(batch, keyed_bits(seeds, positions, TOKEN, 300))
    for row in range(len(seeds)):
        alone = keyed_bits(seeds[row : row + 1], positions[row : row + 1], TOKEN, 120)
        assert torch.equal(alone[0], batch[row, :120]), row
    order = torch.tensor([4, 2, 0, 3, 1])
    assert torch.equal(keyed_bits(seeds[order], positions[order], TOKEN, 300), batch[order])
    # Within a row the 32-bit values never repeat (a bijection of the column).
    assert all(len(set(row.tolist())) == 300 for row in batch)


def test_bad_keys_are_refused():
    with pytest.raises(ValueError, match="int64"):
        keyed_bits(torch.tensor([1.0]), torch.tensor([0]), TOKEN, 4)
    with pytest.raises(ValueError, match="one length"):
        keyed_bits(torch.tensor([1, 2]), torch.tensor([0]), TOKEN, 4)
    with pytest.raises(ValueError, match="depth"):
        draft_draw(-1)


# ---- distribution ---------------------------------------------------------------------------


def _grid(num_seeds: int, num_positions: int, draw: int = TOKEN):
    """Keys of every (seed, position) pair of a small grid, as flat tensors."""
    seeds = torch.arange(num_seeds).repeat_interleave(num_positions) * 7919 + 3
    positions = torch.arange(num_positions).repeat(num_seeds) + 11
    return seeds, positions


def _chi2_uniform(bins: torch.Tensor, num_bins: int) -> tuple[float, float]:
    counts = torch.bincount(bins.reshape(-1), minlength=num_bins).double()
    expected = counts.sum() / num_bins
    return float(((counts - expected) ** 2 / expected).sum()), chi2_critical(num_bins - 1)


def _ks(values: torch.Tensor) -> tuple[float, float]:
    """Kolmogorov-Smirnov distance of ``values`` from the uniform law on (0, 1), and the
    critical value at 0.001."""
    ordered = values.reshape(-1).sort().values
    n = ordered.numel()
    ranks = torch.arange(1, n + 1, dtype=torch.float64)
    distance = torch.maximum(ranks / n - ordered, ordered - (ranks - 1) / n).max()
    return float(distance), 1.9495 / math.sqrt(n)


def test_uniforms_are_uniform_on_the_open_interval():
    seeds, positions = _grid(64, 64)
    bits = keyed_bits(seeds, positions, ACCEPT, 128)  # 524,288 numbers
    uniforms = keyed_uniform(seeds, positions, ACCEPT, 128)
    assert float(uniforms.min()) > 0 and float(uniforms.max()) < 1
    for name, bins in (("top byte", bits >> 24), ("low byte", bits & 255)):
        stat, critical = _chi2_uniform(bins, 256)
        assert stat < critical, f"{name}: chi2 {stat:.1f} >= {critical:.1f}"
    distance, critical = _ks(uniforms[:, ::16])  # 32,768 of them
    assert distance < critical, (distance, critical)


def test_exponentials_are_exponential():
    seeds, positions = _grid(32, 32)
    noise = keyed_exponential(seeds, positions, TOKEN, 64)
    assert noise.dtype == torch.float32
    noise = noise.double()
    assert float(noise.min()) > 0 and noise.isfinite().all()
    n = noise.numel()
    assert abs(float(noise.mean()) - 1) < 5 / math.sqrt(n)  # the mean and sd are both 1
    distance, critical = _ks(1 - torch.exp(-noise))
    assert distance < critical, (distance, critical)


def _pairs(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Two uniforms per pair of keys that differ in one respect only (65,536 pairs)."""
    seeds, positions = _grid(256, 256)
    if name == "adjacent positions":
        return keyed_uniform(seeds, positions, TOKEN, 1), keyed_uniform(
            seeds, positions + 1, TOKEN, 1
        )
    if name == "adjacent seeds":
        return keyed_uniform(seeds, positions, TOKEN, 1), keyed_uniform(
            seeds + 1, positions, TOKEN, 1
        )
    if name == "seeds 2**32 apart":
        return keyed_uniform(seeds, positions, TOKEN, 1), keyed_uniform(
            seeds + 2**32, positions, TOKEN, 1
        )
    if name == "TOKEN and ACCEPT":
        return keyed_uniform(seeds, positions, TOKEN, 1), keyed_uniform(seeds, positions, ACCEPT, 1)
    if name == "adjacent draft depths":
        return keyed_uniform(seeds, positions, draft_draw(0), 1), keyed_uniform(
            seeds, positions, draft_draw(1), 1
        )
    assert name == "adjacent columns"
    row = keyed_uniform(seeds[:512], positions[:512], TOKEN, 257)
    return row[:, :-1], row[:, 1:]


@pytest.mark.parametrize(
    "name",
    [
        "adjacent positions",
        "adjacent seeds",
        "seeds 2**32 apart",
        "TOKEN and ACCEPT",
        "adjacent draft depths",
        "adjacent columns",
    ],
)
def test_numbers_of_neighbouring_keys_are_independent(name):
    first, second = (x.reshape(-1) for x in _pairs(name))
    independent, why = _independent(first, second)
    assert independent, why


def _independent(first: torch.Tensor, second: torch.Tensor) -> tuple[bool, str]:
    """(passes, why): the pairs' joint chi-square over a 16 x 16 grid at 0.001, and their
    correlation within 4.4 standard errors (p < 1e-5)."""
    n = first.numel()
    cells = (first * 16).long() * 16 + (second * 16).long()
    stat, critical = _chi2_uniform(cells, 256)
    correlation = float(torch.corrcoef(torch.stack([first, second]))[0, 1])
    why = f"joint chi2 {stat:.1f} (critical {critical:.1f}), correlation {correlation:.4f}, n {n}"
    return stat < critical and abs(correlation) * math.sqrt(n) < 4.4, why


def test_independence_check_rejects_dependent_pairs():
    """Negative control: the check above fails for uniform but weakly dependent pairs."""
    first = keyed_uniform(*_grid(256, 256), TOKEN, 1).reshape(-1)
    noise = keyed_uniform(*_grid(256, 256), ACCEPT, 1).reshape(-1)
    for second in ((first + 0.3 * noise) % 1, (first * 7 + noise / 4) % 1):
        independent, why = _independent(first, second)
        assert not independent, why


@pytest.mark.parametrize("vocab", [8, 37, 300])
def test_the_two_level_race_draws_from_p(vocab):
    """``draw`` races blocks of tokens by mass, then the chosen block's tokens: over 40,000
    keyed draws (one seed, consecutive positions) the tokens follow p, including a vocab that
    is not a multiple of the block and a block (and more) with no mass at all."""
    weights = (torch.arange(vocab) % 7 + 1).double()
    weights[: vocab // 3] = 0  # whole blocks without mass
    weights[-1] = 0
    n = 40_000 if vocab < 300 else 200_000
    positions = torch.arange(n)
    tokens = draw(weights.float().expand(n, -1), torch.full((n,), 3), positions, TOKEN)
    counts = torch.bincount(tokens, minlength=vocab).double()
    support = weights > 0
    assert counts[~support].sum() == 0
    expected = n * weights[support] / weights.sum()
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    assert stat < chi2_critical(int(support.sum()) - 1), stat


# ---- sample_step ------------------------------------------------------------------------------

VOCAB = 48


def _row(seed: int, position: int, num_drafts: int, start: int, params=None, probs=None):
    params = params or SamplingParams(temperature=0.9, top_k=30)
    return SamplingRow(start, num_drafts, params, seed, position, 0, probs)


def _request(generator, num_drafts: int):
    """Logits [k + 1, V], input tokens (last token, drafts) and draft probs [k, V]."""
    logits = 2 * torch.randn((num_drafts + 1, VOCAB), generator=generator)
    probs = (logits[:-1] + torch.randn((num_drafts, VOCAB), generator=generator)).softmax(-1)
    drafts = torch.multinomial(probs, 1, generator=generator).reshape(-1) if num_drafts else []
    return logits, torch.cat([torch.tensor([3]), torch.as_tensor(drafts, dtype=torch.long)]), probs


def _run(requests, positions_on_device=False):
    """sample_step over (seed, position, k, logits, tokens, probs, params) requests; per
    request its emitted tokens."""
    rows, start = [], 0
    for seed, position, k, _, _, probs, params in requests:
        rows.append(_row(seed, None if positions_on_device else position, k, start, params, probs))
        start += k + 1
    positions = torch.tensor([r[1] for r in requests]) if positions_on_device else None
    logits = torch.cat([r[3] for r in requests])
    result = sample_step(rows, logits, torch.cat([r[4] for r in requests]), positions)
    return [
        result.candidates[row.logits_start : row.logits_start + int(count)].tolist()
        for row, count in zip(rows, result.num_emitted, strict=True)
    ]


@pytest.mark.parametrize("num_drafts", [0, 1, 3])
def test_a_row_draws_the_same_tokens_alone_and_in_any_batch(num_drafts):
    generator = torch.Generator().manual_seed(num_drafts)
    greedy = SamplingParams(temperature=0.0)
    for seed in range(20):
        tested = (seed, 40 + seed, num_drafts, *_request(generator, num_drafts), None)
        others = [
            (seed + 1, 40 + seed, 2, *_request(generator, 2), None),  # drafted
            (seed, 41 + seed, 0, *_request(generator, 0), None),  # plain, the same seed
            (7, 3, 1, *_request(generator, 1), greedy),
            (2**62, 40 + seed, 0, *_request(generator, 0), None),
        ]
        alone = _run([tested])[0]
        for batch, index in (
            ([tested, *others], 0),
            ([*others, tested], 4),
            (others[:2] + [tested], 2),
        ):
            assert _run(batch)[index] == alone, (seed, index)
            assert _run(batch, positions_on_device=True)[index] == alone, (seed, index)


def test_residual_and_bonus_draws_use_the_plain_sample_s_noise():
    """By design the TOKEN noise of (seed, t) decides the token at t however it is drawn.
    A draft with target probability 0 is always rejected and its residual is p itself; a
    draft with target probability 1 is always accepted: the residual draw at t and the
    bonus draw after it equal a plain sample at t with the same logits."""
    generator = torch.Generator().manual_seed(9)
    params = SamplingParams(temperature=1.0)
    for seed in range(30):
        t = 100 + seed
        logits = 2 * torch.randn((2, VOCAB), generator=generator)
        last = torch.tensor([3])
        bonus = _run([(seed, t + 1, 0, logits[1:], last, None, params)])[0]
        # Rejected: the draft (token 5) has target probability 0 at t.
        banned = logits.clone()
        banned[0, 5] = float("-inf")
        drafted = torch.tensor([3, 5])
        emitted = _run([(seed, t, 1, banned, drafted, None, params)])[0]
        assert emitted == _run([(seed, t, 0, banned[:1], last, None, params)])[0], seed
        # Accepted: the target puts all its mass on the draft at t; the bonus at t + 1.
        certain = logits.clone()
        certain[0] = float("-inf")
        certain[0, 5] = 0.0
        assert _run([(seed, t, 1, certain, drafted, None, params)])[0] == [5, *bonus], seed


def test_plain_rows_keyed_by_engine_drawn_seeds_follow_the_filtered_distribution():
    """20,000 unseeded requests in one step, keyed as the worker keys them (seeds from the
    engine seed's host generator), all at one position: the tokens follow p (chi-square)."""
    logits = torch.tensor([[1.0, 0.0, 2.0, -1.0, 0.5, 1.5, -9.0, 0.2]])
    params = SamplingParams(temperature=0.7, top_k=6)
    source = random.Random(0)
    n = 20_000
    rows = [_row(request_seed(None, source), 77, 0, i, params) for i in range(n)]
    result = sample_step(rows, logits.expand(n, -1), torch.zeros(n, dtype=torch.long))
    p = (logits[0] / 0.7).softmax(-1)
    p[p < p.topk(6).values[-1]] = 0
    p /= p.sum()
    counts = torch.bincount(result.candidates, minlength=8).double()
    assert all(counts[t] == 0 for t in range(8) if p[t] == 0)
    support = p > 0
    expected = n * p[support].double()
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    assert stat < chi2_critical(int(support.sum()) - 1), (stat, counts.tolist())


# ---- the worker's seeds -----------------------------------------------------------------------


def _admit(batch, request_id: str, seed: int | None) -> int:
    from tandem.request import Request
    from tandem.step import ScheduledRequest

    request = Request(request_id, [1, 2, 3], SamplingParams(seed=seed))
    return batch.state_for(ScheduledRequest(request, 3, [0], reset_token_ids=[1, 2, 3])).seed


def test_unseeded_requests_get_seeds_drawn_from_the_engine_seed():
    from tandem.worker.input_batch import InputBatch

    def seeds(engine_seed: int) -> list[int]:
        batch = InputBatch(torch.device("cpu"), 4, 64, seed=engine_seed)
        keys = [_admit(batch, f"r{i}", s) for i, s in enumerate([None, 12, None, -1, None])]
        # A reset (preemption) keeps the request's key.
        assert _admit(batch, "r0", None) == keys[0]
        return keys

    first = seeds(0)
    assert first == seeds(0)  # reproducible from the engine seed
    assert first[1] == 12 and first[3] == 2**63 - 1  # own seeds, reduced mod 2**63
    unseeded = [first[0], first[2], first[4]]
    assert len(set(unseeded)) == 3 and all(0 <= s < 2**63 for s in unseeded)
    assert seeds(1)[0] != first[0]
