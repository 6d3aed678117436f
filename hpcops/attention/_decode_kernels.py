"""Triton kernels of paged decode attention. Only @triton.jit code lives here.

Rows of a program's M tile are the (query token j, query head g) pairs of one KV head:
row = j·G + g, so one K/V tile load serves every query head of the group and every new token.
At Q_LEN·G == 1 the row path (ROW_PATH, `_attend_task`) keeps no M tile: the one query row meets each K
tile on the CUDA cores and the online softmax is kept per key slot, merged into one row per task.
Scores live in the log2 domain: s = (q·k) · sm_scale · log2(e) (· q_scale · k_scale for fp8).
The paged-KV tile routine (block-table lookup, bad-block clamp, K/V loads, online-softmax step) is
shared with prefill and lives in `_paged_tile.py`; the KV loops here (`_attend_tiles`, `_attend_whole`)
call it.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from hpcops.attention._paged_tile import (
    _accumulate_pv,
    _clamp_block,
    _load_block_id,
    _load_kv_tile,
    _row_accumulate_pv,
    _row_scores,
    _row_softmax_step,
    _softmax_step,
    _tile_scores,
)


@triton.jit
def _load_q(q_ptr, q_scale_ptr, b, h, offs_m, offs_d, stride_qt, stride_qh, num_q_heads,
            Q_LEN: tl.constexpr, G: tl.constexpr, HEAD_DIM: tl.constexpr, KV_FP8: tl.constexpr,
            Q_FP8: tl.constexpr):
    """The [M, D] query tile of (request b, kv head h) and its per-row log2-domain scale factor."""
    j = offs_m // G
    g = offs_m % G
    row_ok = offs_m < Q_LEN * G
    tok = (b * Q_LEN + j).to(tl.int64)
    head = h * G + g
    ptrs = q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(ptrs, mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    if Q_FP8:
        qs = tl.load(q_scale_ptr + tok * num_q_heads + head, mask=row_ok, other=0.0)
    else:
        qs = tl.full([offs_m.shape[0]], 1.0, tl.float32)
    if KV_FP8 and not Q_FP8:
        # fp8 K widens to fp16 in one conversion (to bf16 it takes a second, per element), so the 16-bit q goes
        # to fp16 too. A bf16 q can exceed fp16's 65504: a row whose largest |q| is 2^15 or more is scaled by
        # 2^-e (exact: a power of two; e from the exponent bits of that largest |q|), and its logit scale by 2^e.
        if q.dtype == tl.bfloat16:
            amax = tl.max(tl.abs(q.to(tl.float32)), axis=1)
            e = tl.maximum(((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - (127 + 14), 0)
            down = ((127 - e) << 23).to(tl.float32, bitcast=True)
            q = (q.to(tl.float32) * down[:, None]).to(tl.float16)
            qs = ((127 + e) << 23).to(tl.float32, bitcast=True)
        else:
            q = q.to(tl.float16)
    return q, qs, j


@triton.jit
def _load_q_row(q_ptr, q_scale_ptr, b, h, offs_d, stride_qt, stride_qh, num_q_heads, HEAD_DIM: tl.constexpr,
                Q_FP8: tl.constexpr):
    """The row path's query (Q_LEN·G == 1: token b, head h): q [D] fp32 and its scale (q_scale for an fp8 q, else 1)."""
    tok = b.to(tl.int64)
    q = tl.load(q_ptr + tok * stride_qt + h * stride_qh + offs_d, mask=offs_d < HEAD_DIM, other=0.0)
    if Q_FP8:
        qs = tl.load(q_scale_ptr + tok * num_q_heads + h)
    else:
        qs = 1.0
    return q.to(tl.float32), qs


@triton.jit
def _merge_slots(acc, m_i, l_i, M_PAD: tl.constexpr):
    """The row path's per-key-slot state (acc [BLOCK_N, D], m_i, l_i [BLOCK_N]) merged into one row:
    m = max_n m_n, w_n = 2^(m_n − m), acc = Σ_n w_n·acc_n, l = Σ_n w_n·l_n, returned as the [M_PAD, D],
    [M_PAD] state `_finish_task` takes (every row the merged one; only row 0 is stored). No key seen: l = 0.
    """
    m = tl.max(m_i, 0)
    w = tl.exp2(m_i - tl.where(m == float("-inf"), 0.0, m))  # [BLOCK_N]
    o = tl.sum(acc * w[:, None], 0)  # [D]
    l_row = tl.sum(l_i * w, 0)
    zeros = tl.zeros([M_PAD], dtype=tl.float32)
    return zeros[:, None] + o[None, :], zeros + m, zeros + l_row


@triton.jit
def _attend_tiles(acc, m_i, l_i, q, s_scale, last_pos, k_ptr, v_ptr, k_desc, v_desc, k_col, v_col,
                  bt_row_ptr, bt_width, num_blocks,
                  stride_kb, stride_kt, stride_vb, stride_vt, kv_len, tile_lo, tile_hi,
                  offs_d, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
                  BLOCK_N: tl.constexpr, KV_FP8: tl.constexpr, Q_FP8: tl.constexpr, NUM_STAGES: tl.constexpr,
                  USE_TMA: tl.constexpr, LEAN: tl.constexpr = False, Q_LEN: tl.constexpr = 1,
                  LEAN_RECOMPUTE: tl.constexpr = False, KV_SAME_STRIDES: tl.constexpr = False,
                  LEAN_PAGES: tl.constexpr = False, ROW: tl.constexpr = False):
    """Online softmax over KV tiles [tile_lo, tile_hi) of one (request, kv head), BLOCK_N keys a step.

    acc [M, D], m_i [M], l_i [M] fp32 running state; last_pos [M]: last key each row may see.
    fp8 KV is widened to fp16 (one cvt per pair of values on sm90) and q is fp16 then.
    USE_TMA (pages ≥ BLOCK_N): K/V tiles come through TMA descriptors over the cache seen as 2-D
    [num_blocks·block_size, token row], the kv head at columns k_col / v_col.
    LEAN (one-tile steps inside one page, or with LEAN_PAGES over whole pages smaller than a tile;
    otherwise ignored): the tiles every row sees whole run without the sequence and causal masks
    (`_attend_whole`: through TMA with USE_TMA, else a scalar page base plus a [BLOCK_N, D] offset
    tile, held across the loop or, LEAN_RECOMPUTE, rebuilt each step; small pages: a page id a key
    row); only the tail (the tiles holding the causal edge or the sequence end, at most 2) runs masked.
    ROW (one query row, Q_LEN·G == 1; pointer loads): q [D] fp32, s_scale and last_pos scalars, and the
    state kept per key slot, acc [BLOCK_N, D], m_i, l_i [BLOCK_N] (`_row_softmax_step`): scores and P·V
    on the CUDA cores, no MMA and no reduction over keys inside the loops (`_merge_slots` after them).
    """
    offs_n = tl.arange(0, BLOCK_N)
    d_ok = offs_d < HEAD_DIM
    stop = tl.minimum(tile_hi * TILE, kv_len)
    if LEAN and (BLOCK_N == TILE) and ((BLOCK_SIZE >= BLOCK_N) or
                                       (LEAN_PAGES and (BLOCK_N % BLOCK_SIZE == 0) and not USE_TMA)):
        # keys < vis_end are in the sequence and visible to every row (last_pos = kv_len − Q_LEN + j):
        # whole tiles below it unmasked, the rest (the tail) by the masked loop below
        vis_end = kv_len - Q_LEN + 1
        mid = tl.minimum(tl.maximum(tl.maximum(vis_end, 0) // TILE, tile_lo), tile_hi)
        if BLOCK_SIZE < BLOCK_N:
            acc, m_i, l_i = _attend_whole_pages(
                acc, m_i, l_i, q, s_scale, k_ptr, v_ptr, bt_row_ptr, bt_width, num_blocks, stride_kb, stride_kt,
                stride_vb, stride_vt, tile_lo, mid, offs_d, HEAD_DIM, BLOCK_SIZE, TILE, BLOCK_N, KV_FP8, Q_FP8,
                NUM_STAGES, KV_SAME_STRIDES, ROW)
        else:
            acc, m_i, l_i = _attend_whole(
                acc, m_i, l_i, q, s_scale, k_ptr, v_ptr, k_desc, v_desc, k_col, v_col, bt_row_ptr, bt_width,
                num_blocks, stride_kb, stride_kt, stride_vb, stride_vt, tile_lo, mid, offs_d, HEAD_DIM,
                BLOCK_SIZE, TILE, BLOCK_N, KV_FP8, Q_FP8, NUM_STAGES, USE_TMA, LEAN_RECOMPUTE, KV_SAME_STRIDES, ROW)
        tile_lo = mid
    for start in tl.range(tile_lo * TILE, tile_hi * TILE, BLOCK_N, num_stages=NUM_STAGES):
        tok = start + offs_n  # [BLOCK_N]
        in_seq = tok < stop
        if (BLOCK_SIZE >= BLOCK_N) and (BLOCK_N == TILE):
            # steps start on tile boundaries, so a one-tile step lies in one page: one block-table load
            page_s = _load_block_id(bt_row_ptr, start // BLOCK_SIZE, bt_width, True, False)
        else:
            page_s = _load_block_id(bt_row_ptr, tok // BLOCK_SIZE, bt_width, in_seq, False)  # [BLOCK_N]
        page, ok = _clamp_block(page_s, num_blocks, in_seq)
        page = page.to(tl.int64)
        slot = (tok % BLOCK_SIZE).to(tl.int64)
        kv_mask = ok[:, None] & d_ok[None, :]
        # USE_TMA: a page id ≥ num_blocks reads past the cache (zeros); its keys are masked anyway
        row0 = (tl.where(page_s >= 0, page_s, 0) * BLOCK_SIZE + start % BLOCK_SIZE).to(tl.int32)
        k = _load_kv_tile(k_ptr + page[:, None] * stride_kb + slot[:, None] * stride_kt + offs_d[None, :], kv_mask,
                          k_desc, row0, k_col, ok, USE_TMA, not USE_TMA)  # [BLOCK_N, D]
        if ROW:
            s = tl.where((tok <= last_pos) & ok, _row_scores(q, k) * s_scale, float("-inf"))  # [BLOCK_N]
            p, alpha, m_i, l_i = _row_softmax_step(s, m_i, l_i)
        else:
            s = _tile_scores(q, k, KV_FP8, Q_FP8) * s_scale[:, None]  # [M, BLOCK_N]
            visible = (tok[None, :] <= last_pos[:, None]) & ok[None, :]
            s = tl.where(visible, s, float("-inf"))
            p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, s_scale, False)
        # TMA: rows past the sequence may hold anything, zeroed
        v = _load_kv_tile(v_ptr + page[:, None] * stride_vb + slot[:, None] * stride_vt + offs_d[None, :], kv_mask,
                          v_desc, row0, v_col, ok, USE_TMA, True)  # [BLOCK_N, D]
        acc = _pv_step(acc, alpha, p, v, KV_FP8, ROW)
    return acc, m_i, l_i


@triton.jit
def _whole_step(q, k, ok, s_scale, m_i, l_i, KV_FP8: tl.constexpr, Q_FP8: tl.constexpr, ROW: tl.constexpr):
    """Scores of a whole tile (no causal edge, keys on bad pages (`ok` off) at −inf) and the online-softmax step:
    the one query row on the CUDA cores (ROW) or the q tile through the MMA."""
    if ROW:
        s = _row_scores(q, k) * s_scale + tl.where(ok, 0.0, float("-inf"))  # [BLOCK_N]
        p, alpha, m_i, l_i = _row_softmax_step(s, m_i, l_i)
    else:
        s = _tile_scores(q, k, KV_FP8, Q_FP8) * s_scale[:, None] + tl.where(ok, 0.0, float("-inf"))[None, :]
        p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, s_scale, False)
    return p, alpha, m_i, l_i


@triton.jit
def _pv_step(acc, alpha, p, v, KV_FP8: tl.constexpr, ROW: tl.constexpr):
    """acc·alpha + P·V: per key slot on the CUDA cores (ROW), else an MMA in fp16 over fp8 V or in V's dtype."""
    if ROW:
        acc = _row_accumulate_pv(acc, alpha, p, v)
    elif KV_FP8:
        acc = _accumulate_pv(acc, alpha, p, v, tl.float16, False)
    else:
        acc = _accumulate_pv(acc, alpha, p, v, v.dtype, False)
    return acc


@triton.jit
def _attend_whole(acc, m_i, l_i, q, s_scale, k_ptr, v_ptr, k_desc, v_desc, k_col, v_col, bt_row_ptr, bt_width,
                  num_blocks, stride_kb, stride_kt, stride_vb, stride_vt, tile_lo, tile_hi,
                  offs_d, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
                  BLOCK_N: tl.constexpr, KV_FP8: tl.constexpr, Q_FP8: tl.constexpr, NUM_STAGES: tl.constexpr,
                  USE_TMA: tl.constexpr = False, LEAN_RECOMPUTE: tl.constexpr = False,
                  KV_SAME_STRIDES: tl.constexpr = False, ROW: tl.constexpr = False):
    """Tiles [tile_lo, tile_hi) whose keys every row sees (BLOCK_N == TILE, one page per step): no
    sequence or causal mask; a bad page id (< 0 or ≥ num_blocks) is never read, its keys score −inf
    and its V rows load as 0.

    Addressing: USE_TMA: descriptor loads at row page·BLOCK_SIZE + slot (a bad page at row
    num_blocks·BLOCK_SIZE, past the cache: TMA fills it with zeros). Else a scalar page base plus a
    [BLOCK_N, D] int32 offset tile: held across the loop (k_off, v_off; the persistent kernel then
    takes 255 registers on sm90), or LEAN_RECOMPUTE: rebuilt each step from the step's slots and a
    page-dependent stride (a few integer ops per element; with a stride that does not vary, recomputed
    offsets were hoisted out of the loops and held again: 255); KV_SAME_STRIDES (stride_kt ==
    stride_vt and stride_kb == stride_vb, the launcher's promise): K's offsets serve V too.
    ROW: one query row, state per key slot (`_attend_tiles`).
    """
    offs_n = tl.arange(0, BLOCK_N)
    d_ok = offs_d < HEAD_DIM
    if not LEAN_RECOMPUTE:
        k_off = offs_n[:, None] * stride_kt + offs_d[None, :]  # [BLOCK_N, D] int32, loop-invariant
        if KV_SAME_STRIDES:
            v_off = k_off
        else:
            v_off = offs_n[:, None] * stride_vt + offs_d[None, :]
    # the page of the next step is loaded one step ahead (a loop-carried scalar), so that the K/V
    # loads, not the block-table load, take the software pipeline's stages
    next_page = _load_block_id(bt_row_ptr, (tile_lo * TILE) // BLOCK_SIZE, bt_width, tile_lo < tile_hi, False)
    for start in tl.range(tile_lo * TILE, tile_hi * TILE, BLOCK_N, num_stages=NUM_STAGES):
        page_s = next_page
        next_page = _load_block_id(bt_row_ptr, (start + BLOCK_N) // BLOCK_SIZE, bt_width,
                                   start + BLOCK_N < tile_hi * TILE, False)
        page, ok = _clamp_block(page_s, num_blocks, True)
        page = page.to(tl.int64)
        slot = start % BLOCK_SIZE
        row0 = tl.where(ok, page_s, num_blocks) * BLOCK_SIZE + slot  # USE_TMA
        if LEAN_RECOMPUTE:
            # this step's slots times a stride that depends on the page: nothing the compiler can
            # hoist out of the loops (the persistent kernel's task loop included) and hold
            rows = slot + offs_n  # [BLOCK_N]
            k_off = rows[:, None] * tl.where(ok, stride_kt, 0) + offs_d[None, :]  # [BLOCK_N, D] int32
            k_base = page * stride_kb
        else:
            k_base = page * stride_kb + slot * stride_kt
        k = _load_kv_tile(k_ptr + k_base + k_off, d_ok[None, :] & ok, k_desc, row0, k_col, ok, USE_TMA,
                          not USE_TMA)  # [BLOCK_N, D]
        p, alpha, m_i, l_i = _whole_step(q, k, ok, s_scale, m_i, l_i, KV_FP8, Q_FP8, ROW)
        if LEAN_RECOMPUTE:
            if KV_SAME_STRIDES:
                v_off = k_off
                v_base = k_base
            else:
                v_off = rows[:, None] * tl.where(ok, stride_vt, 0) + offs_d[None, :]  # [BLOCK_N, D] int32
                v_base = page * stride_vb
        else:
            v_base = page * stride_vb + slot * stride_vt
        v = _load_kv_tile(v_ptr + v_base + v_off, d_ok[None, :] & ok, v_desc, row0, v_col, ok, USE_TMA,
                          not USE_TMA)  # [BLOCK_N, D]
        acc = _pv_step(acc, alpha, p, v, KV_FP8, ROW)
    return acc, m_i, l_i


@triton.jit
def _attend_whole_pages(acc, m_i, l_i, q, s_scale, k_ptr, v_ptr, bt_row_ptr, bt_width, num_blocks,
                        stride_kb, stride_kt, stride_vb, stride_vt, tile_lo, tile_hi, offs_d,
                        HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
                        BLOCK_N: tl.constexpr, KV_FP8: tl.constexpr, Q_FP8: tl.constexpr,
                        NUM_STAGES: tl.constexpr, KV_SAME_STRIDES: tl.constexpr = False, ROW: tl.constexpr = False):
    """`_attend_whole` for pages smaller than a step (BLOCK_SIZE divides BLOCK_N == TILE; pointer loads).

    A step spans BLOCK_N // BLOCK_SIZE pages: each key row takes its page id (one [BLOCK_N] load of
    the block-table row, repeated ids, loaded a step ahead like `_attend_whole`'s scalar page) and its
    slot n % BLOCK_SIZE (steps start on page boundaries). No sequence or causal mask; a bad page id
    is never read: its rows score −inf and load V as 0. ROW: one query row, state per key slot (`_attend_tiles`).
    """
    offs_n = tl.arange(0, BLOCK_N)
    d_ok = offs_d < HEAD_DIM
    slot = offs_n % BLOCK_SIZE  # [BLOCK_N]
    next_pages = _load_block_id(bt_row_ptr, (tile_lo * TILE + offs_n) // BLOCK_SIZE, bt_width, tile_lo < tile_hi,
                                False)
    for start in tl.range(tile_lo * TILE, tile_hi * TILE, BLOCK_N, num_stages=NUM_STAGES):
        pages_s = next_pages
        next_pages = _load_block_id(bt_row_ptr, (start + BLOCK_N + offs_n) // BLOCK_SIZE, bt_width,
                                    start + BLOCK_N < tile_hi * TILE, False)
        page, ok = _clamp_block(pages_s, num_blocks, True)  # [BLOCK_N]
        page = page.to(tl.int64)
        kv_mask = ok[:, None] & d_ok[None, :]
        k_row = page * stride_kb + slot * stride_kt  # [BLOCK_N] int64
        k = _load_kv_tile(k_ptr + k_row[:, None] + offs_d[None, :], kv_mask, k_ptr, 0, 0, ok, False, True)
        p, alpha, m_i, l_i = _whole_step(q, k, ok, s_scale, m_i, l_i, KV_FP8, Q_FP8, ROW)
        if KV_SAME_STRIDES:
            v_row = k_row
        else:
            v_row = page * stride_vb + slot * stride_vt
        v = _load_kv_tile(v_ptr + v_row[:, None] + offs_d[None, :], kv_mask, v_ptr, 0, 0, ok, False, True)
        acc = _pv_step(acc, alpha, p, v, KV_FP8, ROW)
    return acc, m_i, l_i


@triton.jit
def _finish_task(acc, m_i, l_i, v_scale, split, slot, b, h, offs_m, offs_d, out_ptr, part_o_ptr, part_lse_ptr,
                 stride_ot, stride_oh, Q_LEN: tl.constexpr, G: tl.constexpr, HEAD_DIM: tl.constexpr,
                 ROWS: tl.constexpr):
    """Write the normalized output (unsplit task) or the fp32 partial + log2-sum-exp (split task)."""
    row_ok = offs_m < Q_LEN * G
    d_ok = offs_d < HEAD_DIM
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None] * v_scale
    if split:
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
        base = slot.to(tl.int64) * ROWS
        tl.store(part_o_ptr + (base + offs_m)[:, None] * HEAD_DIM + offs_d[None, :], o,
                 mask=row_ok[:, None] & d_ok[None, :])
        tl.store(part_lse_ptr + base + offs_m, lse, mask=row_ok)
    else:
        j = offs_m // G
        g = offs_m % G
        tok = (b * Q_LEN + j).to(tl.int64)
        ptrs = out_ptr + tok[:, None] * stride_ot + (h * G + g)[:, None] * stride_oh + offs_d[None, :]
        tl.store(ptrs, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def decode_persistent_kernel(
    q_ptr, k_ptr, v_ptr, k_desc, v_desc, bt_ptr, seq_lens_ptr, out_ptr, part_o_ptr, part_lse_ptr,
    header_ptr, cum_ptr, first_b_ptr, pair_desc_ptr, merge_sem_ptr, q_scale_ptr, k_scale_ptr, v_scale_ptr,
    sm_scale_log2, B, num_q_heads, bt_width, num_blocks,
    stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_bt, stride_ot, stride_oh,
    Q_LEN: tl.constexpr, G: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    M_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, BLOCK_N: tl.constexpr,
    KV_FP8: tl.constexpr, Q_FP8: tl.constexpr, NUM_STAGES: tl.constexpr, USE_TMA: tl.constexpr,
    USE_PDL: tl.constexpr = False, TASK_DESC: tl.constexpr = False, LEAN: tl.constexpr = False,
    LEAN_RECOMPUTE: tl.constexpr = False, KV_SAME_STRIDES: tl.constexpr = False, LEAN_PAGES: tl.constexpr = False,
    ROW_PATH: tl.constexpr = False, TAIL_MERGE: tl.constexpr = False, R_PAD: tl.constexpr = 1,
    TAIL_STAGES: tl.constexpr = 1, TAIL_GROUP: tl.constexpr = 0, PDL_WAIT: tl.constexpr = False,
):
    """One persistent program walks its bucket of the plan's tile stream, task by task.

    USE_PDL: let the combine kernel (launched with programmatic dependent launch) start early;
    it waits (griddepcontrol.wait) for this grid's writes before reading them.
    PDL_WAIT (`DecodeConfig.pdl_wait`; launched with programmatic dependent launch itself): wait for the previous
    kernel's writes before the first read (q, the plan, the cache: nothing is read before it); without a combine,
    let the next kernel launch when the program's work is done (at the start, the next grid's programs would take
    the SM slots this one leaves free as they free up, unevenly, and a persistent grid placed unevenly runs long).
    TASK_DESC: `first_b_ptr` is the plan's task_desc [programs, 8]: start from it (request, head,
    first tile, bucket length, the request's length: one load level) and walk with the request lengths alone (a
    task after the first starts at tile 0 of the next request; a task is split iff it does not cover its
    request), the next request's length loaded before the current task's tiles.
    LEAN, LEAN_RECOMPUTE, KV_SAME_STRIDES: the whole-tile loop and its addressing (`_attend_tiles`).
    ROW_PATH: one query row a task (Q_LEN·G == 1) on the CUDA cores (`_attend_task`).
    TAIL_MERGE (with TASK_DESC): a split task, once its partial is written, counts it into the pair's
    merge_sem; the program that writes the last partial merges the pair into the output (`_tail_merge`),
    so no combine kernel runs. R_PAD: Q_LEN·G padded to a power of two; TAIL_STAGES: partials' loads in
    flight (`_merge_rows`); TAIL_GROUP: partials a group of the two-level merge of a long split (0: one level).
    """
    pid = tl.program_id(0)
    if PDL_WAIT:
        gdc_wait()
    if USE_PDL:
        gdc_launch_dependents()
    if TASK_DESC:
        offs_m = tl.arange(0, M_PAD)
        offs_d = tl.arange(0, D_PAD)
        kv_scale = 1.0
        v_scale = 1.0
        if KV_FP8:
            kv_scale = tl.load(k_scale_ptr)
            v_scale = tl.load(v_scale_ptr)
        td = first_b_ptr + pid * 8  # the plan's task_desc
        b = tl.load(td)
        h = tl.load(td + 1)
        lo = tl.load(td + 2)
        left = tl.load(td + 3)
        kv_len = tl.load(td + 4, mask=b >= 0, other=0)  # the first request's length (0 idle)
        later = pid * 0
        while left > 0:
            b_next = tl.where(b + 1 == B, 0, b + 1)
            kv_next = tl.load(seq_lens_ptr + b_next)
            t_b = tl.maximum((kv_len + TILE - 1) // TILE, 1)
            n = tl.minimum(left, t_b - lo)
            acc, m_i, l_i, j = _attend_task(
                q_ptr, k_ptr, v_ptr, k_desc, v_desc, bt_ptr, q_scale_ptr, b, h, kv_len, lo, lo + n,
                sm_scale_log2 * kv_scale, num_q_heads, bt_width, num_blocks, offs_m, offs_d,
                stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_bt,
                Q_LEN, G, HEAD_DIM, M_PAD, D_PAD, BLOCK_SIZE, TILE, BLOCK_N, KV_FP8, Q_FP8, NUM_STAGES, USE_TMA,
                LEAN, LEAN_RECOMPUTE, KV_SAME_STRIDES, LEAN_PAGES, ROW_PATH)
            split = (lo > 0) | (lo + n < t_b)
            _finish_task(acc, m_i, l_i, v_scale, split, 2 * pid + later, b, h, offs_m, offs_d, out_ptr,
                         part_o_ptr, part_lse_ptr, stride_ot, stride_oh, Q_LEN, G, HEAD_DIM, Q_LEN * G)
            if TAIL_MERGE:
                if split:
                    _tail_merge(part_o_ptr, part_lse_ptr, pair_desc_ptr, merge_sem_ptr, pid, b, h, B, out_ptr,
                                stride_ot, stride_oh, Q_LEN, G, HEAD_DIM, D_PAD, R_PAD, TAIL_STAGES, TAIL_GROUP)
            left -= n
            h = tl.where(b_next == 0, h + 1, h)
            b = b_next
            kv_len = kv_next
            lo = 0
            later = 1
    else:
        bucket = tl.load(header_ptr)
        s_tiles = tl.load(header_ptr + 1)
        total = tl.load(header_ptr + 2)
        b = tl.load(first_b_ptr + pid)
        p0 = pid * bucket
        p1 = tl.minimum(p0 + bucket, total)
        p = tl.where(b >= 0, p0, p1)
        offs_m = tl.arange(0, M_PAD)
        offs_d = tl.arange(0, D_PAD)
        kv_scale = 1.0
        v_scale = 1.0
        if KV_FP8:
            kv_scale = tl.load(k_scale_ptr)
            v_scale = tl.load(v_scale_ptr)
        while p < p1:
            h = p // s_tiles
            r = p - h * s_tiles
            start_b = tl.load(cum_ptr + b)
            end_b = tl.load(cum_ptr + b + 1)
            n = tl.minimum(p1 - p, end_b - r)
            kv_len = tl.load(seq_lens_ptr + b)
            acc, m_i, l_i, j = _attend_task(
                q_ptr, k_ptr, v_ptr, k_desc, v_desc, bt_ptr, q_scale_ptr, b, h, kv_len, r - start_b, r - start_b + n,
                sm_scale_log2 * kv_scale, num_q_heads, bt_width, num_blocks, offs_m, offs_d,
                stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_bt,
                Q_LEN, G, HEAD_DIM, M_PAD, D_PAD, BLOCK_SIZE, TILE, BLOCK_N, KV_FP8, Q_FP8, NUM_STAGES, USE_TMA,
                LEAN, LEAN_RECOMPUTE, KV_SAME_STRIDES, LEAN_PAGES, ROW_PATH)
            pair_lo = h * s_tiles + start_b
            pair_hi = h * s_tiles + end_b
            split = (pair_lo // bucket) != ((pair_hi - 1) // bucket)
            slot = 2 * pid + tl.where(p == p0, 0, 1)
            _finish_task(acc, m_i, l_i, v_scale, split, slot, b, h, offs_m, offs_d, out_ptr, part_o_ptr,
                         part_lse_ptr, stride_ot, stride_oh, Q_LEN, G, HEAD_DIM, Q_LEN * G)
            p += n
            b = tl.where(b + 1 == B, 0, b + 1)
    if PDL_WAIT:
        if not USE_PDL:  # no combine: release the next kernel once this program's work is done
            gdc_launch_dependents()


@triton.jit
def _attend_task(q_ptr, k_ptr, v_ptr, k_desc, v_desc, bt_ptr, q_scale_ptr, b, h, kv_len, tile_lo, tile_hi,
                 scale_log2, num_q_heads, bt_width, num_blocks, offs_m, offs_d,
                 stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_bt,
                 Q_LEN: tl.constexpr, G: tl.constexpr, HEAD_DIM: tl.constexpr, M_PAD: tl.constexpr,
                 D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, BLOCK_N: tl.constexpr,
                 KV_FP8: tl.constexpr, Q_FP8: tl.constexpr, NUM_STAGES: tl.constexpr, USE_TMA: tl.constexpr,
                 LEAN: tl.constexpr, LEAN_RECOMPUTE: tl.constexpr, KV_SAME_STRIDES: tl.constexpr,
                 LEAN_PAGES: tl.constexpr, ROW_PATH: tl.constexpr = False):
    """One task: the q tile of (request b, kv head h), fresh softmax state, tiles [tile_lo, tile_hi).

    ROW_PATH (Q_LEN·G == 1, pointer loads): the one query row against each K tile on the CUDA cores, the
    online softmax kept per key slot (`_attend_tiles`), merged into one row at the end (`_merge_slots`);
    instead of padding the row to an M_PAD-row MMA tile and reducing over keys every step.
    """
    if ROW_PATH:
        tl.static_assert(Q_LEN * G == 1, "the row path takes one query row a (request, kv head)")
        tl.static_assert(not USE_TMA, "the row path reads K/V through pointers")
        q, qs = _load_q_row(q_ptr, q_scale_ptr, b, h, offs_d, stride_qt, stride_qh, num_q_heads, HEAD_DIM, Q_FP8)
        acc = tl.zeros([BLOCK_N, D_PAD], dtype=tl.float32)
        m_i = tl.full([BLOCK_N], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_N], dtype=tl.float32)
        s_scale = qs * scale_log2
        last_pos = kv_len - 1
        j = offs_m
    else:
        q, qs, j = _load_q(q_ptr, q_scale_ptr, b, h, offs_m, offs_d, stride_qt, stride_qh, num_q_heads,
                           Q_LEN, G, HEAD_DIM, KV_FP8, Q_FP8)
        acc = tl.zeros([M_PAD, D_PAD], dtype=tl.float32)
        m_i = tl.full([M_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([M_PAD], dtype=tl.float32)
        s_scale = qs * scale_log2
        last_pos = kv_len - Q_LEN + j
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q, s_scale, last_pos,
        k_ptr + h.to(tl.int64) * stride_kh, v_ptr + h.to(tl.int64) * stride_vh,
        k_desc, v_desc, h * stride_kh, h * stride_vh,
        bt_ptr + b.to(tl.int64) * stride_bt, bt_width, num_blocks,
        stride_kb, stride_kt, stride_vb, stride_vt, kv_len, tile_lo, tile_hi,
        offs_d, HEAD_DIM, BLOCK_SIZE, TILE, BLOCK_N, KV_FP8, Q_FP8, NUM_STAGES, USE_TMA, LEAN, Q_LEN,
        LEAN_RECOMPUTE, KV_SAME_STRIDES, LEAN_PAGES, ROW_PATH)
    if ROW_PATH:
        acc, m_i, l_i = _merge_slots(acc, m_i, l_i, M_PAD)
    return acc, m_i, l_i, j


@triton.jit
def _merge_chunks(part_o_ptr, part_lse_ptr, first_slot, rest_base, rest_step, n_chunks, b, h, row, out_ptr,
                  stride_ot, stride_oh, Q_LEN: tl.constexpr, G: tl.constexpr, HEAD_DIM: tl.constexpr,
                  D_PAD: tl.constexpr, CB: tl.constexpr, DW: tl.constexpr = 0, col0=0):
    """out[row] = Σ_c 2^(lse_c − m) · O_c / Σ_c 2^(lse_c − m) over chunk slots first_slot, rest_base + c·rest_step.

    One pass over the chunks in blocks of CB, the running maximum rescaling what came before (an online
    softmax over the partials): a merge of at most CB partials is one round of loads (lse and O together),
    a longer one ceil(n / CB) rounds. DW (> 0): only the DW columns from col0 (a slice of the row, the rest
    merged by other programs: `decode_combine_kernel`'s MERGE_SLICES); 0: the whole row.
    """
    ROWS: tl.constexpr = Q_LEN * G
    offs_c = tl.arange(0, CB)
    if DW == 0:
        offs_d = tl.arange(0, D_PAD)
    else:
        offs_d = col0 + tl.arange(0, DW)
    d_ok = offs_d < HEAD_DIM
    m_run = tl.max(tl.full([CB], float("-inf"), tl.float32), axis=0)
    w = tl.sum(tl.zeros([CB], dtype=tl.float32), axis=0)
    acc = tl.zeros([D_PAD if DW == 0 else DW], dtype=tl.float32)
    for c0 in range(0, n_chunks, CB):
        c = c0 + offs_c
        c_ok = c < n_chunks
        slot = tl.where(c == 0, first_slot, rest_base + c * rest_step).to(tl.int64)
        lse = tl.load(part_lse_ptr + slot * ROWS + row, mask=c_ok, other=float("-inf"))
        o = tl.load(part_o_ptr + (slot * ROWS + row)[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=c_ok[:, None] & d_ok[None, :], other=0.0)  # [CB, D]
        m_new = tl.maximum(m_run, tl.max(lse, axis=0))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_run - m_ref)
        wc = tl.exp2(lse - m_ref)  # [CB]; 0 for an empty partial or a masked slot
        acc = acc * alpha + tl.sum(o * wc[:, None], axis=0)
        w = w * alpha + tl.sum(wc, axis=0)
        m_run = m_new
    res = acc / tl.where(w == 0.0, 1.0, w)
    j = row // G
    g = row % G
    tok = (b * Q_LEN + j).to(tl.int64)
    tl.store(out_ptr + tok * stride_ot + (h * G + g) * stride_oh + offs_d, res.to(out_ptr.dtype.element_ty),
             mask=d_ok)


@triton.jit
def _merge_rows(part_o_ptr, part_lse_ptr, first_slot, rest_base, rest_step, n_parts, b, h, out_ptr,
                stride_ot, stride_oh, Q_LEN: tl.constexpr, G: tl.constexpr, HEAD_DIM: tl.constexpr,
                D_PAD: tl.constexpr, R_PAD: tl.constexpr, STAGES: tl.constexpr, TO_PART: tl.constexpr = False):
    """Every q row of a split (request b, kv head h) at once: out = Σ_c 2^(lse_c − m) · O_c / Σ_c 2^(lse_c − m)
    over slots first_slot, rest_base + c·rest_step, one partial a step ([R_PAD, D_PAD] tile, a running maximum
    a row: elementwise, no reduction across threads), STAGES partials' loads in flight. TO_PART: the result is
    a partial again, its O and log2-sum-exp written into slot first_slot (a group of a two-level merge).
    Partials are read past L1 (`.cg`): other programs wrote them in this launch."""
    ROWS: tl.constexpr = Q_LEN * G
    offs_r = tl.arange(0, R_PAD)
    offs_d = tl.arange(0, D_PAD)
    r_ok = offs_r < ROWS
    rd_ok = r_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    m_run = tl.full([R_PAD], float("-inf"), tl.float32)
    w = tl.zeros([R_PAD], dtype=tl.float32)
    acc = tl.zeros([R_PAD, D_PAD], dtype=tl.float32)
    for c in tl.range(0, n_parts, num_stages=STAGES):
        row = tl.where(c == 0, first_slot, rest_base + c * rest_step).to(tl.int64) * ROWS + offs_r
        lse = tl.load(part_lse_ptr + row, mask=r_ok, other=float("-inf"), cache_modifier=".cg")
        o = tl.load(part_o_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], mask=rd_ok, other=0.0,
                    cache_modifier=".cg")
        m_new = tl.maximum(m_run, lse)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_run - m_ref)
        wc = tl.exp2(lse - m_ref)  # 0 for an empty partial or a masked row
        acc = acc * alpha[:, None] + o * wc[:, None]
        w = w * alpha + wc
        m_run = m_new
    res = acc / tl.where(w == 0.0, 1.0, w)[:, None]
    if TO_PART:
        dst = first_slot.to(tl.int64) * ROWS + offs_r
        tl.store(part_o_ptr + dst[:, None] * HEAD_DIM + offs_d[None, :], res, mask=rd_ok)
        tl.store(part_lse_ptr + dst, tl.where(w == 0.0, float("-inf"), m_run + tl.log2(w)), mask=r_ok)
    else:
        tok = (b * Q_LEN + offs_r // G).to(tl.int64)
        ptrs = out_ptr + tok[:, None] * stride_ot + (h * G + offs_r % G)[:, None] * stride_oh + offs_d[None, :]
        tl.store(ptrs, res.to(out_ptr.dtype.element_ty), mask=rd_ok)


@triton.jit
def _tail_merge(part_o_ptr, part_lse_ptr, pair_desc_ptr, merge_sem_ptr, pid, b, h, B, out_ptr, stride_ot,
                stride_oh, Q_LEN: tl.constexpr, G: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                R_PAD: tl.constexpr, STAGES: tl.constexpr, GROUP: tl.constexpr):
    """A split task's partial is written: count it in (release: the CTA barrier orders every thread's partial
    stores before the one-thread atomic, as a semaphore release does); the program that brings the count to
    the pair's partials merges them (acquire) and sets the count back to 0 for the next call.

    GROUP > 0 and a split of more than GROUP partials: two levels, so that no program merges a long split
    alone (~136 partials at 1x64K+15x4K h8/1). Partial c (program owner + c) belongs to group c // GROUP; the
    program that completes a group (its count: merge_sem[the group's first slot]) merges it into that first
    slot, then counts the group into the pair; the one that completes the pair merges the groups' partials
    (slots first_slot, 2·(owner + GROUP·g))."""
    idx = (h * B + b).to(tl.int64)
    pd = pair_desc_ptr + idx * 4
    owner = tl.load(pd)
    parts = tl.load(pd + 1)
    first_slot = tl.load(pd + 2)
    pair_sem = merge_sem_ptr + 2 * tl.num_programs(0) + idx
    n_top = parts
    step = parts * 0 + 2
    ready = parts > 0
    tl.debug_barrier()
    if GROUP > 0:
        if parts > GROUP:
            g_lo = (pid - owner) // GROUP * GROUP
            g_n = tl.minimum(parts - g_lo, GROUP)
            g_first = tl.where(g_lo == 0, first_slot, 2 * (owner + g_lo))
            arrived = tl.atomic_add(merge_sem_ptr + g_first, 1, sem="acq_rel", scope="gpu")
            ready = arrived == g_n - 1
            if ready:
                tl.store(merge_sem_ptr + g_first, 0)
                _merge_rows(part_o_ptr, part_lse_ptr, g_first, 2 * (owner + g_lo), 2, g_n, b, h, out_ptr,
                            stride_ot, stride_oh, Q_LEN, G, HEAD_DIM, D_PAD, R_PAD, STAGES, True)
                tl.debug_barrier()
            n_top = (parts + GROUP - 1) // GROUP
            step = parts * 0 + 2 * GROUP
    if ready:
        arrived = tl.atomic_add(pair_sem, 1, sem="acq_rel", scope="gpu")
        if arrived == n_top - 1:
            tl.store(pair_sem, 0)
            _merge_rows(part_o_ptr, part_lse_ptr, first_slot, 2 * owner, step, n_top, b, h, out_ptr, stride_ot,
                        stride_oh, Q_LEN, G, HEAD_DIM, D_PAD, R_PAD, STAGES)


@triton.jit
def _merge_partials(part_o_ptr, part_lse_ptr, first_slot, rest_base, rest_step, n_chunks, b, h, row, out_ptr,
                    stride_ot, stride_oh, Q_LEN: tl.constexpr, G: tl.constexpr, HEAD_DIM: tl.constexpr,
                    D_PAD: tl.constexpr, CB: tl.constexpr):
    """`_merge_chunks` in one round of a 16-partial tile where that holds them all (most merges: fewer
    addresses and registers a program), else in rounds of CB."""
    SMALL: tl.constexpr = 16 if CB > 16 else CB
    if n_chunks <= SMALL:
        _merge_chunks(part_o_ptr, part_lse_ptr, first_slot, rest_base, rest_step, n_chunks, b, h, row, out_ptr,
                      stride_ot, stride_oh, Q_LEN, G, HEAD_DIM, D_PAD, SMALL)
    else:
        _merge_chunks(part_o_ptr, part_lse_ptr, first_slot, rest_base, rest_step, n_chunks, b, h, row, out_ptr,
                      stride_ot, stride_oh, Q_LEN, G, HEAD_DIM, D_PAD, CB)


@triton.jit
def decode_combine_kernel(
    part_o_ptr, part_lse_ptr, out_ptr, header_ptr, cum_ptr, last_b_ptr, stride_ot, stride_oh,
    Q_LEN: tl.constexpr, G: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, CB: tl.constexpr,
    USE_PDL: tl.constexpr = False, MERGE_DESC: tl.constexpr = False, PDL_NEXT: tl.constexpr = False,
    MERGE_SLICES: tl.constexpr = 1,
):
    """Program (k, row) merges `row` of the split (head, request) that starts in program k's bucket and leaves it.

    The plan tables were written before the attention kernel started, so they are read before the
    USE_PDL wait; the partials only after it (with `DecodeConfig.pdl_wait` the attention kernel lets this one
    launch only after its own wait, so the plan is complete then too). MERGE_DESC: `last_b_ptr` is the plan's
    merge_desc [programs, 4], whose row k (request or −1, head, first slot, partials) says it in one load level.
    PDL_NEXT (with MERGE_DESC): after its merge, let the next kernel launch (the next layer's attention kernel,
    PDL_WAIT; a program with nothing to merge releases it by exiting). USE_PDL: program (0, 0) waits for the
    attention grid even with nothing to merge, so that this grid never completes before it (a plan that splits
    nothing has no other waiting program, and the next kernel waits on this grid alone).
    MERGE_SLICES (> 1, with MERGE_DESC; `DecodeConfig.merge_slices`, a plan built with it): a split of more than
    16 partials is merged by MERGE_SLICES programs, each a slice of D_PAD / MERGE_SLICES columns of the row in rounds
    of CB · MERGE_SLICES partials (one round up to 256 at head_dim 128, where one program takes 4): its owner
    (slice 0) and the programs just after it, inside the split, which have nothing of their own to merge; the
    plan writes their merge_desc rows as the owner's, so a row's slice is k − first_slot // 2.
    """
    k = tl.program_id(0)
    row = tl.program_id(1)
    if USE_PDL:
        # this grid must not complete before the attention grid has: a kernel launched with PDL after it waits on
        # it alone (griddepcontrol.wait), and where nothing is split no other program waits (the next layer's
        # attention would overlap this one's in a benchmark, a consumer of `out` read it early)
        if (k == 0) & (row == 0):
            gdc_wait()
    if MERGE_DESC:
        md = last_b_ptr + k * 4  # the plan's merge_desc
        b = tl.load(md)
        h = tl.load(md + 1)
        first_slot = tl.load(md + 2)
        n_chunks = tl.load(md + 3)
        if b >= 0:
            if USE_PDL:
                gdc_wait()
            if MERGE_SLICES > 1 and n_chunks > 16:  # constexpr-false (one program a row) when MERGE_SLICES is 1
                owner = first_slot // 2
                DW: tl.constexpr = D_PAD // MERGE_SLICES
                _merge_chunks(part_o_ptr, part_lse_ptr, first_slot, 2 * owner, 2, n_chunks, b, h, row, out_ptr,
                              stride_ot, stride_oh, Q_LEN, G, HEAD_DIM, D_PAD, CB * MERGE_SLICES, DW, (k - owner) * DW)
            else:
                _merge_partials(part_o_ptr, part_lse_ptr, first_slot, 2 * k, 2, n_chunks, b, h, row, out_ptr,
                                stride_ot, stride_oh, Q_LEN, G, HEAD_DIM, D_PAD, CB)
            if PDL_NEXT:
                gdc_launch_dependents()
    else:
        b = tl.load(last_b_ptr + k)
        if b >= 0:
            bucket = tl.load(header_ptr)
            s_tiles = tl.load(header_ptr + 1)
            total = tl.load(header_ptr + 2)
            p_last = tl.minimum((k + 1) * bucket, total) - 1
            h = p_last // s_tiles
            pair_lo = h * s_tiles + tl.load(cum_ptr + b)
            pair_hi = h * s_tiles + tl.load(cum_ptr + b + 1)
            first = pair_lo // bucket
            last = (pair_hi - 1) // bucket
            if (first == k) & (last > first):
                if USE_PDL:
                    gdc_wait()
                first_slot = 2 * k + tl.where(pair_lo == k * bucket, 0, 1)
                _merge_partials(part_o_ptr, part_lse_ptr, first_slot, 2 * k, 2, last - first + 1, b, h, row,
                                out_ptr, stride_ot, stride_oh, Q_LEN, G, HEAD_DIM, D_PAD, CB)


@triton.jit
def decode_static_kernel(
    q_ptr, k_ptr, v_ptr, k_desc, v_desc, bt_ptr, seq_lens_ptr, out_ptr, part_o_ptr, part_lse_ptr,
    q_scale_ptr, k_scale_ptr, v_scale_ptr,
    sm_scale_log2, num_kv_heads, num_q_heads, bt_width, num_blocks,
    stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_bt, stride_ot, stride_oh,
    SPLITS: tl.constexpr, Q_LEN: tl.constexpr, G: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    M_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, BLOCK_N: tl.constexpr,
    KV_FP8: tl.constexpr, Q_FP8: tl.constexpr, NUM_STAGES: tl.constexpr, USE_TMA: tl.constexpr,
    LEAN: tl.constexpr = False, LEAN_RECOMPUTE: tl.constexpr = False, KV_SAME_STRIDES: tl.constexpr = False,
    LEAN_PAGES: tl.constexpr = False, ROW_PATH: tl.constexpr = False,
):
    """Classic static split-KV: program (b, h, s) takes the s-th of SPLITS equal chunks of request b."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    kv_len = tl.load(seq_lens_ptr + b)
    n_tiles = tl.maximum((kv_len + TILE - 1) // TILE, 1)
    chunk = (n_tiles + SPLITS - 1) // SPLITS
    lo = s * chunk
    if lo < n_tiles:
        hi = tl.minimum(lo + chunk, n_tiles)
        offs_m = tl.arange(0, M_PAD)
        offs_d = tl.arange(0, D_PAD)
        kv_scale = 1.0
        v_scale = 1.0
        if KV_FP8:
            kv_scale = tl.load(k_scale_ptr)
            v_scale = tl.load(v_scale_ptr)
        acc, m_i, l_i, j = _attend_task(
            q_ptr, k_ptr, v_ptr, k_desc, v_desc, bt_ptr, q_scale_ptr, b, h, kv_len, lo, hi,
            sm_scale_log2 * kv_scale, num_q_heads, bt_width, num_blocks, offs_m, offs_d,
            stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_bt,
            Q_LEN, G, HEAD_DIM, M_PAD, D_PAD, BLOCK_SIZE, TILE, BLOCK_N, KV_FP8, Q_FP8, NUM_STAGES, USE_TMA,
            LEAN, LEAN_RECOMPUTE, KV_SAME_STRIDES, LEAN_PAGES, ROW_PATH)
        split = chunk < n_tiles
        slot = (b * num_kv_heads + h) * SPLITS + s
        _finish_task(acc, m_i, l_i, v_scale, split, slot, b, h, offs_m, offs_d, out_ptr, part_o_ptr,
                     part_lse_ptr, stride_ot, stride_oh, Q_LEN, G, HEAD_DIM, Q_LEN * G)


@triton.jit
def decode_static_combine_kernel(
    part_o_ptr, part_lse_ptr, out_ptr, seq_lens_ptr, num_kv_heads, stride_ot, stride_oh,
    SPLITS: tl.constexpr, Q_LEN: tl.constexpr, G: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    CB: tl.constexpr, TILE: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    row = tl.program_id(2)
    kv_len = tl.load(seq_lens_ptr + b)
    n_tiles = tl.maximum((kv_len + TILE - 1) // TILE, 1)
    chunk = (n_tiles + SPLITS - 1) // SPLITS
    n_chunks = (n_tiles + chunk - 1) // chunk
    if n_chunks > 1:
        base = (b * num_kv_heads + h) * SPLITS
        _merge_partials(part_o_ptr, part_lse_ptr, base, base, 1, n_chunks, b, h, row, out_ptr, stride_ot, stride_oh,
                        Q_LEN, G, HEAD_DIM, D_PAD, CB)
