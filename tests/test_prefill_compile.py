"""The prefill kernel compiles for sm_90 (H200) on the CPU: ahead-of-time through Triton's NVIDIA backend
in a subprocess without TRITON_INTERPRET, so GPU-only compile errors (layouts, fp8 wgmma, TMA
descriptors, register spills) show up in CI. Asserts wgmma is used (mma.sync below 64 rows), nothing
spills (PTX local memory, and ptxas -v on the PTX for sm_90a), and exactly the TMA variants issue bulk tensor
copies."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from hpcops.attention.prefill import GLUON_WS_FP8_PERSIST_REGS, GLUON_WS_FP8_REGS, GLUON_WS_PERSIST_REGS
from hpcops.testing import sm90_build_in_subprocess

SCRIPT = textwrap.dedent(r"""
import inspect, json, re, sys, time
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hpcops.attention._prefill_kernels import prefill_attention_fwd_kernel as k

UNIT = ("stride_qd", "stride_kd", "stride_vd", "stride_od")
ALIGNED = ("stride_qt", "stride_qh", "stride_kb", "stride_kt", "stride_kh", "stride_vb", "stride_vt", "stride_vh",
           "stride_ot", "stride_oh")

def build(d, group, bm, bn, page, q, kv, pv_fp8, tma, warps, stages, quant_q=False, fma=True, heads_inner=False):
    params = list(inspect.signature(k.fn).parameters)
    out = "bf16" if q == "fp8e4nv" else q
    ptr = {"q_ptr": q, "q_scale_ptr": "fp32", "k_ptr": kv, "v_ptr": kv, "block_table_ptr": "i32",
           "seq_lens_ptr": "i32", "cu_seqlens_q_ptr": "i32", "k_scale_ptr": "fp32", "v_scale_ptr": "fp32",
           "out_ptr": out}
    if tma:
        ptr["k_desc"] = f"tensordesc<{kv}[{bn}, {d}]>"
        ptr["v_desc"] = f"tensordesc<{kv}[{bn}, {d}]>"
    else:
        ptr["k_desc"] = "*" + kv
        ptr["v_desc"] = "*" + kv
    const = dict(HEAD_DIM=d, GROUP=group, BLOCK_M=bm, BLOCK_N=bn, PAGE=page, BLOCK_B=16, Q_FP8=q == "fp8e4nv",
                 KV_FP8=kv == "fp8e4nv", PV_FP8=pv_fp8, USE_TMA=tma, QUANT_Q=quant_q, FMA_SCALE=fma,
                 HEADS_INNER=heads_inner, **{u: 1 for u in UNIT})
    sig = {}
    for p in params:
        if p in ptr:
            sig[p] = ptr[p] if ptr[p].startswith("tensordesc") else "*" + ptr[p].lstrip("*")
        elif p in const:
            sig[p] = "constexpr"
        elif p == "sm_scale":
            sig[p] = "fp32"
        else:
            sig[p] = "i32"
    attrs = {(params.index(p),): [["tt.divisibility", 16]] for p in params
             if (p.endswith("_ptr") or p in ALIGNED) and not sig[p].startswith("tensordesc")}
    src = ASTSource(fn=k, signature=sig, constexprs={(params.index(n),): v for n, v in const.items()}, attrs=attrs)
    cc = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    ptx = cc.asm["ptx"]
    return {"wgmma": len(re.findall(r"wgmma\.mma_async", ptx)), "mma_sync": ptx.count("mma.sync"),
            "cp_async": ptx.count("cp.async.cg") + ptx.count("cp.async.ca"), "tma": ptx.count("cp.async.bulk.tensor"),
            "local": ptx.count("st.local"), "smem": cc.metadata.shared, **ptxas_stats(ptx)}

def ptxas_stats(ptx):
    # register allocation happens in ptxas: PTX without st.local can still spill there
    import os, subprocess, tempfile
    from triton.backends.nvidia.compiler import get_ptxas
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        log = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", src, "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True, check=True).stderr
    spill = re.search(r"(\d+) bytes spill stores", log)
    regs = re.search(r"Used (\d+) registers", log)
    return {"spill": int(spill.group(1)) if spill else -1, "regs": int(regs.group(1)) if regs else -1}

out = {}
for name, cfg in json.loads(sys.argv[1]).items():
    t = time.time()
    out[name] = build(**cfg)
    out[name]["s"] = round(time.time() - t, 1)
print(json.dumps(out))
""")


def _v(d=128, group=8, bm=128, bn=64, page=64, q="bf16", kv="bf16", pv_fp8=False, tma=False, warps=8, stages=2, **kw):
    return dict(
        d=d, group=group, bm=bm, bn=bn, page=page, q=q, kv=kv, pv_fp8=pv_fp8, tma=tma, warps=warps, stages=stages, **kw
    )


VARIANTS = {
    "bf16-128x64-s2": _v(),
    # the D = 128 16-bit-q default: 64-row tiles on one warpgroup, TMA, tile-major order
    "bf16-64x64-w4-tma-heads-inner": _v(bm=64, warps=4, tma=True, heads_inner=True),
    "tma-fp8kv-bf16q-64x64-w4": _v(bm=64, warps=4, kv="fp8e4nv", tma=True, heads_inner=True),
    "fp8-128x128": _v(bn=128, q="fp8e4nv", kv="fp8e4nv"),
    "fp8-pvfp8": _v(bn=128, page=128, q="fp8e4nv", kv="fp8e4nv", pv_fp8=True),
    "tma-bf16-s3": _v(tma=True, stages=3),
    "gather-page16-fp16-gqa3": _v(group=3, page=16, q="fp16", kv="fp16"),
    # the D = 256 default (64x64 with 4 warps spilled 536 bytes in ptxas; 64x32 with 8 warps spills none)
    "d256-64x32-w8": _v(d=256, group=2, bm=64, bn=32, warps=8),
    "d256-64x32-w8-tma-fp8kv": _v(d=256, group=2, bm=64, bn=32, warps=8, kv="fp8e4nv", tma=True),
    # the CPU-tier case test_prefill_matches_reference[fp8kv-fp8q-pvfp8]: with block_n 16 its fp8 P·V dot
    # (K = 16 < 32) failed to compile on the H200; block_m 32 < 64 runs mma.sync, not wgmma
    "fp8-pvfp8-cpu-case-bm32-bn32-page16": _v(
        d=64, group=2, bm=32, bn=32, page=16, q="fp8e4nv", kv="fp8e4nv", pv_fp8=True, warps=4, stages=1
    ),
    # the default path for bf16 q + fp8 KV at page 64 (TMA is on wherever the layout allows it)
    "tma-fp8kv-bf16q": _v(kv="fp8e4nv", tma=True),
    "tma-quant-q-pvfp8-heads-inner": _v(kv="fp8e4nv", tma=True, quant_q=True, pv_fp8=True, heads_inner=True),
    "no-fma-scale": _v(tma=True, fma=False),
}


# bytes of ptxas spill stores tolerated: the fp8 q+KV default tile (128×128, 8 warps) sits at 255 registers
# (12 bytes with fma_scale, 16 before it, 40 without it); the tiny CPU-tier case runs on mma.sync with an
# 8-byte stack frame at 128 registers
SPILL_OK = {"fp8-128x128": 16, "fp8-pvfp8-cpu-case-bm32-bn32-page16": 8}


def test_compiles_for_sm90():
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(VARIANTS)], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    print(json.dumps(res, indent=1))
    for name, r in res.items():
        if VARIANTS[name]["bm"] >= 64:
            assert r["wgmma"] > 0, (name, r)
        else:  # a warpgroup MMA needs M >= 64 rows
            assert r["mma_sync"] > 0, (name, r)
        assert r["local"] == 0 and r["spill"] <= SPILL_OK.get(name, 0), f"{name} spills registers: {r}"
        assert r["smem"] <= 227 * 1024, (name, r)
    for name, cfg in VARIANTS.items():
        assert (res[name]["tma"] > 0) == cfg["tma"], (name, res[name])


GLUON_BUILD = textwrap.dedent("""
import json, sys
from triton.experimental.gluon import language as gl
from hpcops.attention._prefill_gluon import prefill_gluon_kernel
from hpcops.testing import compile_gluon_sm90, sm90_resources

d, g, bm, tile, page, stages, dt, *tree = json.loads(sys.argv[1])
gdt = {"bf16": gl.bfloat16, "fp16": gl.float16}[dt]
box = min(tile, page)  # the launcher's TMA box: a tile inside a page, or one page
desc = f"tensordesc<{dt}[{box}, {d}],{gl.NVMMASharedLayout.get_default_for([box, d], gdt)}>"
sig = dict(q_ptr="*" + dt, k_desc=desc, v_desc=desc, bt_ptr="*i32", seq_lens_ptr="*i32", cu_seqlens_q_ptr="*i32",
           out_ptr="*" + dt, sm_scale_log2="fp32")
sig.update({a: "i32" for a in ("num_reqs", "tiles_per_head", "num_kv_heads", "bt_width", "num_blocks", "stride_qt",
                               "stride_qh", "stride_kh", "stride_vh", "stride_bt", "stride_ot", "stride_oh")})
consts = dict(D=d, G=g, BLOCK_M=bm, TILE=tile, PAGE=page, BLOCK_B=16, STAGES=stages, HEADS_INNER=True,
              num_warps=bm // 16, SOFTMAX=1 if tree and tree[0] else 0)
sig.update({a: "constexpr" for a in consts})
print(json.dumps(sm90_resources(compile_gluon_sm90(prefill_gluon_kernel, sig, consts, num_warps=bm // 16))))
""")

GLUON_BUILDS = {  # name: (head_dim, G, block_m, block_n, page, stages, dtype)
    "d128-h8/1-128x128": (128, 8, 128, 128, 64, 2, "bf16"),  # gluon_config's D = 128 default, pages of 64
    "d128-mha-128x128-page16": (128, 1, 128, 128, 16, 2, "bf16"),
    "d128-64x128-page256-fp16": (128, 8, 64, 128, 256, 2, "fp16"),
    "d128-128x64-3buf": (128, 8, 128, 64, 64, 3, "bf16"),
    "d128-128x128-3buf": (128, 8, 128, 128, 64, 3, "bf16"),
    "d64-128x128": (64, 3, 128, 128, 32, 2, "bf16"),
    "d256-128x64": (256, 2, 128, 64, 64, 2, "bf16"),
    "d256-64x64": (256, 2, 64, 64, 64, 2, "bf16"),
    "d128-64x128-tree": (128, 8, 64, 128, 64, 2, "bf16", True),  # PrefillConfig.gluon_tree
}


@pytest.mark.parametrize("name", list(GLUON_BUILDS))
def test_gluon_prefill_kernel_builds_for_sm90(name):
    """PrefillConfig.gluon's kernel (Gluon cannot run in the interpreter) compiles for sm_90 at the launcher's
    shapes with no spill: S = q·Kᵀ and O += P·V as wgmma (P from registers), K/V by TMA (STAGES tiles before the
    loop, one refill in it; a box a page when pages are under a tile), shared memory within one SM's 227 KB."""
    pytest.importorskip("triton.backends.nvidia")
    d, g, bm, tile, page, stages, dt = GLUON_BUILDS[name][:7]
    r = sm90_build_in_subprocess(GLUON_BUILD, GLUON_BUILDS[name])
    print(name, r)
    assert r["spill_bytes"] == 0 and 0 < r["registers"] <= 255, r
    # the first tile's S and the loop's (D/16 K steps each), the loop's P·V and the last tile's (block_n/16)
    assert r["wgmma"] == 2 * (d // 16) + 2 * (tile // 16), r
    boxes = max(1, tile // page)
    assert r["tma_loads"] == 2 * (stages + 1) * boxes, r
    assert r["shared"] <= 227 * 1024, r


GLUON_WS_BUILD = textwrap.dedent(r"""
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from hpcops.attention._prefill_gluon import prefill_gluon_ws_kernel, prefill_gluon_ws_persist_kernel
from hpcops.attention.prefill import GLUON_WS_CONSUMER_REGS, GLUON_WS_FP8_PERSIST_REGS, GLUON_WS_FP8_REGS
from hpcops.attention.prefill import GLUON_WS_PERSIST_REGS
from hpcops.testing import sm90_resources

d, g, tile, page, stages, dt, *flags = json.loads(sys.argv[1])
p_regs, tree, p_dbuf, pvo, msum, persist, qregs, prmt, trace, wide = (flags + [False] * 10)[:10]
gdt = {"bf16": gl.bfloat16, "fp16": gl.float16, "fp8e4nv": gl.float8e4nv}[dt]
box = min(tile, page)
desc = f"tensordesc<{dt}[{box}, {d}],{gl.NVMMASharedLayout.get_default_for([box, d], gdt)}>"
sig = dict(q_ptr="*" + dt, k_desc=desc, v_desc=desc, bt_ptr="*i32", seq_lens_ptr="*i32", cu_seqlens_q_ptr="*i32",
           out_ptr="*" + ("bf16" if dt == "fp8e4nv" else dt), sm_scale_log2="fp32", q_scale_ptr="*fp32",
           k_scale_ptr="*fp32", v_scale_ptr="*fp32")
sig.update({a: "i32" for a in ("num_reqs", "tiles_per_head", "num_kv_heads", "bt_width", "num_blocks", "stride_qt",
                               "stride_qh", "stride_kh", "stride_vh", "stride_bt", "stride_ot", "stride_oh",
                               "stride_qst", "stride_qsh")})
consts = dict(D=d, G=g, TILE=tile, PAGE=page, BLOCK_B=16, STAGES=stages, HEADS_INNER=True,
              CONSUMER_REGS=GLUON_WS_CONSUMER_REGS, num_warps=4,
              FP8=(2 if p_regs else 3 if p_dbuf else 1) if dt == "fp8e4nv" else 0,
              FP8_CONSUMER_REGS=GLUON_WS_FP8_REGS[0], FP8_PRODUCER_REGS=GLUON_WS_FP8_REGS[1],
              SOFTMAX=(1 if tree else 0) | (2 if pvo else 0) | (4 if msum else 0) | (32 if qregs else 0)
              | (128 if prmt else 0))
if trace:  # the opt-in trace (scripts/probe_prefill_trace.py): clock stamps into an int32 buffer
    consts["TRACE"] = True
    sig["trace_ptr"] = "*i32"
if wide:  # PrefillConfig.gluon_wide_store
    consts["SOFTMAX"] |= 512
if persist:  # PrefillConfig.gluon_persist: the kernel as a persistent grid, its own register splits
    consts.update(FP8_CONSUMER_REGS=GLUON_WS_FP8_PERSIST_REGS[0], FP8_PRODUCER_REGS=GLUON_WS_FP8_PERSIST_REGS[1],
                  CONSUMER_REGS=GLUON_WS_PERSIST_REGS[0], PRODUCER_REGS=GLUON_WS_PERSIST_REGS[1])
sig.update({a: "constexpr" for a in consts})
kernel = prefill_gluon_ws_persist_kernel if persist else prefill_gluon_ws_kernel
# wide: the strides and pointers as a launch specializes them (multiples of 16), so that 16-byte stores can show
attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(kernel.arg_names)
         if wide and a in ("out_ptr", "stride_ot", "stride_oh")}
c = triton.compile(GluonASTSource(kernel, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": 4, "maxnreg": 168})
r = sm90_resources(c)
ptx = c.asm["ptx"]
r["setmaxnreg"] = sorted({int(x) for x in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)})
r["cta_barriers"] = len(re.findall(r"\bbar\.sync\s+0;", ptx))  # bar.sync 0 without a thread count: the whole CTA
r["byte_stores"] = len(re.findall(r"\bst\.shared\.b8\b", ptx))
r["clock_reads"] = ptx.count("%clock")
r["global_stores"] = len(re.findall(r"\bst\.global\.", ptx))
r["global_v4_stores"] = len(re.findall(r"\bst\.global\.v4\.", ptx))
r["b16_stores"] = len(re.findall(r"\bst\.shared\.b16\b", ptx))  # the fp8 P's 2-byte pieces
r["v4_stores"] = len(re.findall(r"\bst\.shared\.v4\.b32\b", ptx))
# the SASS between a loop's S wait (DEPBAR.LE gsb0, 0x1; gluon_mma_sum 0x2: P·1 too) and its P·V wait (0x0):
# how many exp2 run under P·V
sass = c.asm["sass"]
r["fadd"] = len(re.findall(r"\bFADD\b", sass))
r["q_reg_wgmma"] = len(re.findall(r"GMMA\.64x\d+x\d+\.F32\.\w+\.\w+ R\d+, R\d+, gdesc", sass))  # A from registers
r["ones_bits"] = "943208504" in ptx  # gluon_mma_sum's ones stored as e4m3 bits 0x38383838 (not a cast constant)
r["ex2_under_pv"] = [part.split("WARPGROUP.DEPBAR.LE gsb0, 0x0")[0].count("MUFU.EX2")
                     for part in sass.split(f"WARPGROUP.DEPBAR.LE gsb0, 0x{2 if msum else 1}")[1:]]
print(json.dumps(r))
""")

GLUON_WS_BUILDS = {  # name: (head_dim, G, block_n, page, stages, dtype)
    "d128-h8/1-128": (128, 8, 128, 64, 2, "bf16"),
    "d128-128-3buf": (128, 8, 128, 64, 3, "bf16"),
    "d128-mha-page16": (128, 1, 128, 16, 2, "bf16"),
    "d64-64-fp16": (64, 3, 64, 32, 2, "fp16"),
    "d256-64": (256, 2, 64, 64, 2, "bf16"),
    "fp8-d128-h8/1-128-3buf": (128, 8, 128, 64, 3, "fp8e4nv"),  # PrefillConfig(gluon_ws=True) over fp8 q and KV
    "fp8-d128-mha-64-page16": (128, 1, 64, 16, 3, "fp8e4nv"),
    "fp8-d64-gqa3-128-page32": (64, 3, 128, 32, 3, "fp8e4nv"),  # _vt_bases at 128 keys × 64
    "fp8-d128-h8/1-128-4buf-pregs": (128, 8, 128, 64, 4, "fp8e4nv", True),  # gluon_p_regs: P by warp shuffles
    # PrefillConfig.gluon_tree: the row max and sum as trees (bf16 d256's 64-key tiles, fp8's 128)
    "d256-64-tree": (256, 2, 64, 64, 2, "bf16", False, True),
    "fp8-d128-h8/1-128-3buf-tree": (128, 8, 128, 64, 3, "fp8e4nv", False, True),
    # PrefillConfig.gluon_p_dbuf: two P buffers a consumer
    "fp8-d128-h8/1-128-3buf-pdbuf": (128, 8, 128, 64, 3, "fp8e4nv", False, False, True),
    # PrefillConfig.gluon_pv_overlap: the 16-bit kernel's row sums stored before its P·V wait
    "d128-128-3buf-pvo": (128, 8, 128, 64, 3, "bf16", False, False, False, True),
    # PrefillConfig.gluon_mma_sum: the fp8 row sums as l += P8·1 (N = 8 wgmma), alone, at 64 keys and with two P
    # buffers and the trees
    "fp8-d128-h8/1-128-3buf-msum": (128, 8, 128, 64, 3, "fp8e4nv", False, False, False, False, True),
    "fp8-d128-mha-64-page16-msum": (128, 1, 64, 16, 3, "fp8e4nv", False, False, False, False, True),
    "fp8-d128-h8/1-128-3buf-msum-pdbuf-tree": (128, 8, 128, 64, 3, "fp8e4nv", False, True, True, False, True),
    # PrefillConfig.gluon_persist: the fp8 kernel as a persistent grid (the default fp8 tile, pages under a tile,
    # two P buffers)
    "fp8-d128-h8/1-128-3buf-msum-persist": (128, 8, 128, 64, 3, "fp8e4nv", False, False, False, False, True, True),
    "fp8-d128-mha-64-page16-msum-persist": (128, 1, 64, 16, 3, "fp8e4nv", False, False, False, False, True, True),
    "fp8-d128-h8/1-128-3buf-pdbuf-persist": (128, 8, 128, 64, 3, "fp8e4nv", False, False, True, False, False, True),
    # the 16-bit persistent kernel: the bf16 default's tile (with trees and pvo), d256's 64-key tiles
    "d128-128-3buf-persist": (128, 8, 128, 64, 3, "bf16", False, False, False, False, False, True),
    "d128-128-3buf-tree-pvo-persist": (128, 8, 128, 64, 3, "bf16", False, True, False, True, False, True),
    "d256-64-persist": (256, 2, 64, 64, 2, "bf16", False, False, False, False, False, True),
    # PrefillConfig.gluon_q_regs (the fp8 default): q in registers, alone, at 64 keys over 16-token pages, persistent
    "fp8-d128-h8/1-128-3buf-msum-qregs": (128, 8, 128, 64, 3, "fp8e4nv", False, False, False, False, True, False, True),
    "fp8-d128-mha-64-page16-msum-qregs": (128, 1, 64, 16, 3, "fp8e4nv", False, False, False, False, True, False, True),
    "fp8-d128-h8/1-128-3buf-msum-qregs-persist": (128, 8, 128, 64, 3, "fp8e4nv", False, False, False, False, True,
                                                  True, True),
    # PrefillConfig.gluon_vt_prmt: the producer's transpose by byte permutes, a program a tile and persistent
    "fp8-d128-h8/1-128-3buf-msum-prmt": (128, 8, 128, 64, 3, "fp8e4nv", False, False, False, False, True, False,
                                         False, True),
    "fp8-d128-h8/1-128-3buf-msum-qregs-persist-prmt": (128, 8, 128, 64, 3, "fp8e4nv", False, False, False, False,
                                                       True, True, True, True),
    # the opt-in trace (`_stamp`): the bf16 default's tile at h8/1 q4k, the fp8 kernel a program a tile
    "d128-128-3buf-trace": (128, 8, 128, 64, 3, "bf16", False, False, False, False, False, False, False, False,
                            True),
    "fp8-d128-h8/1-128-3buf-msum-qregs-prmt-trace": (128, 8, 128, 64, 3, "fp8e4nv", False, False, False, False,
                                                     True, False, True, True, True),
    # PrefillConfig.gluon_wide_store: the output in 16-byte pieces (16-bit: through q's buffer, the bf16 default's 3
    # buffers and the persistent kernel; d256; fp8 a program a tile: the compiler's scratch)
    "d128-128-3buf-wide": (128, 8, 128, 64, 3, "bf16", False, False, False, False, False, False, False, False, False,
                           True),
    "d128-128-3buf-persist-wide": (128, 8, 128, 64, 3, "bf16", False, False, False, False, False, True, False, False,
                                   False, True),
    "d256-64-wide": (256, 2, 64, 64, 2, "bf16", False, False, False, False, False, False, False, False, False, True),
    "fp8-d128-h8/1-128-3buf-msum-qregs-prmt-wide": (128, 8, 128, 64, 3, "fp8e4nv", False, False, False, False, True,
                                                    False, True, True, False, True),
}


@pytest.mark.parametrize("name", list(GLUON_WS_BUILDS))
def test_gluon_ws_prefill_kernel_builds_for_sm90(name):
    """PrefillConfig.gluon_ws's kernel compiles for sm_90 with no spill: two consumer copies of the loop (wgmma:
    each consumer's first S, its loop's S and P·V, its last P·V; fp8: K steps of 32), registers moved by
    setmaxnreg to 240 for the consumers and 24 for the producer warp (fp8: GLUON_WS_FP8_REGS, the producer a
    warpgroup that transposes V), and no CTA-wide barrier (the partitions meet on mbarriers only)."""
    pytest.importorskip("triton.backends.nvidia")
    d, g, tile, page, stages, dt = GLUON_WS_BUILDS[name][:6]
    r = sm90_build_in_subprocess(GLUON_WS_BUILD, GLUON_WS_BUILDS[name])
    print(name, r)
    persist = GLUON_WS_BUILDS[name][11:12] == (True,)
    trace = GLUON_WS_BUILDS[name][14:15] == (True,)
    # the persistent kernel: a few registers of the tile walk's state spilled where a q tile starts and ends (ptxas at
    # fp8's (216, 72): none in the consumers' K/V loop; d256's consumers spill 112 bytes); the trace's stamps a few
    # (a probe's build: 8 bytes at the bf16 tile); every other build none
    assert r["spill_bytes"] <= ((128 if d > 128 else 64) if persist or trace else 0), r
    k_step = 32 if dt == "fp8e4nv" else 16  # an fp8 wgmma takes 32 of K a step
    msum = GLUON_WS_BUILDS[name][10:11] == (True,)  # gluon_mma_sum: P·1 in the loop and after it, N = 8
    assert r["wgmma"] == 2 * (2 * (d // k_step) + (4 if msum else 2) * (tile // k_step)), r
    if msum:  # no row sum on the CUDA cores: a tile's P·1 joins l in 4 FADD a thread (the fp32 promotion) and a
        # handful are the epilogue's and the scale's, not 64 a tile
        assert r["fadd"] < 32 and r["ones_bits"], r
    elif dt == "fp8e4nv":
        assert r["fadd"] >= tile, r  # each consumer loop: the tile / 2 probabilities a thread holds
    if dt == "fp8e4nv":  # the 4-warp producer that transposes V, and 224 for each consumer (persistent: 216 / 72)
        assert set(GLUON_WS_FP8_PERSIST_REGS if persist else GLUON_WS_FP8_REGS) <= set(r["setmaxnreg"]), r
    else:
        assert set(GLUON_WS_PERSIST_REGS if persist else (24, 240)) <= set(r["setmaxnreg"]), r
    assert r["cta_barriers"] == 0, r
    assert r["shared"] <= 227 * 1024, r
    # the trace's clock reads: none unless asked for; else at each consumer's tile and step waits (6 a step, fp8 7,
    # and 4 a tile) and the producer's steps
    assert (r["clock_reads"] >= 2 * (6 + 4) + 2) if trace else r["clock_reads"] == 0, r
    if GLUON_WS_BUILDS[name][15:16] == (True,):  # gluon_wide_store: every output store 16 bytes, 64 rows x D a
        # consumer in D / 8 pieces a row over 128 threads (16-bit), shared memory no larger than without it
        assert r["global_stores"] == r["global_v4_stores"] == 2 * 64 * d // 8 // 128, r
        assert r["shared"] <= 227 * 1024, r
    if dt == "fp8e4nv" and d == tile == 128:  # Vᵀ by 8-byte stores (_transpose_v's layouts), never byte by byte
        assert r["byte_stores"] == 0, r
    if GLUON_WS_BUILDS[name][6:7] == (True,):  # gluon_p_regs: P reaches the P·V wgmma in registers, never stored
        assert r["b16_stores"] == 0, r
    elif GLUON_WS_BUILDS[name][8:9] == (True,) or GLUON_WS_BUILDS[name][9:10] == (True,):
        # gluon_p_dbuf, gluon_pv_overlap: the loop's softmax (64 exp2 a thread) sits between the S wait and the
        # P·V wait, so P·V runs under it (without them ptxas puts the P·V wait first: 0 there)
        assert r["ex2_under_pv"] and min(r["ex2_under_pv"]) >= 64, r
    if dt == "fp8e4nv" and tile == 128 and d in (64, 128) and GLUON_WS_BUILDS[name][6:7] != (True,):
        # the permuted key order (_vt_perm): each consumer stores its 64 x 128 P in 16-byte pieces, 4 a thread, in
        # the prologue and the loop (2 consumers), not 2 bytes at a time
        assert r["b16_stores"] == 0 and r["v4_stores"] >= 2 * 2 * 4, r
    if GLUON_WS_BUILDS[name][12:13] == (True,):  # gluon_q_regs: S wgmmas take q from registers (both consumers)
        assert r["q_reg_wgmma"] >= 2 * (d // k_step), r
    else:
        assert r["q_reg_wgmma"] == 0 or GLUON_WS_BUILDS[name][6:7] == (True,), r


GLUON_PREFETCH_BUILD = textwrap.dedent(r"""
import json, os, re, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from hpcops.attention._prefill_gluon import prefill_gluon_ws_prefetch_kernel
from hpcops.attention.prefill import GLUON_WS_FP8_PREFETCH_REGS
from hpcops.testing import sm90_resources

d, g, tile, page, stages, p_dbuf, queue, vt3, prmt, *rest = json.loads(sys.argv[1])
trace, wide = (rest + [False, False])[:2]
dt, gdt = "fp8e4nv", gl.float8e4nv
box = min(tile, page)
desc = f"tensordesc<{dt}[{box}, {d}],{gl.NVMMASharedLayout.get_default_for([box, d], gdt)}>"
qdesc = f"tensordesc<{dt}[{g}, {d}],{gl.NVMMASharedLayout.get_default_for([g, d], gdt)}>"
qsdesc = f"tensordesc<fp32[{64 // g}, {g}],{gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)}>"
sig = dict(q_ptr="*" + dt, k_desc=desc, v_desc=desc, bt_ptr="*i32", seq_lens_ptr="*i32", cu_seqlens_q_ptr="*i32",
           out_ptr="*bf16", sm_scale_log2="fp32", q_scale_ptr="*fp32", k_scale_ptr="*fp32", v_scale_ptr="*fp32",
           q_desc=qdesc, qs_desc=qsdesc, queue_ptr="*i32")
sig.update({a: "i32" for a in ("num_reqs", "tiles_per_head", "num_kv_heads", "bt_width", "num_blocks", "stride_qt",
                               "stride_qh", "stride_kh", "stride_vh", "stride_bt", "stride_ot", "stride_oh",
                               "stride_qst", "stride_qsh")})
consts = dict(D=d, G=g, TILE=tile, PAGE=page, BLOCK_B=16, STAGES=stages, HEADS_INNER=True, num_warps=4,
              FP8=3 if p_dbuf else 1, FP8_CONSUMER_REGS=GLUON_WS_FP8_PREFETCH_REGS[0],
              FP8_PRODUCER_REGS=GLUON_WS_FP8_PREFETCH_REGS[1],
              SOFTMAX=(0 if p_dbuf else 4) | 32 | (64 if vt3 else 0) | (128 if prmt else 0), QUEUE=queue)
if trace:  # the opt-in trace (scripts/probe_prefill_trace.py)
    consts["TRACE"] = True
    sig["trace_ptr"] = "*i32"
if wide:  # PrefillConfig.gluon_wide_store, the strides as a launch specializes them (multiples of 16)
    consts["SOFTMAX"] |= 512
attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(prefill_gluon_ws_prefetch_kernel.arg_names)
         if wide and a in ("out_ptr", "stride_ot", "stride_oh")}
sig.update({a: "constexpr" for a in consts})
c = triton.compile(GluonASTSource(prefill_gluon_ws_prefetch_kernel, sig, consts, attrs),
                   target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "maxnreg": 168})
r = sm90_resources(c)
ptx = c.asm["ptx"]
r["setmaxnreg"] = sorted({int(x) for x in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)})
r["cta_barriers"] = len(re.findall(r"\bbar\.sync\s+0;", ptx))
r["q_reg_wgmma"] = len(re.findall(r"GMMA\.64x\d+x\d+\.F32\.\w+\.\w+ R\d+, R\d+, gdesc", c.asm["sass"]))
atoms = re.findall(r"^\s*(@!?%p\d+\s+)?atom\.([\w.]+)", ptx, re.M)
r["atom_add"] = sum(1 for _, op in atoms if ".add." in op)
r["atom_exch"] = sum(1 for _, op in atoms if ".exch." in op)
r["atom_unpredicated"] = sum(1 for pred, _ in atoms if not pred)
r["prmt_asm"] = ptx.count("prmt.b32 t0,")  # `_transpose_v_prmt`'s inline asm, once per transpose in the code
r["clock_reads"] = ptx.count("%clock")
r["global_stores"] = len(re.findall(r"\bst\.global\.", ptx))
r["global_v4_stores"] = len(re.findall(r"\bst\.global\.v4\.", ptx))
with tempfile.NamedTemporaryFile(suffix=".cubin") as f:  # every partition's SASS (asm["sass"] holds one)
    f.write(c.asm["cubin"])
    f.flush()
    cob = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    sass = subprocess.run([cob, "-sass", f.name], capture_output=True, text=True, check=True).stdout
r["prmt_sass"] = len(re.findall(r"\bPRMT\b", sass))
print(json.dumps(r))
""")

GLUON_PREFETCH_BUILDS = {  # name: (head_dim, G, block_n, page, stages, gluon_p_dbuf, gluon_queue, gluon_vt3,
    # gluon_vt_prmt)
    "fp8-d128-h8/1-128-3buf": (128, 8, 128, 64, 3, False, False, False, False),  # the fp8 default's tile, mma_sum
    "fp8-d128-g16-64-page16": (128, 16, 64, 16, 3, False, False, False, False),  # 16-row q boxes, pages under a tile
    "fp8-d128-h8/1-128-2buf-pdbuf": (128, 8, 128, 64, 2, True, False, False, False),
    "fp8-d128-h8/1-128-3buf-queue": (128, 8, 128, 64, 3, False, True, False, False),  # gluon_queue
    "fp8-d128-g16-64-page16-queue": (128, 16, 64, 16, 3, False, True, False, False),
    "fp8-d128-h8/1-128-3buf-vt3": (128, 8, 128, 64, 3, False, False, True, False),  # gluon_vt3: three Vᵀ buffers
    "fp8-d128-h8/1-128-2buf-pdbuf-vt3": (128, 8, 128, 64, 2, True, False, True, False),
    "fp8-d128-h8/1-128-3buf-prmt": (128, 8, 128, 64, 3, False, False, False, True),  # gluon_vt_prmt
    "fp8-d64-h8/1-128-3buf-prmt": (64, 8, 128, 64, 3, False, False, False, True),
    # the opt-in trace (`_stamp`) on the fp8 default
    "fp8-d128-h8/1-128-3buf-prmt-trace": (128, 8, 128, 64, 3, False, False, False, True, True),
    # PrefillConfig.gluon_wide_store on the fp8 default: 16-byte output stores through the compiler's scratch
    "fp8-d128-h8/1-128-3buf-prmt-wide": (128, 8, 128, 64, 3, False, False, False, True, False, True),
}


@pytest.mark.parametrize("name", list(GLUON_PREFETCH_BUILDS))
def test_gluon_prefetch_prefill_kernel_builds_for_sm90(name):
    """PrefillConfig.gluon_prefetch's kernel compiles for sm_90: the persistent fp8 kernel's wgmmas (q from
    registers), its K/V TMA plus the producer's q prefetch (a [G, D] box a token and two scale boxes a tile, at the
    first tile and in the walk), GLUON_WS_FP8_PREFETCH_REGS by setmaxnreg, no CTA-wide barrier, at most 64 bytes
    spilled (the tile walk's state, as `gluon_persist`), shared memory within one SM."""
    pytest.importorskip("triton.backends.nvidia")
    from hpcops.attention.prefill import GLUON_WS_FP8_PREFETCH_REGS

    d, g, tile, page, stages, p_dbuf, queue, vt3, prmt, *rest = GLUON_PREFETCH_BUILDS[name]
    r = sm90_build_in_subprocess(GLUON_PREFETCH_BUILD, GLUON_PREFETCH_BUILDS[name])
    print(name, r)
    assert r["spill_bytes"] <= 64, r
    # the trace's clock reads (`_stamp`): none unless asked for; else at each consumer's tile and step waits and the
    # producer's tile and step events
    assert (r["clock_reads"] >= 2 * (7 + 4) + 4 + 2) if rest and rest[0] else r["clock_reads"] == 0, r
    if rest[1:2] == [True]:  # gluon_wide_store: every output store 16 bytes (64 rows x D bf16 a consumer)
        assert r["global_stores"] == r["global_v4_stores"] == 2 * 64 * d // 8 // 128, r
    msum = not p_dbuf
    # each consumer: its first S and its loop's (K steps of 32), the loop's and the last P·V (and P·1, gluon_mma_sum)
    assert r["wgmma"] == 2 * (2 * (d // 32) + (4 if msum else 2) * (tile // 32)), r
    assert r["q_reg_wgmma"] >= 2 * (d // 32), r
    boxes = max(1, tile // page)
    q_boxes = 2 * (128 // g + 2)  # a token's heads a box and two scale boxes, at the first tile and in the walk
    assert r["tma_loads"] == 2 * (stages + 1) * boxes + q_boxes, r
    assert set(GLUON_WS_FP8_PREFETCH_REGS) <= set(r["setmaxnreg"]), r
    assert r["cta_barriers"] == 0, r
    assert r["shared"] <= 227 * 1024, r
    if vt3:  # the third Vᵀ [D, block_n] buffer: at the default tile 182888 bytes of shared memory become 199272
        assert r["shared"] >= 182888 + d * tile - 1024 or p_dbuf, r
    # gluon_queue: the take's add at the first tile and in the walk, the last take's reset beside each, every one
    # predicated (issued by one thread); the snake walk has no atomic
    assert (r["atom_add"], r["atom_exch"]) == ((2, 2) if queue else (0, 0)), r
    assert r["atom_unpredicated"] == 0, r
    # gluon_vt_prmt: the transpose's byte moves are the inline asm's (at the first tile's step and in the loop, as
    # ptxas places them), 64 PRMT a thread and tile at D 128 where convert_layout of the fp8 tile takes 119: the
    # whole kernel's SASS at the default tile has 192 PRMT, 750 without (Triton 3.6, session 68)
    assert (r["prmt_asm"] > 0) == prmt, r
    if prmt and d == 128:
        assert r["prmt_sass"] <= 256, r
    elif (d, tile, p_dbuf, vt3) == (128, 128, False, False):
        assert r["prmt_sass"] >= 512, r


QUANT_BUILD = textwrap.dedent("""
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hpcops.attention._prefill_kernels import quantize_q_kernel as k

out = {}
for dtype in ("bf16", "fp16"):
    sig = {"x_ptr": f"*{dtype}", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "n_rows": "i32", "num_heads": "i32",
           "stride_xt": "i32", "stride_xh": "i32", "HEAD_DIM": "constexpr", "D_PAD": "constexpr",
           "BLOCK_R": "constexpr"}
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(k.arg_names)
             if a in ("x_ptr", "q_ptr", "s_ptr", "stride_xt", "stride_xh")}
    src = ASTSource(k, sig, {"HEAD_DIM": 128, "D_PAD": 128, "BLOCK_R": 32}, attrs)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
    out[dtype] = {"cvt_e4m3": len(re.findall(r"cvt\\.rn\\.satfinite\\.e4m3x2", ptx)), "local": ptx.count(".local"),
                  "div_rn": len(re.findall(r"div\\.rn\\.f32", ptx)),
                  # the masked lanes' dividend swapped for 1.0 (a 0 takes div.rn.f32's slow path)
                  "one_fill": len(re.findall(r"selp\\.f32[^\\n]*0f3F800000", ptx))}
print(json.dumps(out))
""")


def test_quantize_q_kernel_compiles_for_sm90():
    """prefill_attention(quantize_q=True)'s quantizing kernel builds for sm_90: packed e4m3 conversions, the
    correctly rounded divisions that make it bit-exact with its torch reference, no local memory, and the masked
    lanes dividing 1.0 rather than the 0 they load (a 0 dividend takes the IEEE division's slow path)."""
    pytest.importorskip("triton.backends.nvidia")
    res = sm90_build_in_subprocess(QUANT_BUILD, None)
    for dtype, r in res.items():
        assert r["cvt_e4m3"] > 0 and r["div_rn"] > 0 and r["local"] == 0 and r["one_fill"] > 0, (dtype, r)
