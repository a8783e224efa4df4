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
from tandem.worker.spec_decode.proposer import MTPProposer, ProposalRow
from tandem.worker.spec_decode.slot_rows import Accepted, VerifyRows

BLOCK_SIZE = 4
NUM_BLOCKS = 12
MAX_MODEL_LEN = 40
K = 3
TABLES = [[2, 9, 4, 7], [5, 1, 10, 3]]  # not contiguous, not sorted
STARTS = [6, 9]  # each request's verification row starts here (its last known token)


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


def _ragged(proposer, hidden, candidates, accepted):
    """The proposer's drafting over each request's kept positions only (start..start+a)."""
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
    sampling = {row.request_id: (SamplingParams(temperature=0.0), 0) for row in rows}
    proposal = proposer.propose(rows, hidden, sampling)
    return torch.stack([proposal.draft_token_ids[row.request_id] for row in rows])


def _fixed(proposer, hidden, candidates, accepted):
    """Drafting at fixed shape over every verified row, the accepted one gathered."""
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
    return proposer.propose_uniform(hidden, candidates, rows, metadata, kept, tables, TABLES, K)


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


def test_slots_grow_on_demand_and_are_reused_after_release():
    slots = RequestSlots(num_drafts=2, device=torch.device("cpu"), capacity=3)
    first = [slots.assign() for _ in range(2)]  # slot 0 is the padding rows' scratch slot
    assert RequestSlots.scratch not in first and slots.generation == 0
    slots.write(first, [5, 7], [11, 13], torch.tensor([[1, 2], [3, 4]]))
    third = slots.assign()  # full: the storage doubles and keeps what it held
    assert slots.capacity == 6 and third not in first and slots.generation == 1
    assert slots.next_start[first].tolist() == [5, 7]
    assert slots.last_token[first].tolist() == [11, 13]
    assert slots.drafts[first].tolist() == [[1, 2], [3, 4]]
    slots.release(first[0])
    assert slots.assign() == first[0]
