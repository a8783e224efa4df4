"""MTP steps resolved on the device: the fixed-shape drafting after a uniform verification
step equals the ragged drafting over the kept positions alone, for every accepted count, in
drafts and in the MTP head's KV at every position the ragged drafting writes; and the
device slots grow and reuse as requests come and go."""

import pytest
import torch

from tandem.layers.attention import TorchAttentionBackend
from tandem.layers.triton_attention import TritonAttentionBackend
from tandem.models.loader import ModelFiles, load_model
from tandem.models.mtp import load_mtp_head
from tandem.sampling_params import SamplingParams
from tandem.worker.request_slots import RequestSlots
from tandem.worker.spec_decode.draft_sampling import DraftSampling
from tandem.worker.spec_decode.proposer import MTPProposer, ProposalRow
from tandem.worker.spec_decode.slot_rows import Accepted, VerifyRows
from tandem.worker.step_sampler import sampling_batch

BLOCK_SIZE = 4
NUM_BLOCKS = 12
MAX_MODEL_LEN = 40
K = 3
TABLES = [[2, 9, 4, 7], [5, 1, 10, 3]]  # not contiguous, not sorted
STARTS = [6, 9]  # each request's verification row starts here (its last known token)
SEEDS = [1234567, 89]  # the requests' key seeds (sampled drafting)


def _proposer(backend) -> MTPProposer:
    files = ModelFiles("dummy:tiny")
    model = load_model(files, MAX_MODEL_LEN, torch.float32, torch.device("cpu"), seed=0)
    head = load_mtp_head("dummy", files, model.rotary, seed=0).eval()
    arch = model.arch
    shape = (2, NUM_BLOCKS + 1, BLOCK_SIZE, arch.num_kv_heads, arch.head_dim)
    generator = torch.Generator().manual_seed(1)
    caches = [torch.randn(shape, generator=generator) for _ in range(head.num_layers)]
    return MTPProposer(head, model, caches, backend, BLOCK_SIZE, torch.device("cpu"))


def _slot(table: list[int], position: int) -> int:
    return table[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE


def _ragged(proposer, hidden, candidates, accepted, params=None):
    """The proposer's drafting over each request's kept positions only (start..start+a):
    drafts [2, K], and their distributions [2, K, V] when ``params`` (one per request) are
    given (request i's key seed is SEEDS[i])."""
    q = K + 1
    rows = [
        ProposalRow(
            f"r{i}",
            list(range(start, start + a + 1)),
            list(range(i * q, i * q + a + 1)),
            candidates[i * q : i * q + a + 1].tolist(),
            TABLES[i],
            K,
        )
        for i, (start, a) in enumerate(zip(STARTS, accepted, strict=True))
    ]
    if params is None:
        sampling = {row.request_id: (SamplingParams(temperature=0.0), 0) for row in rows}
    else:
        sampling = {row.request_id: (params[i], SEEDS[i]) for i, row in enumerate(rows)}
    proposal = proposer.propose(rows, hidden, sampling)
    drafts = torch.stack([proposal.draft_token_ids[row.request_id] for row in rows])
    if params is None:
        return drafts
    probs = [proposal.draft_probs.get(row.request_id) for row in rows]
    return drafts, probs


def _fixed(proposer, hidden, candidates, accepted, params=None):
    """Drafting at fixed shape over every verified row, the accepted one gathered (sampled
    as ``_ragged`` when ``params`` are given)."""
    q = K + 1
    positions = torch.tensor([s + j for s in STARTS for j in range(q)])
    slot_mapping = torch.tensor(
        [_slot(TABLES[i], s + j) for i, s in enumerate(STARTS) for j in range(q)]
    )
    seq_lens = torch.tensor([s + q for s in STARTS])
    bounds = [s + 2 * q for s in STARTS]  # the host knows only upper bounds
    metadata = proposer.backend.build_metadata(
        [q, q], bounds, TABLES, slot_mapping, BLOCK_SIZE, "cpu", seq_lens_device=seq_lens
    )
    tables = torch.tensor(TABLES, dtype=torch.int32)
    rows = VerifyRows(torch.tensor(STARTS), positions, None, slot_mapping, seq_lens)
    counts = torch.tensor(accepted)
    kept = Accepted(counts + 1, torch.arange(2) * q + counts, rows.start + counts)
    sampling = None
    if params is not None:
        batch = sampling_batch(params, torch.tensor(SEEDS), proposer.model.arch.vocab_size, "cpu")
        sampling = DraftSampling(batch, kept.last_positions + 2)
    drafts, probs = proposer.propose_uniform(
        hidden, candidates, rows, metadata, kept, tables, TABLES, K, sampling=sampling
    )
    if params is None:
        assert probs is None  # greedy rows: q is one-hot
        return drafts
    return drafts, probs


@pytest.mark.parametrize("backend", [TorchAttentionBackend, TritonAttentionBackend])
@pytest.mark.parametrize("accepted", [[0, 3], [1, 2], [2, 1], [3, 0]])
def test_fixed_shape_drafting_equals_the_ragged_one_for_every_accepted_count(backend, accepted):
    ragged, fixed = _proposer(backend()), _proposer(backend())
    generator = torch.Generator().manual_seed(2)
    hidden = torch.randn((2 * (K + 1), ragged.model.arch.hidden_size), generator=generator)
    candidates = torch.randint(0, ragged.model.arch.vocab_size, (2 * (K + 1),), generator=generator)
    with torch.inference_mode():
        want = _ragged(ragged, hidden, candidates, accepted)
        got = _fixed(fixed, hidden, candidates, accepted)
    assert torch.equal(got, want)
    # Every position the ragged drafting wrote (kept positions at depth 0, then one per
    # later depth) holds the same MTP KV; the fixed shape also wrote the rejected rows'
    # positions, which the next step overwrites.
    for i, (start, a) in enumerate(zip(STARTS, accepted, strict=True)):
        for position in range(start, start + a + K):
            slot = _slot(TABLES[i], position)
            for want_cache, got_cache in zip(ragged.kv_caches, fixed.kv_caches, strict=True):
                block, offset = divmod(slot, BLOCK_SIZE)
                torch.testing.assert_close(
                    got_cache[:, block, offset], want_cache[:, block, offset], rtol=1e-5, atol=1e-5
                )


@pytest.mark.parametrize("backend", [TorchAttentionBackend, TritonAttentionBackend])
@pytest.mark.parametrize("accepted", [[0, 3], [1, 2], [2, 1], [3, 0]])
def test_fixed_shape_sampled_drafting_equals_the_ragged_one(backend, accepted):
    """A sampled request and a greedy one in the same batch: the fixed-shape drafting draws
    the ragged drafting's tokens (keyed by seed, position and depth) from the same
    distributions q, which only the sampled request has."""
    params = [SamplingParams(temperature=1.3, top_k=20, top_p=0.9), SamplingParams(temperature=0)]
    if accepted[0] < accepted[1]:
        params.reverse()
    ragged, fixed = _proposer(backend()), _proposer(backend())
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn((2 * (K + 1), ragged.model.arch.hidden_size), generator=generator)
    candidates = torch.randint(0, ragged.model.arch.vocab_size, (2 * (K + 1),), generator=generator)
    with torch.inference_mode():
        want_drafts, want_probs = _ragged(ragged, hidden, candidates, accepted, params)
        got_drafts, got_probs = _fixed(fixed, hidden, candidates, accepted, params)
    assert torch.equal(got_drafts, want_drafts)
    sampled = 0 if not params[0].greedy else 1
    assert want_probs[1 - sampled] is None  # the greedy request's q is one-hot
    assert got_probs.shape == (2, K, ragged.model.arch.vocab_size)
    torch.testing.assert_close(got_probs[sampled], want_probs[sampled], rtol=1e-5, atol=1e-6)
    # Each sampled draft has mass under its q (a draw from it), and q sums to one.
    drawn = got_probs[sampled].gather(1, got_drafts[sampled][:, None])
    assert bool((drawn > 0).all())
    torch.testing.assert_close(got_probs[sampled].sum(dim=-1), torch.ones(K))


def test_slots_grow_on_demand_and_are_reused_after_release():
    slots = RequestSlots(num_drafts=2, vocab_size=5, device=torch.device("cpu"), capacity=3)
    first = [slots.assign() for _ in range(2)]  # slot 0 is the padding rows' scratch slot
    assert RequestSlots.scratch not in first and slots.generation == 0
    q = torch.rand((2, 5))  # the second request's drafts were sampled from q
    slots.write(first, [5, 7], [11, 13], torch.tensor([[1, 2], [3, 4]]), {first[1]: q})
    third = slots.assign()  # full: the storage doubles and keeps what it held
    assert slots.capacity == 6 and third not in first and slots.generation == 1
    assert slots.next_start[first].tolist() == [5, 7]
    assert slots.last_token[first].tolist() == [11, 13]
    assert slots.drafts[first].tolist() == [[1, 2], [3, 4]]
    assert torch.equal(slots.draft_probs[first[1]], q)
    assert slots.draft_probs.shape == (6, 2, 5)
    slots.release(first[0])
    assert slots.assign() == first[0]
