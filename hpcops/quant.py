"""FP8 (e4m3) quantization configs and torch helpers shared by the ops and their references.

Scales are dequantization multipliers: ``x ≈ x_fp8.float() * scale``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


@dataclass(frozen=True)
class Fp8PerTensor:
    """FP8 e4m3 weights with one scale per expert, activations with a per-tensor static scale or
    dynamic per-token scales.

    `w13_scale`, `w2_scale`: fp32 [E_local] (or [1]). `a13_scale` / `a2_scale`: fp32 [1] static
    activation scales (FP8 checkpoints), or None for dynamic per-token quantization.
    """

    w13_scale: torch.Tensor
    w2_scale: torch.Tensor
    a13_scale: torch.Tensor | None = None
    a2_scale: torch.Tensor | None = None


@dataclass(frozen=True)
class Fp8Block128:
    """FP8 e4m3 weights with 128×128 block scales, activations quantized per token per group of 128.

    `w13_scale`: fp32 [E_local, ceil(2I/128), ceil(H/128)]; `w2_scale`: fp32 [E_local, ceil(H/128), ceil(I/128)].
    """

    w13_scale: torch.Tensor
    w2_scale: torch.Tensor
    block: int = 128


def quantize_per_tensor(x: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8(x / scale) with saturation; `scale` defaults to amax/448. Returns (x_fp8, scale[1])."""
    xf = x.float()
    if scale is None:
        scale = (xf.abs().amax().clamp_min(1e-12) / FP8_MAX).reshape(1)
    q = (xf / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale.float().reshape(1)


def quantize_per_token_head(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [T, H, D] → (fp8 [T, H, D], scale fp32 [T, H]) with scale = amax over D / 448, correctly rounded on every
    device (the divisor a tensor: CUDA torch turns a division by a Python number into a product with its reciprocal,
    one ulp off now and then, where the CPU divides)."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1).clamp_min(1e-12)
    scale = amax / torch.full_like(amax, FP8_MAX)
    q = (xf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def quantize_per_token_group(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [T, K] → (fp8 [T, K], scale fp32 [T, ceil(K/group)]), one scale per token per group."""
    t, k = x.shape
    ng = -(-k // group)
    xf = torch.nn.functional.pad(x.float(), (0, ng * group - k)).view(t, ng, group)
    scale = xf.abs().amax(dim=-1).clamp_min(1e-12) / FP8_MAX
    q = (xf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).view(t, ng * group)[:, :k].to(FP8)
    return q, scale


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [T, K] → (fp8 [T, K], scale fp32 [T]) with scale = max|x[t]| / 448 (dynamic per token)."""
    q, scale = quantize_per_token_group(x, max(x.shape[-1], 1))
    return q, scale[:, 0] if scale.shape[-1] else scale.reshape(x.shape[0])


def expand_block_scale(scale: torch.Tensor, shape: tuple[int, int], block: int = 128) -> torch.Tensor:
    """Block scales [..., ceil(R/b), ceil(C/b)] → per-element scales [..., R, C] (for dequantizing)."""
    r, c = shape
    s = scale.float().repeat_interleave(block, dim=-2).repeat_interleave(block, dim=-1)
    return s[..., :r, :c]


def dequantize_block128(w: torch.Tensor, scale: torch.Tensor, block: int = 128) -> torch.Tensor:
    """fp8 weights [..., R, C] with 128×128 block scales [..., ceil(R/b), ceil(C/b)] → fp32."""
    return w.float() * expand_block_scale(scale, tuple(w.shape[-2:]), block)


def quantize_block128(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """w: [..., R, C] → (fp8 [..., R, C], scale fp32 [..., ceil(R/b), ceil(C/b)]), amax/448 per block."""
    *lead, r, c = w.shape
    rb, cb = -(-r // block), -(-c // block)
    wf = torch.nn.functional.pad(w.float(), (0, cb * block - c, 0, rb * block - r))
    blocks = wf.reshape(*lead, rb, block, cb, block)
    scale = blocks.abs().amax(dim=(-3, -1)).clamp_min(1e-12) / FP8_MAX
    q = (blocks / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    q = q.reshape(*lead, rb * block, cb * block)
    return q[..., :r, :c].to(FP8), scale
