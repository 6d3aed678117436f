"""Probe: the MoE's top-k reduction as fp32 atomics in the down GEMM's epilogue, against today's y + reduce (issue 9).

Today the down GEMM writes y [T·k, H] (16-bit, expert-sorted rows) and `moe_reduce_kernel` reads it back:
out[t] = Σ_j w[t, j] · y[pos[t, j]]. At large batches that round trip is the down GEMM's biggest cost (y is
134 MB at Hy3 B2048). The alternative: each down tile adds w · its rows into an fp32 [T, H] buffer with atomics
(the buffer fits in L2 up to T ≈ 3000 at H 4096), then one pass rounds it to `out`. This times only the
epilogue's part of both (a GEMM-shaped kernel whose tile values are made in registers, so the GEMM itself
drops out), CUDA-graph replays, µs per call:
- `store+reduce`: tiles stored to y in sorted order, then the reduction (as `moe_reduce_kernel`);
- `zero+atomic+cast`: the fp32 buffer zeroed (torch), tiles added with `tl.atomic_add` (relaxed), one cast pass;
- `atomic`: the atomic tiles alone; `store`: the stores alone.
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

    store()
    reduce()
    zero_atomic_cast()
    torch.cuda.synchronize()
    err = ((out_a.float() - out_b.float()).abs().max() / out_a.float().abs().max().clamp_min(1e-9)).item()
    reps = 4
    row = {"T": t, "H": h, "k": k, "E": e, "block_m": bm, "block_n": bn, "max_rel_diff": err,
           "y_MB": p * h * 2 / 1e6, "acc_MB": t * h * 4 / 1e6}
    for name, fn in (("store+reduce", lambda: (store(), reduce())), ("zero+atomic+cast", zero_atomic_cast),
                     ("store", store), ("atomic", atomic), ("reduce", reduce), ("cast", cast),
                     ("zero", acc.zero_)):
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
    cols = ["store+reduce", "zero+atomic+cast", "store", "reduce", "atomic", "zero", "cast"]
    lines = ["# the MoE reduction: y + reduce against fp32 atomics in the epilogue (µs per call, Hy3 H 4096, k 8)", "",
             f"GPU: {torch.cuda.get_device_name()}; CUDA-graph replays; tiles block_m × block_n of the emitting "
             "kernel.", "",
             "| T | tile | y MB | fp32 acc MB | " + " | ".join(cols) + " | max rel diff |",
             "|---:|---|---:|---:|" + "---:|" * len(cols) + "---:|"]
    for r in rows:
        lines.append(f"| {r['T']} | {r['block_m']}x{r['block_n']} | {r['y_MB']:.1f} | {r['acc_MB']:.1f} | "
                     + " | ".join(f"{r[c]:.1f}" for c in cols) + f" | {r['max_rel_diff']:.1e} |")
    (out / "probe_atomic_reduce.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
