"""Probe (issue 10): how fast can a Hopper-only Gluon decode tile be on one TP8 rank of Hy3 (8 q heads, 1 kv head)?

Not library code: a measurement to decide whether a Gluon decode kernel is worth building behind the plan.
The kernel is a plain split-KV (program (request, split), equal splits) over 64-token pages of an fp8 KV cache
with the fp8 q the prologue emits, head_dim 128, written as a Hopper kernel:
- K and V tiles arrive by TMA (the cache seen as 2-D [blocks·64, token row]), STAGES buffers deep, one mbarrier
  a buffer, the next tiles issued before the current one is used;
- swap-AB: Sᵀ [64 keys, 8 rows] = K [64, 128] · qᵀ as one fp8 wgmma (the keys on its 64-row M side, the 8 q
  rows as N = 8; no widening of K);
- Oᵀ [128, 8] += Vᵀ · Pᵀ as a bf16 wgmma: fp8 wgmma wants V K-major and the cache holds it D-major, so V goes
  through registers (widened to bf16) as the A operand and Pᵀ through shared memory as B.
The combine of the splits runs in torch (not timed), as in the issue's earlier probe.

    python3 scripts/probe_gluon_decode.py --compile-only   # no GPU: compiles for sm_90, prints registers/spills
    python3 scripts/probe_gluon_decode.py                   # on the H200: check against the torch reference,
                                                            # then time it beside hpcops' decode (same inputs)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

TILE = 64
D = 128
NQ = 8  # q rows of one (request, kv head): Hy3's 8 q heads per kv head at q_len 1
KV_BYTES = 2 * TILE * D  # one K and one V tile, fp8


@gluon.jit
def gluon_decode_split_kernel(q_desc, k_desc, v_desc, q_scale_ptr, bt_ptr, seq_lens_ptr, part_o_ptr, part_lse_ptr,
                              scale_log2, bt_stride, SPLITS: gl.constexpr, NQ: gl.constexpr, D: gl.constexpr,
                              TILE: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr):
    b = gl.program_id(0)
    sp = gl.program_id(1)
    kv_len = gl.load(seq_lens_ptr + b)
    n_tiles = (kv_len + TILE - 1) // TILE
    chunk = (n_tiles + SPLITS - 1) // SPLITS
    lo = sp * chunk
    n = gl.maximum(gl.minimum(chunk, n_tiles - lo), 0)

    # Sᵀ [TILE, NQ]: fp8 wgmma (k = 32); Oᵀ [D, NQ]: bf16 wgmma (k = 16); Vᵀ as A from registers
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, NQ, 32])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, NQ, 16])
    vt_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    p_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([NQ, TILE], gl.bfloat16)

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [NQ, D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, TILE, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, TILE, D], v_desc.layout)
    p_smem = gl.allocate_shared_memory(gl.bfloat16, [NQ, TILE], p_smem_layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    mbarrier.init(q_bar, count=1)

    mbarrier.expect(q_bar, NQ * D)
    tma.async_copy_global_to_shared(q_desc, [b * NQ, 0], q_bar, q_smem)
    bt_row = bt_ptr + b * bt_stride + lo
    for i in gl.static_range(STAGES - 1):  # the first tiles in flight
        ok = i < n
        page = gl.load(bt_row + i, mask=ok, other=0)
        mbarrier.expect(bars.index(i), 2 * TILE * D, pred=ok)
        tma.async_copy_global_to_shared(k_desc, [page * TILE, 0], bars.index(i), k_smem.index(i), pred=ok)
        tma.async_copy_global_to_shared(v_desc, [page * TILE, 0], bars.index(i), v_smem.index(i), pred=ok)

    cols_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    rows_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    cols_o: gl.constexpr = gl.SliceLayout(0, o_layout)
    rows_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    qs = gl.load(q_scale_ptr + b * NQ + gl.arange(0, NQ, layout=cols_s)) * scale_log2  # [NQ] log2-domain scale
    m_i = gl.full([NQ], float("-inf"), gl.float32, layout=cols_s)
    l_i = gl.zeros([NQ], gl.float32, layout=cols_s)
    o = gl.zeros([D, NQ], gl.float32, layout=o_layout)
    keys = gl.arange(0, TILE, layout=rows_s)
    mbarrier.wait(q_bar, phase=0)
    q_t = q_smem.permute((1, 0))  # [D, NQ], K-major: the B operand of Sᵀ = K·qᵀ
    p_t = p_smem.permute((1, 0))  # [TILE, NQ], K-major: the B operand of Oᵀ = Vᵀ·Pᵀ

    for i in range(n):
        # refill the buffer the previous tile used (its wgmmas completed: both are synchronous)
        j = i + STAGES - 1
        sj = j % STAGES
        ok = j < n
        page = gl.load(bt_row + j, mask=ok, other=0)
        mbarrier.expect(bars.index(sj), 2 * TILE * D, pred=ok)
        tma.async_copy_global_to_shared(k_desc, [page * TILE, 0], bars.index(sj), k_smem.index(sj), pred=ok)
        tma.async_copy_global_to_shared(v_desc, [page * TILE, 0], bars.index(sj), v_smem.index(sj), pred=ok)

        s = i % STAGES
        mbarrier.wait(bars.index(s), phase=(i // STAGES) & 1)
        st = warpgroup_mma(k_smem.index(s), q_t, gl.zeros([TILE, NQ], gl.float32, layout=s_layout), use_acc=False)
        st = st * qs[None, :]
        st = gl.where(((lo + i) * TILE + keys < kv_len)[:, None], st, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(st, axis=0))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(st - m_new[None, :])
        l_i = l_i * alpha + gl.sum(p, axis=0)
        m_i = m_new
        p_smem.store(gl.permute(p.to(gl.bfloat16), (1, 0)))
        fence_async_shared()
        vt = v_smem.index(s).permute((1, 0)).load(vt_layout).to(gl.bfloat16)  # [D, TILE]
        o = o * gl.convert_layout(alpha, cols_o)[None, :]
        o = warpgroup_mma(vt, p_t, o)

    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))
    mbarrier.invalidate(q_bar)
    l_o = gl.convert_layout(l_i, cols_o)
    m_o = gl.convert_layout(m_i, cols_o)
    o = o / gl.where(l_o == 0.0, 1.0, l_o)[None, :]
    lse = gl.where(l_o == 0.0, float("-inf"), m_o + gl.log2(gl.where(l_o == 0.0, 1.0, l_o)))
    row0 = (b * SPLITS + sp) * NQ
    qrow = gl.arange(0, NQ, layout=cols_o)
    d = gl.arange(0, D, layout=rows_o)
    gl.store(part_o_ptr + (row0 + qrow)[None, :] * D + d[:, None], o)
    gl.store(part_lse_ptr + row0 + qrow, lse)


def descriptors(x: dict, fp8: torch.dtype):
    """TMA descriptors over q8 [B·8, D] and the packed K|V cache as 2-D [blocks·64, D] views (row stride 2·D)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    q8 = x["q8"].reshape(-1, D)
    nb = x["packed"].shape[0]
    row = x["packed"].stride(1)
    k2 = torch.as_strided(x["k_cache"], (nb * TILE, D), (row, 1))
    v2 = torch.as_strided(x["v_cache"], (nb * TILE, D), (row, 1))
    lay_q = gl.NVMMASharedLayout.get_default_for([NQ, D], gl.float8e4nv)
    lay_kv = gl.NVMMASharedLayout.get_default_for([TILE, D], gl.float8e4nv)
    return (TensorDescriptor(q8, list(q8.shape), list(q8.stride()), [NQ, D], lay_q),
            TensorDescriptor(k2, list(k2.shape), list(k2.stride()), [TILE, D], lay_kv),
            TensorDescriptor(v2, list(v2.shape), list(v2.stride()), [TILE, D], lay_kv))


def launcher(x: dict, splits: int, stages: int):
    b = x["seq_lens"].shape[0]
    dev = x["q"].device
    part_o = torch.empty((b * splits * NQ, D), dtype=torch.float32, device=dev)
    part_lse = torch.empty((b * splits * NQ,), dtype=torch.float32, device=dev)
    q_desc, k_desc, v_desc = descriptors(x, x["q8"].dtype)
    scale_log2 = (1.0 / math.sqrt(D)) * math.log2(math.e) * float(x["k_scale"])
    bt = x["block_table"]

    def run():
        gluon_decode_split_kernel[(b, splits)](
            q_desc, k_desc, v_desc, x["q_scale"], bt, x["seq_lens"], part_o, part_lse, scale_log2, bt.stride(0),
            SPLITS=splits, NQ=NQ, D=D, TILE=TILE, STAGES=stages, num_warps=4)
    return run, part_o, part_lse


def combine(part_o, part_lse, b: int, splits: int, v_scale: float) -> torch.Tensor:
    o = part_o.view(b, splits, NQ, D)
    lse = part_lse.view(b, splits, NQ)
    m = lse.max(dim=1, keepdim=True).values
    w = torch.exp2(lse - torch.where(torch.isinf(m), torch.zeros_like(m), m))
    return ((o * w[..., None]).sum(1) / w.sum(1)[..., None] * v_scale).to(torch.bfloat16)


def compile_only(stages: int) -> dict:
    """Compile for sm_90 without a GPU (GluonASTSource, as PREFILL.md describes) and read registers and spills."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    lay_q = gl.NVMMASharedLayout.get_default_for([NQ, D], gl.float8e4nv)
    lay_kv = gl.NVMMASharedLayout.get_default_for([TILE, D], gl.float8e4nv)
    desc = "tensordesc<{}[{}, {}],{}>"
    sig = {"q_desc": desc.format("fp8e4nv", NQ, D, lay_q), "k_desc": desc.format("fp8e4nv", TILE, D, lay_kv),
           "v_desc": desc.format("fp8e4nv", TILE, D, lay_kv), "q_scale_ptr": "*fp32", "bt_ptr": "*i32",
           "seq_lens_ptr": "*i32", "part_o_ptr": "*fp32", "part_lse_ptr": "*fp32", "scale_log2": "fp32",
           "bt_stride": "i32", "SPLITS": "constexpr", "NQ": "constexpr", "D": "constexpr", "TILE": "constexpr",
           "STAGES": "constexpr", "num_warps": "constexpr"}
    constexprs = {"SPLITS": 8, "NQ": NQ, "D": D, "TILE": TILE, "STAGES": stages, "num_warps": 4}
    src = GluonASTSource(gluon_decode_split_kernel, sig, constexprs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    ptx = k.asm["ptx"]
    from hpcops.testing import sm90_resources

    return {"stages": stages, **sm90_resources(k), "wgmma": ptx.count("wgmma.mma_async"),
            "tma_loads": ptx.count("cp.async.bulk.tensor")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compile-only", action="store_true", help="compile for sm_90 on the CPU and stop")
    ap.add_argument("--spec", default="64x4K", help="decode batch (the decode suite's length syntax)")
    ap.add_argument("--splits", default="4,8,16", help="splits per request to time")
    ap.add_argument("--stages", default="3,4", help="TMA buffers to time")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    stages = [int(s) for s in args.stages.split(",")]
    if args.compile_only:
        for st in stages:
            print(json.dumps(compile_only(st)))
        return 0

    import hpcops
    from hpcops.attention import reference as ref
    from hpcops.bench.scenarios import parse_lengths
    from hpcops.bench.suites.decode import make_decode_inputs
    from hpcops.bench.timing import graph_time_us, layers_for
    from hpcops.testing import assert_close

    lens = parse_lengths(args.spec)
    kv_bytes = sum(lens) * D * 2
    layers = layers_for(kv_bytes)
    xs = [make_decode_inputs(lens, NQ, 1, True, seed=i) for i in range(layers)]
    x0 = xs[0]
    want = ref.decode_attention(x0["q8"], x0["k_cache"], x0["v_cache"], x0["block_table"], x0["seq_lens"],
                                k_scale=x0["k_scale"], v_scale=x0["v_scale"], q_scale=x0["q_scale"])
    rows = []
    for st in stages:
        for sp in [int(s) for s in args.splits.split(",")]:
            run, po, pl = launcher(x0, sp, st)
            po.fill_(float("nan"))
            run()
            got = combine(po, pl, len(lens), sp, float(x0["v_scale"]))
            assert_close(want, got, name=f"gluon stages={st} splits={sp}")
            runs = [launcher(x, sp, st)[0] for x in xs]
            us = graph_time_us(runs)
            rows.append({"impl": f"gluon-split stages={st} splits={sp} (no combine)", "us": us})
            print(f"{rows[-1]['impl']}: {us:.1f} us, {kv_bytes / us / 1e3:.0f} GB/s", flush=True)
    for schedule in ("dynamic", "static"):
        calls = []
        for x in xs:
            plan = hpcops.plan_decode(x["seq_lens"], num_kv_heads=1, block_size=TILE) if schedule == "dynamic" else None
            calls.append(lambda x=x, plan=plan, schedule=schedule: hpcops.decode_attention(
                x["q8"], x["k_cache"], x["v_cache"], x["block_table"], x["seq_lens"], plan=plan, schedule=schedule,
                k_scale=x["k_scale"], v_scale=x["v_scale"], q_scale=x["q_scale"], out=x["out"]))
        us = graph_time_us(calls)
        rows.append({"impl": f"hpcops {schedule} (with its combine)", "us": us})
        print(f"{rows[-1]['impl']}: {us:.1f} us, {kv_bytes / us / 1e3:.0f} GB/s", flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "probe_gluon_decode.json"), "w") as f:
            json.dump({"spec": args.spec, "layers": layers, "kv_bytes": kv_bytes, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
