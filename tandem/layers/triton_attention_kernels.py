"""The Triton kernels of paged attention: one program per (query tile, KV head[, key range])
over a ragged batch, and the combination of flash-decoding's key ranges.

The batch layout, the launch choices and the backend that calls these are in
:mod:`tandem.layers.triton_attention`; this module holds only device code. Each kernel keeps
its leading underscore: profiles and the benchmark JSONs name kernels by function name.

Design
------
Grid ``(T // BLOCK_Q + B, H_kv)``, from sizes alone (no host value is read at launch).

* Axis 1 is the KV head. A program handles the whole GQA group of that head: its query
  tile has ``BLOCK_M`` rows, row m being query row ``m // GROUP`` of the tile and query
  head ``kv_head * GROUP + m % GROUP``. The group thus shares every K/V tile it loads, and
  the tile is tall enough for tensor-core dots even for a decode row (``BLOCK_M >= 16``).
  ``BLOCK_Q = BLOCK_M // GROUP`` query rows per tile; rows past ``BLOCK_Q * GROUP`` (when
  GROUP is not a power of two) are masked.
* Axis 0 numbers query tiles. Request b's query rows are cut into ``cdiv(query_len,
  BLOCK_Q)`` tiles and its first tile is numbered ``query_start_loc[b] // BLOCK_Q + b``.
  That start is increasing in b and leaves room for all of b's tiles, so
  ``T // BLOCK_Q + B`` tiles bound the total; a program finds its request by a binary
  search over ``query_start_loc`` on the device and returns at once when its tile lies
  past its request's rows (the few spare programs of the bound).
* Each program loops over its request's keys in tiles of ``BLOCK_N`` positions, from 0 to
  the position of its last query row (so causally hidden tiles are never loaded). Each
  key's physical slot is looked up through the block table (block ``pos // block_size``,
  slot ``pos % block_size``), so tiles may span blocks and the block size need not be a
  power of two. Scores and the online softmax (running max, sum and output) are fp32,
  with the scale folded into ``exp2``; masking is one ``where`` per tile: key inside the
  request and key position <= query position. Key 0 is visible to every row, so every
  row's running max is finite after the first tile and no row divides by zero.
* ``BLOCK_M`` is 16 when ``max_query_len * GROUP <= 16`` (decode and short verification
  batches) and 64 otherwise: a host-side choice from an upper bound, as allowed. A batch
  that mixes the two kinds (continuous batching: decode rows next to a prefill chunk) runs
  two launches over the same grid rule, the first taking only the requests whose rows fit
  the 16-row tile and the second only the others, so decode rows do not fill a quarter of
  a 64-row tile (and hold its registers) while their keys stream past.

Flash-decoding: for decode and short verification tiles (``BLOCK_M = 16``) of a small
batch, grid axis 2 splits each tile's keys into ``num_splits`` consecutive ranges (chosen on
the host from the batch size and head count, so a CUDA graph keeps it), each program
writing its unnormalized output with its running max and sum; a second kernel combines
the splits. Rows with no visible key in a range leave max -inf and sum 0 there, which the
combination weighs 0; the first range holds key 0, so every row has one finite range.

Rotating form (``ROTATE``, decode and verification launches only: every request's rows fit
one 16-row tile): the queries and the step's own keys arrive unrotated from the projection
and the cache does not hold the step's keys and values yet. The queries are rotated as they
load; the loop reads only cached keys (positions before the first query row); the step's
own keys (all in the program's one tile) follow, rotated from the projection exactly as
the rotation kernel rotates them, and the program of split 0 stores them and the values
after attending (the rotation: ``fused_rotary._rotated_rows``). Every position is the layout's:
query row j of a request sits at ``seq_lens - query_len + j``.

Triton is imported under a guard: without it this module defines no kernel.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # tandem imports without triton; paged_attention then raises
    triton = None
    tl = None


if triton is not None:
    from tandem.layers.dependent_launch import pdl_prologue
    from tandem.layers.fused_rotary import _rotated_rows

    @triton.jit
    def _find_request(query_start_loc_ptr, tile, num_seqs, BLOCK_Q: tl.constexpr):
        """The request whose query tiles include ``tile`` (request b's first tile is
        ``query_start_loc[b] // BLOCK_Q + b``): binary search for the last start <= tile."""
        lo: tl.int32 = 0
        hi = num_seqs
        while lo < hi:
            mid = (lo + hi) // 2
            start = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
            if start <= tile:
                lo = mid + 1
            else:
                hi = mid
        return lo - 1

    @triton.jit
    def _attend_keys(
        q, k, v, key_ok, key_pos, query_pos, m_i, l_i, acc, scale_log2, DOT_PRECISION: tl.constexpr
    ):
        """One tile of keys ``k`` and values ``v`` [N, D] (rows; ``key_ok`` [N] the real ones
        at ``key_pos``) into the online softmax of the query rows ``q`` [M, D] at
        ``query_pos`` (causal): the running max ``m_i``, sum ``l_i`` and output ``acc``,
        updated. Scores in base 2 (``scale_log2``), fp32."""
        scores = tl.dot(q, tl.trans(k).to(q.dtype), input_precision=DOT_PRECISION) * scale_log2
        visible = key_ok[None, :] & (key_pos[None, :] <= query_pos[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_new = tl.where(m_new > float("-inf"), m_new, 0.0)  # nothing visible yet
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(
            p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION
        )
        return m_new, l_i, acc

    # The batch size and the block table's width change from step to step: left
    # unspecialized, so a new value never compiles a new variant in the middle of a run.
    @triton.jit(do_not_specialize=["num_seqs", "stride_bt"])
    def _paged_attention_kernel(
        out_ptr,
        q_ptr,
        k_cache_ptr,
        v_cache_ptr,
        block_tables_ptr,
        query_start_loc_ptr,
        seq_lens_ptr,
        scale_log2,
        num_seqs,
        stride_qt,
        stride_qh,
        stride_qd,
        stride_ot,
        stride_oh,
        stride_od,
        stride_kb,
        stride_ks,
        stride_kh,
        stride_kd,
        stride_vb,
        stride_vs,
        stride_vh,
        stride_vd,
        stride_bt,
        part_out_ptr,
        part_ml_ptr,
        new_k_ptr,
        new_v_ptr,
        slot_mapping_ptr,
        cos_ptr,
        sin_ptr,
        stride_nkt,
        stride_nkh,
        stride_nvt,
        stride_nvh,
        stride_c,
        GROUP: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        HEAD_DIM_PAD: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_Q: tl.constexpr,
        BLOCK_N: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        ROWS: tl.constexpr,
        SHORT_Q: tl.constexpr,
        ROTATE: tl.constexpr,
        PDL_WAIT: tl.constexpr,
        PDL_RELEASE: tl.constexpr,
    ):
        """One query tile (BLOCK_Q rows x the GQA group of one KV head) of one request; with
        NUM_SPLITS > 1, one of that many consecutive ranges of its key tiles, whose partial
        output, running max and sum go to ``part_out`` / ``part_ml`` for the reduction.
        ROWS 1 takes only requests of at most SHORT_Q query rows, ROWS 2 only the others
        (0: all). With ROTATE the queries come unrotated and the step's own keys and
        values are not in the cache yet: the program rotates the queries as it loads them,
        takes the step's keys (rotated) and values from ``new_k`` / ``new_v`` instead of
        the cache, and split 0 stores its tile's keys and values at their
        ``slot_mapping`` slots (what ``fused_rotary.rotary_store_kv`` does, in this
        launch; no program reads those slots here). PDL_WAIT / PDL_RELEASE:
        ``dependent_launch.pdl_prologue``."""
        pdl_prologue(PDL_WAIT, PDL_RELEASE)
        tile = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        seq = _find_request(query_start_loc_ptr, tile, num_seqs, BLOCK_Q)
        q_start = tl.load(query_start_loc_ptr + seq)
        q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
        tile_in_seq = tile - (q_start // BLOCK_Q + seq)
        if tile_in_seq * BLOCK_Q >= q_len:
            return
        if ROWS == 1 and q_len > SHORT_Q:
            return
        if ROWS == 2 and q_len <= SHORT_Q:
            return
        context = tl.load(seq_lens_ptr + seq) - q_len  # positions before the first query row

        offs_m = tl.arange(0, BLOCK_M)
        q_row = tile_in_seq * BLOCK_Q + offs_m // GROUP  # query row within the request
        head = kv_head * GROUP + offs_m % GROUP
        row_ok = (offs_m < BLOCK_Q * GROUP) & (q_row < q_len)
        query_pos = context + q_row
        token = (q_start + q_row).to(tl.int64)
        offs_d = tl.arange(0, HEAD_DIM_PAD)
        d_ok = offs_d < HEAD_DIM

        if ROTATE:
            q = _rotated_rows(
                q_ptr,
                token * stride_qt + head * stride_qh,
                row_ok,
                query_pos,
                cos_ptr,
                sin_ptr,
                stride_c,
                offs_d,
                HEAD_DIM,
            )
        else:
            q = tl.load(
                q_ptr
                + token[:, None] * stride_qt
                + head[:, None] * stride_qh
                + offs_d[None, :] * stride_qd,
                mask=row_ok[:, None] & d_ok[None, :],
                other=0.0,
            )
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)

        # Keys [0, kv_end) reach the tile's last query row; later ones are causally hidden.
        kv_end = context + tl.minimum((tile_in_seq + 1) * BLOCK_Q, q_len)
        offs_n = tl.arange(0, BLOCK_N)
        table_row = block_tables_ptr + seq * stride_bt
        kv_start = 0
        if NUM_SPLITS > 1:
            tiles_per_split = tl.cdiv(tl.cdiv(kv_end, BLOCK_N), NUM_SPLITS)
            kv_start = split * tiles_per_split * BLOCK_N
            kv_end = tl.minimum(kv_end, kv_start + tiles_per_split * BLOCK_N)
        cached_end = kv_end
        if ROTATE:  # the step's own keys are not in the cache yet: they come after the loop
            cached_end = tl.minimum(kv_end, context)
        for start_n in range(kv_start, cached_end, BLOCK_N):
            key_pos = start_n + offs_n
            key_ok = key_pos < cached_end
            block = tl.load(table_row + key_pos // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
            slot = key_pos % BLOCK_SIZE
            # Keys loaded as rows (each key's head_dim contiguous).
            k = tl.load(
                k_cache_ptr
                + block[:, None] * stride_kb
                + slot[:, None] * stride_ks
                + kv_head * stride_kh
                + offs_d[None, :] * stride_kd,
                mask=key_ok[:, None] & d_ok[None, :],
                other=0.0,
            )
            v = tl.load(
                v_cache_ptr
                + block[:, None] * stride_vb
                + slot[:, None] * stride_vs
                + kv_head * stride_vh
                + offs_d[None, :] * stride_vd,
                mask=key_ok[:, None] & d_ok[None, :],
                other=0.0,
            )
            m_i, l_i, acc = _attend_keys(
                q, k, v, key_ok, key_pos, query_pos, m_i, l_i, acc, scale_log2, DOT_PRECISION
            )
        if ROTATE:
            # The step's own keys and values, after the cached ones (the launch is refused
            # rows past one tile, so this tile holds all of its request's q_len rows): each
            # rotated once from new_k, attended where it lies in this range, and stored by
            # split 0 after that (no program of the launch reads them from the cache).
            own = offs_m < q_len
            own_pos = context + offs_m
            own_token = tl.where(own, q_start + offs_m, 0).to(tl.int64)
            own_mask = own[:, None] & d_ok[None, :]
            k = _rotated_rows(
                new_k_ptr,
                own_token * stride_nkt + kv_head * stride_nkh,
                own,
                own_pos,
                cos_ptr,
                sin_ptr,
                stride_c,
                offs_d,
                HEAD_DIM,
            ).to(k_cache_ptr.dtype.element_ty)
            v = tl.load(
                new_v_ptr
                + (own_token * stride_nvt + kv_head * stride_nvh)[:, None]
                + offs_d[None, :],
                mask=own_mask,
                other=0.0,
            ).to(v_cache_ptr.dtype.element_ty)
            in_range = own & (own_pos >= kv_start) & (own_pos < kv_end)
            m_i, l_i, acc = _attend_keys(
                q, k, v, in_range, own_pos, query_pos, m_i, l_i, acc, scale_log2, DOT_PRECISION
            )
            if (
                split == 0
            ):  # into their cache slots (flat slot s: s % BLOCK_SIZE of block s // BLOCK_SIZE)
                slot = tl.load(slot_mapping_ptr + own_token, mask=own, other=0).to(tl.int64)
                block, within = slot // BLOCK_SIZE, slot % BLOCK_SIZE
                tl.store(
                    k_cache_ptr
                    + (block * stride_kb + within * stride_ks + kv_head * stride_kh)[:, None]
                    + offs_d[None, :] * stride_kd,
                    k,
                    mask=own_mask,
                )
                tl.store(
                    v_cache_ptr
                    + (block * stride_vb + within * stride_vs + kv_head * stride_vh)[:, None]
                    + offs_d[None, :] * stride_vd,
                    v,
                    mask=own_mask,
                )
        if NUM_SPLITS > 1:
            # Partials [T, H_q, NUM_SPLITS, HEAD_DIM_PAD] and [T, H_q, NUM_SPLITS, 2] (fp32).
            part_row = (token * (GROUP * tl.num_programs(1)) + head) * NUM_SPLITS + split
            tl.store(
                part_out_ptr + part_row[:, None] * HEAD_DIM_PAD + offs_d[None, :],
                acc,
                mask=row_ok[:, None],
            )
            # A row that saw no key here stores max -inf (its loop left 0 in m_i).
            tl.store(
                part_ml_ptr + part_row * 2, tl.where(l_i > 0.0, m_i, float("-inf")), mask=row_ok
            )
            tl.store(part_ml_ptr + part_row * 2 + 1, l_i, mask=row_ok)
            return
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr
            + token[:, None] * stride_ot
            + head[:, None] * stride_oh
            + offs_d[None, :] * stride_od,
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )


if triton is not None:

    @triton.jit
    def _combine_splits_kernel(
        out_ptr,
        part_out_ptr,
        part_ml_ptr,
        stride_ot,
        stride_oh,
        stride_od,
        num_heads,
        NUM_SPLITS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        HEAD_DIM_PAD: tl.constexpr,
        PDL_WAIT: tl.constexpr,
        PDL_RELEASE: tl.constexpr,
    ):
        """One (query row, head): the splits' partial outputs weighted by exp2(m - max)."""
        pdl_prologue(PDL_WAIT, PDL_RELEASE)
        token = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        row = (token * num_heads + head) * NUM_SPLITS
        splits = tl.arange(0, NUM_SPLITS)
        offs_d = tl.arange(0, HEAD_DIM_PAD)
        m = tl.load(part_ml_ptr + (row + splits) * 2)
        lsum = tl.load(part_ml_ptr + (row + splits) * 2 + 1)
        m_max = tl.max(m, 0)  # finite: split 0 holds key 0, visible to every row
        weight = tl.where(m > float("-inf"), tl.exp2(m - m_max), 0.0)
        total = tl.sum(weight * lsum, 0)
        acc = tl.load(part_out_ptr + (row + splits)[:, None] * HEAD_DIM_PAD + offs_d[None, :])
        out = tl.sum(acc * weight[:, None], 0) / total
        tl.store(
            out_ptr + token * stride_ot + head * stride_oh + offs_d * stride_od,
            out.to(out_ptr.dtype.element_ty),
            mask=offs_d < HEAD_DIM,
        )
