"""Top-k / top-p / min-p thresholds: the search kernel (in Triton's interpreter) against the
sort-based reference, bit for bit, and the reference against the old sort-and-cumsum rule.

Top-p compares a mass with ``top_p`` times a mass, and the kernel and the reference sum in
different orders: every top-p here puts its goal away from every cumulative mass (halfway
between two, or 5e-5 below one), so rounding cannot move the cut-off
(``_assert_top_p_margins`` checks it)."""

from __future__ import annotations

import itertools
from contextlib import contextmanager

import pytest
import torch

from tandem.layers import sampling_kernels
from tandem.layers.sampler import SamplingBatch, apply_filters
from tandem.layers.sampling_kernels import filter_threshold, filter_threshold_reference

pytestmark = pytest.mark.skipif(sampling_kernels.triton is None, reason="needs triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _probs(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    return (logits / temperature[:, None]).softmax(dim=-1)


def _cumulative_masses(p: torch.Tensor, top_k: int) -> tuple[list[float], float]:
    """Mass of ``{p >= v}`` within the top-k set for each distinct value v (largest first,
    in float64), and the set's mass."""
    values = p.double().unique(sorted=True).flip(0)
    kth = p.double().sort(descending=True).values[min(top_k, p.numel()) - 1]
    in_k = values[values >= kth] if top_k < p.numel() else values
    masses = [float(p.double()[p.double() >= v].sum()) for v in in_k]
    return masses, masses[-1]


def _top_p_between(p: torch.Tensor, top_k: int, rank: int, gap: float | None = None) -> float:
    """A top_p that keeps the distinct values ranked <= ``rank``: its goal lies halfway
    between the masses of ``{p >= value}`` at ranks ``rank - 1`` and ``rank``, or ``gap``
    below the latter (a tight case, still far above fp32 rounding)."""
    masses, total = _cumulative_masses(p, top_k)
    below = masses[rank - 1] if rank > 0 else 0.0
    goal = (below + masses[rank]) / 2 if gap is None else masses[rank] - gap
    return goal / total


def _assert_top_p_margins(probs, top_k, top_p) -> None:
    for row in range(probs.shape[0]):
        if top_p[row] >= 1:
            continue
        masses, total = _cumulative_masses(probs[row], int(top_k[row]))
        goal = float(top_p[row]) * total
        assert min(abs(m - goal) for m in masses) > 1e-5, f"row {row}: top_p at a crossing"


def _mixed_rows(vocab: int):
    """Logits, temperature and per-row (top_k, top_p, min_p) covering every filter alone,
    together, disabled, and ties at each boundary."""
    generator = torch.Generator().manual_seed(vocab)
    num_rows = 12
    logits = 3 * torch.randn(num_rows, vocab, generator=generator)
    temperature = torch.ones(num_rows)
    temperature[5], temperature[11] = 0.7, 2.5
    top_k = torch.full((num_rows,), vocab)
    top_p = torch.ones(num_rows)
    min_p = torch.zeros(num_rows)
    top_k[1], top_k[3], top_k[5], top_k[9] = 5, 50, 20, 1
    min_p[4], min_p[5] = 0.1, 0.05
    # Row 6: the 4th to 7th largest logits tie, with top_k = 5: all four are kept.
    order = logits[6].argsort(descending=True)
    logits[6, order[3:7]] = logits[6, order[3]].item()
    top_k[6] = 5
    # Row 7: the 3rd to 5th largest tie and top-p's cut-off falls inside them.
    order = logits[7].argsort(descending=True)
    logits[7, order[2:5]] = logits[7, order[2]].item()
    # Row 8: a tiny top_p keeps the argmax only; row 10: top_k = 1 with two tied maxima.
    top_p[8] = 1e-7
    order = logits[10].argsort(descending=True)
    logits[10, order[1]] = logits[10, order[0]].item()
    top_k[10] = 1
    probs = _probs(logits, temperature)
    for row, rank in ((3, 4), (5, 3)):
        top_p[row] = _top_p_between(probs[row], int(top_k[row]), rank)
    for row, rank in ((2, 7), (11, 30)):
        top_p[row] = _top_p_between(probs[row], int(top_k[row]), rank, gap=5e-5)
    top_p[7] = _top_p_between(probs[7], vocab, 2)  # inside the tie group (value rank 2)
    _assert_top_p_margins(probs, top_k, top_p)
    # Built on the CPU (the margins read values); the kernel runs compiled where there is a GPU.
    return tuple(t.to(DEVICE) for t in (logits, temperature, top_k, top_p, min_p))


@pytest.mark.parametrize("vocab", [300, 1500])
@pytest.mark.parametrize(
    "filters", [f for n in (1, 2, 3) for f in itertools.combinations("kpm", n)]
)
def test_kernel_threshold_equals_the_reference_bit_for_bit(vocab, filters):
    """Mixed rows (every filter, disabled rows, ties, temperature); 1500 spans three blocks
    of the kernel, the last one partial."""
    logits, temperature, top_k, top_p, min_p = _mixed_rows(vocab)
    probs = _probs(logits, temperature)
    args = (
        top_k if "k" in filters else None,
        top_p if "p" in filters else None,
        min_p if "m" in filters else None,
    )
    got = filter_threshold(probs, *args, use_triton=True)
    expected = filter_threshold_reference(probs, *args)
    assert torch.equal(got.view(torch.int32), expected.view(torch.int32)), (got, expected)
    assert bool((expected > 0).any())


def _batch(temperature, top_k, top_p, min_p) -> SamplingBatch:
    return SamplingBatch(
        temperature=temperature,
        greedy=torch.zeros_like(top_k, dtype=bool),
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        seeds=None,
        all_greedy=False,
    )


@pytest.mark.parametrize("vocab", [300, 1500])
def test_filtered_distributions_keep_ties_and_equal_the_reference(vocab):
    logits, temperature, top_k, top_p, min_p = _mixed_rows(vocab)
    batch = _batch(temperature, top_k, top_p, min_p)
    got = apply_filters(logits, batch, use_triton=True)
    assert torch.equal(got, apply_filters(logits, batch, use_triton=False))
    torch.testing.assert_close(got.sum(dim=-1), torch.ones(len(got), device=got.device))
    kept = (got > 0).sum(dim=-1)
    assert kept[0] == vocab  # nothing enabled
    assert kept[1] == 5 and kept[9] == 1
    assert kept[6] == 7  # top_k = 5, the 4th to 7th tie: all kept
    assert kept[7] == 5  # the cut-off falls inside the 3rd to 5th: all kept
    assert kept[8] == 1 and got[8].argmax() == logits[8].argmax()  # tiny top_p
    assert kept[10] == 2  # top_k = 1, two tied maxima
    probs = _probs(logits, temperature)
    assert torch.equal(got[4] > 0, probs[4] >= 0.1 * probs[4].max())  # min-p
    for row, rank in ((2, 7), (3, 4), (11, 30)):  # top-p (no ties there)
        assert kept[row] == rank + 1
    assert 0 < kept[5] <= 4


def _old_apply_filters(logits, temperature, top_k, top_p, min_p):
    """The sort-based filters this kernel replaced, as they were: top-k on the logits,
    top-p by the smallest sorted prefix covering top_p, min-p after both."""
    logits = logits / temperature[:, None]
    kth = logits.sort(dim=-1, descending=True).values.gather(1, (top_k - 1)[:, None])
    logits = logits.masked_fill(logits < kth, float("-inf"))
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    sorted_probs = sorted_logits.softmax(dim=-1)
    drop_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p[:, None]
    drop_sorted &= top_p[:, None] < 1.0
    logits = logits.masked_fill(
        torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted), float("-inf")
    )
    probs = logits.softmax(dim=-1)
    probs = probs.masked_fill(probs < probs.max(dim=-1, keepdim=True).values * min_p[:, None], 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


def test_reference_agrees_with_the_old_sort_rule_on_tie_free_rows():
    vocab, num_rows = 400, 16
    generator = torch.Generator().manual_seed(5)
    logits = 2 * torch.randn(num_rows, vocab, generator=generator)
    temperature = 0.5 + torch.rand(num_rows, generator=generator)
    top_k = torch.tensor([vocab, 1, 3, 40, 400, 100, 7, vocab] * 2)
    min_p = torch.tensor([0.0, 0.0, 0.2, 0.0, 0.01, 0.0, 0.0, 0.3] * 2)
    probs = _probs(logits, temperature)
    assert all(len(row.unique()) == vocab for row in probs)  # no ties
    top_p = torch.ones(num_rows)
    for row in range(8, num_rows):
        rank = min(row - 7, int(top_k[row]) - 1)
        top_p[row] = _top_p_between(
            probs[row], int(top_k[row]), rank, gap=5e-5 if row % 2 else None
        )
    _assert_top_p_margins(probs, top_k, top_p)
    expected = _old_apply_filters(logits, temperature, top_k, top_p, min_p)
    got = apply_filters(logits, _batch(temperature, top_k, top_p, min_p), use_triton=False)
    assert torch.equal(got > 0, expected > 0)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)
    assert len({int(n) for n in (got > 0).sum(dim=-1)}) > 8  # the rows cut in varied places


@contextmanager
def _no_host_reads(monkeypatch):
    """Any read of a tensor's value on the host (a device sync on CUDA) raises."""

    def refuse(*args, **kwargs):
        raise AssertionError("a tensor value was read on the host")

    with monkeypatch.context() as patch:
        for name in ("item", "tolist", "__bool__", "__int__", "__float__", "numpy"):
            patch.setattr(torch.Tensor, name, refuse)
        yield


@pytest.mark.parametrize("use_triton", [False, True])
def test_filters_read_nothing_back_to_the_host(monkeypatch, use_triton):
    logits, temperature, top_k, top_p, min_p = _mixed_rows(300)
    batch = _batch(temperature, top_k, top_p, min_p)
    expected = apply_filters(logits, batch, use_triton=use_triton)
    with _no_host_reads(monkeypatch):
        got = apply_filters(logits, batch, use_triton=use_triton)
    assert torch.equal(got, expected)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_kernel_equals_the_reference_at_a_llama3_vocabulary():
    """The kernel compiled for the GPU (not the interpreter), 64 rows of 128,256 tokens with
    mixed filters, against the reference on the CPU, bit for bit. Each top-p goal lies
    halfway between the masses of two consecutive top values (a margin of half a
    probability of rank <= 30, far above either side's rounding)."""
    vocab, num_rows = 128_256, 64
    generator = torch.Generator().manual_seed(0)
    logits = 4 * torch.randn(num_rows, vocab, generator=generator)
    temperature = 0.5 + torch.rand(num_rows, generator=generator)
    rows = torch.arange(num_rows)
    top_k = torch.where(
        rows % 3 == 0, torch.randint(1, 2000, (num_rows,), generator=generator), vocab
    )
    min_p = torch.where(rows % 5 == 0, 0.05, 0.0)
    probs = _probs(logits, temperature)
    top_p = torch.ones(num_rows)
    ranks = torch.randint(1, 30, (num_rows,), generator=generator)
    for row in range(0, num_rows, 2):
        ordered = probs[row].double().sort(descending=True).values
        kept = ordered[: int(top_k[row])]
        cumulative = kept.cumsum(0)
        rank = min(int(ranks[row]), kept.numel() - 1)
        if rank < 1:
            continue
        goal = (cumulative[rank - 1] + cumulative[rank]) / 2
        top_p[row] = float(goal / cumulative[-1])
    expected = filter_threshold_reference(probs, top_k, top_p, min_p)
    got = filter_threshold(probs.cuda(), top_k.cuda(), top_p.cuda(), min_p.cuda(), use_triton=True)
    assert torch.equal(got.cpu().view(torch.int32), expected.view(torch.int32))
    active = (top_k < vocab) | (top_p < 1) | (min_p > 0)
    assert bool((expected[active] > 0).all()) and bool((expected[~active] == 0).all())
