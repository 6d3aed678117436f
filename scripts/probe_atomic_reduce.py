"""Probe: the MoE's top-k reduction as fp32 atomics in the down GEMM's epilogue, against today's y + reduce (issue 9).

Today the down GEMM writes y [T·k, H] (16-bit, expert-sorted rows) and `moe_reduce_kernel` reads it back:
out[t] = Σ_j w[t, j] · y[pos[t, j]]. At large batches that round trip is the down GEMM's biggest cost (y is
134 MB at Hy3 B2048). The alternative: each down tile adds w · its rows into an fp32 [T, H] buffer with atomics
(the buffer fits in L2 up to T ≈ 3000 at H 4096), then one pass rounds it to `out`. This times only the
epilogue's part of both (a GEMM-shaped kernel whose tile values are made in registers, so the GEMM itself
drops out), CUDA-graph replays, µs per call:
- `store+reduce`: tiles stored to y in sorted order, then the reduction (as `moe_reduce_kernel`);
- `zero+atomic+cast`: the fp32 buffer zeroed (torch), tiles added with `tl.atomic_add` (relaxed), one cast pass;
- `atomic`: the atomic tiles alone; `store`: the stores alone;
- `red2`, `red4`: the atomic tiles as vector reductions, `red.global.add.v2.f32` / `.v4.f32` (sm_90; SASS
  REDG.E.ADD.F32x2 / x4), 2 or 4 consecutive columns a thread in a Gluon layout (Triton's `tl` gives an
  elementwise inline asm no such layout); `zero+red4+cast` the whole path with them.
Writes probe_atomic_reduce.{md,json} into --out.

    python3 scripts/probe_atomic_reduce.py --out DIR [--t 512,2048,4096,16384]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from hpcops.bench.timing import graph_time_us


@triton.jit
def _emit_kernel(y_ptr, acc_ptr, sorted_ptr, tw_ptr, P, H, TOP_K: tl.constexpr, ATOMIC: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < P
    val = (rows[:, None] * 7 + cols[None, :]).to(tl.float32) * 1e-4
    if ATOMIC:
        pair = tl.load(sorted_ptr + rows, mask=rmask, other=0)
        w = tl.load(tw_ptr + pair, mask=rmask, other=0.0)
        tok = (pair // TOP_K).to(tl.int64)
        tl.atomic_add(acc_ptr + tok[:, None] * H + cols[None, :], val * w[:, None], mask=rmask[:, None],
                      sem="relaxed")
    else:
        tl.store(y_ptr + rows.to(tl.int64)[:, None] * H + cols[None, :], val.to(y_ptr.dtype.element_ty),
                 mask=rmask[:, None])


@gluon.jit
def _red_vec_kernel(acc_ptr, sorted_ptr, tw_ptr, P, H, TOP_K: gl.constexpr, VEC: gl.constexpr, BLOCK_M: gl.constexpr,
                    BLOCK_N: gl.constexpr, num_warps: gl.constexpr):
    """`_emit_kernel`'s atomic tiles (the same values) as VEC-wide vector reductions: each thread holds VEC
    consecutive columns (an explicit layout), one red.global.add.vVEC.f32 per VEC."""
    TN: gl.constexpr = min(32, BLOCK_N // VEC)  # threads along a row: the layout never wraps (no duplicate adds)
    layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, VEC], threads_per_warp=[32 // TN, TN],
                                            warps_per_cta=[num_warps, 1], order=[1, 0])
    rows = gl.program_id(0) * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
    cols = gl.program_id(1) * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
    rmask = rows < P
    pair = gl.load(sorted_ptr + rows, mask=rmask, other=0)
    w = gl.where(rmask, gl.load(tw_ptr + pair, mask=rmask, other=0.0), 0.0)  # a padded row adds 0 to token 0
    tok = (pair // TOP_K).to(gl.int64)
    val = (gl.expand_dims(rows, 1) * 7 + gl.expand_dims(cols, 0)).to(gl.float32) * 1e-4 * gl.expand_dims(w, 1)
    addr = (acc_ptr + gl.expand_dims(tok, 1) * H + gl.expand_dims(cols, 0)).to(gl.int64, bitcast=True)
    if VEC == 4:
        gl.inline_asm_elementwise(
            "red.global.add.v4.f32 [$4], {$8, $9, $10, $11}; mov.u32 $0, 0; mov.u32 $1, 0; mov.u32 $2, 0; "
            "mov.u32 $3, 0;", "=r,=r,=r,=r,l,l,l,l,f,f,f,f", [addr, val], dtype=gl.int32, is_pure=False, pack=4)
    else:
        gl.inline_asm_elementwise(
            "red.global.add.v2.f32 [$2], {$4, $5}; mov.u32 $0, 0; mov.u32 $1, 0;", "=r,=r,l,l,f,f", [addr, val],
            dtype=gl.int32, is_pure=False, pack=2)


@triton.jit
def _reduce_kernel(y_ptr, pos_ptr, tw_ptr, out_ptr, H, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        p = tl.load(pos_ptr + t * TOP_K + j).to(tl.int64)
        acc += tl.load(tw_ptr + t * TOP_K + j) * tl.load(y_ptr + p * H + cols).to(tl.float32)
    tl.store(out_ptr + t * H + cols, acc.to(out_ptr.dtype.element_ty))


@triton.jit
def _cast_kernel(acc_ptr, out_ptr, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    tl.store(out_ptr + offs, tl.load(acc_ptr + offs, mask=m).to(out_ptr.dtype.element_ty), mask=m)


def run_case(t: int, h: int, k: int, e: int, bm: int, bn: int) -> dict:
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(t)
    ids = torch.stack([torch.randperm(e, device=dev, generator=g)[:k] for _ in range(t)])  # [T, k]
    sorted_pairs = torch.argsort(ids.flatten(), stable=True).to(torch.int32)  # sorted row -> pair
    pos = torch.empty_like(sorted_pairs)
    pos[sorted_pairs.long()] = torch.arange(t * k, device=dev, dtype=torch.int32)  # pair -> sorted row
    tw = torch.rand(t * k, device=dev, generator=g, dtype=torch.float32)
    p = t * k
    y = torch.empty(p, h, device=dev, dtype=torch.bfloat16)
    acc = torch.empty(t, h, device=dev, dtype=torch.float32)
    out_a = torch.empty(t, h, device=dev, dtype=torch.bfloat16)
    out_b = torch.empty_like(out_a)
    grid = (triton.cdiv(p, bm), triton.cdiv(h, bn))

    def store():
        _emit_kernel[grid](y, acc, sorted_pairs, tw, p, h, TOP_K=k, ATOMIC=False, BLOCK_M=bm, BLOCK_N=bn)

    def reduce():
        _reduce_kernel[(t, h // 1024)](y, pos, tw, out_a, h, TOP_K=k, BLOCK_H=1024)

    def atomic():
        _emit_kernel[grid](y, acc, sorted_pairs, tw, p, h, TOP_K=k, ATOMIC=True, BLOCK_M=bm, BLOCK_N=bn)

    def cast():
        _cast_kernel[(triton.cdiv(t * h, 4096),)](acc, out_b, t * h, BLOCK=4096)

    def zero_atomic_cast():
        acc.zero_()
        atomic()
        cast()

    def red(vec):
        return lambda: _red_vec_kernel[grid](acc, sorted_pairs, tw, p, h, TOP_K=k, VEC=vec, BLOCK_M=bm, BLOCK_N=bn,
                                             num_warps=4)

    def zero_red4_cast():
        acc.zero_()
        red(4)()
        cast()

    store()
    reduce()
    zero_atomic_cast()
    torch.cuda.synchronize()
    err = ((out_a.float() - out_b.float()).abs().max() / out_a.float().abs().max().clamp_min(1e-9)).item()
    errs = {}
    for vec in (2, 4):  # the vector reductions against the same reference
        acc.zero_()
        red(vec)()
        out_b.fill_(float("nan"))
        cast()
        torch.cuda.synchronize()
        d = (out_a.float() - out_b.float()).abs().max() / out_a.float().abs().max().clamp_min(1e-9)
        errs[f"max_rel_diff_red{vec}"] = d.item()
    reps = 4
    row = {"T": t, "H": h, "k": k, "E": e, "block_m": bm, "block_n": bn, "max_rel_diff": err, **errs,
           "y_MB": p * h * 2 / 1e6, "acc_MB": t * h * 4 / 1e6}
    for name, fn in (("store+reduce", lambda: (store(), reduce())), ("zero+atomic+cast", zero_atomic_cast),
                     ("zero+red4+cast", zero_red4_cast), ("store", store), ("atomic", atomic), ("red2", red(2)),
                     ("red4", red(4)), ("reduce", reduce), ("cast", cast), ("zero", acc.zero_)):
        row[name] = round(graph_time_us([fn] * reps), 2)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--t", default="4,64,512,2048,4096,16384")
    ap.add_argument("--tiles", default="64x128,128x128,64x64")
    args = ap.parse_args()
    rows = []
    for t in map(int, args.t.split(",")):
        for tile in args.tiles.split(","):
            bm, bn = map(int, tile.split("x"))
            r = run_case(t, 4096, 8, 192, bm, bn)
            print(json.dumps(r), flush=True)
            rows.append(r)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "probe_atomic_reduce.json").write_text(json.dumps(rows, indent=1))
    cols = ["store+reduce", "zero+atomic+cast", "zero+red4+cast", "store", "reduce", "atomic", "red2", "red4", "zero",
            "cast"]
    lines = ["# the MoE reduction: y + reduce against fp32 atomics in the epilogue (µs per call, Hy3 H 4096, k 8)", "",
             f"GPU: {torch.cuda.get_device_name()}; CUDA-graph replays; tiles block_m × block_n of the emitting "
             "kernel.", "",
             "| T | tile | y MB | fp32 acc MB | " + " | ".join(cols) + " | max rel diff (atomic / red2 / red4) |",
             "|---:|---|---:|---:|" + "---:|" * len(cols) + "---:|"]
    for r in rows:
        lines.append(f"| {r['T']} | {r['block_m']}x{r['block_n']} | {r['y_MB']:.1f} | {r['acc_MB']:.1f} | "
                     + " | ".join(f"{r[c]:.1f}" for c in cols)
                     + f" | {r['max_rel_diff']:.1e} / {r['max_rel_diff_red2']:.1e} / {r['max_rel_diff_red4']:.1e} |")
    (out / "probe_atomic_reduce.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
