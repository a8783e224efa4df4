"""Per-row cut-off of top-k, top-p and min-p filtering, without sorting the vocabulary.

Every filter keeps the tokens whose probability reaches a per-row threshold, so the kept
set (their intersection) is ``p >= threshold`` with the largest of the three thresholds
(the definitions are in :func:`tandem.layers.sampler.apply_filters`). The Triton kernel
finds each row's threshold by a search over the bit patterns of the fp32 probabilities:
for non-negative floats the int32 pattern orders like the value, so "the largest t whose
count (top-k) or mass (top-p) of ``{p >= t}`` reaches a goal" is a search over integers.
Each pass over the row tests 16 evenly spaced candidates at once and keeps the interval
where the goal stops being met, so a row takes at most 8 passes per filter (plus one for
the maximum and one for the mass of the top-k set), where a sort of a 128k vocabulary
costs far more. The top-k and top-p thresholds are exact: each is one of the row's
probabilities, the same bits as the sort-based reference finds. Only the top-p mass
comparison can differ, and only where ``top_p * mass`` ties a cumulative mass within fp32
rounding (the two sum in different orders).

The PyTorch reference runs on the CPU and wherever triton is missing; ``use_triton=True``
forces the kernel (tests run it in Triton's interpreter). Neither reads a device value on
the host.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # tandem runs without triton: the threshold takes its PyTorch form
    triton = None
    tl = None

PIVOTS = 16  # candidates tested per pass over a row: 4 bits of the threshold per pass
BLOCK = 512  # probabilities per block of a pass: BLOCK x PIVOTS compares (no register spill)
_MIN_ROWS = 256  # fewer rows than this: the sort is faster (filter_threshold's docstring)


def filter_threshold_reference(
    probs: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
) -> torch.Tensor:
    """Per row of ``probs`` [N, V] (fp32, the tempered softmax) the threshold [N] of the
    kept set ``probs >= threshold``, by sorting: top-k's k-th largest probability (0 where
    ``top_k >= V``), top-p's largest t whose mass of ``{p >= t}`` within the top-k set
    reaches ``top_p`` times that set's mass (0 where ``top_p >= 1``), ``min_p * max(p)``;
    the largest of them."""
    num_rows, vocab = probs.shape
    threshold = probs.new_zeros(num_rows)
    if top_k is not None or top_p is not None:
        sorted_probs = probs.sort(dim=-1, descending=True).values
    if top_k is not None:
        k = top_k.clamp(1, vocab)
        kth = sorted_probs.gather(1, (k - 1)[:, None]).squeeze(1)
        threshold = torch.where(k < vocab, kth, threshold)
    if top_p is not None:
        in_top_k = sorted_probs >= threshold[:, None]
        kept_mass = torch.where(probs >= threshold[:, None], probs, 0.0).sum(dim=-1)
        cumulative = torch.where(in_top_k, sorted_probs, 0.0).cumsum(dim=-1)
        # The first sorted position whose running mass reaches the goal holds t_p: the mass
        # of {p >= its value} (the running mass after its ties) reaches the goal, and the
        # mass of {p >= any larger value} (a running mass before it) does not.
        first = (cumulative < (top_p * kept_mass)[:, None]).sum(dim=-1).clamp(max=vocab - 1)
        top_p_threshold = sorted_probs.gather(1, first[:, None]).squeeze(1)
        threshold = torch.where(top_p < 1.0, threshold.maximum(top_p_threshold), threshold)
    if min_p is not None:
        threshold = threshold.maximum(min_p * probs.max(dim=-1).values)
    return threshold


def filter_threshold(
    probs: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
    use_triton: bool | None = None,
) -> torch.Tensor:
    """``filter_threshold_reference`` by one program per row where that pays, or always
    with ``use_triton=True``. Measured on the H200 at the 128,256-token vocabulary
    (``scripts/kernel_sweep.py``, benchmarks/results/kernels/kernel-sweep-sampling-*.json): with
    one of top-k and top-p, 256 rows take 2.22 / 2.67 ms against the sort's 2.42 / 3.44;
    64 rows (too few programs to fill the GPU) 1.44 / 1.76 ms against 0.66 / 1.12, and both
    filters together need two searches (4.71 ms against 3.35 at 256 rows). So by default
    the kernel runs on CUDA for 256 rows or more with exactly one of the two (min-p alone
    is a row maximum: no search, no sort)."""
    if use_triton is None:
        use_triton = (
            triton is not None
            and probs.is_cuda
            and probs.shape[0] >= _MIN_ROWS
            and (top_k is None) != (top_p is None)
        )
    if not use_triton:
        return filter_threshold_reference(probs, top_k, top_p, min_p)
    if probs.dtype != torch.float32 or probs.stride(-1) != 1:
        raise ValueError("filter_threshold needs fp32 probs, contiguous in the vocabulary")
    num_rows, vocab = probs.shape
    threshold = torch.empty(num_rows, dtype=torch.float32, device=probs.device)
    if num_rows:
        _threshold_kernel[(num_rows,)](
            probs,
            threshold,
            probs.stride(0),
            vocab,
            top_k if top_k is not None else probs,
            top_p if top_p is not None else probs,
            min_p if min_p is not None else probs,
            HAS_TOP_K=top_k is not None,
            HAS_TOP_P=top_p is not None,
            HAS_MIN_P=min_p is not None,
            BLOCK=BLOCK,
            PIVOTS=PIVOTS,
        )
    return threshold


if triton is not None:

    @triton.jit
    def _row_max(row_ptr, n_cols, BLOCK: tl.constexpr):
        offsets = tl.arange(0, BLOCK)
        largest = tl.zeros([BLOCK], tl.float32)
        for start in range(0, n_cols, BLOCK):
            cols = start + offsets
            p = tl.load(row_ptr + cols, mask=cols < n_cols, other=0.0)
            largest = tl.maximum(largest, p)
        return tl.max(largest, axis=0)

    @triton.jit
    def _tally(
        row_ptr, n_cols, candidates, MASS: tl.constexpr, BLOCK: tl.constexpr, PIVOTS: tl.constexpr
    ):
        """Per candidate (fp32 bit patterns [PIVOTS]): how many probabilities of the row are
        >= it, or with MASS their sum."""
        offsets = tl.arange(0, BLOCK)
        total = tl.zeros([PIVOTS], tl.float32)
        for start in range(0, n_cols, BLOCK):
            cols = start + offsets
            # -1.0 past the row: its (negative) pattern is below every candidate.
            p = tl.load(row_ptr + cols, mask=cols < n_cols, other=-1.0)
            above = p.to(tl.int32, bitcast=True)[:, None] >= candidates[None, :]
            if MASS:
                total += tl.sum(tl.where(above, p[:, None], 0.0), axis=0)
            else:
                total += tl.sum(above.to(tl.float32), axis=0)
        return total

    @triton.jit
    def _search(
        row_ptr, n_cols, lo, hi, goal, MASS: tl.constexpr, BLOCK: tl.constexpr, PIVOTS: tl.constexpr
    ):
        """The largest bit pattern t in [lo, hi) whose tally meets ``goal``, given that lo's
        does and hi's does not (the tally only falls as t grows)."""
        pivots = tl.arange(0, PIVOTS)
        while hi - lo > 1:
            step = (hi - lo + PIVOTS - 1) // PIVOTS
            candidates = tl.minimum(lo + step * pivots, hi - 1)
            meets = _tally(row_ptr, n_cols, candidates, MASS, BLOCK, PIVOTS) >= goal
            lo = tl.max(tl.where(meets, candidates, lo), axis=0)
            hi = tl.min(tl.where(meets, hi, candidates), axis=0)
        return lo

    @triton.jit
    def _threshold_kernel(
        probs_ptr,
        out_ptr,
        stride,
        n_cols,
        top_k_ptr,
        top_p_ptr,
        min_p_ptr,
        HAS_TOP_K: tl.constexpr,
        HAS_TOP_P: tl.constexpr,
        HAS_MIN_P: tl.constexpr,
        BLOCK: tl.constexpr,
        PIVOTS: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        row_ptr = probs_ptr + row * stride
        p_max = _row_max(row_ptr, n_cols, BLOCK)
        # Nothing is >= the pattern after p_max: every search ends at or below p_max.
        hi = p_max.to(tl.int32, bitcast=True) + 1
        threshold = hi * 0
        if HAS_TOP_K:
            k = tl.minimum(tl.maximum(tl.load(top_k_ptr + row), 1), n_cols)
            if k < n_cols:
                threshold = _search(
                    row_ptr, n_cols, threshold, hi, k.to(tl.float32), False, BLOCK, PIVOTS
                )
        if HAS_TOP_P:
            top_p = tl.load(top_p_ptr + row)
            if top_p < 1.0:
                kept = _tally(
                    row_ptr, n_cols, threshold + tl.zeros([PIVOTS], tl.int32), True, BLOCK, PIVOTS
                )
                threshold = _search(
                    row_ptr,
                    n_cols,
                    threshold,
                    hi,
                    top_p * tl.max(kept, axis=0),
                    True,
                    BLOCK,
                    PIVOTS,
                )
        if HAS_MIN_P:
            min_p_threshold = tl.load(min_p_ptr + row) * p_max
            threshold = tl.maximum(threshold, min_p_threshold.to(tl.int32, bitcast=True))
        tl.store(out_ptr + row, threshold.to(tl.float32, bitcast=True))
