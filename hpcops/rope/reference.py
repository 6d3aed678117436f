"""Pure-torch reference of `rope_norm_store_kv`: the unfused sequence (norm, rope, cache write, quant).

Maths in fp32 from the input values, rounded once at the end (as the fused kernel does). Also the
"unfused torch" peer of `hpcops bench rope` (through `unfused_sequence(..., skip_check=False)`, which
has no host sync so it can be captured in a CUDA graph).
"""

from __future__ import annotations

import torch

from hpcops.quant import FP8, quantize_per_tensor, quantize_per_token_head


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * w.float()


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int, neox: bool) -> torch.Tensor:
    """x: [T, H, D] fp32; cos, sin: [T, 1, rotary_dim/2] fp32."""
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    if neox:
        x1, x2 = rot.chunk(2, dim=-1)
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
    return torch.cat([out, rest], dim=-1)


def _transform(x, cos, sin, w, eps, order, rotary_dim, neox):
    if order == "norm_rope":
        x = _rms_norm(x, w, eps)
    x = _rope(x, cos, sin, rotary_dim, neox)
    if order == "rope_norm":
        x = _rms_norm(x, w, eps)
    return x


def _write(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, scale: torch.Tensor | None) -> None:
    """cache[slot // bs, slot % bs] = rows (fp8: saturated fp8(rows / scale))."""
    if cache.dtype == FP8:
        rows = quantize_per_tensor(rows, scale)[0]
    else:
        rows = rows.to(cache.dtype)
    bs = cache.shape[1]
    # scatter the raw bytes: index_put_ on float8 tensors is not implemented on every backend
    cache.view(torch.uint8)[slots // bs, slots % bs] = rows.view(torch.uint8)


def unfused_sequence(qkv, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, *, num_q_heads,
                     num_kv_heads, head_dim, q_norm_weight=None, k_norm_weight=None, eps=1e-6,
                     order="norm_rope", style="neox", rotary_dim=None, k_scale=None, v_scale=None,
                     quantize_q=False, q_out=None, skip_invalid_slots=True):
    """The reference; `skip_invalid_slots=False` assumes every slot is ≥ 0 (no host sync: capturable)."""
    t, hq, hkv, d = qkv.shape[0], num_q_heads, num_kv_heads, head_dim
    rot = head_dim if rotary_dim is None else rotary_dim
    x = qkv[:, : (hq + 2 * hkv) * d].float()
    q = x[:, : hq * d].reshape(t, hq, d)
    k = x[:, hq * d: (hq + hkv) * d].reshape(t, hkv, d)
    v = x[:, (hq + hkv) * d:].reshape(t, hkv, d)
    cs = cos_sin_cache[positions.long()].float()
    cos, sin = cs[:, None, : rot // 2], cs[:, None, rot // 2: rot]
    neox = style == "neox"
    if order == "rope":
        q = _rope(q, cos, sin, rot, neox)
        k = _rope(k, cos, sin, rot, neox)
    else:
        q = _transform(q, cos, sin, q_norm_weight, eps, order, rot, neox)
        k = _transform(k, cos, sin, k_norm_weight, eps, order, rot, neox)

    slots = slot_mapping.long()
    if skip_invalid_slots:
        keep = (slots >= 0).nonzero().squeeze(1)
        slots, k, v = slots[keep], k[keep], v[keep]
    _write(k_cache, slots, k, k_scale)
    _write(v_cache, slots, v, v_scale)

    if quantize_q:
        q8, q_scale = quantize_per_token_head(q)
        if q_out is None:
            return q8, q_scale
        q_out.copy_(q8)
        return q_out, q_scale
    if q_out is None:
        return q.to(qkv.dtype), None
    q_out.copy_(q)
    return q_out, None


def rope_norm_store_kv(qkv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, *,
                       num_q_heads: int, num_kv_heads: int, head_dim: int,
                       q_norm_weight: torch.Tensor | None = None, k_norm_weight: torch.Tensor | None = None,
                       eps: float = 1e-6, order: str = "norm_rope", style: str = "neox",
                       rotary_dim: int | None = None, k_scale: torch.Tensor | None = None,
                       v_scale: torch.Tensor | None = None, quantize_q: bool = False,
                       q_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Reference for `hpcops.rope_norm_store_kv` (same signature and semantics; see its docstring)."""
    return unfused_sequence(qkv, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
                            num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                            q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight, eps=eps, order=order,
                            style=style, rotary_dim=rotary_dim, k_scale=k_scale, v_scale=v_scale,
                            quantize_q=quantize_q, q_out=q_out)
