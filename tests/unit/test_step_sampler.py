"""The step sampler's batched rejection sampling, through ``sample_step``: each sampled row
with drafts gets what the one-request reference ``rejection_verify`` gives it for its key
(seed and position), a row the same tokens alone or in any batch, and nothing is read back
to the host."""

from __future__ import annotations

import torch

from tandem.layers.sampler import SamplingBatch, apply_filters
from tandem.sampling_params import SamplingParams
from tandem.worker.spec_decode.verification import RejectionLayout, rejection_verify
from tandem.worker.step_sampler import SamplingRow, sample_step, sample_uniform, sampling_batch

VOCAB = 64
POSITION = 30  # first drawn positions are POSITION + seed % 5


def _request(generator, num_drafts: int, params: SamplingParams, seed: int, with_draft_probs: bool):
    """(params, seed, logits [k + 1, V], input tokens [k + 1], draft probs or None); its first
    drawn position is ``POSITION + seed % 5``."""
    logits = 2 * torch.randn((num_drafts + 1, VOCAB), generator=generator)
    draft_probs = None
    if with_draft_probs:
        draft_probs = (torch.randn((num_drafts, VOCAB), generator=generator) + logits[:-1]).softmax(
            dim=-1
        )
        drafts = torch.multinomial(draft_probs, 1, generator=generator).squeeze(1)
    else:
        drafts = logits[:-1].argmax(dim=-1)  # a one-hot draft the target likes
    tokens = torch.cat([torch.tensor([7]), drafts])
    return params, seed, logits, tokens, draft_probs


def _position(seed: int) -> int:
    return POSITION + seed % 5


def _rows(requests):
    """SamplingRows and the step's logits and input tokens."""
    rows, start = [], 0
    for params, seed, logits, _, draft_probs in requests:
        rows.append(
            SamplingRow(start, len(logits) - 1, params, seed, _position(seed), 5, draft_probs)
        )
        start += len(logits)
    return rows, torch.cat([r[2] for r in requests]), torch.cat([r[3] for r in requests])


def _run(requests):
    """sample_step over ``requests`` in this order; per request (num_emitted, candidates)."""
    rows, logits, tokens = _rows(requests)
    result = sample_step(rows, logits, tokens)
    return [
        (
            int(result.num_emitted[i]),
            result.candidates[row.logits_start : row.logits_start + row.num_drafts + 1],
        )
        for i, row in enumerate(rows)
    ]


def _reference(request):
    """rejection_verify on the request's filtered target and its q (one-hot without one)."""
    params, seed, logits, tokens, draft_probs = request
    k = len(logits) - 1
    batch = sampling_batch([params] * (k + 1), None, VOCAB, torch.device("cpu"))
    target = apply_filters(logits, batch)
    if draft_probs is None:
        draft_probs = torch.nn.functional.one_hot(tokens[1:], VOCAB).float()
    accepted, candidates = rejection_verify(target, draft_probs, tokens[1:], seed, _position(seed))
    return int(accepted) + 1, candidates


def _mixed_batch(generator, seed: int):
    """A greedy row with drafts, a plain row, a drafted row, the row under test (top-k and
    top-p) and a row with one-hot drafts."""
    sampled = SamplingParams(temperature=0.9)
    seeded = _request(
        generator, 2, SamplingParams(temperature=0.8, top_k=20, top_p=0.9), seed, True
    )
    return seeded, [
        _request(generator, 2, SamplingParams(temperature=0.0), seed + 2, False),
        _request(generator, 0, sampled, seed + 3, False),
        seeded,
        _request(generator, 3, sampled, 2**62 + seed, True),
        _request(generator, 1, SamplingParams(temperature=1.2, min_p=0.05), seed + 1, False),
    ]


def test_seeded_drafted_row_matches_the_reference_alone_and_in_a_mixed_batch():
    generator = torch.Generator().manual_seed(0)
    emitted_counts = set()
    for seed in range(12):
        seeded, batch = _mixed_batch(generator, seed)
        expected = _reference(seeded)
        emitted_counts.add(expected[0])
        for requests, position in (([seeded], 0), (batch, 2), (batch[::-1], 2)):
            num_emitted, candidates = _run(requests)[position]
            assert num_emitted == expected[0] and torch.equal(candidates, expected[1]), seed
        # The one-hot row is verified against its own reference too.
        num_emitted, candidates = _run(batch)[4]
        one_hot = _reference(batch[4])
        assert num_emitted == one_hot[0] and torch.equal(candidates, one_hot[1]), seed
    assert emitted_counts == {1, 2, 3}  # rejections at each draft, and all accepted


def test_sample_step_reads_nothing_back_to_the_host(monkeypatch):
    """The runner queues the next step before reading this one: no value comes back."""
    _, batch = _mixed_batch(torch.Generator().manual_seed(1), 5)
    expected = _run(batch)

    def refuse(*args, **kwargs):
        raise AssertionError("a tensor value was read on the host")

    with monkeypatch.context() as patch:
        for name in ("item", "tolist", "__bool__", "__int__", "__float__", "numpy"):
            patch.setattr(torch.Tensor, name, refuse)
        rows, logits, tokens = _rows(batch)
        result = sample_step(rows, logits, tokens)
    for (num_emitted, candidates), row in zip(expected, rows, strict=True):
        span = slice(row.logits_start, row.logits_start + row.num_drafts + 1)
        assert torch.equal(result.candidates[span][:num_emitted], candidates[:num_emitted])


def test_uniform_sampling_equals_sample_step_on_every_row():
    """``sample_uniform`` (what a resolved-step graph records: every row verified both
    ways, all filters present, no host value) gives each row what ``sample_step`` gives it,
    for greedy rows and sampled rows with every kind of filter, drafts the target likes
    (long accepted runs) and drafts it does not."""
    generator = torch.Generator().manual_seed(11)
    k = 3
    kinds = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.9),
        SamplingParams(temperature=1.3, top_k=5),
        SamplingParams(temperature=0.7, top_p=0.8),
        SamplingParams(temperature=1.0, min_p=0.05, top_k=9, top_p=0.9),
        SamplingParams(temperature=0.0),
    ]
    requests = [
        _request(generator, k, params, 100 + 17 * i, with_draft_probs=not params.greedy)
        for i, params in enumerate(kinds * 3)
    ]
    rows, logits, tokens = _rows(requests)
    want = sample_step(rows, logits, tokens)
    seeds = torch.tensor([seed for _, seed, _, _, _ in requests])
    batch = sampling_batch([r[0] for r in requests], seeds, VOCAB, torch.device("cpu"))
    batch = SamplingBatch(  # every filter present, as a graph's static buffers hold them
        batch.temperature,
        batch.greedy,
        torch.tensor([p.top_k if p.top_k > 0 else VOCAB for p, *_ in requests]),
        torch.tensor([p.top_p for p, *_ in requests]),
        torch.tensor([p.min_p for p, *_ in requests]),
        seeds,
        all_greedy=False,
    )
    draft_probs = torch.stack(
        [q if q is not None else torch.rand((k, VOCAB)) for *_, q in requests]
    )  # greedy rows' q is never read: noise there
    first_positions = torch.tensor([_position(seed) for _, seed, _, _, _ in requests])
    layout = RejectionLayout.of([k] * len(requests), torch.device("cpu"))
    candidates, emitted = sample_uniform(
        logits, tokens, batch, draft_probs, first_positions, layout
    )
    assert torch.equal(emitted, want.num_emitted)
    for row, count in zip(rows, emitted.tolist(), strict=True):
        span = slice(row.logits_start, row.logits_start + count)
        assert torch.equal(candidates[span], want.candidates[span])
    assert set(want.num_emitted.tolist()) > {1}  # some drafts accepted, some rejected
