"""The decode variants behind DecodeConfig knobs (task_desc, lean_loop) and the plan kernel's launch
choices compile for sm_90 on the CPU (as tests/test_decode_compile.py does for the defaults): no
register spills, shared memory fits, the KV loop pipelined."""

from __future__ import annotations

import textwrap

from test_decode_compile import SCRIPT, _attn, _combine, compile_sm90

# every constexpr given (one that is not compiles as a runtime int, i.e. every branch of it)
VARIANTS = {
    "persistent-bf16-taskdesc": _attn(TASK_DESC=True, LEAN=False, USE_PDL=False),
    "persistent-fp8kv-lean": _attn(kv="fp8e4nv", LEAN=True, TASK_DESC=False, USE_PDL=False),
    "persistent-bf16-taskdesc-lean": _attn(TASK_DESC=True, LEAN=True, USE_PDL=False),
    "persistent-fp8q-q4-g16-taskdesc-lean": _attn(q="fp8e4nv", kv="fp8e4nv", q_len=4, g=16, TASK_DESC=True,
                                                  LEAN=True, USE_PDL=False),
    "persistent-bf16-pdl-taskdesc-lean": _attn(USE_PDL=True, TASK_DESC=True, LEAN=True),
    "persistent-fp8kv-lean-s4": _attn(kv="fp8e4nv", LEAN=True, TASK_DESC=False, USE_PDL=False, stages=4),
    "static-bf16-lean": _attn("decode_static_kernel", SPLITS=4, LEAN=True),
    "combine-mergedesc": _combine("decode_combine_kernel", MERGE_DESC=True, USE_PDL=False),
    "combine-pdl-mergedesc": _combine("decode_combine_kernel", USE_PDL=True, MERGE_DESC=True),
}

PLAN_SCRIPT = textwrap.dedent(r"""
import inspect, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hpcops.attention._plan_kernels import plan_decode_kernel as fn

out = {}
for name, (block_c, block_b, one, warps, desc, *pairs) in json.loads(sys.argv[1]).items():
    const = dict(TILE=64, BLOCK_B=block_b, BLOCK_C=block_c, ONE_BLOCK=one, DESC=desc, PAIRS=bool(pairs and pairs[0]))
    params = list(inspect.signature(fn.fn).parameters)
    sig = {p: "constexpr" if p in const else ("*i32" if p.endswith("_ptr") else "i32") for p in params}
    cexp = {(params.index(p),): v for p, v in const.items()}
    src = ASTSource(fn=fn, signature=sig, constexprs=cexp)
    cc = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    out[name] = {"local": cc.asm["ptx"].count("st.local"), "smem": cc.metadata.shared}
print(json.dumps(out))
""")
PLAN_LAUNCHES = {"c16-b256-w1": (16, 256, True, 1, False), "c128-b64-w4-2pass": (128, 64, False, 4, False),
                 "c32-b256-w2-desc": (32, 256, True, 2, True),
                 "c128-b256-w4": (128, 256, True, 4, False), "c128-b256-w4-desc": (128, 256, True, 4, True),
                 "c64-b1024-w4-desc": (64, 1024, True, 4, True), "c32-b256-loop-w2-desc": (32, 256, False, 2, True),
                 "c256-b64-w8": (256, 64, True, 8, False),
                 # DecodeConfig.tail_merge: the pair table and the counts zeroed
                 "c16-b256-w1-desc-pairs": (16, 256, True, 1, True, True),
                 "c32-b256-loop-w2-desc-pairs": (32, 256, False, 2, True, True)}


def test_knob_variants_compile_for_sm90():
    res = compile_sm90(SCRIPT, VARIANTS)
    assert set(res) == set(VARIANTS)
    for name, r in res.items():
        assert r["local"] == 0, f"{name} spills registers: {r}"
        assert r["smem"] <= 227 * 1024, (name, r)
        if "pdl" in name:
            assert r["griddep"] > 0, f"{name}: no griddepcontrol instruction: {r}"
        if name.startswith(("persistent", "static")):
            assert r["cp_async"] > 0, f"{name}: KV loop not pipelined: {r}"


def test_plan_launches_compile_for_sm90():
    res = compile_sm90(PLAN_SCRIPT, PLAN_LAUNCHES)
    assert set(res) == set(PLAN_LAUNCHES)
    for name, r in res.items():
        assert r["local"] == 0, f"plan {name} spills registers: {r}"
