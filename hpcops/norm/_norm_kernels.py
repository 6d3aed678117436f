"""Triton kernel of `hpcops.norm.rms_norm`: one program per row. A row of up to BLOCK_H elements stays in registers;
a wider one is read in chunks twice (the sum of squares, then the scaled write, the second read from L1/L2)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _load_row_chunk(x_ptr, res_ptr, h_ptr, row, offs, mask, stride_x, stride_r, stride_h, HAS_RES: tl.constexpr):
    """x's chunk, or h = dtype(x + residual) (stored: the new residual stream keeps x's dtype, and the norm is taken
    of h as rounded)."""
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(h_ptr + row * stride_h + offs, x, mask=mask)
    return x


@triton.jit
def rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, h_ptr, H, eps,
                    stride_x, stride_r, stride_o, stride_h,
                    HAS_RES: tl.constexpr, BLOCK_H: tl.constexpr, NUM_CHUNKS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    if NUM_CHUNKS == 1:
        offs = tl.arange(0, BLOCK_H)
        mask = offs < H
        xf = _load_row_chunk(x_ptr, res_ptr, h_ptr, row, offs, mask, stride_x, stride_r, stride_h,
                             HAS_RES).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / H + eps)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_o + offs, (xf * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)
    else:
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for c in tl.static_range(NUM_CHUNKS):
            offs = c * BLOCK_H + tl.arange(0, BLOCK_H)
            mask = offs < H
            xf = _load_row_chunk(x_ptr, res_ptr, h_ptr, row, offs, mask, stride_x, stride_r, stride_h,
                                 HAS_RES).to(tl.float32)
            acc += xf * xf
        rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / H + eps)
        if HAS_RES:
            tl.debug_barrier()  # the stored h chunks, read back by whichever thread owns them now
        src_ptr = h_ptr if HAS_RES else x_ptr
        stride_s = stride_h if HAS_RES else stride_x
        for c in tl.static_range(NUM_CHUNKS):
            offs = c * BLOCK_H + tl.arange(0, BLOCK_H)
            mask = offs < H
            xf = tl.load(src_ptr + row * stride_s + offs, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(out_ptr + row * stride_o + offs, (xf * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)
