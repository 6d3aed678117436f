"""The paged-KV tile routine that decode (`_decode_kernels.py`) and prefill (`_prefill_kernels.py`) share.

Only @triton.jit helpers (inlined into their callers): the block-table lookup, the bad-block clamp,
the K/V tile load (pointers or a TMA descriptor) and the online-softmax step in the exp2 domain, with
its one-query-row form (`_row_*`: decode's row path, no MMA, state per key slot). A new variant of the
KV loop (sliding window, sinks, soft-cap) is written here once.

A bad block id (< 0 or ≥ num_blocks) is never an address: `_clamp_block` maps it to block 0 and says
which ids were good (decode's TMA rows put a bad page past the cache instead, where a descriptor
load reads zeros). What a kernel does with the answer is its documented semantics: decode masks
those keys (score −inf, V rows 0), prefill reads block 0 (PREFILL.md, "Checks").
What stays in the kernels: the loops and their masks (decode's visible/last_pos test and its lean
whole-tile loop with the page loaded a step ahead; prefill's unmasked and causal loops), the
addressing (strides, offset tiles, TMA rows) and which dtype P·V takes.
"""

import triton
import triton.language as tl


@triton.jit
def _load_block_id(bt_row, col, bt_width, mask, CLAMP_COL: tl.constexpr):
    """Entry `col` (a scalar or [BLOCK_N]) of one request's block-table row `bt_row`, unchecked.

    A column past the row's width: CLAMP_COL reads the row's last entry (prefill; `mask` unused),
    else −1, a bad id, as does a lane off `mask` (decode).
    """
    if CLAMP_COL:
        blk = tl.load(bt_row + tl.minimum(col, bt_width - 1))
    else:
        blk = tl.load(bt_row + col, mask=mask & (col < bt_width), other=-1)
    return blk


@triton.jit
def _clamp_block(blk, num_blocks, mask):
    """(block id or 0 where it is bad or off `mask`, ok): a bad id is never read through."""
    ok = mask & (blk >= 0) & (blk < num_blocks)
    return tl.where(ok, blk, 0), ok


@triton.jit
def _load_kv_tile(ptrs, mask, desc, row0, col, row_ok, USE_TMA: tl.constexpr, MASKED: tl.constexpr):
    """A [BLOCK_N, D] K or V tile.

    USE_TMA: the descriptor's rows [row0, row0 + BLOCK_N) at column `col` (the cache seen as 2-D
    [num_blocks·block_size, token row]); a descriptor load cannot mask, so MASKED zeroes the rows
    off `row_ok` [BLOCK_N] after the load (slots past the sequence may hold anything, NaN included).
    Else the pointer tile `ptrs`, with MASKED loaded under `mask` (0 elsewhere).
    """
    if USE_TMA:
        x = desc.load([row0, col])  # [BLOCK_N, D]
        if MASKED:
            x = tl.where(row_ok[:, None], x, 0.0)
    elif MASKED:
        x = tl.load(ptrs, mask=mask, other=0.0)  # [BLOCK_N, D]
    else:
        x = tl.load(ptrs)  # [BLOCK_N, D]
    return x


@triton.jit
def _softmax_step(s, m_i, l_i, row_scale, FMA_SCALE: tl.constexpr):
    """One online-softmax step in the exp2 domain over scores s [M, BLOCK_N] (masked keys at −inf).

    Returns (p [M, BLOCK_N], alpha [M], m_new [M], l_new [M]); the caller rescales its accumulator
    by alpha = exp2(m_old − m_new) and adds P·V. s is already scaled, or with FMA_SCALE (row_scale
    [M] > 0) raw: the max is taken on the raw scores times row_scale and the scale goes into exp2's
    argument (one FFMA a logit). A row whose keys are all masked so far keeps m = −inf and subtracts
    0 instead (no NaN).
    """
    if FMA_SCALE:
        m_new = tl.maximum(m_i, tl.max(s, 1) * row_scale)
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_ref)
    if FMA_SCALE:
        p = tl.exp2(s * row_scale[:, None] - m_ref[:, None])  # [M, BLOCK_N]
    else:
        p = tl.exp2(s - m_ref[:, None])  # [M, BLOCK_N]
    l_new = l_i * alpha + tl.sum(p, 1)
    return p, alpha, m_new, l_new


@triton.jit
def _tile_scores(q, k, KV_FP8: tl.constexpr, QK_FP8: tl.constexpr):
    """q·kᵀ [M, BLOCK_N] fp32 of q [M, D] and a K tile [BLOCK_N, D]; fp8 K under a 16-bit q is widened
    to q's dtype first (an fp8 q takes the fp8 dot)."""
    if KV_FP8 and not QK_FP8:
        k = k.to(q.dtype)
    return tl.dot(q, tl.trans(k))


@triton.jit
def _accumulate_pv(acc, alpha, p, v, PV_DTYPE: tl.constexpr, ACC_IN_DOT: tl.constexpr):
    """acc [M, D] rescaled by alpha [M] plus P·V, P [M, BLOCK_N] and V [BLOCK_N, D] cast to PV_DTYPE.

    ACC_IN_DOT: the rescaled acc is the dot's accumulator (prefill: the MMA accumulates in place);
    else P·V is a separate dot added after (decode).
    """
    if ACC_IN_DOT:
        acc = tl.dot(p.to(PV_DTYPE), v.to(PV_DTYPE), acc * alpha[:, None])
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(PV_DTYPE), v.to(PV_DTYPE))
    return acc


@triton.jit
def _row_scores(q, k):
    """q·kᵀ [BLOCK_N] fp32 of one query row q [D] fp32 and a K tile [BLOCK_N, D] on the CUDA cores (no
    MMA): K widened to fp32 element by element (fp8 and 16-bit alike), reduced over d."""
    return tl.sum(k.to(tl.float32) * q[None, :], 1)


@triton.jit
def _row_softmax_step(s, m_i, l_i):
    """The online softmax of one query row kept per key slot: s, m_i, l_i [BLOCK_N] (masked keys at −inf).

    Slot n sees key n of every step and is updated alone (no reduction over keys): returns
    (p, alpha, m_new, l_new), all [BLOCK_N]; the caller rescales accumulator row n by alpha[n] and adds
    p[n]·v[n]. A slot that has seen only masked keys keeps m = −inf and subtracts 0 instead (p = 0, no NaN).
    """
    m_new = tl.maximum(m_i, s)
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref)
    return p, alpha, m_new, l_i * alpha + p


@triton.jit
def _row_accumulate_pv(acc, alpha, p, v):
    """acc [BLOCK_N, D] fp32 (a row per key slot) rescaled by alpha [BLOCK_N] plus p[n]·v[n], V widened to fp32."""
    return acc * alpha[:, None] + p[:, None] * v.to(tl.float32)
