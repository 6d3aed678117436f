"""`store_kv`: the new tokens' K and V into the paged caches, one launch (fp8: quantized with per-tensor scales).

What an attention layer runs before the attention when the rope is not ours (vLLM's backends call it
`do_kv_cache_update`; vLLM's own is one CUDA kernel, `reshape_and_cache_flash`). Without it the vLLM backend ran a
torch scatter: index maths, a conversion chain for fp8 and two index_put, about ten small kernels a layer.
`rope_norm_store_kv` fuses the same write with QK-norm and RoPE where those are ours too.
"""

from __future__ import annotations

import torch
import triton

from hpcops._checks import (
    FP8_E4M3,
    HALF_DTYPES,
    check_index_range,
    check_kernel_device,
    check_scale,
    check_tensor,
    values_checkable,
)
from hpcops.attention._kv_store_kernels import store_kv_kernel

INDEX_DTYPES = (torch.int64, torch.int32)


def _validate(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale, check):
    check_tensor("key", key, dtypes=HALF_DTYPES, ndim=3)
    t, h, d = key.shape
    dev = key.device
    check_tensor("value", value, dtypes=(key.dtype,), shape=(t, h, d), device=dev)
    check_tensor("k_cache", k_cache, dtypes=(key.dtype, FP8_E4M3), ndim=4, device=dev)
    if k_cache.shape[2:] != (h, d):
        raise ValueError(f"k_cache must have shape [num_blocks, block_size, num_kv_heads={h}, head_dim={d}] (key's "
                         f"heads and head_dim), got {list(k_cache.shape)}")
    check_tensor("v_cache", v_cache, dtypes=(k_cache.dtype,), shape=tuple(k_cache.shape), device=dev)
    for name, x in (("key", key), ("value", value), ("k_cache", k_cache), ("v_cache", v_cache)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous along head_dim (its last dimension)")
    check_tensor("slot_mapping", slot_mapping, dtypes=INDEX_DTYPES, shape=(t,), device=dev)
    if k_cache.dtype == FP8_E4M3:
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            if s is None:
                raise ValueError(f"an fp8 KV cache needs {name} (one-element float32 per-tensor scale)")
            check_scale(name, s, device=dev)
    elif k_scale is not None or v_scale is not None:
        raise ValueError(f"k_scale / v_scale are for an fp8 cache; the cache is {str(k_cache.dtype)[6:]}")
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    if check is None:
        check = values_checkable(slot_mapping)
    elif check and slot_mapping.is_cuda and torch.cuda.is_current_stream_capturing():
        raise ValueError("check=True copies slot_mapping to the host: not while a CUDA graph is captured")
    if t and check:
        check_index_range("slot_mapping", slot_mapping, -1, num_slots, "a slot of the cache, or -1 to skip")


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, *, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
             check: bool | None = None) -> None:
    """Write token i's key and value heads into the caches at slot_mapping[i] (block · block_size + offset).

    key, value: [T, Hkv, D] bf16/fp16, any token and head strides, a contiguous D (views of a fused qkv are
    fine). k_cache, v_cache: [num_blocks, block_size, Hkv, D], key's dtype or fp8 e4m3 with `k_scale`,
    `v_scale` (one-element fp32; stored e4m3(x / scale) saturated at ±448), any strides with a contiguous D
    (vLLM's packed K|V views). slot_mapping: int64/int32 [T]; −1 (padding) writes nothing. Slot values are
    checked on the host (CPU tensors, or `check=True` / HPCOPS_CHECK=1 on a GPU: a device sync); unchecked, a
    slot past the cache writes nothing. One launch, no host sync: CUDA-graph safe.
    """
    _validate(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale, check)
    check_kernel_device("key", key)
    t, h, d = key.shape
    if t == 0:
        return
    h_p, d_p = triton.next_power_of_2(h), triton.next_power_of_2(d)
    block_t = max(1, min(64, 4096 // (h_p * d_p)))
    fp8 = k_cache.dtype == FP8_E4M3
    dummy = slot_mapping  # stands in for absent scales (never read)
    store_kv_kernel[(triton.cdiv(t, block_t),)](
        key, value, k_cache, v_cache, slot_mapping, k_scale if fp8 else dummy, v_scale if fp8 else dummy, t,
        k_cache.shape[0] * k_cache.shape[1], k_cache.shape[1],
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), H=h, H_P=h_p, D=d, D_P=d_p, BLOCK_T=block_t, KV_FP8=fp8, num_warps=4)


__all__ = ["store_kv"]
