"""Triton kernel of `hpcops.store_kv` (only @triton.jit code; the launcher is kv_store.py)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def store_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, ks_ptr, vs_ptr, num_tokens, num_slots, block_size,
                    s_kt, s_kh, s_vt, s_vh, s_kcb, s_kcs, s_kch, s_vcb, s_vcs, s_vch,
                    H: tl.constexpr, H_P: tl.constexpr, D: tl.constexpr, D_P: tl.constexpr,
                    BLOCK_T: tl.constexpr, KV_FP8: tl.constexpr):
    """Every kv head of tokens pid·BLOCK_T .. + BLOCK_T into the paged caches at their slots (slot = block ·
    block_size + offset). A slot < 0 (padding) writes nothing; so does one past the cache (unchecked values on
    a GPU: never a write out of bounds). fp8: e4m3(x / scale) saturated, the division correctly rounded (as
    torch's `(x.float() / scale).clamp(-448, 448).to(fp8)`, bit for bit)."""
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = tok < num_tokens
    slot = tl.load(slot_ptr + tok, mask=t_ok, other=-1).to(tl.int64)
    ok = t_ok & (slot >= 0) & (slot < num_slots)
    slot = tl.where(ok, slot, 0)
    blk = slot // block_size
    off = slot - blk * block_size
    h = tl.arange(0, H_P)
    d = tl.arange(0, D_P)
    m = ok[:, None, None] & (h < H)[None, :, None] & (d < D)[None, None, :]
    tok = tok.to(tl.int64)
    # lanes off the mask (the block's rows past the tokens, padding slots) read 1.0, never stored: a 0 would send
    # each of their fp8 divisions down the IEEE division's slow path (at T = 1, 31 rows of 32: ~9 µs a call)
    k = tl.load(k_ptr + (tok * s_kt)[:, None, None] + (h * s_kh)[None, :, None] + d[None, None, :], mask=m, other=1.0)
    v = tl.load(v_ptr + (tok * s_vt)[:, None, None] + (h * s_vh)[None, :, None] + d[None, None, :], mask=m, other=1.0)
    if KV_FP8:
        ks = tl.zeros(k.shape, tl.float32) + tl.load(ks_ptr)
        vs = tl.zeros(v.shape, tl.float32) + tl.load(vs_ptr)
        k = tl.clamp(tl.math.div_rn(k.to(tl.float32), ks), -448.0, 448.0)
        v = tl.clamp(tl.math.div_rn(v.to(tl.float32), vs), -448.0, 448.0)
    kc = kc_ptr + (blk * s_kcb + off * s_kcs)[:, None, None] + (h * s_kch)[None, :, None] + d[None, None, :]
    vc = vc_ptr + (blk * s_vcb + off * s_vcs)[:, None, None] + (h * s_vch)[None, :, None] + d[None, None, :]
    tl.store(kc, k.to(kc_ptr.dtype.element_ty), mask=m)
    tl.store(vc, v.to(vc_ptr.dtype.element_ty), mask=m)
