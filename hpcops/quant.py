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
    """x: [T, H, D] → (fp8 [T, H, D], scale fp32 [T, H]) with scale = amax over D / 448."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1).clamp_min(1e-12) / FP8_MAX
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
