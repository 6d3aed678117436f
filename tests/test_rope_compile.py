"""Ahead-of-time compile of the rope kernel for sm_90 (no GPU needed: Triton ships ptxas).

The interpreter accepts code the GPU compiler rejects (non-constexpr globals, shape mismatches in
builtins), so the CPU tier also compiles the hot variants to a cubin and checks the properties the
kernel's speed rests on: no spills, 16-byte q/v accesses, int32 index arithmetic, one IEEE division
per (token, head) at most in the fp8 path (reciprocal + multiplies elsewhere), the fp8 clamp folded
into the saturating conversion. Runs in a subprocess: kernels there must not be interpreted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(r'''
    import inspect, json, re, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from hpcops.rope._rope_kernels import rope_norm_store_kv_fused_kernel as k

    UNIT = ("s_qkv_d", "s_cs_d", "s_qw", "s_kw", "s_kc_d", "s_vc_d", "s_q_d", "s_qs_h")
    ALIGNED = ("s_qkv_t", "s_kc_b", "s_kc_s", "s_kc_h", "s_vc_b", "s_vc_s", "s_vc_h", "s_q_t", "s_q_h",
               "s_cs_p", "block_size")

    def build(hq, hkv, d, rot, fp8, neox, order, bt, bkv, warps, idx64=False, linear=True, smem=False):
        params = list(inspect.signature(k.fn).parameters)
        kv = "fp8e4nv" if fp8 else "bf16"
        ptr = {"qkv_ptr": "bf16", "pos_ptr": "i64", "cs_ptr": "fp32", "qw_ptr": "fp32", "kw_ptr": "fp32",
               "kc_ptr": kv, "vc_ptr": kv, "slot_ptr": "i64", "ks_ptr": "fp32", "vs_ptr": "fp32",
               "q_ptr": kv, "qs_ptr": "fp32"}
        g, half, tail = hq // hkv, rot // 2, d - rot
        const = dict(HQ=hq, HKV=hkv, HKV_P=triton.next_power_of_2(hkv), D=d, D_P=d, GROUP=g,
                     GROUP_P=triton.next_power_of_2(g), HALF=half, HALF_P=triton.next_power_of_2(half),
                     TAIL_P=triton.next_power_of_2(max(tail, 1)), HAS_TAIL=tail > 0, NEOX=neox, ORDER=order,
                     KV_FP8=fp8, Q_FP8=fp8, BLOCK_T=bt, BLOCK_KV=bkv, IDX64=idx64, CACHE_I64=idx64,
                     SLOT_LINEAR=linear, CS_SMEM=smem, **{u: 1 for u in UNIT})
        missing = [p for p in params if p.isupper() and p not in const]
        assert not missing, f"constexprs the test does not set: {missing}"
        sig = {}
        for p in params:
            if p in ptr:
                sig[p] = "*" + ptr[p]
            elif p in const:
                sig[p] = "constexpr"
            else:  # strides and sizes: i32 as Triton specializes them when they fit
                sig[p] = "fp32" if p == "eps" else "i64" if idx64 and p.startswith("s_") else "i32"
        attrs = {(params.index(p),): [["tt.divisibility", 16]] for p in params
                 if p.endswith("_ptr") or p in ALIGNED}
        src = ASTSource(fn=k, signature=sig, constexprs={(params.index(n),): v for n, v in const.items()},
                        attrs=attrs)
        cc = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
        ptx = cc.asm["ptx"]
        count = lambda pat: len(re.findall(pat, ptx))
        return {"ld_v4": count(r"ld\.global(?:\.\w+)*\.v4"), "st_v4": count(r"st\.global(?:\.\w+)*\.v4"),
                "local": count(r"\bst\.local|\bld\.local"),
                "div_rn": count(r"\bdiv\.rn\.f32"), "div_any": count(r"\bdiv\.\w+\.f32"),
                "int64_mul": count(r"\b(?:mul|mad)\.(?:lo|hi)\.[su]64"),
                "int64_div": count(r"\b(?:div|rem)\.[su]64"), "int_div": count(r"\b(?:div|rem)\.[su](?:32|64)"),
                "min_f32": count(r"\bmin(?:\.\w+)*\.f32"), "satfinite": count(r"cvt\.rn\.satfinite\.e4m3x2")}

    out = {}
    for name, cfg in json.loads(sys.argv[1]).items():
        out[name] = build(**cfg)
    print(json.dumps(out))
''')

HY3 = dict(d=128, rot=128, neox=True, order=1)
VARIANTS = {
    # the defaults of the Hy3 shapes at large T (RopeConfig(4, 8), block_kv 2 resp. 16)
    "hy3-full-bf16": dict(hq=64, hkv=8, fp8=False, bt=4, bkv=2, warps=8, **HY3),
    "hy3-full-fp8": dict(hq=64, hkv=8, fp8=True, bt=4, bkv=2, warps=8, **HY3),
    "hy3-rank-fp8": dict(hq=8, hkv=1, fp8=True, bt=4, bkv=16, warps=8, **HY3),
    "hy3-full-bf16-bt8w4": dict(hq=64, hkv=8, fp8=False, bt=8, bkv=4, warps=4, **HY3),
    "hy3-rank-fp8-smem": dict(hq=8, hkv=1, fp8=True, bt=4, bkv=16, warps=8, smem=True, **HY3),
    # the general paths: int64 offsets, a cache whose blocks are not adjacent, GPT-J, partial rotary
    "gptj-partial-d256-i64": dict(hq=6, hkv=2, d=256, rot=96, fp8=True, neox=False, order=2, bt=2, bkv=2,
                                  warps=4, idx64=True, linear=False),
}


def test_compiles_for_sm90():
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(VARIANTS)], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, r in res.items():
        assert r["local"] == 0, f"{name}: register spills to local memory"
    for name in ("hy3-full-bf16", "hy3-full-fp8", "hy3-rank-fp8", "hy3-full-bf16-bt8w4"):
        r = res[name]
        # q lo/hi + cos/sin + weights (q programs), v rows (kv programs): 16-byte loads
        assert r["ld_v4"] >= 9, f"{name}: q/v tiles no longer load 16 bytes per thread ({r})"
        assert r["int64_mul"] == 0 and r["int_div"] == 0, f"{name}: 64-bit or divided index maths ({r})"
    for name in ("hy3-full-bf16", "hy3-full-bf16-bt8w4"):
        assert res[name]["st_v4"] >= 3, f"{name}: q/v rows no longer stored 16 bytes per thread"
    for name in ("hy3-full-fp8", "hy3-rank-fp8", "hy3-rank-fp8-smem"):
        r = res[name]
        assert r["div_rn"] <= 1, f"{name}: more than the one IEEE division (q_scale = amax / 448) per thread"
        assert r["div_any"] <= 4, f"{name}: per-element divisions are back ({r})"
        assert r["satfinite"] > 0 and r["min_f32"] == 0, f"{name}: fp8 clamp not left to cvt.rn.satfinite"
    assert res["gptj-partial-d256-i64"]["int_div"] > 0  # non-adjacent blocks: slot // block_size
