"""RMSNorm in one launch, with an optional residual add before it.

    h = x                      or  h = dtype(x + residual)   (the new residual stream, returned too)
    out = dtype(h · rsqrt(mean(h², -1) + eps) · weight)       (in fp32)

What vLLM runs as one CUDA kernel (`rms_norm`, and `fused_add_rms_norm` with the residual), where torch's
`F.rms_norm` on a graph is a chain of small launches (the float casts, the square, the mean, the rsqrt and the
products). No host sync, CUDA-graph safe.
"""

from __future__ import annotations

import torch
import triton

from hpcops._checks import HALF_DTYPES, check_kernel_device, check_tensor
from hpcops.norm._norm_kernels import rms_norm_kernel

DTYPES = (*HALF_DTYPES, torch.float32)
MAX_BLOCK_H = 4096  # elements of a row per chunk: wider rows take several chunks


def _launch(h: int) -> tuple[int, int, int]:
    """(BLOCK_H, chunks, warps): one chunk up to MAX_BLOCK_H elements, 4 warps up to 1024, 8 beyond."""
    block = min(triton.next_power_of_2(h), MAX_BLOCK_H)
    return block, triton.cdiv(h, block), 4 if block <= 1024 else 8


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, residual: torch.Tensor | None = None,
             out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None):
    """RMSNorm of the rows of `x` (with `residual` added first).

    Args:
        x: `[T, H]` bf16/fp16/fp32, last dim contiguous.
        weight: `[H]`, any float dtype (read in fp32).
        eps: added to the mean square.
        residual: `[T, H]`, x's dtype: h = dtype(x + residual) is normalized and returned as the new residual.
        out, residual_out: `[T, H]` x's dtype, last dim contiguous (default: new tensors).

    Returns:
        out, or (out, h) with `residual`.
    """
    check_tensor("x", x, dtypes=DTYPES, ndim=2)
    T, H = x.shape
    dev = x.device
    check_tensor("weight", weight, ndim=1, shape=(H,), device=dev)
    if not weight.is_floating_point():
        raise TypeError(f"weight must be a floating tensor, got {weight.dtype}")
    if isinstance(eps, bool) or not isinstance(eps, int | float) or not eps >= 0:
        raise ValueError(f"eps must be a python float >= 0, got {eps!r}")
    for name, t in (("residual", residual), ("out", out), ("residual_out", residual_out)):
        if t is not None:
            check_tensor(name, t, dtypes=(x.dtype,), shape=(T, H), device=dev)
    if residual is None and residual_out is not None:
        raise ValueError("residual_out is the new residual stream x + residual: pass residual too")
    for name, t in (("x", x), ("residual", residual), ("out", out), ("residual_out", residual_out)):
        if t is not None and H > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous along its last dimension, got strides {tuple(t.stride())}")
    check_kernel_device("x", x)
    if out is None:
        out = torch.empty((T, H), dtype=x.dtype, device=dev)
    if residual is not None and residual_out is None:
        residual_out = torch.empty((T, H), dtype=x.dtype, device=dev)
    if T and H:
        block, chunks, warps = _launch(H)
        r = residual if residual is not None else x
        hb = residual_out if residual_out is not None else out
        rms_norm_kernel[(T,)](x, r, weight.contiguous(), out, hb, H, float(eps),
                              x.stride(0), r.stride(0), out.stride(0), hb.stride(0),
                              HAS_RES=residual is not None, BLOCK_H=block, NUM_CHUNKS=chunks, num_warps=warps)
    return out if residual is None else (out, residual_out)
