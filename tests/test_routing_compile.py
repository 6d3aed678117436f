"""Ahead-of-time compile of the router kernels for sm_90 (no GPU needed: Triton ships ptxas): the split-K router
GEMM (the fp32 weight split into three bf16 terms, three MMAs a K step) and the top-k kernel that adds its partial
sums. The interpreter accepts code the GPU compiler rejects; runs in a subprocess, uninterpreted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(r'''
    import inspect, json, re
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from hpcops.moe import routing
    from hpcops.moe._moe_kernels import router_gemm_kernel, select_experts_kernel

    def build(k, ptr, const, fp32=(), warps=4):
        sig_params = inspect.signature(k.fn).parameters
        params = list(sig_params)
        missing = [p for p, v in sig_params.items() if "constexpr" in str(v.annotation) and p not in const
                   and v.default is inspect.Parameter.empty]
        assert not missing, f"constexprs the test does not set: {missing}"
        sig = {p: "*" + ptr[p] if p in ptr else "constexpr" if p in const else "fp32" if p in fp32 else "i32"
               for p in params}
        attrs = {(params.index(p),): [["tt.divisibility", 16]] for p in params if p.endswith("_ptr")}
        src = ASTSource(fn=k, signature=sig, constexprs={(params.index(n),): v for n, v in const.items()},
                        attrs=attrs)
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps}).asm["ptx"]
        count = lambda pat: len(re.findall(pat, ptx))
        return {"local": count(r"\bst\.local|\bld\.local"), "fma": count(r"\bfma\.rn\.f32"),
                "cvt_bf16": count(r"\bcvt\.rn(?:\.satfinite)?\.bf16"),
                "mma": count(r"\b(?:w?gmma|mma)\."), "ld_global": count(r"\bld\.global")}

    lc = routing.router_launch(4, 192, 4096)
    blocks = dict(BLOCK_T=lc.block_t, BLOCK_E=lc.block_e, BLOCK_K=lc.block_k)
    out = {}
    ptrs = {"x_ptr": "bf16", "w_ptr": "fp32", "part_ptr": "fp32"}
    out["gemm-bf16"] = build(router_gemm_kernel, ptrs, blocks, warps=lc.warps)
    big = routing.router_launch(8192, 192, 4096)  # the prefill tiles
    out["gemm-large"] = build(router_gemm_kernel, ptrs, dict(BLOCK_T=big.block_t, BLOCK_E=big.block_e,
                              BLOCK_K=big.block_k), warps=big.warps)
    sel = {"logits_ptr": "fp32", "bias_ptr": "fp32", "w_ptr": "fp32", "ids_ptr": "i32"}
    for splits in (1, 32):
        out[f"select-{splits}"] = build(select_experts_kernel, sel, dict(TOP_K=8, K_PAD=8, E_PAD=256, BLOCK_T=1,
                                        SIGMOID=True, HAS_BIAS=True, RENORM=True, SPLITS=splits),
                                        fp32=("scale",), warps=1)
    print(json.dumps(out))
''')


def test_router_kernels_compile_for_sm90():
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, r in res.items():
        assert r["local"] == 0, f"{name}: register spills to local memory"
    # three bf16 MMAs a K step (x·lo, x·mid, x·hi), and the split's conversions to bf16, in both tilings
    for name in ("gemm-bf16", "gemm-large"):
        assert res[name]["mma"] >= 3 and res[name]["cvt_bf16"] >= 3, res[name]
    # the partial sums: one more load of logits per split (the default, one split, as before)
    assert res["select-32"]["ld_global"] > res["select-1"]["ld_global"]
