"""Device helper of the paged attention kernel's flash-decoding form
(:mod:`tandem.layers.triton_attention_kernels`, ``NUM_SPLITS > 1``): the combination of a
query tile's key ranges, run by the last of the tile's programs to finish.

Triton is imported under a guard: without it this module defines nothing.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # tandem imports without triton
    triton = None
    tl = None


if triton is not None:

    @triton.jit
    def _combine_splits(
        part_out_ptr,
        part_ml_ptr,
        first_row,
        row_ok,
        offs_d,
        NUM_SPLITS: tl.constexpr,
        HEAD_DIM_PAD: tl.constexpr,
    ):
        """The splits' partial outputs of each row [BLOCK_M], weighted by exp2(m - max), and
        their weighted sum (the unnormalized output and its divisor), splits in order. The
        partials are read at L2 (``.cg``): they were written by other programs. Every load
        is independent of the sums (the maxima and sums in one [rows, splits] load, the
        unrolled loop's outputs after), so they are in flight together: in a loop whose
        loads wait on each other, the L2's latency adds up split by split."""
        splits = tl.arange(0, NUM_SPLITS)
        pairs = part_ml_ptr + (first_row[:, None] + splits[None, :]) * 2
        m = tl.load(pairs, mask=row_ok[:, None], other=float("-inf"), cache_modifier=".cg")
        lsum = tl.load(pairs + 1, mask=row_ok[:, None], other=0.0, cache_modifier=".cg")
        m_max = tl.max(m, 1)  # finite on a kept row: split 0 holds key 0
        m_max = tl.where(m_max > float("-inf"), m_max, 0.0)  # rows not kept: no -inf - -inf
        # exp2(-inf) = 0 where a range saw no key
        total = tl.sum(tl.exp2(m - m_max[:, None]) * lsum, 1)
        acc = tl.zeros([first_row.shape[0], HEAD_DIM_PAD], dtype=tl.float32)
        for split in tl.static_range(NUM_SPLITS):
            row = first_row + split
            m_split = tl.load(
                part_ml_ptr + row * 2, mask=row_ok, other=float("-inf"), cache_modifier=".cg"
            )
            part = tl.load(
                part_out_ptr + row[:, None] * HEAD_DIM_PAD + offs_d[None, :],
                mask=row_ok[:, None],
                other=0.0,
                cache_modifier=".cg",
            )
            acc += part * tl.exp2(m_split - m_max)[:, None]
        return acc, total
