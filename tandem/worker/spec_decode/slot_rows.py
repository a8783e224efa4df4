"""The integer work of a resolved MTP step, one kernel each: the verification rows' inputs
from the device slots, the accepted counts and the slots' advance, and each later draft
depth's positions and KV slots.

A resolved step (``uniform_step``, ``step_graphs``) computes its rows' positions, input
tokens, KV slots and sequence lengths on the device from the slots (``RequestSlots``), and
after the verification moves the slots on by the accepted counts. In PyTorch that is some
fifty kernels of a few elements each per step (index selects, gathers, divisions, casts,
a cumulative product, index copies), about as many launches as the model's own layers at
batch 1, each costing its launch gap inside a CUDA graph. Here each stage is one Triton
launch on CUDA (:func:`tandem.layers.fused.kernels_apply`); the PyTorch form runs on the
CPU and is the reference the kernels are tested against (``use_triton=True`` forces the
kernel: Triton's interpreter on the CPU).

Block-table reads past a table's width read ``pad_block`` (the cache's scratch block, which
no request owns): a position past its request's blocks never lands in another's block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.layers.fused import kernels_apply

try:
    import triton
    import triton.language as tl
except ImportError:  # tandem runs without triton: every stage takes its PyTorch form
    triton = None
    tl = None


@dataclass
class VerifyRows:
    """The inputs of a resolved verification step of B rows of k + 1 tokens (k: the drafts
    each row verifies, at most the slots' k)."""

    start: torch.Tensor  # [B] long: each row's first position (its last known token's)
    positions: torch.Tensor  # [B * (k + 1)] long
    input_ids: torch.Tensor  # [B * (k + 1)] long: the last known token, then the k drafts
    slot_mapping: torch.Tensor  # [B * (k + 1)] long: KV cache slots
    seq_lens: torch.Tensor  # [B] int32: start + k + 1


@dataclass
class Accepted:
    """What the verification of a resolved step decided, per row."""

    emitted: torch.Tensor  # [B] long: accepted drafts + 1 (the bonus token)
    kept: torch.Tensor  # [B] long: the flat index of the row's last accepted position
    last_positions: torch.Tensor  # [B] long: start + accepted drafts


def table_blocks(tables, columns, pad_block):
    """``tables[b, columns[b, j]]``, ``pad_block`` past a row's width (PyTorch form)."""
    inside = columns < tables.shape[1]
    blocks = tables.gather(1, torch.where(inside, columns, 0)).long()
    return torch.where(inside, blocks, pad_block)


def verify_rows(
    slots,
    slot_ids,
    tables,
    block_size: int,
    pad_block: int,
    use_triton: bool | None = None,
    num_drafts: int | None = None,
) -> VerifyRows:
    """The rows ``slot_ids`` [B] (long) of ``slots`` (``RequestSlots``; rows naming the
    scratch slot start at position 0) over their block tables ``tables`` [B, W] (int32),
    each verifying the first ``num_drafts`` of its slot's drafts (default: all k)."""
    k = slots.num_drafts if num_drafts is None else num_drafts
    rows, q = slot_ids.shape[0], k + 1
    if not (kernels_apply(slot_ids, tables) if use_triton is None else use_triton):
        start = slots.next_start.index_select(0, slot_ids)
        start = torch.where(slot_ids == slots.scratch, 0, start)
        positions = start[:, None] + torch.arange(q, device=start.device)
        input_ids = torch.cat(
            [
                slots.last_token.index_select(0, slot_ids)[:, None],
                slots.drafts[:, :k].index_select(0, slot_ids),
            ],
            dim=1,
        )
        blocks = table_blocks(tables, positions // block_size, pad_block)
        slot_mapping = blocks * block_size + positions % block_size
        return VerifyRows(
            start,
            positions.reshape(-1),
            input_ids.reshape(-1),
            slot_mapping.reshape(-1),
            (start + q).to(torch.int32),
        )
    device = slot_ids.device
    out = VerifyRows(
        torch.empty(rows, dtype=torch.long, device=device),
        torch.empty(rows * q, dtype=torch.long, device=device),
        torch.empty(rows * q, dtype=torch.long, device=device),
        torch.empty(rows * q, dtype=torch.long, device=device),
        torch.empty(rows, dtype=torch.int32, device=device),
    )
    if rows:
        _verify_rows_kernel[(rows,)](
            slot_ids,
            slots.next_start,
            slots.last_token,
            slots.drafts,
            slots.drafts.stride(0),
            tables,
            tables.stride(0),
            tables.shape[1],
            out.start,
            out.positions,
            out.input_ids,
            out.slot_mapping,
            out.seq_lens,
            slots.scratch,
            block_size,
            pad_block,
            Q=q,
            Q_PAD=max(2, triton.next_power_of_2(q)),
        )
    return out


def accept(
    slots,
    slot_ids,
    rows: VerifyRows,
    candidates,
    emitted=None,
    use_triton: bool | None = None,
) -> Accepted:
    """Greedy verification of ``rows`` by the target's ``candidates`` [B * (k + 1)] (each
    row accepts its drafts up to the first that differs; k: the drafts ``rows`` verify),
    or, given ``emitted`` [B] (a sampled verification's counts), those counts; then each
    row's slot moves on: its next start past the accepted drafts and its last token the
    bonus candidate there."""
    num_rows = slot_ids.shape[0]
    q = rows.input_ids.shape[0] // num_rows if num_rows else slots.num_drafts + 1
    k = q - 1
    if not (kernels_apply(slot_ids, candidates) if use_triton is None else use_triton):
        per_row = candidates.view(num_rows, q)
        if emitted is None:
            agree = rows.input_ids.view(num_rows, q)[:, 1:] == per_row[:, :k]
            accepted = agree.long().cumprod(dim=1).sum(dim=1)
        else:
            accepted = emitted.long() - 1
        bonus = per_row.gather(1, accepted[:, None]).squeeze(1)
        slots.next_start.index_copy_(0, slot_ids, rows.start + accepted + 1)
        slots.last_token.index_copy_(0, slot_ids, bonus)
        kept = torch.arange(num_rows, device=accepted.device) * q + accepted
        return Accepted(accepted + 1, kept, rows.start + accepted)
    device = slot_ids.device
    out = Accepted(*(torch.empty(num_rows, dtype=torch.long, device=device) for _ in range(3)))
    if num_rows:
        _accept_kernel[(num_rows,)](
            candidates,
            rows.input_ids,
            candidates if emitted is None else emitted,
            rows.start,
            slot_ids,
            slots.next_start,
            slots.last_token,
            out.emitted,
            out.kept,
            out.last_positions,
            K=k,
            K_PAD=max(2, triton.next_power_of_2(k)),
            GREEDY=emitted is None,
        )
    return out


def depth_rows(
    last_positions,
    tables,
    depth: int,
    block_size: int,
    pad_block: int,
    use_triton: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draft depth ``depth``'s row of each request: positions (``last_positions`` [B] +
    depth), KV slots (long) and sequence lengths (int32)."""
    if not (kernels_apply(last_positions, tables) if use_triton is None else use_triton):
        positions = last_positions + depth
        blocks = table_blocks(tables, (positions // block_size)[:, None], pad_block)[:, 0]
        return positions, blocks * block_size + positions % block_size, (positions + 1).int()
    rows = last_positions.shape[0]
    positions = torch.empty_like(last_positions)
    slot_mapping = torch.empty_like(last_positions)
    seq_lens = torch.empty(rows, dtype=torch.int32, device=last_positions.device)
    if rows:
        block = 128
        _depth_rows_kernel[(triton.cdiv(rows, block),)](
            last_positions,
            tables,
            tables.stride(0),
            tables.shape[1],
            positions,
            slot_mapping,
            seq_lens,
            rows,
            depth,
            block_size,
            pad_block,
            BLOCK=block,
        )
    return positions, slot_mapping, seq_lens


if triton is not None:

    @triton.jit
    def _table_block(tables_ptr, row, stride_table, width, column, pad_block, mask):
        """Block ``column`` of table row ``row``, ``pad_block`` past the width."""
        inside = mask & (column < width)
        block = tl.load(tables_ptr + row * stride_table + column, mask=inside, other=0)
        return tl.where(inside, block.to(tl.int64), pad_block)

    @triton.jit(do_not_specialize=["stride_table", "width", "scratch", "pad_block"])
    def _verify_rows_kernel(
        slot_ids_ptr,
        next_start_ptr,
        last_token_ptr,
        drafts_ptr,
        stride_drafts,
        tables_ptr,
        stride_table,
        width,
        start_ptr,
        positions_ptr,
        input_ids_ptr,
        slot_mapping_ptr,
        seq_lens_ptr,
        scratch,
        block_size,
        pad_block,
        Q: tl.constexpr,
        Q_PAD: tl.constexpr,
    ):
        """One row: its start, positions, tokens, KV slots and sequence length."""
        row = tl.program_id(0)
        slot = tl.load(slot_ids_ptr + row)
        start = tl.load(next_start_ptr + slot)
        start = tl.where(slot == scratch, 0, start)
        offs = tl.arange(0, Q_PAD)
        ok = offs < Q
        positions = start + offs
        last = tl.load(last_token_ptr + slot)
        drafts = tl.load(drafts_ptr + slot * stride_drafts + offs - 1, mask=ok & (offs > 0))
        tokens = tl.where(offs == 0, last, drafts)
        blocks = _table_block(
            tables_ptr, row, stride_table, width, positions // block_size, pad_block, ok
        )
        flat = row * Q + offs
        tl.store(positions_ptr + flat, positions, mask=ok)
        tl.store(input_ids_ptr + flat, tokens, mask=ok)
        tl.store(slot_mapping_ptr + flat, blocks * block_size + positions % block_size, mask=ok)
        tl.store(start_ptr + row, start)
        tl.store(seq_lens_ptr + row, (start + Q).to(tl.int32))

    @triton.jit
    def _accept_kernel(
        candidates_ptr,
        input_ids_ptr,
        emitted_in_ptr,
        start_ptr,
        slot_ids_ptr,
        next_start_ptr,
        last_token_ptr,
        emitted_ptr,
        kept_ptr,
        last_positions_ptr,
        K: tl.constexpr,
        K_PAD: tl.constexpr,
        GREEDY: tl.constexpr,
    ):
        """One row: accepted drafts (greedy: up to the first candidate that differs), the
        slot's next start and bonus token, the row's kept index and last position."""
        row = tl.program_id(0)
        base = row * (K + 1)
        if GREEDY:
            offs = tl.arange(0, K_PAD)
            ok = offs < K
            drafts = tl.load(input_ids_ptr + base + 1 + offs, mask=ok, other=0)
            candidates = tl.load(candidates_ptr + base + offs, mask=ok, other=0)
            accepted = tl.min(tl.where(ok & (drafts != candidates), offs, K), axis=0)
        else:
            accepted = tl.load(emitted_in_ptr + row) - 1
        accepted = accepted.to(tl.int64)
        start = tl.load(start_ptr + row)
        slot = tl.load(slot_ids_ptr + row)
        tl.store(next_start_ptr + slot, start + accepted + 1)
        tl.store(last_token_ptr + slot, tl.load(candidates_ptr + base + accepted))
        tl.store(emitted_ptr + row, accepted + 1)
        tl.store(kept_ptr + row, base + accepted)
        tl.store(last_positions_ptr + row, start + accepted)

    @triton.jit(do_not_specialize=["stride_table", "width", "rows", "depth", "pad_block"])
    def _depth_rows_kernel(
        last_positions_ptr,
        tables_ptr,
        stride_table,
        width,
        positions_ptr,
        slot_mapping_ptr,
        seq_lens_ptr,
        rows,
        depth,
        block_size,
        pad_block,
        BLOCK: tl.constexpr,
    ):
        """BLOCK rows of one draft depth: positions, KV slots, sequence lengths."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < rows
        positions = tl.load(last_positions_ptr + offs, mask=ok, other=0) + depth
        blocks = _table_block(
            tables_ptr, offs, stride_table, width, positions // block_size, pad_block, ok
        )
        tl.store(positions_ptr + offs, positions, mask=ok)
        tl.store(slot_mapping_ptr + offs, blocks * block_size + positions % block_size, mask=ok)
        tl.store(seq_lens_ptr + offs, (positions + 1).to(tl.int32), mask=ok)
