"""Triton kernels of `hpcops.prefill_attention` (only @triton.jit code; the launcher is prefill.py).

One program computes one (query tile, kv head) pair. A query tile holds `BLOCK_M // GROUP`
consecutive new tokens of one request times the `GROUP` query heads that share the kv head
(GQA packing), so each K/V tile is read once for the whole group. The tiles of every request are
enumerated from a flat list built in-kernel from `cu_seqlens_q` with a prefix sum (no host sync),
heaviest (last, causal) tile of each request first. See PREFILL.md.
One KV step (`_prefill_kv_tile`) is built from the paged-KV tile routine shared with decode,
`_paged_tile.py` (block-table lookup, bad-block clamp, K/V loads, online-softmax step).
"""

from __future__ import annotations

import triton
import triton.language as tl

from hpcops.attention._paged_tile import (
    _accumulate_pv,
    _clamp_block,
    _load_block_id,
    _load_kv_tile,
    _softmax_step,
    _tile_scores,
)


@triton.jit
def _prefill_kv_tile(
    acc,
    m_i,
    l_i,
    q,
    row_scale,
    start_n,
    kv_limit,
    seq_len,
    bt_row,
    max_blocks,
    num_blocks,
    k_ptr,
    v_ptr,
    k_desc,
    v_desc,
    k_col,
    v_col,
    stride_kb,
    stride_kt,
    stride_kd,
    stride_vb,
    stride_vt,
    stride_vd,
    k_head_off,
    v_head_off,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    KV_FP8: tl.constexpr,
    QK_FP8: tl.constexpr,
    PV_FP8: tl.constexpr,
    MASKED: tl.constexpr,
    USE_TMA: tl.constexpr,
    FMA_SCALE: tl.constexpr,
):
    """One online-softmax step over keys [start_n, start_n + BLOCK_N) of the paged cache.

    `row_scale` [BLOCK_M]: the logit scale of each row in the exp2 domain (softmax scale · log2 e, times
    k_scale with fp8 KV and q's row scale with fp8 q). With FMA_SCALE (all row scales > 0) the max is
    taken on the raw dot product and the scale is applied inside exp2's argument (one FFMA per logit).
    """
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    kv_mask = offs_n < seq_len
    if USE_TMA or (PAGE % BLOCK_N == 0):
        # the whole tile lies in one page: one block id, contiguous slots (a column past the table's
        # width reads its last entry)
        blk = _load_block_id(bt_row, start_n // PAGE, max_blocks, True, True)
    else:
        page_idx = offs_n // PAGE
        kv_mask = kv_mask & (page_idx < max_blocks)
        blk = _load_block_id(bt_row, page_idx, max_blocks, kv_mask, False)  # [BLOCK_N]
    blk, _ = _clamp_block(blk, num_blocks, True)  # a bad block id (unchecked) reads block 0
    # USE_TMA: one page per tile; the cache is seen as 2-D [num_blocks * PAGE, row] with kv heads as columns
    row0 = blk * PAGE + start_n % PAGE
    slot = (offs_n % PAGE).to(tl.int64)
    k_rows = blk.to(tl.int64) * stride_kb + slot * stride_kt
    v_rows = blk.to(tl.int64) * stride_vb + slot * stride_vt
    k_ptrs = k_ptr + k_head_off + k_rows[:, None] + offs_d[None, :] * stride_kd
    v_ptrs = v_ptr + v_head_off + v_rows[:, None] + offs_d[None, :] * stride_vd
    # K rows past seq_len are masked in the scores; their TMA rows are not zeroed
    k = _load_kv_tile(
        k_ptrs, kv_mask[:, None], k_desc, row0, k_col, kv_mask, USE_TMA, MASKED and not USE_TMA
    )  # [BLOCK_N, HEAD_DIM]
    s = _tile_scores(q, k, KV_FP8, QK_FP8)  # [BLOCK_M, BLOCK_N] fp32
    if not FMA_SCALE:
        s = s * row_scale[:, None]
    if MASKED:
        # kv_limit <= seq_len - 1, so the causal test also masks the slots past seq_len
        s = tl.where(offs_n[None, :] <= kv_limit[:, None], s, float("-inf"))
    p, alpha, m_new, l_i = _softmax_step(s, m_i, l_i, row_scale, FMA_SCALE)
    # slots past seq_len in the last page may hold anything (NaN): P = 0 there is not enough
    v = _load_kv_tile(v_ptrs, kv_mask[:, None], v_desc, row0, v_col, kv_mask, USE_TMA, MASKED)  # [BLOCK_N, HEAD_DIM]
    if PV_FP8:
        # P in [0, 1] is scaled by 256 into e4m3's normal range; the epilogue divides it out
        acc = _accumulate_pv(acc, alpha, p * 256.0, v, v.dtype, True)
    elif QK_FP8:
        acc = _accumulate_pv(acc, alpha, p, v, tl.bfloat16, True)
    elif KV_FP8:
        acc = _accumulate_pv(acc, alpha, p, v, q.dtype, True)
    else:
        acc = _accumulate_pv(acc, alpha, p, v, v.dtype, True)
    return acc, m_new, l_i


@triton.jit
def prefill_attention_fwd_kernel(
    q_ptr,
    stride_qt,
    stride_qh,
    stride_qd,
    q_scale_ptr,
    stride_qst,
    stride_qsh,
    k_ptr,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_kd,
    v_ptr,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_vd,
    block_table_ptr,
    stride_bt,
    max_blocks,
    num_blocks,
    seq_lens_ptr,
    cu_seqlens_q_ptr,
    k_scale_ptr,
    v_scale_ptr,
    k_desc,
    v_desc,
    out_ptr,
    stride_ot,
    stride_oh,
    stride_od,
    sm_scale,
    num_reqs,
    tiles_per_head,
    num_kv_heads,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_B: tl.constexpr,
    Q_FP8: tl.constexpr,
    KV_FP8: tl.constexpr,
    PV_FP8: tl.constexpr,
    USE_TMA: tl.constexpr,
    QUANT_Q: tl.constexpr,
    FMA_SCALE: tl.constexpr,
    HEADS_INNER: tl.constexpr,
):
    # an fp8 P·V dot has K = BLOCK_N; fp8 MMAs (mma.sync and wgmma) need K >= 32 (the interpreter
    # accepts any K, so this is asserted here rather than found by the GPU compile)
    tl.static_assert(not PV_FP8 or BLOCK_N >= 32, "PV_FP8 needs BLOCK_N >= 32")
    TOKENS: tl.constexpr = BLOCK_M // GROUP  # new tokens per query tile
    QK_FP8: tl.constexpr = Q_FP8 or QUANT_Q  # an fp8 q tile (given, or quantized here)
    pid = tl.program_id(0)
    if HEADS_INNER:
        # tile-major: the heaviest tiles of every kv head first (longest-first over the whole launch)
        kv_head = pid % num_kv_heads
        tile = pid // num_kv_heads
    else:
        # head-major: one kv head's tiles after another (its K/V stay hot in L2)
        kv_head = pid // tiles_per_head
        tile = pid % tiles_per_head

    # flat tile list: request b owns tiles [cum[b] - n[b], cum[b]) with n[b] = cdiv(q_len[b], TOKENS)
    offs_b = tl.arange(0, BLOCK_B)
    b_mask = offs_b < num_reqs
    q_lo = tl.load(cu_seqlens_q_ptr + offs_b, mask=b_mask, other=0)
    q_hi = tl.load(cu_seqlens_q_ptr + offs_b + 1, mask=b_mask, other=0)
    n_tiles = (q_hi - q_lo + TOKENS - 1) // TOKENS  # [BLOCK_B]
    cum = tl.cumsum(n_tiles, 0)
    if tile >= tl.sum(n_tiles, 0):
        return
    req = tl.sum((cum <= tile).to(tl.int32), 0)
    sel = offs_b == req
    req_tiles = tl.sum(tl.where(sel, n_tiles, 0), 0)
    req_first = tl.sum(tl.where(sel, cum, 0), 0) - req_tiles
    # heaviest (last) tile of each request first
    m_blk = req_tiles - 1 - (tile - req_first)

    q_start = tl.load(cu_seqlens_q_ptr + req)
    q_len = tl.load(cu_seqlens_q_ptr + req + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + req)
    ctx_len = seq_len - q_len  # keys before the first new token

    offs_m = tl.arange(0, BLOCK_M)
    tok = m_blk * TOKENS + offs_m // GROUP  # [BLOCK_M] token index within the request
    head = kv_head * GROUP + offs_m % GROUP  # [BLOCK_M] query head
    row_mask = (offs_m < TOKENS * GROUP) & (tok < q_len)
    offs_d = tl.arange(0, HEAD_DIM)
    q_rows = (q_start + tok).to(tl.int64) * stride_qt + head.to(tl.int64) * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :] * stride_qd, mask=row_mask[:, None], other=0.0)
    qk_scale = sm_scale * 1.4426950408889634  # exp2 domain
    if KV_FP8:
        k_scale = tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)
        qk_scale = qk_scale * k_scale
    else:
        v_scale = 1.0
    if Q_FP8:
        q_row_scale = tl.load(
            q_scale_ptr + (q_start + tok).to(tl.int64) * stride_qst + head * stride_qsh,
            mask=row_mask,
            other=0.0,
        )
        row_scale = q_row_scale * qk_scale
    elif QUANT_Q:
        # q (bf16/fp16) to e4m3 per row (token, head) with scale amax / 448, as quantize_per_token_head
        qf = q.to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(qf), 1), 1e-12)
        q = tl.clamp(qf * (448.0 / amax)[:, None], -448.0, 448.0).to(tl.float8e4nv)
        row_scale = amax * (1.0 / 448.0) * qk_scale
    else:
        row_scale = tl.full([BLOCK_M], 1.0, dtype=tl.float32) * qk_scale
    if FMA_SCALE:
        # FMA_SCALE needs row_scale > 0 (-inf · 0 would be NaN); a zero q scale only zeroes the logits
        row_scale = tl.maximum(row_scale, 1e-30)

    # query at token t sees keys [0, ctx_len + t]; rows past q_len are clamped to the last token
    kv_limit = ctx_len + tl.minimum(tok, q_len - 1)  # [BLOCK_M]
    first_tok = m_blk * TOKENS
    last_tok = tl.minimum(first_tok + TOKENS, q_len) - 1
    full_end = ((ctx_len + first_tok + 1) // BLOCK_N) * BLOCK_N  # tiles every row sees entirely
    kv_end = ctx_len + last_tok + 1  # keys past this are masked for every row: skipped

    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
    k_head_off = kv_head.to(tl.int64) * stride_kh
    v_head_off = kv_head.to(tl.int64) * stride_vh
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for start_n in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = _prefill_kv_tile(
            acc,
            m_i,
            l_i,
            q,
            row_scale,
            start_n,
            kv_limit,
            seq_len,
            bt_row,
            max_blocks,
            num_blocks,
            k_ptr,
            v_ptr,
            k_desc,
            v_desc,
            kv_head * stride_kh,
            kv_head * stride_vh,
            stride_kb,
            stride_kt,
            stride_kd,
            stride_vb,
            stride_vt,
            stride_vd,
            k_head_off,
            v_head_off,
            HEAD_DIM,
            BLOCK_N,
            PAGE,
            KV_FP8,
            QK_FP8,
            PV_FP8,
            False,
            USE_TMA,
            FMA_SCALE,
        )
    for start_n in range(full_end, kv_end, BLOCK_N):
        acc, m_i, l_i = _prefill_kv_tile(
            acc,
            m_i,
            l_i,
            q,
            row_scale,
            start_n,
            kv_limit,
            seq_len,
            bt_row,
            max_blocks,
            num_blocks,
            k_ptr,
            v_ptr,
            k_desc,
            v_desc,
            kv_head * stride_kh,
            kv_head * stride_vh,
            stride_kb,
            stride_kt,
            stride_kd,
            stride_vb,
            stride_vt,
            stride_vd,
            k_head_off,
            v_head_off,
            HEAD_DIM,
            BLOCK_N,
            PAGE,
            KV_FP8,
            QK_FP8,
            PV_FP8,
            True,
            USE_TMA,
            FMA_SCALE,
        )

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    if PV_FP8:
        out_scale = v_scale * (1.0 / 256.0) / l_safe
    else:
        out_scale = v_scale / l_safe
    o = acc * out_scale[:, None]  # [BLOCK_M, HEAD_DIM]
    o_rows = (q_start + tok).to(tl.int64) * stride_ot + head.to(tl.int64) * stride_oh
    o_ptrs = out_ptr + o_rows[:, None] + offs_d[None, :] * stride_od
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])


@triton.jit
def quantize_q_kernel(x_ptr, q_ptr, s_ptr, n_rows, num_heads, stride_xt, stride_xh,
                      HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_R: tl.constexpr):
    """`prefill_attention(quantize_q=True)`'s q before the fp8 kernel: BLOCK_R rows (token, head) of a 16-bit q
    [T, H, D] (any token and head strides, a contiguous D) to e4m3 with scale amax / 448, as
    `quantize_per_token_head` rounds them (the scale and each x / scale correctly rounded): q8 [T, H, D]
    contiguous, scale fp32 [T, H]."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, D_PAD)
    ok = rows < n_rows
    tok = (rows // num_heads).to(tl.int64)
    head = rows % num_heads
    m = ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    x = tl.load(x_ptr + (tok * stride_xt + head * stride_xh)[:, None] + offs_d[None, :], mask=m, other=0.0)
    x = x.to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.math.div_rn(tl.maximum(amax, 1e-12), tl.full(amax.shape, 448.0, tl.float32))
    # lanes off the mask (rows past the last, a padded head_dim) divide 1.0, never stored: the 0 that feeds amax
    # would send each of their divisions down the IEEE division's slow path
    y = tl.clamp(tl.math.div_rn(tl.where(m, x, 1.0), tl.broadcast_to(scale[:, None], x.shape)), -448.0, 448.0)
    tl.store(q_ptr + rows.to(tl.int64)[:, None] * HEAD_DIM + offs_d[None, :], y.to(tl.float8e4nv), mask=m)
    tl.store(s_ptr + rows, scale, mask=ok)
