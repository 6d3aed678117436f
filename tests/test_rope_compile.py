"""Ahead-of-time compile of the rope kernel for sm_90 (no GPU needed: Triton ships ptxas).

The interpreter accepts code the GPU compiler rejects (non-constexpr globals, shape mismatches in
builtins), so the CPU tier also compiles the hot variants to a cubin and checks they neither spill
nor lose the 16-byte q loads. Runs in a subprocess: kernels there must not be interpreted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(r'''
    import inspect, json, os, re, subprocess, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from hpcops.rope._rope_kernels import rope_norm_store_kv_fused_kernel as k

    UNIT = ("s_qkv_d", "s_cs_d", "s_qw", "s_kw", "s_kc_d", "s_vc_d", "s_q_d", "s_qs_h")
    ALIGNED = ("s_qkv_t", "s_kc_b", "s_kc_s", "s_kc_h", "s_vc_b", "s_vc_s", "s_vc_h", "s_q_t", "s_q_h",
               "s_cs_p", "block_size")

    def build(hq, hkv, d, rot, fp8, neox, order, bt, warps):
        params = list(inspect.signature(k.fn).parameters)
        kv = "fp8e4nv" if fp8 else "bf16"
        ptr = {"qkv_ptr": "bf16", "pos_ptr": "i64", "cs_ptr": "fp32", "qw_ptr": "fp32", "kw_ptr": "fp32",
               "kc_ptr": kv, "vc_ptr": kv, "slot_ptr": "i64", "ks_ptr": "fp32", "vs_ptr": "fp32",
               "q_ptr": kv, "qs_ptr": "fp32"}
        g, half, tail = hq // hkv, rot // 2, d - rot
        const = dict(HQ=hq, HKV=hkv, D=d, D_P=d, GROUP=g, GROUP_P=triton.next_power_of_2(g), HALF=half,
                     HALF_P=triton.next_power_of_2(half), TAIL_P=triton.next_power_of_2(max(tail, 1)),
                     HAS_TAIL=tail > 0, NEOX=neox, ORDER=order, KV_FP8=fp8, Q_FP8=fp8, BLOCK_T=bt,
                     **{u: 1 for u in UNIT})
        sig = {}
        for p in params:
            if p in ptr:
                sig[p] = "*" + ptr[p]
            elif p in const:
                sig[p] = "constexpr"
            else:
                sig[p] = "fp32" if p == "eps" else "i64" if p.startswith("s_") else "i32"
        attrs = {(params.index(p),): [["tt.divisibility", 16]] for p in params
                 if p.endswith("_ptr") or p in ALIGNED}
        src = ASTSource(fn=k, signature=sig, constexprs={(params.index(n),): v for n, v in const.items()},
                        attrs=attrs)
        cc = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
        ptx = cc.asm["ptx"]
        return {"v4_loads": len(re.findall(r"ld\.global(?:\.\w+)*\.v4", ptx)),
                "local": ptx.count("st.local")}

    out = {}
    for name, cfg in json.loads(sys.argv[1]).items():
        out[name] = build(**cfg)
    print(json.dumps(out))
''')

VARIANTS = {
    "hy3-full-bf16": dict(hq=64, hkv=8, d=128, rot=128, fp8=False, neox=True, order=1, bt=4, warps=8),
    "hy3-rank-fp8": dict(hq=8, hkv=1, d=128, rot=128, fp8=True, neox=True, order=1, bt=4, warps=8),
    "gptj-partial-d256": dict(hq=6, hkv=2, d=256, rot=96, fp8=True, neox=False, order=2, bt=2, warps=4),
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
    assert res["hy3-full-bf16"]["v4_loads"] >= 2, "q tiles no longer load 16 bytes per thread"
