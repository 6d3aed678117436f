"""TMA (tensor-descriptor) access to paged KV caches, shared by decode and prefill.

The cache `[num_blocks, block_size, Hkv, D]` is seen as a 2-D tensor `[num_blocks·block_size, token
row]`: row `block·block_size + slot`, kv head h at column `h·stride(2)`. A tile of `block_n` keys must
lie in one page, so `block_size` must be a multiple of `block_n`.
"""

from __future__ import annotations

import torch


def tma_unsupported_reason(cache: torch.Tensor, block_n: int) -> str | None:
    """Why a K or V cache cannot be read with TMA tiles of `block_n` keys (None: it can)."""
    nb, page, hkv, d = cache.shape
    sb, st, sh, sd = cache.stride()
    e = cache.element_size()
    if page % block_n:
        return f"block_size {page} is not a multiple of block_n {block_n} (a TMA tile must lie in one page)"
    if sd != 1:
        return "head_dim is not contiguous"
    if sb != page * st and nb > 1:
        return f"blocks are not back to back (stride(0) {sb} != block_size·stride(1) {page * st})"
    if (hkv - 1) * sh + d > st:
        return f"a token row (stride(1) {st}) does not hold all kv heads (stride(2) {sh})"
    if (st * e) % 16 or (sh * e) % 16:
        return f"token/head strides ({st}, {sh} elements) are not multiples of 16 bytes"
    if cache.data_ptr() % 16:
        return "the cache base address is not 16-byte aligned"
    if nb * page >= 2**31:
        return "more than 2^31 cache slots"
    return None


def kv_tma_unsupported_reason(k_cache: torch.Tensor, v_cache: torch.Tensor, block_n: int) -> str | None:
    """`tma_unsupported_reason` for both caches, the first failing one named ("k_cache: ..."; None: both can)."""
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        why = tma_unsupported_reason(cache, block_n)
        if why is not None:
            return f"{name}: {why}"
    return None


def kv_descriptor(cache: torch.Tensor, block_n: int):
    """Host TensorDescriptor over `cache` as 2-D [num_blocks·block_size, token row], box [block_n, D]."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    nb, page, hkv, d = cache.shape
    _, st, sh, _ = cache.stride()
    return TensorDescriptor(cache, [nb * page, (hkv - 1) * sh + d], [st, 1], [block_n, d])


def gluon_kv_descriptor(cache: torch.Tensor, block_n: int):
    """`kv_descriptor` for a Gluon kernel: the same 2-D view and box, with its shared-memory layout."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    nb, page, hkv, d = cache.shape
    _, st, sh, _ = cache.stride()
    dtype = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float8_e4m3fn: gl.float8e4nv}[cache.dtype]
    layout = gl.NVMMASharedLayout.get_default_for([block_n, d], dtype)
    return TensorDescriptor(cache, [nb * page, (hkv - 1) * sh + d], [st, 1], [block_n, d], layout)
