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
        partials are read at L2 (``.cg``): they were written by other programs."""
        m_max = tl.full(first_row.shape, float("-inf"), dtype=tl.float32)
        for split in range(NUM_SPLITS):
            m = tl.load(
                part_ml_ptr + (first_row + split) * 2,
                mask=row_ok,
                other=float("-inf"),
                cache_modifier=".cg",
            )
            m_max = tl.maximum(m_max, m)  # finite on a kept row: split 0 holds key 0
        m_max = tl.where(m_max > float("-inf"), m_max, 0.0)  # rows not kept: no -inf - -inf
        total = tl.zeros(first_row.shape, dtype=tl.float32)
        acc = tl.zeros([first_row.shape[0], HEAD_DIM_PAD], dtype=tl.float32)
        for split in range(NUM_SPLITS):
            row = first_row + split
            m = tl.load(
                part_ml_ptr + row * 2, mask=row_ok, other=float("-inf"), cache_modifier=".cg"
            )
            lsum = tl.load(part_ml_ptr + row * 2 + 1, mask=row_ok, other=0.0, cache_modifier=".cg")
            weight = tl.exp2(m - m_max)  # 0 where the range saw no key (m = -inf)
            total += weight * lsum
            part = tl.load(
                part_out_ptr + row[:, None] * HEAD_DIM_PAD + offs_d[None, :],
                mask=row_ok[:, None],
                other=0.0,
                cache_modifier=".cg",
            )
            acc += part * weight[:, None]
        return acc, total
