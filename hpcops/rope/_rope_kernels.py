"""Triton kernels of the fused attention prologue (only `@triton.jit` code; launcher: prologue.py).

One program handles BLOCK_T tokens of one KV group: its GROUP query heads as one 3-D tile
[BLOCK_T, GROUP_P, HALF_P], the key head and the value head. Each head is held as three pieces:
`lo` and `hi` (the two members of every rotary pair; NeoX: d and d + R/2, GPT-J: 2i and 2i + 1)
and `tail` (dims R..D that pass through the rotation). All maths in fp32.
"""

from __future__ import annotations

import triton
import triton.language as tl

FP8_MAX = tl.constexpr(448.0)


@triton.jit
def _rms_scale(lo, hi, tail, eps, D: tl.constexpr, HAS_TAIL: tl.constexpr):
    """1 / rms over the last axis of a head held as (lo, hi, tail); returns [..., 1]-broadcastable."""
    ss = tl.sum(lo * lo, axis=2) + tl.sum(hi * hi, axis=2)
    if HAS_TAIL:
        ss += tl.sum(tail * tail, axis=2)
    return tl.rsqrt(ss / D + eps)[:, :, None]


@triton.jit
def _transform_head(lo, hi, tail, cos, sin, w_lo, w_hi, w_tail, eps,
                    D: tl.constexpr, HAS_TAIL: tl.constexpr, ORDER: tl.constexpr):
    """ORDER 0: rope; 1: rmsnorm then rope; 2: rope then rmsnorm. lo/hi/tail: [BLOCK_T, H, *]."""
    if ORDER == 1:
        r = _rms_scale(lo, hi, tail, eps, D, HAS_TAIL)
        lo = lo * r * w_lo
        hi = hi * r * w_hi
        if HAS_TAIL:
            tail = tail * r * w_tail
    new_lo = lo * cos - hi * sin
    new_hi = hi * cos + lo * sin
    lo = new_lo
    hi = new_hi
    if ORDER == 2:
        r = _rms_scale(lo, hi, tail, eps, D, HAS_TAIL)
        lo = lo * r * w_lo
        hi = hi * r * w_hi
        if HAS_TAIL:
            tail = tail * r * w_tail
    return lo, hi, tail


@triton.jit
def _fp8_quant(x, scale):
    """clamp(x / scale, ±448) with IEEE division (plain `/` is div.full.f32, up to 2 ulp off torch)."""
    y = tl.math.div_rn(x, tl.zeros_like(x) + scale)
    return tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)


@triton.jit
def rope_norm_store_kv_fused_kernel(
    qkv_ptr, pos_ptr, cs_ptr, qw_ptr, kw_ptr, kc_ptr, vc_ptr, slot_ptr, ks_ptr, vs_ptr, q_ptr, qs_ptr,
    num_tokens, eps, block_size,
    s_qkv_t, s_qkv_d,
    s_cs_p, s_cs_d,
    s_qw, s_kw,
    s_kc_b, s_kc_s, s_kc_h, s_kc_d,
    s_vc_b, s_vc_s, s_vc_h, s_vc_d,
    s_q_t, s_q_h, s_q_d,
    s_qs_t, s_qs_h,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, D_P: tl.constexpr,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr,
    HALF: tl.constexpr, HALF_P: tl.constexpr, TAIL_P: tl.constexpr, HAS_TAIL: tl.constexpr,
    NEOX: tl.constexpr, ORDER: tl.constexpr, KV_FP8: tl.constexpr, Q_FP8: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    pid_t = tl.program_id(0)
    kvh = tl.program_id(1)

    tok = pid_t.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    t_mask = tok < num_tokens
    row = tok * s_qkv_t  # [BLOCK_T] int64

    i = tl.arange(0, HALF_P)  # [HALF_P]
    i_mask = i < HALF
    if NEOX:
        d_lo = i
        d_hi = i + HALF
    else:
        d_lo = 2 * i
        d_hi = 2 * i + 1
    j = 2 * HALF + tl.arange(0, TAIL_P)  # [TAIL_P]
    j_mask = j < D

    # cos/sin of every token: [BLOCK_T, 1, HALF_P], shared by the group's q heads and its k head
    pos = tl.load(pos_ptr + tok, mask=t_mask, other=0).to(tl.int64)
    cs_row = pos * s_cs_p
    cs_mask = t_mask[:, None] & i_mask[None, :]
    cos = tl.load(cs_ptr + cs_row[:, None] + i[None, :] * s_cs_d, mask=cs_mask, other=0.0).to(tl.float32)
    sin = tl.load(cs_ptr + cs_row[:, None] + (HALF + i)[None, :] * s_cs_d, mask=cs_mask,
                  other=0.0).to(tl.float32)
    cos = cos[:, None, :]
    sin = sin[:, None, :]

    if ORDER != 0:
        qw_lo = tl.load(qw_ptr + d_lo * s_qw, mask=i_mask, other=0.0).to(tl.float32)[None, None, :]
        qw_hi = tl.load(qw_ptr + d_hi * s_qw, mask=i_mask, other=0.0).to(tl.float32)[None, None, :]
        kw_lo = tl.load(kw_ptr + d_lo * s_kw, mask=i_mask, other=0.0).to(tl.float32)[None, None, :]
        kw_hi = tl.load(kw_ptr + d_hi * s_kw, mask=i_mask, other=0.0).to(tl.float32)[None, None, :]
        qw_tail = tl.load(qw_ptr + j * s_qw, mask=j_mask, other=0.0).to(tl.float32)[None, None, :]
        kw_tail = tl.load(kw_ptr + j * s_kw, mask=j_mask, other=0.0).to(tl.float32)[None, None, :]
    else:
        qw_lo = 1.0
        qw_hi = 1.0
        qw_tail = 1.0
        kw_lo = 1.0
        kw_hi = 1.0
        kw_tail = 1.0

    # ---- query heads of this group: [BLOCK_T, GROUP_P, *]
    g = tl.arange(0, GROUP_P)
    g_mask = g < GROUP
    qh = kvh * GROUP + g  # [GROUP_P]
    tq_mask = t_mask[:, None, None] & g_mask[None, :, None]
    q_base = qkv_ptr + row[:, None, None] + (qh * D)[None, :, None] * s_qkv_d
    q_lo = tl.load(q_base + d_lo[None, None, :] * s_qkv_d, mask=tq_mask & i_mask[None, None, :],
                   other=0.0).to(tl.float32)
    q_hi = tl.load(q_base + d_hi[None, None, :] * s_qkv_d, mask=tq_mask & i_mask[None, None, :],
                   other=0.0).to(tl.float32)
    if HAS_TAIL:
        q_tail = tl.load(q_base + j[None, None, :] * s_qkv_d, mask=tq_mask & j_mask[None, None, :],
                         other=0.0).to(tl.float32)
    else:
        q_tail = tl.zeros([BLOCK_T, GROUP_P, TAIL_P], dtype=tl.float32)
    q_lo, q_hi, q_tail = _transform_head(q_lo, q_hi, q_tail, cos, sin, qw_lo, qw_hi, qw_tail, eps,
                                         D, HAS_TAIL, ORDER)

    qo_base = q_ptr + (tok * s_q_t)[:, None, None] + (qh.to(tl.int64) * s_q_h)[None, :, None]
    if Q_FP8:
        amax = tl.maximum(tl.max(tl.abs(q_lo), axis=2), tl.max(tl.abs(q_hi), axis=2))  # [BLOCK_T, GROUP_P]
        if HAS_TAIL:
            amax = tl.maximum(amax, tl.max(tl.abs(q_tail), axis=2))
        scale = tl.math.div_rn(tl.maximum(amax, 1e-12), tl.full(amax.shape, FP8_MAX, tl.float32))
        tl.store(qs_ptr + (tok * s_qs_t)[:, None] + (qh * s_qs_h)[None, :], scale,
                 mask=t_mask[:, None] & g_mask[None, :])
        q_lo = _fp8_quant(q_lo, scale[:, :, None])
        q_hi = _fp8_quant(q_hi, scale[:, :, None])
        if HAS_TAIL:
            q_tail = _fp8_quant(q_tail, scale[:, :, None])
    out_ty = q_ptr.dtype.element_ty
    tl.store(qo_base + d_lo[None, None, :] * s_q_d, q_lo.to(out_ty), mask=tq_mask & i_mask[None, None, :])
    tl.store(qo_base + d_hi[None, None, :] * s_q_d, q_hi.to(out_ty), mask=tq_mask & i_mask[None, None, :])
    if HAS_TAIL:
        tl.store(qo_base + j[None, None, :] * s_q_d, q_tail.to(out_ty), mask=tq_mask & j_mask[None, None, :])

    # ---- key head: [BLOCK_T, 1, *], written to the paged cache at slot_mapping (-1: skip)
    slot = tl.load(slot_ptr + tok, mask=t_mask, other=-1).to(tl.int64)
    kv_mask = t_mask & (slot >= 0)
    slot = tl.where(kv_mask, slot, 0)
    blk = slot // block_size
    off = slot - blk * block_size

    k_base = qkv_ptr + row[:, None, None] + (HQ + kvh) * D * s_qkv_d
    tk_mask = t_mask[:, None, None]
    k_lo = tl.load(k_base + d_lo[None, None, :] * s_qkv_d, mask=tk_mask & i_mask[None, None, :],
                   other=0.0).to(tl.float32)
    k_hi = tl.load(k_base + d_hi[None, None, :] * s_qkv_d, mask=tk_mask & i_mask[None, None, :],
                   other=0.0).to(tl.float32)
    if HAS_TAIL:
        k_tail = tl.load(k_base + j[None, None, :] * s_qkv_d, mask=tk_mask & j_mask[None, None, :],
                         other=0.0).to(tl.float32)
    else:
        k_tail = tl.zeros([BLOCK_T, 1, TAIL_P], dtype=tl.float32)
    k_lo, k_hi, k_tail = _transform_head(k_lo, k_hi, k_tail, cos, sin, kw_lo, kw_hi, kw_tail, eps,
                                         D, HAS_TAIL, ORDER)
    kc_base = kc_ptr + (blk * s_kc_b + off * s_kc_s)[:, None, None] + kvh * s_kc_h
    wk_mask = kv_mask[:, None, None]
    kc_ty = kc_ptr.dtype.element_ty
    if KV_FP8:
        k_scale = tl.load(ks_ptr).to(tl.float32)
        k_lo = _fp8_quant(k_lo, k_scale)
        k_hi = _fp8_quant(k_hi, k_scale)
        if HAS_TAIL:
            k_tail = _fp8_quant(k_tail, k_scale)
    tl.store(kc_base + d_lo[None, None, :] * s_kc_d, k_lo.to(kc_ty), mask=wk_mask & i_mask[None, None, :])
    tl.store(kc_base + d_hi[None, None, :] * s_kc_d, k_hi.to(kc_ty), mask=wk_mask & i_mask[None, None, :])
    if HAS_TAIL:
        tl.store(kc_base + j[None, None, :] * s_kc_d, k_tail.to(kc_ty), mask=wk_mask & j_mask[None, None, :])

    # ---- value head: [BLOCK_T, D_P], copied (or quantized) into the cache
    dv = tl.arange(0, D_P)
    dv_mask = dv < D
    v = tl.load(qkv_ptr + row[:, None] + ((HQ + HKV + kvh) * D + dv)[None, :] * s_qkv_d,
                mask=t_mask[:, None] & dv_mask[None, :], other=0.0)
    vc_ty = vc_ptr.dtype.element_ty
    if KV_FP8:
        v_scale = tl.load(vs_ptr).to(tl.float32)
        v = _fp8_quant(v.to(tl.float32), v_scale)
    vc_ptrs = vc_ptr + (blk * s_vc_b + off * s_vc_s + kvh * s_vc_h)[:, None] + dv[None, :] * s_vc_d
    tl.store(vc_ptrs, v.to(vc_ty), mask=kv_mask[:, None] & dv_mask[None, :])
