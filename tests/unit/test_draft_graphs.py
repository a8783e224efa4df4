"""MTP draft graphs: depths >= 1 computed as one padded chain on the device equal the
proposer's eager depth-by-depth drafts, and write the same KV.

The capture needs CUDA (tests/e2e/test_cuda_graphs.py checks graphed drafts against eager
ones there); the chain the graph records, its static buffers and its padding run here, with
Triton's interpreter on the CPU.
"""

import pytest
import torch

from tandem.layers.keyed_random import draft_draw, keyed_exponential
from tandem.layers.sampler import race, race_width
from tandem.layers.triton_attention import TritonAttentionBackend
from tandem.models.loader import ModelFiles, load_model
from tandem.models.mtp import load_mtp_head
from tandem.sampling_params import SamplingParams
from tandem.worker.spec_decode.draft_graphs import DraftGraphRunner
from tandem.worker.spec_decode.proposer import MTPProposer, ProposalRow

BLOCK_SIZE = 4
NUM_BLOCKS = 12
SCRATCH = NUM_BLOCKS  # the cache's extra block
MAX_MODEL_LEN = 40
K = 3


def _proposer():
    files = ModelFiles("dummy:tiny")
    model = load_model(files, MAX_MODEL_LEN, torch.float32, torch.device("cpu"), seed=0)
    head = load_mtp_head("dummy", files, model.rotary, seed=0).eval()
    arch = model.arch
    shape = (2, NUM_BLOCKS + 1, BLOCK_SIZE, arch.num_kv_heads, arch.head_dim)
    generator = torch.Generator().manual_seed(1)
    caches = [torch.randn(shape, generator=generator) for _ in range(head.num_layers)]
    return MTPProposer(
        head, model, caches, TritonAttentionBackend(), BLOCK_SIZE, torch.device("cpu")
    )


def _rows(num_drafts: list[int]) -> list[ProposalRow]:
    """Three requests: a verify step's kept positions (A: 3, B: 1), a prefill chunk's
    (C: 5); block tables not contiguous, not sorted."""
    specs = [([2, 9, 4], 7, 3), ([5, 1, 10, 3], 13, 1), ([0, 6, 11], 2, 5)]
    rows, offset = [], 0
    for (blocks, start, kept), drafts in zip(specs, num_drafts, strict=True):
        positions = list(range(start, start + kept))
        rows.append(
            ProposalRow(
                f"r{len(rows)}",
                positions,
                list(range(offset, offset + kept)),
                [(11 * p + 3) % 50 for p in positions],
                blocks,
                drafts,
            )
        )
        offset += kept
    return rows


def _propose(proposer, rows, hidden, params=None, full=False):
    """The drafts per request (the whole proposal with ``full``); request i's key seed is
    ``params.seed + i`` (sampled) or i."""
    sampling = {
        r.request_id: (
            params or SamplingParams(temperature=0.0),
            (params.seed or 0) + i if params else i,
        )
        for i, r in enumerate(rows)
        if r.num_drafts
    }
    with torch.inference_mode():
        proposal = proposer.propose(rows, hidden, sampling)
    return proposal if full else proposal.draft_token_ids


def test_chained_drafts_equal_eager_drafts_and_cache():
    eager, chained = _proposer(), _proposer()
    chained.graphs = DraftGraphRunner(chained, K, MAX_MODEL_LEN, 8, SCRATCH)
    rows = _rows([K, K, K])
    hidden = torch.randn(
        (9, eager.model.arch.hidden_size), generator=torch.Generator().manual_seed(2)
    )
    want, got = _propose(eager, rows, hidden), _propose(chained, rows, hidden)
    assert chained.graphs.padded_size(3) == 4  # one padding row
    for request_id, drafts in want.items():
        assert drafts.shape == (K,)
        assert torch.equal(got[request_id], drafts), request_id
    for want_cache, got_cache in zip(eager.kv_caches, chained.kv_caches, strict=True):
        # Real blocks hold the same KV; the padding row wrote only the scratch block.
        torch.testing.assert_close(
            got_cache[:, :NUM_BLOCKS], want_cache[:, :NUM_BLOCKS], rtol=1e-5, atol=1e-5
        )


@pytest.mark.parametrize("case", ["short", "sampled", "too_many_rows"])
def test_eager_drafting_where_no_chain_applies(case):
    """A request drafting fewer than k tokens, a sampled request or more rows than the
    largest graph: the chain is not used (the drafts equal the eager proposer's)."""
    eager, chained = _proposer(), _proposer()
    chained.graphs = DraftGraphRunner(
        chained, K, MAX_MODEL_LEN, 2 if case == "too_many_rows" else 8, SCRATCH
    )
    calls = []
    original = chained.graphs.run
    chained.graphs.run = lambda *args: calls.append(1) or original(*args)
    rows = _rows([K, 2, K] if case == "short" else [K, K, K])
    params = SamplingParams(temperature=0.8, seed=5) if case == "sampled" else None
    hidden = torch.randn(
        (9, eager.model.arch.hidden_size), generator=torch.Generator().manual_seed(3)
    )
    want, got = _propose(eager, rows, hidden, params), _propose(chained, rows, hidden, params)
    assert calls == []
    if case == "too_many_rows":  # run itself refuses them
        with pytest.raises(ValueError, match="largest draft graph"):
            original(
                [7, 13, 6],
                [[2, 9, 4], [5, 1, 10, 3], [0, 6, 11]],
                torch.zeros(3, dtype=torch.long),
                torch.zeros((3, eager.model.arch.hidden_size)),
            )
    # Sampled drafts too: their random numbers are keyed by seed, position and depth.
    for request_id, drafts in want.items():
        assert torch.equal(got[request_id], drafts), request_id


def test_sampled_drafts_are_keyed_by_seed_position_and_depth():
    """A sampled draft at depth d for position t is the race of its draft distribution
    against the noise of (request seed, t, draft_draw(d)), computed here independently; a
    second proposer over a reordered batch drafts the same."""
    eager = _proposer()
    rows = _rows([K, 2, K])
    params = SamplingParams(temperature=1.5, seed=40)
    hidden = torch.randn(
        (9, eager.model.arch.hidden_size), generator=torch.Generator().manual_seed(4)
    )
    proposal = _propose(eager, rows, hidden, params, full=True)
    for i, row in enumerate(rows):
        drafts = proposal.draft_token_ids[row.request_id]
        probs = proposal.draft_probs[row.request_id]
        assert drafts.shape == (row.num_drafts,) and probs.shape[0] == row.num_drafts
        for depth in range(row.num_drafts):
            noise = keyed_exponential(
                torch.tensor([params.seed + i]),
                torch.tensor([row.positions[-1] + 2 + depth]),
                draft_draw(depth),
                race_width(probs.shape[1]),
            )
            assert int(drafts[depth]) == int(race(probs[depth][None], noise)[0]), (i, depth)
    # The same requests in another order (seeds follow the requests): the same drafts.
    reordered = _proposer()
    order = [2, 0, 1]
    sampling = {rows[i].request_id: (params, params.seed + i) for i in order if rows[i].num_drafts}
    with torch.inference_mode():
        # Each row's hidden_rows still point into the same hidden states.
        again = reordered.propose([rows[i] for i in order], hidden, sampling)
    for row in rows:
        assert torch.equal(
            again.draft_token_ids[row.request_id], proposal.draft_token_ids[row.request_id]
        )
