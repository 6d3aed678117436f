"""`hpcops.store_kv` (the paged K/V write without the rope) against its torch reference: bit for bit, padding slots
untouched, argument errors; on the GPU at Hy3 sizes and under a CUDA graph."""

from __future__ import annotations

import pytest
import torch

import hpcops
from hpcops.attention import reference

FP8 = torch.float8_e4m3fn


def _case(t, h, d, bs, nb, cache_dtype, *, dtype=torch.bfloat16, packed=False, slot_dtype=torch.int64,
          device="cpu", seed=0):
    """Strided key/value (views of a fused qkv with 2 q heads), NaN-filled caches (packed K|V views if `packed`), a
    slot mapping of distinct shuffled slots with every third token padding (−1)."""
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn((t, 2 + 2 * h, d), generator=g) * 30).to(dtype)
    key, value = qkv[:, 2:2 + h], qkv[:, 2 + h:]
    if packed:
        phys = torch.full((nb, bs, h, 2 * d), float("nan")).to(cache_dtype)
        k_cache, v_cache = phys[..., :d], phys[..., d:]
    else:
        k_cache = torch.full((nb, bs, h, d), float("nan")).to(cache_dtype)
        v_cache = k_cache.clone()
    slots = torch.randperm(nb * bs, generator=g)[:t]
    slots[::3] = -1
    fp8 = cache_dtype == FP8
    scales = dict(k_scale=torch.tensor([0.07]), v_scale=torch.tensor([0.05])) if fp8 else {}
    to = lambda x: x.to(device)  # noqa: E731
    return ((to(key), to(value), to(k_cache), to(v_cache), to(slots.to(slot_dtype))),
            {k: to(v) for k, v in scales.items()})


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.uint8 if x.element_size() == 1 else torch.int16)


def _check_against_reference(args, kw):
    key, value, k_cache, v_cache, slots = args
    want_k, want_v = k_cache.clone(), v_cache.clone()
    reference.store_kv(key, value, want_k, want_v, slots, **kw)
    assert hpcops.store_kv(key, value, k_cache, v_cache, slots, **kw) is None
    assert torch.equal(_bits(k_cache), _bits(want_k)) and torch.equal(_bits(v_cache), _bits(want_v))
    written = int((slots >= 0).sum())
    nan = k_cache.float().isnan().reshape(-1, *k_cache.shape[2:]).all(-1).all(-1)
    assert int((~nan).sum()) == written  # padding and every other slot untouched (still NaN)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("t,h,d,bs,packed", [(10, 1, 128, 16, False), (9, 3, 64, 32, True), (21, 8, 128, 64, True),
                                             (5, 2, 96, 16, False)])
def test_store_kv_matches_reference(t, h, d, bs, packed, cache_dtype, device):
    args, kw = _case(t, h, d, bs, 6, cache_dtype, packed=packed, device=device)
    _check_against_reference(args, kw)


def test_store_kv_fp16_and_int32_slots(device):
    args, kw = _case(12, 2, 64, 16, 4, torch.float16, dtype=torch.float16, slot_dtype=torch.int32, device=device)
    _check_against_reference(args, kw)


def test_store_kv_fp8_saturates(device):
    args, kw = _case(4, 1, 64, 16, 2, FP8, device=device)
    key = args[0]
    key[1, 0, :3] = torch.tensor([1e4, -1e4, 0.0], dtype=key.dtype)
    args[4][1] = 5
    _check_against_reference(args, kw)
    k_cache = args[2]
    assert k_cache[0, 5, 0, :2].float().tolist() == [448.0, -448.0]


@pytest.mark.parametrize(
    "mutate, exc, match",
    [
        (lambda a, k: a.__setitem__(0, a[0].float()), TypeError, "key must have dtype"),
        (lambda a, k: a.__setitem__(1, a[1][:, :1]), ValueError, "value must have shape"),
        (lambda a, k: a.__setitem__(2, a[2][..., :32]), ValueError, "k_cache must have shape"),
        (lambda a, k: a.__setitem__(3, a[3].to(torch.float16)), TypeError, "v_cache must have dtype"),
        (lambda a, k: a.__setitem__(4, a[4][:-1]), ValueError, "slot_mapping must have shape"),
        (lambda a, k: a.__setitem__(4, a[4].float()), TypeError, "slot_mapping must have dtype"),
        (lambda a, k: a[4].__setitem__(1, 6 * 16), ValueError, r"slot_mapping\[1\] = 96 is outside \[-1, 96\)"),
        (lambda a, k: a[4].__setitem__(1, -2), ValueError, r"slot_mapping\[1\] = -2"),
        (lambda a, k: k.update(k_scale=torch.ones(1)), ValueError, "k_scale / v_scale are for an fp8 cache"),
        (lambda a, k: a.__setitem__(0, a[0].transpose(1, 2).contiguous().transpose(1, 2)), ValueError,
         "key must be contiguous along head_dim"),
    ],
)
def test_store_kv_argument_errors(mutate, exc, match):
    args, kw = _case(6, 2, 64, 16, 6, torch.bfloat16)
    args = list(args)
    mutate(args, kw)
    with pytest.raises(exc, match=match):
        hpcops.store_kv(*args, **kw)


def test_store_kv_fp8_needs_scales():
    args, kw = _case(6, 2, 64, 16, 6, FP8)
    with pytest.raises(ValueError, match="an fp8 KV cache needs v_scale"):
        hpcops.store_kv(*args, k_scale=kw["k_scale"])
    with pytest.raises(ValueError, match="k_scale must be a one-element"):
        hpcops.store_kv(*args, k_scale=torch.ones(2), v_scale=kw["v_scale"])


def test_store_kv_signature_is_the_reference():
    import inspect

    params = lambda f: [(p.name, p.kind, p.default) for p in inspect.signature(f).parameters.values()]  # noqa: E731
    assert params(hpcops.store_kv) == params(reference.store_kv)


def test_store_kv_no_tokens(device):
    args, kw = _case(3, 1, 64, 16, 2, torch.bfloat16, device=device)
    empty = [x[:0] for x in args[:2]] + list(args[2:4]) + [args[4][:0]]
    hpcops.store_kv(*empty, **kw)
    assert args[2].float().isnan().all()


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("t,h", [(1, 1), (64, 1), (8192, 8)], ids=["T1-h1", "T64-h1", "T8192-h8"])
def test_store_kv_gpu(t, h, cache_dtype):
    """At Hy3's decode and prefill sizes (head_dim 128, page 64, packed K|V like vLLM's cache) on the GPU, bit for
    bit; then the same writes replayed from a CUDA graph."""
    args, kw = _case(t, h, 128, 64, t // 32 + 4, cache_dtype, packed=True, device="cuda", seed=t)
    _check_against_reference(args, kw)
    key, value, k_cache, v_cache, slots = args
    k_cache.fill_(float("nan")), v_cache.fill_(float("nan"))
    from hpcops.testing import capture_graph

    graph, _ = capture_graph(lambda: hpcops.store_kv(key, value, k_cache, v_cache, slots, **kw))
    k_cache.fill_(float("nan")), v_cache.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    want_k = torch.full_like(k_cache, float("nan"))
    want_v = torch.full_like(v_cache, float("nan"))
    reference.store_kv(key, value, want_k, want_v, slots, **kw)
    assert torch.equal(_bits(k_cache), _bits(want_k)) and torch.equal(_bits(v_cache), _bits(want_v))


@pytest.mark.gpu
def test_store_kv_gpu_unchecked_bad_slot_writes_nothing():
    """A slot past the cache on a GPU, unchecked (no host sync): nothing is written for it, nothing else is hit."""
    args, kw = _case(8, 1, 128, 64, 2, torch.bfloat16, device="cuda")
    key, value, k_cache, v_cache, slots = args
    slots[1] = 10 ** 9
    hpcops.store_kv(key, value, k_cache, v_cache, slots, check=False)
    torch.cuda.synchronize()
    written = int((slots >= 0).sum()) - 1
    nan = k_cache.float().isnan().reshape(-1, *k_cache.shape[2:]).all(-1).all(-1)
    assert int((~nan).sum()) == written


STORE_BUILD = """
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hpcops.attention._kv_store_kernels import store_kv_kernel as k

out = {}
for cache in ("bf16", "fp8e4nv"):
    sig = {a: "i64" if a.startswith("s_") else "i32" for a in k.arg_names}
    sig.update({"k_ptr": "*bf16", "v_ptr": "*bf16", "kc_ptr": f"*{cache}", "vc_ptr": f"*{cache}", "slot_ptr": "*i64",
                "ks_ptr": "*fp32", "vs_ptr": "*fp32"})
    consts = {"H": 8, "H_P": 8, "D": 128, "D_P": 128, "BLOCK_T": 4, "KV_FP8": cache == "fp8e4nv"}
    sig.update({c: "constexpr" for c in consts})
    ptx = triton.compile(ASTSource(k, sig, consts), target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": 4}).asm["ptx"]
    out[cache] = {"cvt_e4m3": len(re.findall(r"cvt\\.rn\\.satfinite\\.e4m3x2", ptx)),
                  "local": ptx.count(".local"), "st": len(re.findall(r"st\\.global", ptx)),
                  # the fill of each masked 16-bit K/V load: a register moved in before the predicated load
                  "fills": sorted(set(re.findall(r"mov\\.u16 %rs\\d+, (\\S+);\\s*@%p\\d+ ld\\.global\\.b16", ptx))),
                  "bf16_one": len(re.findall(r"mov\\.b16\\s+%rs\\d+, 16256;", ptx))}
print(json.dumps(out))
"""


def test_store_kv_kernel_compiles_for_sm90():
    """The store kernel builds for sm_90 (bf16 and fp8 caches): e4m3 conversions on the fp8 path only, no local
    memory, and its masked K/V loads fill with 1.0 (a 0 dividend takes the IEEE division's slow path)."""
    pytest.importorskip("triton.backends.nvidia")
    from hpcops.testing import sm90_build_in_subprocess

    res = sm90_build_in_subprocess(STORE_BUILD, None)
    assert res["fp8e4nv"]["cvt_e4m3"] > 0 and res["bf16"]["cvt_e4m3"] == 0, res
    assert all(r["local"] == 0 and r["st"] > 0 for r in res.values()), res
    # the K/V lanes off the mask read bf16 1.0, not 0 (0 / scale takes div.rn.f32's slow path on the fp8 path)
    fp8 = res["fp8e4nv"]
    assert fp8["fills"] and "0x0" not in fp8["fills"] and fp8["bf16_one"] > 0, res
