"""Ahead-of-time compile, for sm90, of every kernel launch `fused_moe` makes with the GPU heuristics.

The interpreter never compiles, so a kernel can pass the CPU tier and fail to build on the H200 (a
non-constexpr global, an unsupported fp8 dot shape). Here the launches are recorded on the CPU without
running them, then compiled with `triton.compile(..., target=GPUTarget("cuda", 90, 32))` in a subprocess
without TRITON_INTERPRET (Triton's bundled ptxas needs no GPU). Also checks the loads are pipelined.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import triton

from hpcops.moe import _moe_kernels as K
from hpcops.moe.configs import get_config
from hpcops.moe.fused_moe import fused_moe
from hpcops.quant import FP8, Fp8Block128, Fp8PerTensor
from hpcops.testing import describe_launch, recorded_launches

KERNELS = {n: getattr(K, n) for n in dir(K) if n.startswith("moe_") and n.endswith("_kernel")}


def _record(monkeypatch) -> list[dict]:
    from hpcops.moe import fused_moe as F

    monkeypatch.setattr(F, "is_interpreter", lambda: False)  # record the GPU launches (PDL included)
    with recorded_launches(K) as calls:
        _launch_all()
    unique = {json.dumps(dict(describe_launch(KERNELS[n], args, kw), kernel=n), sort_keys=True)
              for n, args, kw in calls}
    return [json.loads(u) for u in sorted(unique)]


def _launch_all() -> None:
    """fused_moe over both Hy3 layouts, every quantization and the configs of each batch regime, with the
    shared expert's output added and with the shared expert fused into the GEMM kernels, and with a down program
    over several N tiles (`MoeConfig.down_n_per`; at large batches also with one K step over I)."""
    E, H, k = 4, 4096, 8
    for inter in (192, 1536):
        for kind in ("none", "fp8_tensor", "fp8_tensor_dyn", "fp8_block"):
            if kind == "fp8_block" and inter % 128:
                continue
            for T_cfg in (1, 4, 64, 512, 2048, 4096):  # block_m 16, 32, 64, 128
                T = 3
                x = torch.zeros(T, H, dtype=torch.bfloat16)
                ids = torch.zeros(T, k, dtype=torch.int32)
                tw = torch.zeros(T, k)
                wdt = torch.bfloat16 if kind == "none" else FP8
                w13 = torch.zeros(E, 2 * inter, H, dtype=wdt)
                w2 = torch.zeros(E, H, inter, dtype=wdt)
                one = torch.ones(1)
                quant = {"none": None,
                         "fp8_tensor": Fp8PerTensor(torch.ones(E), torch.ones(E), one, one),
                         "fp8_tensor_dyn": Fp8PerTensor(torch.ones(E), torch.ones(E)),
                         "fp8_block": Fp8Block128(torch.ones(E, 2 * inter // 128, H // 128),
                                                  torch.ones(E, H // 128, inter // 128))}[kind]
                cfg = get_config(num_tokens=T_cfg, top_k=k, num_experts=192, hidden=H, inter=inter,
                                 quant=kind.replace("_dyn", ""))
                # the task form the real batch would get (T·k pairs); the launches here have T = 3
                cfg = cfg.with_(index_small_max=1024 if T_cfg < 512 else 0,
                                naive_max_pairs=cfg.naive_max_pairs if T_cfg * k <= cfg.naive_max_pairs else 0)
                if kind == "fp8_block" and T_cfg == 4:  # narrow N tiles: the down GEMM quantizes act groups
                    cfg = cfg.with_(block_n=64)
                emap = torch.zeros(192, dtype=torch.int32) if inter == 1536 else None
                fused_moe(x, w13, w2, tw, ids, quant=quant, expert_map=emap, shared_output=torch.zeros_like(x),
                          config=cfg)
                # the shared expert fused into the GEMM kernels (Hy3's, TP-sharded: I_s = 192, bf16)
                fused_moe(x, w13, w2, tw, ids, quant=quant, expert_map=emap, config=cfg,
                          shared_w13=torch.zeros(384, H, dtype=torch.bfloat16),
                          shared_w2=torch.zeros(H, 192, dtype=torch.bfloat16))
                if T_cfg in (4, 64, 2048):  # MoeConfig.pdl: each kernel released at its programs' end, or no PDL
                    fused_moe(x, w13, w2, tw, ids, quant=quant, expert_map=emap, shared_output=torch.zeros_like(x),
                              config=cfg.with_(pdl=2 if T_cfg > 4 else 0))
                if T_cfg in (4, 64, 2048, 4096):  # a down program over several N tiles (MoeConfig.down_n_per)
                    fused_moe(x, w13, w2, tw, ids, quant=quant, expert_map=emap,
                              config=cfg.with_(down_n_per=4 if T_cfg <= 64 else 32))
                if T_cfg in (4, 64):  # the gate-up K loop over 4 programs (MoeConfig.split_k)
                    fused_moe(x, w13, w2, tw, ids, quant=quant, expert_map=emap, config=cfg.with_(split_k=4))
                if T_cfg == 4096 and inter == 192 and kind.startswith("fp8_tensor"):  # ... one K step over I
                    fused_moe(x, w13, w2, tw, ids, quant=quant, expert_map=emap,
                              config=cfg.with_(down_n_per=32, down_block_k=triton.next_power_of_2(inter)))
                if kind.startswith("fp8_tensor"):  # the fp8 MMA sums promoted the other way than by default
                    fused_moe(x, w13, w2, tw, ids, quant=quant, expert_map=emap,
                              config=cfg.with_(fp8_promote=0 if kind == "fp8_tensor_dyn" else 128))


_COMPILER = r"""
import json, sys
from hpcops.moe import _moe_kernels as K
from hpcops.testing import compile_launch

bad = []
for d in json.load(sys.stdin):
    try:
        k = compile_launch(getattr(K, d["kernel"]), d)
    except Exception as exc:
        bad.append(f"{d['kernel']} {d['consts']}: {type(exc).__name__}: {str(exc)[-400:]}")
        continue
    ptx = k.asm["ptx"]
    if ("gate_up" in d["kernel"] or "down" in d["kernel"]) and "cp.async" not in ptx:
        bad.append(f"{d['kernel']} {d['consts']}: K loop not pipelined (no cp.async)")
    if k.metadata.shared > 227 * 1024:  # an H100/H200 block's shared memory: the launch would fail
        bad.append(f"{d['kernel']} {d['consts']}: {k.metadata.shared} bytes of shared memory")
    if d["consts"].get("SPLIT_K", 1) > 1 and "atom.global.gpu.acq_rel" not in ptx:
        bad.append(f"{d['kernel']} {d['consts']}: split K without an acquire-release arrival count")
    if d["consts"].get("PDL_WAIT") and "griddepcontrol.wait" not in ptx:
        bad.append(f"{d['kernel']} {d['consts']}: launched with PDL but never waits")
print(json.dumps(bad))
"""


@pytest.mark.slow
def test_kernels_compile_for_sm90(monkeypatch, tmp_path):
    launches = _record(monkeypatch)
    assert any(d["consts"].get("N_PER") == 4 for d in launches)
    assert any(d["consts"].get("K_ONE") for d in launches)
    assert any(d["consts"].get("SPLIT_K") == 4 for d in launches)
    assert {d["kernel"] for d in launches} >= {"moe_gate_up_kernel", "moe_down_kernel", "moe_reduce_kernel",
                                               "moe_index_small_kernel", "moe_index_scan_kernel",
                                               "moe_index_hist_kernel", "moe_index_scatter_kernel"}
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-c", _COMPILER], input=json.dumps(launches), env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    bad = json.loads(res.stdout.strip().splitlines()[-1])
    assert not bad, "\n".join(bad)


GLUON_BUILD = """
import json, sys
from triton.experimental.gluon import language as gl
from hpcops.moe._moe_gluon import moe_gate_up_block_gluon_kernel as kernel
from hpcops.testing import compile_gluon_sm90, sm90_resources

steps, stages, split, naive, warps = json.loads(sys.argv[1])
layout = gl.NVMMASharedLayout.get_default_for([128, 128], gl.float8e4nv)
sig = dict(x_ptr="*fp8e4nv", xs_ptr="*fp32", w_desc=f"tensordesc<fp8e4nv[128, 128],{layout}>", ws_ptr="*fp32",
           tasks_ptr="*i32", offsets_ptr="*i32", sorted_ptr="*i32", ids_ptr="*i32", map_ptr="*i32",
           act_ptr="*fp8e4nv", act_s_ptr="*fp32", part_ptr="*fp32", cnt_ptr="*i32")
sig.update({a: "i32" for a in ("H", "I", "CAP", "TOP_K", "E_GLOBAL", "E_LOCAL", "stride_xt", "stride_xst",
                               "stride_xsg", "stride_wse", "stride_wsn", "stride_wsk", "stride_act", "stride_acts")})
consts = dict(ACT_DT=gl.bfloat16, NAIVE=bool(naive), HAS_MAP=True, BLOCK_M=16, STEPS=steps, STAGES=stages,
              SPLIT_K=split, PDL_WAIT=True, PDL_NEXT=2, num_warps=warps)
sig.update({a: "constexpr" for a in consts})
c = compile_gluon_sm90(kernel, sig, consts, num_warps=warps,
                       div16=("x_ptr", "act_ptr", "H", "stride_xt", "stride_act"))
ptx = c.asm["ptx"]
copies = ptx.count("cp.async.cg.shared.global") + ptx.count("cp.async.ca.shared.global")
print(json.dumps(dict(sm90_resources(c), keep_two=ptx.count("wgmma.wait_group.sync.aligned 2"), x_copies=copies),
                 sort_keys=True))
"""


@pytest.mark.parametrize("build", [(16, 4, 2, 0, 8), (32, 4, 1, 0, 4), (7, 4, 8, 1, 4), (56, 2, 1, 0, 8)],
                         ids=["hy3-ep8-split2", "hy3-ep8-w4", "dsv3-split8-naive", "dsv3-unsplit"])
def test_gluon_gate_up_builds_for_sm90(build):
    """`MoeConfig.gluon`'s kernel (it cannot run in the interpreter) builds for sm_90 at the launcher's shapes (Hy3 EP8
    H 4096 over 2 programs and over 1, DeepSeek-V3 H 7168 over 8 and 1): no spill, within shared memory, the weight
    tiles by TMA, x's rows by cp.async, and the K loop's wait keeps the current step's two MMAs in flight
    (`wgmma.wait_group 2`) while the previous step's result is scaled."""
    from hpcops.testing import sm90_build_in_subprocess

    steps, stages = build[:2]
    r = sm90_build_in_subprocess(GLUON_BUILD, list(build))
    assert r["spill_bytes"] == 0 and r["shared"] <= 227 * 1024, r
    assert r["tma_loads"] > 0 and r["keep_two"] == 1, r
    assert r["x_copies"] >= steps, r
