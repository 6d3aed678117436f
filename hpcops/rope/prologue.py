"""The fused attention prologue: QK-RMSNorm + RoPE from the fused QKV projection, K/V straight into
the paged cache (bf16/fp16 or fp8 e4m3 per-tensor), optional per-token-per-head fp8 query. One launch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from hpcops import _platform
from hpcops._checks import (
    FP8_E4M3,
    HALF_DTYPES,
    check_choice,
    check_index_range,
    check_kernel_device,
    check_scale,
    check_tensor,
    values_checkable,
)
from hpcops._library import register
from hpcops.rope._rope_kernels import rope_norm_store_kv_fused_kernel

SUPPORTED_HEAD_DIMS = (64, 128, 256)
ORDERS = ("norm_rope", "rope_norm", "rope")
STYLES = ("neox", "gptj")
_ORDER_CODE = {"rope": 0, "norm_rope": 1, "rope_norm": 2}
INDEX_DTYPES = (torch.int64, torch.int32)


I32_LIMIT = 2**31 - 1


@dataclass(frozen=True)
class RopeConfig:
    """Launch shape: q programs of `block_t` tokens × one KV group's query heads; kv programs of
    `block_kv` tokens × all key and value heads (None: `default_block_kv`). `cos_sin_smem`: gather
    cos/sin once per program and broadcast it over the heads through shared memory (default: each
    warp gathers the rows of its heads from L1, no barrier)."""

    block_t: int
    num_warps: int
    block_kv: int | None = None
    cos_sin_smem: bool = False


def default_block_kv(block_t: int, num_tokens: int, num_q_heads: int, num_kv_heads: int) -> int:
    """kv tiles about as large as the q tiles: block_kv · Hkv_p · 2D ≈ block_t · group_p · D."""
    group_p = triton.next_power_of_2(num_q_heads // num_kv_heads)
    hkv_p = triton.next_power_of_2(num_kv_heads)
    block_kv = max(1, block_t * group_p // (2 * hkv_p))
    return max(1, min(block_kv, 64, triton.next_power_of_2(max(num_tokens, 1))))


def default_config(num_tokens: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                   device: torch.device | None = None) -> RopeConfig:
    """Tiles of ~`8K` fp32 elements per KV group (q heads + k + v) when the grid is large
    (bandwidth-bound), smaller tiles while the grid would not fill the SMs twice (launch/latency-bound)."""
    group_p = triton.next_power_of_2(num_q_heads // num_kv_heads)
    per_token = (group_p + 2) * head_dim
    block_t = max(1, triton.next_power_of_2(max(1, 8192 // per_token) + 1) // 2)  # largest pow2 ≤ quotient
    block_t = min(block_t, 16)
    sms = _platform.num_sms(device)
    while block_t > 1 and triton.cdiv(num_tokens, block_t) * num_kv_heads < 2 * sms:
        block_t //= 2
    elems = block_t * per_token
    num_warps = 2 if elems <= 1024 else 4 if elems <= 4096 else 8
    return RopeConfig(block_t=block_t, num_warps=num_warps,
                      block_kv=default_block_kv(block_t, num_tokens, num_q_heads, num_kv_heads))


def _max_offset(t: torch.Tensor, extra_rows: int = 0) -> int:
    """Largest element offset a kernel may form into `t` (plus `extra_rows` rows past the end)."""
    if t.numel() == 0:
        return 0
    return sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride())) + extra_rows * abs(t.stride(0))


def _slot_linear(c: torch.Tensor) -> bool:
    """Slot s of the cache sits at s · stride(1) (block stride == block_size · slot stride)."""
    return c.shape[0] == 1 or c.stride(0) == c.shape[1] * c.stride(1)


def _check(qkv, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, num_q_heads, num_kv_heads,
           head_dim, q_norm_weight, k_norm_weight, order, style, rotary_dim, k_scale, v_scale, quantize_q,
           q_out) -> int:
    """Validate everything (metadata only: no host sync); returns the rotary dim."""
    check_tensor("qkv", qkv, dtypes=HALF_DTYPES, ndim=2)
    dev = qkv.device
    for name, v in (("num_q_heads", num_q_heads), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    check_choice("head_dim", head_dim, SUPPORTED_HEAD_DIMS)
    width = (num_q_heads + 2 * num_kv_heads) * head_dim
    if qkv.shape[1] != width:
        raise ValueError(f"qkv must have (num_q_heads + 2*num_kv_heads)*head_dim = {width} columns "
                         f"(q heads, k heads, v heads), got {qkv.shape[1]}")
    t = qkv.shape[0]
    check_choice("order", order, ORDERS)
    check_choice("style", style, STYLES)
    rot = head_dim if rotary_dim is None else rotary_dim
    if not isinstance(rot, int) or isinstance(rot, bool) or rot < 2 or rot % 2 or rot > head_dim:
        raise ValueError(f"rotary_dim must be an even int in [2, head_dim={head_dim}], got {rotary_dim!r}")
    check_tensor("positions", positions, dtypes=INDEX_DTYPES, shape=(t,), device=dev)
    check_tensor("slot_mapping", slot_mapping, dtypes=INDEX_DTYPES, shape=(t,), device=dev)
    check_tensor("cos_sin_cache", cos_sin_cache, dtypes=(torch.float32, qkv.dtype), ndim=2, device=dev)
    if cos_sin_cache.shape[1] != rot:
        narrow = " (too narrow)" if cos_sin_cache.shape[1] < rot else ""
        raise ValueError(f"cos_sin_cache must have rotary_dim = {rot} columns (cos half | sin half), got "
                         f"{cos_sin_cache.shape[1]}{narrow}")
    if order == "rope":
        if q_norm_weight is not None or k_norm_weight is not None:
            raise ValueError("order='rope' applies no norm: q_norm_weight and k_norm_weight must be None "
                             "(use order='norm_rope' or 'rope_norm')")
    else:
        for name, w in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
            if w is None:
                raise ValueError(f"order={order!r} needs {name} (a [head_dim] tensor); use order='rope' "
                                 "for RoPE without norm")
            check_tensor(name, w, dtypes=(torch.float32, qkv.dtype), shape=(head_dim,), device=dev)
    cache_dtypes = (qkv.dtype, FP8_E4M3)
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(name, c, dtypes=cache_dtypes, ndim=4, device=dev)
        if c.shape[2] != num_kv_heads or c.shape[3] != head_dim:
            raise ValueError(f"{name} must have shape [num_blocks, block_size, num_kv_heads={num_kv_heads}, "
                             f"head_dim={head_dim}], got {list(c.shape)}")
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache and v_cache must have the same shape and dtype, got {list(k_cache.shape)} "
                         f"{k_cache.dtype} and {list(v_cache.shape)} {v_cache.dtype}")
    if k_cache.dtype == FP8_E4M3:
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            if s is None:
                raise ValueError(f"an fp8 KV cache needs {name} (one-element float32 per-tensor scale)")
            check_scale(name, s, device=dev)
    if q_out is not None:
        want = FP8_E4M3 if quantize_q else qkv.dtype
        check_tensor("q_out", q_out, dtypes=(want,), shape=(t, num_q_heads, head_dim), device=dev)
    if t and values_checkable(positions):  # on the host, or in checking mode (a device sync)
        check_index_range("positions", positions, 0, cos_sin_cache.shape[0], "a row of cos_sin_cache")
        check_index_range("slot_mapping", slot_mapping, -1, k_cache.shape[0] * k_cache.shape[1],
                          "a slot of the cache, or -1 to skip the KV write")
    # last: argument errors first; then whether the kernels can run where the tensors are
    check_kernel_device("qkv", qkv)
    return rot


def _launch(qkv, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, num_q_heads, num_kv_heads,
            head_dim, q_norm_weight, k_norm_weight, eps, order, style, rot, k_scale, v_scale, quantize_q,
            q_out, q_scale, config: RopeConfig | None = None) -> None:
    t = qkv.shape[0]
    if t == 0:
        return
    group = num_q_heads // num_kv_heads
    half = rot // 2
    tail = head_dim - rot
    cfg = config or default_config(t, num_q_heads, num_kv_heads, head_dim, qkv.device)
    block_kv = cfg.block_kv or default_block_kv(cfg.block_t, t, num_q_heads, num_kv_heads)
    # int32 index arithmetic where every offset provably fits (shapes only: no host sync)
    pad = max(cfg.block_t, block_kv)
    idx64 = max(_max_offset(qkv, pad), _max_offset(q_out, pad), _max_offset(cos_sin_cache),
                _max_offset(q_scale, pad) if quantize_q else 0) > I32_LIMIT
    cache_i64 = max(_max_offset(k_cache), _max_offset(v_cache),
                    k_cache.shape[0] * k_cache.shape[1]) > I32_LIMIT
    kv_fp8 = k_cache.dtype == FP8_E4M3
    norm = order != "rope"
    qw = q_norm_weight if norm else qkv
    kw = k_norm_weight if norm else qkv
    ks = k_scale if kv_fp8 else qkv
    vs = v_scale if kv_fp8 else qkv
    qs = q_scale if quantize_q else q_out
    qs_strides = q_scale.stride() if quantize_q else (0, 0)
    grid = (triton.cdiv(t, cfg.block_t) * num_kv_heads + triton.cdiv(t, block_kv),)
    rope_norm_store_kv_fused_kernel[grid](
        qkv, positions, cos_sin_cache, qw, kw, k_cache, v_cache, slot_mapping, ks, vs, q_out, qs,
        t, cos_sin_cache.shape[0], k_cache.shape[0] * k_cache.shape[1], float(eps), k_cache.shape[1],
        qkv.stride(0), qkv.stride(1),
        cos_sin_cache.stride(0), cos_sin_cache.stride(1),
        qw.stride(0) if norm else 0, kw.stride(0) if norm else 0,
        *k_cache.stride(), *v_cache.stride(),
        *q_out.stride(),
        *qs_strides,
        HQ=num_q_heads, HKV=num_kv_heads, HKV_P=triton.next_power_of_2(num_kv_heads), D=head_dim,
        D_P=triton.next_power_of_2(head_dim),
        GROUP=group, GROUP_P=triton.next_power_of_2(group),
        HALF=half, HALF_P=triton.next_power_of_2(half), TAIL_P=triton.next_power_of_2(max(tail, 1)),
        HAS_TAIL=tail > 0, NEOX=style == "neox", ORDER=_ORDER_CODE[order], KV_FP8=kv_fp8, Q_FP8=quantize_q,
        BLOCK_T=cfg.block_t, BLOCK_KV=block_kv, IDX64=idx64, CACHE_I64=cache_i64,
        SLOT_LINEAR=_slot_linear(k_cache) and _slot_linear(v_cache), CS_SMEM=bool(cfg.cos_sin_smem),
        num_warps=cfg.num_warps,
    )


def rope_norm_store_kv(qkv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, *,
                       num_q_heads: int, num_kv_heads: int, head_dim: int,
                       q_norm_weight: torch.Tensor | None = None, k_norm_weight: torch.Tensor | None = None,
                       eps: float = 1e-6, order: str = "norm_rope", style: str = "neox",
                       rotary_dim: int | None = None, k_scale: torch.Tensor | None = None,
                       v_scale: torch.Tensor | None = None, quantize_q: bool = False,
                       q_out: torch.Tensor | None = None,
                       config: RopeConfig | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """QK-RMSNorm + RoPE of the fused QKV projection; K/V written into the paged cache; one launch.

    qkv: [T, (Hq + 2·Hkv)·D] bf16/fp16, q heads then k heads then v heads (row stride may exceed
      the width). positions: int64/int32 [T], each < cos_sin_cache rows (checked when on the
      host, and in checking mode HPCOPS_CHECK=1).
    cos_sin_cache: [max_pos, rotary_dim] fp32 or qkv's dtype; cos in the first half, sin in the second.
    k_cache, v_cache: [num_blocks, block_size, Hkv, D], any strides (e.g. vLLM's packed K|V views),
      qkv's dtype or float8_e4m3fn with `k_scale`/`v_scale` (fp32 one-element; stored fp8(x/scale),
      saturated). slot_mapping: int64/int32 [T], slot = block·block_size + offset, −1 = no KV write
      (checked like positions).
    q_norm_weight, k_norm_weight: [D] fp32 or qkv's dtype (per-head RMSNorm, `eps`), required for
      order "norm_rope" (norm then RoPE, Hy3) and "rope_norm"; None for order "rope".
    style: "neox" rotates pairs (i, i + R/2), "gptj" pairs (2i, 2i + 1); dims ≥ rotary_dim R pass through.
    Returns q [T, Hq, D] in qkv's dtype and None, or with `quantize_q` fp8 e4m3 q and its scale fp32
    [T, Hq] (scale = amax/448 per token and head, q ≈ q8·scale). `q_out` receives q if given.
    No host sync and no data-dependent allocation: capturable in a CUDA graph.
    """
    rot = _check(qkv, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, num_q_heads, num_kv_heads,
                 head_dim, q_norm_weight, k_norm_weight, order, style, rotary_dim, k_scale, v_scale,
                 quantize_q, q_out)
    t = qkv.shape[0]
    if q_out is None:
        q_out = torch.empty((t, num_q_heads, head_dim), dtype=FP8_E4M3 if quantize_q else qkv.dtype,
                            device=qkv.device)
    q_scale = torch.empty((t, num_q_heads), dtype=torch.float32, device=qkv.device) if quantize_q else None
    _launch(qkv, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, num_q_heads, num_kv_heads,
            head_dim, q_norm_weight, k_norm_weight, eps, order, style, rot, k_scale, v_scale, quantize_q,
            q_out, q_scale, config)
    return q_out, q_scale


# ---- torch.library registration (for torch.compile / graph-capturing frameworks)

def _op(qkv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, k_cache: torch.Tensor,
        v_cache: torch.Tensor, slot_mapping: torch.Tensor, num_q_heads: int, num_kv_heads: int,
        head_dim: int, q_norm_weight: torch.Tensor | None, k_norm_weight: torch.Tensor | None, eps: float,
        order: str, style: str, rotary_dim: int | None, k_scale: torch.Tensor | None,
        v_scale: torch.Tensor | None, quantize_q: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Registered form: always returns (q, q_scale); q_scale is [T, Hq] fp32, or [0] without quantize_q."""
    q, q_scale = rope_norm_store_kv(qkv, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
                                    num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                    q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight, eps=eps,
                                    order=order, style=style, rotary_dim=rotary_dim, k_scale=k_scale,
                                    v_scale=v_scale, quantize_q=quantize_q)
    if q_scale is None:
        q_scale = torch.empty((0,), dtype=torch.float32, device=qkv.device)
    return q, q_scale


def _op_fake(qkv, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, num_q_heads, num_kv_heads,
             head_dim, q_norm_weight, k_norm_weight, eps, order, style, rotary_dim, k_scale, v_scale,
             quantize_q):
    t = qkv.shape[0]
    q = qkv.new_empty((t, num_q_heads, head_dim), dtype=FP8_E4M3 if quantize_q else qkv.dtype)
    q_scale = qkv.new_empty((t, num_q_heads) if quantize_q else (0,), dtype=torch.float32)
    return q, q_scale


rope_norm_store_kv_op = register("rope_norm_store_kv", _op, mutates_args=("k_cache", "v_cache"),
                                 fake=_op_fake)
