"""Triton kernels of the fused attention prologue (only `@triton.jit` code; launcher: prologue.py).

One launch, a 1-D grid of two kinds of programs:
- q programs (the first `cdiv(T, BLOCK_T) · HKV`): BLOCK_T tokens × the GROUP query heads of one KV
  group, one 3-D tile [BLOCK_T, GROUP_P, HALF_P] per piece;
- kv programs (the rest, `cdiv(T, BLOCK_KV)`): BLOCK_KV tokens × all HKV key heads (normed,
  rotated) and value heads (copied), written into the paged cache at slot_mapping (-1: skip).
Splitting the roles gives the key/value rows tiles as wide as the query tiles (16-byte accesses, no
cross-warp reductions on a one-head tile) and keeps slot handling out of the q programs.

Each rotary head is held as three pieces: `lo` and `hi` (the two members of every rotary pair; NeoX:
d and d + R/2, GPT-J: 2i and 2i + 1) and `tail` (dims R..D that pass through). All maths in fp32.
Every program issues its big loads first (q / k / v rows), then the positions → cos/sin gather, so
the dependent gather never delays the bulk traffic.

Cost notes (the kernel is bandwidth- and issue-bound, every instruction per element counts):
- index arithmetic is int32 unless the launcher says a tensor spans ≥ 2^31 elements (IDX64 for
  qkv/q/q_scale/cos_sin/positions, CACHE_I64 for the KV cache);
- SLOT_LINEAR (block stride == block_size · slot stride, true for vLLM's caches, packed or not):
  a slot's row is `slot · slot stride`, no integer division;
- the RMS factor r is applied once at the end (x·w is rotated, then scaled by r, or by r / q_scale
  for fp8 q: amax(|r·u|) = r·amax(|u|)), so fp8 q costs one multiply per element, and one
  reciprocal per (token, head); the per-tensor K/V scales one reciprocal per program; the ±448
  clamp is the conversion's own saturation (`cvt.rn.satfinite`, also in the test interpreter).
"""

from __future__ import annotations

import triton
import triton.language as tl

FP8_MAX = tl.constexpr(448.0)


@triton.jit
def _rms_factor(lo, hi, tail, eps, D: tl.constexpr, HAS_TAIL: tl.constexpr):
    """1 / rms over the last axis of a head held as (lo, hi, tail): [BLOCK, H]."""
    ss = tl.sum(lo * lo, axis=2) + tl.sum(hi * hi, axis=2)
    if HAS_TAIL:
        ss += tl.sum(tail * tail, axis=2)
    return tl.rsqrt(ss * (1.0 / D) + eps)


@triton.jit
def _rotate(lo, hi, tail, cos, sin, w_lo, w_hi, w_tail, eps,
            D: tl.constexpr, HAS_TAIL: tl.constexpr, ORDER: tl.constexpr):
    """ORDER 0: rope; 1: rmsnorm then rope; 2: rope then rmsnorm. lo/hi/tail: [BLOCK, H, *].

    Returns (lo, hi, tail, r): the result is (lo, hi, tail) · r[:, :, None] (r: [BLOCK, H]; ORDER 0:
    r is not used by the callers). r is left out so that callers fold it into one final multiply.
    """
    if ORDER == 1:
        r = _rms_factor(lo, hi, tail, eps, D, HAS_TAIL)
        lo = lo * w_lo
        hi = hi * w_hi
        if HAS_TAIL:
            tail = tail * w_tail
    new_lo = lo * cos - hi * sin
    new_hi = hi * cos + lo * sin
    if ORDER == 2:
        r = _rms_factor(new_lo, new_hi, tail, eps, D, HAS_TAIL)
        new_lo = new_lo * w_lo
        new_hi = new_hi * w_hi
        if HAS_TAIL:
            tail = tail * w_tail
    if ORDER == 0:
        r = 1.0
    return new_lo, new_hi, tail, r


@triton.jit
def _cos_sin(pos_ptr, cs_ptr, tok, t_mask, num_pos, s_cs_p, s_cs_d, H: tl.constexpr,
             HALF: tl.constexpr, HALF_P: tl.constexpr, IDX64: tl.constexpr, CS_SMEM: tl.constexpr):
    """cos, sin of every token for [BLOCK, H, HALF_P] head tiles, fp32.

    Default: gathered straight into the tiles' layout, [BLOCK, H, HALF_P] (each warp reads the rows
    its heads need, the copies come from L1; a thread holding several heads loads a row once), no
    shared memory, no barrier. CS_SMEM: one [BLOCK, HALF_P] gather per program, broadcast over the
    heads through shared memory (fewer L1 requests, a layout conversion with barriers).
    """
    i = tl.arange(0, HALF_P)
    pos = tl.load(pos_ptr + tok, mask=t_mask, other=0)  # masked tokens read the row of position 0
    pos = tl.where((pos >= 0) & (pos < num_pos), pos, 0)  # bad positions (unchecked) stay in the cache
    if IDX64:
        pos = pos.to(tl.int64)
    else:
        pos = pos.to(tl.int32)
    if CS_SMEM:
        # the callers' bulk loads are issued above: keep them there (ptxas would otherwise hoist this
        # pos → cos chain and the layout conversion's barriers in front of them)
        tl.debug_barrier()
        off = (pos * s_cs_p)[:, None] + (i * s_cs_d)[None, :]
        if HALF == HALF_P:
            cos = tl.load(cs_ptr + off).to(tl.float32)
            sin = tl.load(cs_ptr + off + HALF * s_cs_d).to(tl.float32)
        else:
            m = (i < HALF)[None, :]
            cos = tl.load(cs_ptr + off, mask=m, other=0.0).to(tl.float32)
            sin = tl.load(cs_ptr + off + HALF * s_cs_d, mask=m, other=0.0).to(tl.float32)
        cos = cos[:, None, :]
        sin = sin[:, None, :]
    else:
        zero = tl.zeros([1, H, 1], dtype=pos.dtype)
        off = (pos * s_cs_p)[:, None, None] + zero + (i * s_cs_d)[None, None, :]
        if HALF == HALF_P:
            cos = tl.load(cs_ptr + off).to(tl.float32)
            sin = tl.load(cs_ptr + off + HALF * s_cs_d).to(tl.float32)
        else:
            m = (zero == 0) & (i < HALF)[None, None, :]
            cos = tl.load(cs_ptr + off, mask=m, other=0.0).to(tl.float32)
            sin = tl.load(cs_ptr + off + HALF * s_cs_d, mask=m, other=0.0).to(tl.float32)
    return cos, sin


@triton.jit
def _norm_weights(w_ptr, s_w, HALF: tl.constexpr, HALF_P: tl.constexpr, TAIL_P: tl.constexpr,
                  D: tl.constexpr, NEOX: tl.constexpr, ORDER: tl.constexpr):
    """The norm weight as (lo, hi, tail) pieces, [1, 1, *] fp32 (1.0 without a norm)."""
    if ORDER != 0:
        i = tl.arange(0, HALF_P)
        if NEOX:
            d_lo = i
            d_hi = i + HALF
        else:
            d_lo = 2 * i
            d_hi = 2 * i + 1
        j = 2 * HALF + tl.arange(0, TAIL_P)
        w_lo = tl.load(w_ptr + d_lo * s_w, mask=i < HALF, other=0.0).to(tl.float32)[None, None, :]
        w_hi = tl.load(w_ptr + d_hi * s_w, mask=i < HALF, other=0.0).to(tl.float32)[None, None, :]
        w_tail = tl.load(w_ptr + j * s_w, mask=j < D, other=0.0).to(tl.float32)[None, None, :]
    else:
        w_lo = 1.0
        w_hi = 1.0
        w_tail = 1.0
    return w_lo, w_hi, w_tail


@triton.jit
def _load_heads(base, mask, s_d, HALF: tl.constexpr, HALF_P: tl.constexpr, TAIL_P: tl.constexpr,
                D: tl.constexpr, NEOX: tl.constexpr, HAS_TAIL: tl.constexpr):
    """(lo, hi, tail) fp32 pieces of the heads at `base` [BLOCK, H, 1] (tail: zeros without one)."""
    i = tl.arange(0, HALF_P)
    if NEOX:
        d_lo = i
        d_hi = i + HALF
    else:
        d_lo = 2 * i
        d_hi = 2 * i + 1
    # rows outside `mask` are never stored and reduce only among themselves: they need no zero-fill;
    # padded dims (HALF < HALF_P, tail < TAIL_P) must read 0 for the row reductions
    if HALF == HALF_P:
        lo = tl.load(base + (d_lo * s_d)[None, None, :], mask=mask).to(tl.float32)
        hi = tl.load(base + (d_hi * s_d)[None, None, :], mask=mask).to(tl.float32)
    else:
        m = mask & (i < HALF)[None, None, :]
        lo = tl.load(base + (d_lo * s_d)[None, None, :], mask=m, other=0.0).to(tl.float32)
        hi = tl.load(base + (d_hi * s_d)[None, None, :], mask=m, other=0.0).to(tl.float32)
    if HAS_TAIL:
        j = 2 * HALF + tl.arange(0, TAIL_P)
        tail = tl.load(base + (j * s_d)[None, None, :], mask=mask & (j < D)[None, None, :],
                       other=0.0).to(tl.float32)
    else:
        tail = tl.zeros(lo.shape, dtype=tl.float32)
    return lo, hi, tail


@triton.jit
def _store_heads(base, mask, s_d, lo, hi, tail, HALF: tl.constexpr, HALF_P: tl.constexpr,
                 TAIL_P: tl.constexpr, D: tl.constexpr, NEOX: tl.constexpr, HAS_TAIL: tl.constexpr):
    i = tl.arange(0, HALF_P)
    if NEOX:
        d_lo = i
        d_hi = i + HALF
    else:
        d_lo = 2 * i
        d_hi = 2 * i + 1
    ty = base.dtype.element_ty
    m = mask & (i < HALF)[None, None, :]
    tl.store(base + (d_lo * s_d)[None, None, :], lo.to(ty), mask=m)
    tl.store(base + (d_hi * s_d)[None, None, :], hi.to(ty), mask=m)
    if HAS_TAIL:
        j = 2 * HALF + tl.arange(0, TAIL_P)
        tl.store(base + (j * s_d)[None, None, :], tail.to(ty), mask=mask & (j < D)[None, None, :])


@triton.jit
def _q_program(tb, kvh, qkv_ptr, pos_ptr, cs_ptr, qw_ptr, q_ptr, qs_ptr, num_tokens, num_pos, eps,
               s_qkv_t, s_qkv_d, s_cs_p, s_cs_d, s_qw, s_q_t, s_q_h, s_q_d, s_qs_t, s_qs_h,
               D: tl.constexpr, GROUP: tl.constexpr, GROUP_P: tl.constexpr,
               HALF: tl.constexpr, HALF_P: tl.constexpr, TAIL_P: tl.constexpr, HAS_TAIL: tl.constexpr,
               NEOX: tl.constexpr, ORDER: tl.constexpr, Q_FP8: tl.constexpr,
               BLOCK_T: tl.constexpr, IDX64: tl.constexpr, CS_SMEM: tl.constexpr):
    """Query heads kvh·GROUP .. + GROUP of tokens tb·BLOCK_T .. + BLOCK_T."""
    if IDX64:
        tok = tb.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    else:
        tok = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = tok < num_tokens
    g = tl.arange(0, GROUP_P)
    g_mask = g < GROUP
    qh = kvh * GROUP + g
    m = t_mask[:, None, None] & g_mask[None, :, None]
    base = qkv_ptr + (tok * s_qkv_t)[:, None, None] + (qh * (D * s_qkv_d))[None, :, None]
    lo, hi, tail = _load_heads(base, m, s_qkv_d, HALF, HALF_P, TAIL_P, D, NEOX, HAS_TAIL)
    cos, sin = _cos_sin(pos_ptr, cs_ptr, tok, t_mask, num_pos, s_cs_p, s_cs_d, GROUP_P, HALF, HALF_P, IDX64,
                        CS_SMEM)
    w_lo, w_hi, w_tail = _norm_weights(qw_ptr, s_qw, HALF, HALF_P, TAIL_P, D, NEOX, ORDER)
    lo, hi, tail, r = _rotate(lo, hi, tail, cos, sin, w_lo, w_hi, w_tail, eps, D, HAS_TAIL, ORDER)

    if Q_FP8:
        amax = tl.maximum(tl.max(tl.abs(lo), axis=2), tl.max(tl.abs(hi), axis=2))  # [BLOCK_T, GROUP_P]
        if HAS_TAIL:
            amax = tl.maximum(amax, tl.max(tl.abs(tail), axis=2))
        if ORDER != 0:
            amax = amax * r  # r > 0 and rounding is monotonic: this is amax(|u · r|)
        scale = tl.math.div_rn(tl.maximum(amax, 1e-12), tl.full(amax.shape, FP8_MAX, tl.float32))
        tl.store(qs_ptr + (tok * s_qs_t)[:, None] + (qh * s_qs_h)[None, :], scale,
                 mask=t_mask[:, None] & g_mask[None, :])
        if ORDER != 0:
            f = r / scale  # one division per (token, head), then a multiply per element
        else:
            f = 1.0 / scale
        f = f[:, :, None]
        lo = lo * f
        hi = hi * f
        if HAS_TAIL:
            tail = tail * f
    elif ORDER != 0:
        f = r[:, :, None]
        lo = lo * f
        hi = hi * f
        if HAS_TAIL:
            tail = tail * f
    qo = q_ptr + (tok * s_q_t)[:, None, None] + (qh * s_q_h)[None, :, None]
    _store_heads(qo, m, s_q_d, lo, hi, tail, HALF, HALF_P, TAIL_P, D, NEOX, HAS_TAIL)


@triton.jit
def _kv_program(kb, qkv_ptr, pos_ptr, cs_ptr, kw_ptr, kc_ptr, vc_ptr, slot_ptr, ks_ptr, vs_ptr,
                num_tokens, num_pos, num_slots, eps, block_size, s_qkv_t, s_qkv_d, s_cs_p, s_cs_d, s_kw,
                s_kc_b, s_kc_s, s_kc_h, s_kc_d, s_vc_b, s_vc_s, s_vc_h, s_vc_d,
                HQ: tl.constexpr, HKV: tl.constexpr, HKV_P: tl.constexpr, D: tl.constexpr,
                D_P: tl.constexpr, HALF: tl.constexpr, HALF_P: tl.constexpr, TAIL_P: tl.constexpr,
                HAS_TAIL: tl.constexpr, NEOX: tl.constexpr, ORDER: tl.constexpr, KV_FP8: tl.constexpr,
                BLOCK_KV: tl.constexpr, IDX64: tl.constexpr, CACHE_I64: tl.constexpr,
                SLOT_LINEAR: tl.constexpr, CS_SMEM: tl.constexpr):
    """All key and value heads of tokens kb·BLOCK_KV .. + BLOCK_KV, into the cache at their slots."""
    if IDX64:
        tok = kb.to(tl.int64) * BLOCK_KV + tl.arange(0, BLOCK_KV)
    else:
        tok = kb * BLOCK_KV + tl.arange(0, BLOCK_KV)
    t_mask = tok < num_tokens
    h = tl.arange(0, HKV_P)
    h_mask = h < HKV
    m = t_mask[:, None, None] & h_mask[None, :, None]
    row = (tok * s_qkv_t)[:, None, None]
    # the v rows and the slots first, pinned in flight by a barrier (nothing before it waits on a
    # load; ptxas would otherwise sink the v load below the k maths), then the k pieces, cos/sin
    dv = tl.arange(0, D_P)
    dv_mask = (dv < D)[None, None, :]
    v = tl.load(qkv_ptr + row + ((HQ + HKV + h) * (D * s_qkv_d))[None, :, None] + (dv * s_qkv_d)[None, None, :],
                mask=m & dv_mask)
    slot = tl.load(slot_ptr + tok, mask=t_mask, other=-1)
    tl.debug_barrier()
    k_base = qkv_ptr + row + ((HQ + h) * (D * s_qkv_d))[None, :, None]
    lo, hi, tail = _load_heads(k_base, m, s_qkv_d, HALF, HALF_P, TAIL_P, D, NEOX, HAS_TAIL)
    if CACHE_I64:
        slot = slot.to(tl.int64)
    else:
        slot = slot.to(tl.int32)
    cos, sin = _cos_sin(pos_ptr, cs_ptr, tok, t_mask, num_pos, s_cs_p, s_cs_d, HKV_P, HALF, HALF_P, IDX64,
                        CS_SMEM)
    w_lo, w_hi, w_tail = _norm_weights(kw_ptr, s_kw, HALF, HALF_P, TAIL_P, D, NEOX, ORDER)
    if KV_FP8:  # loaded before any store (ptxas keeps loads below the stores that precede them)
        k_scale = tl.load(ks_ptr).to(tl.float32)
        v_scale = tl.load(vs_ptr).to(tl.float32)
    lo, hi, tail, r = _rotate(lo, hi, tail, cos, sin, w_lo, w_hi, w_tail, eps, D, HAS_TAIL, ORDER)

    kv_mask = t_mask & (slot >= 0) & (slot < num_slots)  # −1 skips; bad slots (unchecked) write nothing
    slot = tl.where(kv_mask, slot, 0)
    if SLOT_LINEAR:  # block stride == block_size · slot stride: the row is slot · slot stride
        kc_row = slot * s_kc_s
        vc_row = slot * s_vc_s
    else:
        blk = slot // block_size
        off = slot - blk * block_size
        kc_row = blk * s_kc_b + off * s_kc_s
        vc_row = blk * s_vc_b + off * s_vc_s
    wm = kv_mask[:, None, None] & h_mask[None, :, None]

    if KV_FP8:
        f = 1.0 / k_scale
        if ORDER != 0:
            f = r[:, :, None] * f
        lo = lo * f
        hi = hi * f
        if HAS_TAIL:
            tail = tail * f
    elif ORDER != 0:
        f = r[:, :, None]
        lo = lo * f
        hi = hi * f
        if HAS_TAIL:
            tail = tail * f
    kc = kc_ptr + kc_row[:, None, None] + (h * s_kc_h)[None, :, None]
    _store_heads(kc, wm, s_kc_d, lo, hi, tail, HALF, HALF_P, TAIL_P, D, NEOX, HAS_TAIL)

    if KV_FP8:
        v = v.to(tl.float32) * (1.0 / v_scale)
    vc = vc_ptr + vc_row[:, None, None] + (h * s_vc_h)[None, :, None] + (dv * s_vc_d)[None, None, :]
    tl.store(vc, v.to(vc_ptr.dtype.element_ty), mask=wm & dv_mask)


@triton.jit
def rope_norm_store_kv_fused_kernel(
    qkv_ptr, pos_ptr, cs_ptr, qw_ptr, kw_ptr, kc_ptr, vc_ptr, slot_ptr, ks_ptr, vs_ptr, q_ptr, qs_ptr,
    num_tokens, num_pos, num_slots, eps, block_size,
    s_qkv_t, s_qkv_d,
    s_cs_p, s_cs_d,
    s_qw, s_kw,
    s_kc_b, s_kc_s, s_kc_h, s_kc_d,
    s_vc_b, s_vc_s, s_vc_h, s_vc_d,
    s_q_t, s_q_h, s_q_d,
    s_qs_t, s_qs_h,
    HQ: tl.constexpr, HKV: tl.constexpr, HKV_P: tl.constexpr, D: tl.constexpr, D_P: tl.constexpr,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr,
    HALF: tl.constexpr, HALF_P: tl.constexpr, TAIL_P: tl.constexpr, HAS_TAIL: tl.constexpr,
    NEOX: tl.constexpr, ORDER: tl.constexpr, KV_FP8: tl.constexpr, Q_FP8: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_KV: tl.constexpr, IDX64: tl.constexpr, CACHE_I64: tl.constexpr,
    SLOT_LINEAR: tl.constexpr, CS_SMEM: tl.constexpr,
):
    pid = tl.program_id(0)
    num_q = tl.cdiv(num_tokens, BLOCK_T) * HKV
    if pid < num_q:
        _q_program(pid // HKV, pid % HKV, qkv_ptr, pos_ptr, cs_ptr, qw_ptr, q_ptr, qs_ptr, num_tokens, num_pos, eps,
                   s_qkv_t, s_qkv_d, s_cs_p, s_cs_d, s_qw, s_q_t, s_q_h, s_q_d, s_qs_t, s_qs_h,
                   D, GROUP, GROUP_P, HALF, HALF_P, TAIL_P, HAS_TAIL, NEOX, ORDER, Q_FP8, BLOCK_T, IDX64, CS_SMEM)
    else:
        _kv_program(pid - num_q, qkv_ptr, pos_ptr, cs_ptr, kw_ptr, kc_ptr, vc_ptr, slot_ptr, ks_ptr, vs_ptr,
                    num_tokens, num_pos, num_slots, eps, block_size, s_qkv_t, s_qkv_d, s_cs_p, s_cs_d, s_kw,
                    s_kc_b, s_kc_s, s_kc_h, s_kc_d, s_vc_b, s_vc_s, s_vc_h, s_vc_d,
                    HQ, HKV, HKV_P, D, D_P, HALF, HALF_P, TAIL_P, HAS_TAIL, NEOX, ORDER, KV_FP8,
                    BLOCK_KV, IDX64, CACHE_I64, SLOT_LINEAR, CS_SMEM)
