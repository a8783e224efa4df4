"""The resolved step's integer kernels (compiled on a GPU, Triton's interpreter on the CPU)
against their PyTorch forms, and the PyTorch forms against values worked out by hand."""

from __future__ import annotations

import pytest
import torch

from tandem.worker.request_slots import RequestSlots
from tandem.worker.spec_decode.slot_rows import accept, depth_rows, verify_rows

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BLOCK_SIZE = 4
PAD_BLOCK = 99


def _t(values) -> torch.Tensor:
    return torch.tensor(values, device=DEVICE)


def _slots(num_drafts: int, seed: int = 0) -> RequestSlots:
    slots = RequestSlots(num_drafts, 1000, DEVICE, capacity=8)
    generator = torch.Generator().manual_seed(seed)
    slots.next_start.copy_(torch.randint(0, 9, (8,), generator=generator))
    slots.last_token.copy_(torch.randint(0, 1000, (8,), generator=generator))
    slots.drafts.copy_(torch.randint(0, 1000, (8, num_drafts), generator=generator))
    return slots


def _tables(rows: int, width: int) -> torch.Tensor:
    return (torch.arange(rows * width, dtype=torch.int32, device=DEVICE) * 3 + 1).view(rows, width)


def _fields(obj) -> list[torch.Tensor]:
    return [getattr(obj, name) for name in obj.__dataclass_fields__]


@pytest.mark.parametrize("num_drafts", [1, 3, 4])
def test_verify_rows_kernel_equals_torch(num_drafts):
    slots = _slots(num_drafts)
    slot_ids = _t([3, 0, 5, 0, 1])  # slot 0: the scratch slot of padding rows
    tables = _tables(5, 4)  # 4 blocks of 4: positions past 15 read the pad block
    want = verify_rows(slots, slot_ids, tables, BLOCK_SIZE, PAD_BLOCK, use_triton=False)
    got = verify_rows(slots, slot_ids, tables, BLOCK_SIZE, PAD_BLOCK, use_triton=True)
    for a, b in zip(_fields(got), _fields(want), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_verify_rows_by_hand():
    slots = _slots(2)
    slots.next_start[:3] = _t([7, 6, 14])
    slots.last_token[:3] = _t([0, 11, 12])
    slots.drafts[:3] = _t([[0, 0], [21, 22], [31, 32]])
    tables = _t([[5, 6, 7, 8], [1, 2, 3, 4]]).int()
    rows = verify_rows(slots, _t([1, 2]), tables, BLOCK_SIZE, PAD_BLOCK, False)
    assert rows.start.tolist() == [6, 14]
    assert rows.positions.tolist() == [6, 7, 8, 14, 15, 16]
    assert rows.input_ids.tolist() == [11, 21, 22, 12, 31, 32]
    # Position 16 is block column 4, past the table's 4 columns: the pad block.
    assert rows.slot_mapping.tolist() == [6 * 4 + 2, 6 * 4 + 3, 7 * 4, 4 * 4 + 2, 4 * 4 + 3, 396]
    assert rows.seq_lens.tolist() == [9, 17] and rows.seq_lens.dtype == torch.int32
    padding = verify_rows(slots, _t([0]), tables[:1], BLOCK_SIZE, PAD_BLOCK, False)
    assert padding.start.tolist() == [0]  # whatever the scratch slot holds


@pytest.mark.parametrize("num_drafts", [1, 3])
@pytest.mark.parametrize("sampled", [False, True])
def test_accept_kernel_equals_torch(num_drafts, sampled):
    q = num_drafts + 1
    slot_ids = _t([2, 4, 6, 7])
    results = []
    for use_triton in (False, True):
        slots = _slots(num_drafts, seed=1)
        rows = verify_rows(slots, slot_ids, _tables(4, 6), BLOCK_SIZE, PAD_BLOCK, False)
        # Row b's candidates agree with its drafts for its first b positions.
        candidates = rows.input_ids.view(4, q).roll(-1, dims=1).clone()
        for b in range(4):
            candidates[b, min(b, num_drafts) :] += 5000
        emitted = _t([1, num_drafts + 1, 1, 2]).clamp(max=q) if sampled else None
        out = accept(slots, slot_ids, rows, candidates.reshape(-1), emitted, use_triton)
        results.append((_fields(out), slots))
    (want, want_slots), (got, got_slots) = results
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    for name in ("next_start", "last_token", "drafts"):
        assert torch.equal(getattr(got_slots, name), getattr(want_slots, name))
    if not sampled:
        assert want[0].tolist() == [min(b, num_drafts) + 1 for b in range(4)]


def test_accept_by_hand():
    slots = _slots(2)
    slots.next_start[1], slots.last_token[1], slots.drafts[1] = 10, 7, _t([8, 9])
    rows = verify_rows(slots, _t([1]), _tables(1, 8), BLOCK_SIZE, PAD_BLOCK, False)
    out = accept(slots, _t([1]), rows, _t([8, 40, 41]), use_triton=False)
    # Draft 8 agrees, draft 9 does not (40): one accepted, bonus 40 at position 11.
    assert (out.emitted.item(), out.kept.item(), out.last_positions.item()) == (2, 1, 11)
    assert (slots.next_start[1].item(), slots.last_token[1].item()) == (12, 40)


@pytest.mark.parametrize("depth", [1, 2])
def test_depth_rows_kernel_equals_torch(depth):
    last_positions = _t([0, 3, 7, 14, 15, 2])
    tables = _tables(6, 4)
    want = depth_rows(last_positions, tables, depth, BLOCK_SIZE, PAD_BLOCK, use_triton=False)
    got = depth_rows(last_positions, tables, depth, BLOCK_SIZE, PAD_BLOCK, use_triton=True)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    positions, slot_mapping, seq_lens = want
    assert positions.tolist() == (last_positions + depth).tolist()
    assert seq_lens.tolist() == (last_positions + depth + 1).tolist()
    assert slot_mapping[0].item() == tables[0, 0].item() * BLOCK_SIZE + depth
    assert slot_mapping[4].item() == PAD_BLOCK * BLOCK_SIZE + (15 + depth) % BLOCK_SIZE
