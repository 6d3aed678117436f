"""Torch reference of `hpcops.norm.rms_norm` (same signature)."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, residual: torch.Tensor | None = None,
             out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None):
    """out = dtype(h · rsqrt(mean(h², -1) + eps) · weight) in fp32, h = x, or dtype(x + residual) (returned too)."""
    h = x if residual is None else (x.float() + residual.float()).to(x.dtype)
    hf = h.float()
    y = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
    if out is not None:
        out.copy_(y)
        y = out
    if residual is None:
        return y
    if residual_out is not None:
        residual_out.copy_(h)
        h = residual_out
    return y, h
