"""Probe: does a persistent grid with an equal static share a program finish evenly on this GPU (issue 10)?

Nsight Compute put the persistent decode kernel's SMs idle for 15 % (64x4K h8/1 bf16) and 23 % (1x64K+15x4K) of
its duration (`bench/results/ncu_decode_bf16_h8_4f79be8.txt`: SM active cycles 59.4 k of 70.1 k, 31.8 k of
41.3 k), although the plan gives every program the same cost. This asks whether that is the hardware or the plan:
a bare streaming read of S MB in 32 KB tiles (64 × 256 bf16, a decode K+V tile of 64 tokens at d 128) by a
persistent grid of P programs an SM, each program recording its SM (%smid) and its start and end
(%globaltimer), three ways:
- `static`: program p reads tiles [p·n/P, (p+1)·n/P) in one pipelined loop (the plan's equal buckets);
- `stride`: program p reads tiles p, p + P, p + 2P, ... (an equal share, interleaved);
- `dyn<C>`: programs take chunks of C tiles from an atomic counter until none is left (each chunk its own
  pipelined loop, as a task is in the decode kernel; the last program to finish resets the counter).
Per variant: CUDA-graph µs per layer (L2-cold, every layer its own buffer), TB/s, the spread of the programs'
end times (the latest minus the earliest, as a fraction of the kernel's span), the mean SM-busy fraction
(per SM, first start to last end, over the kernel's span: ncu's "SM active cycles" / elapsed), and the
per-SM finish times sorted (the 5 earliest and 5 latest SMs), from one timed launch.

    python3 scripts/probe_persistent_balance.py --out DIR [--mb 17,65,134] [--per-sm 1,2,3] [--chunks 1,2,4,8]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton
import triton.language as tl

from hpcops._platform import num_sms
from hpcops.bench.timing import graph_time_us, layers_for

ROWS, COLS = 64, 256  # a 32 KB bf16 tile


@triton.jit
def _globaltimer():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _smid():
    return tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def balance_kernel(src_ptr, out_ptr, ctr_ptr, times_ptr, n_tiles, MODE: tl.constexpr, CHUNK: tl.constexpr,
                   ROWS: tl.constexpr, COLS: tl.constexpr, STAGES: tl.constexpr):
    """MODE 0 static contiguous share, 1 interleaved share, 2 dynamic chunks of CHUNK tiles (ctr_ptr: [taken,
    done], zero before the launch and left zero after it)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    t0 = _globaltimer()
    offs = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
    acc = tl.zeros([ROWS, COLS], dtype=tl.float32)
    tile_elems = ROWS * COLS
    if MODE == 0:
        lo = (pid * n_tiles) // nprog
        hi = ((pid + 1) * n_tiles) // nprog
        for t in tl.range(lo, hi, num_stages=STAGES):
            acc += tl.load(src_ptr + t.to(tl.int64) * tile_elems + offs).to(tl.float32)
    elif MODE == 1:
        for t in tl.range(pid, n_tiles, nprog, num_stages=STAGES):
            acc += tl.load(src_ptr + t.to(tl.int64) * tile_elems + offs).to(tl.float32)
    else:
        n_chunks = tl.cdiv(n_tiles, CHUNK)
        c = tl.atomic_add(ctr_ptr, 1)
        while c < n_chunks:
            for t in tl.range(c * CHUNK, tl.minimum(c * CHUNK + CHUNK, n_tiles), num_stages=STAGES):
                acc += tl.load(src_ptr + t.to(tl.int64) * tile_elems + offs).to(tl.float32)
            c = tl.atomic_add(ctr_ptr, 1)
        if tl.atomic_add(ctr_ptr + 1, 1) == nprog - 1:  # every program has left the queue: reset it
            tl.atomic_xchg(ctr_ptr, 0)
            tl.atomic_xchg(ctr_ptr + 1, 0)
    tl.store(out_ptr + pid, tl.sum(tl.sum(acc, 1), 0))
    t1 = _globaltimer()
    tl.store(times_ptr + pid * 3, _smid().to(tl.int64))
    tl.store(times_ptr + pid * 3 + 1, t0)
    tl.store(times_ptr + pid * 3 + 2, t1)


def _launch(src, out, ctr, times, n_tiles, programs, mode, chunk):
    return lambda: balance_kernel[(programs,)](src, out, ctr, times, n_tiles, MODE=mode, CHUNK=chunk, ROWS=ROWS,
                                               COLS=COLS, STAGES=3, num_warps=4)


def _spread(times: torch.Tensor) -> dict:
    t = times.view(-1, 3).cpu()
    sm, t0, t1 = t[:, 0], t[:, 1].double(), t[:, 2].double()
    span = float(t1.max() - t0.min())
    per_sm = {}
    for s, a, b in zip(sm.tolist(), t0.tolist(), t1.tolist()):
        lo, hi = per_sm.get(s, (a, b))
        per_sm[s] = (min(lo, a), max(hi, b))
    busy = sum(hi - lo for lo, hi in per_sm.values()) / (len(per_sm) * span) if span > 0 else 1.0
    ends = sorted((hi - float(t0.min())) / 1e3 for _, hi in per_sm.values())
    starts = sorted((lo - float(t0.min())) / 1e3 for lo, _ in per_sm.values())
    return {"span_us": span / 1e3, "end_spread": float(t1.max() - t1.min()) / span if span > 0 else 0.0,
            "sm_busy": busy, "sms": len(per_sm), "first_ends_us": ends[:5], "last_ends_us": ends[-5:],
            "last_starts_us": starts[-5:]}


def probe(mb: float, per_sm: int, mode: int, chunk: int, device: torch.device) -> dict:
    n_tiles = int(mb * 1e6) // (ROWS * COLS * 2)
    layers = layers_for(n_tiles * ROWS * COLS * 2)
    programs = per_sm * num_sms(device)
    srcs = [torch.randn(n_tiles * ROWS * COLS, device=device).to(torch.bfloat16) for _ in range(layers)]
    outs = [torch.empty(programs, device=device) for _ in range(layers)]
    ctr = torch.zeros(2, dtype=torch.int32, device=device)
    times = [torch.zeros(programs * 3, dtype=torch.int64, device=device) for _ in range(layers)]
    fns = [_launch(s, o, ctr, t, n_tiles, programs, mode, chunk) for s, o, t in zip(srcs, outs, times)]
    fns[0]()
    torch.cuda.synchronize()
    got, want = outs[0].double().sum().item(), srcs[0].double().sum().item()
    if abs(got - want) > 1e-3 * max(1.0, srcs[0].double().abs().sum().item()) or ctr.any():
        raise RuntimeError(f"balance_kernel mode {mode}: sum {got} against {want}, counter {ctr.tolist()}")
    us = graph_time_us(fns, replays=20)
    fns[1]()  # one eager launch, L2-cold (its buffer was last read a graph replay ago)
    torch.cuda.synchronize()
    name = ["static", "stride", f"dyn{chunk}"][mode]
    return {"mb": mb, "per_sm": per_sm, "variant": name, "layers": layers, "graph_us": us,
            "tbs": n_tiles * ROWS * COLS * 2 / (us * 1e-6) / 1e12, **_spread(times[1])}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for probe_persistent_balance.{md,json}")
    ap.add_argument("--mb", default="17,65,134", help="sizes, MB (1e6 bytes), comma-separated")
    ap.add_argument("--per-sm", default="1,2,3", help="programs an SM (static and stride)")
    ap.add_argument("--chunks", default="1,2,4,8", help="tiles a chunk (dynamic, at 2 programs an SM)")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("probe_persistent_balance.py needs a CUDA GPU")
    dev = torch.device("cuda")
    rows = []
    for mb in (float(s) for s in a.mb.split(",")):
        for p in (int(s) for s in a.per_sm.split(",")):
            rows += [probe(mb, p, 0, 1, dev), probe(mb, p, 1, 1, dev)]
        rows += [probe(mb, 2, 2, int(c), dev) for c in a.chunks.split(",")]
    lines = ["# probe_persistent_balance", "",
             f"{torch.cuda.get_device_name()}, {num_sms(dev)} SMs: a persistent streaming read of S MB in 32 KB "
             "tiles (see the script's docstring). µs: CUDA-graph replay per layer, L2-cold. end spread: latest "
             "minus earliest program end over the kernel's span; SM busy: per SM first start to last end over the "
             "span (ncu's SM active / elapsed); ends: SMs' last program end, µs after the first start (5 earliest, "
             "5 latest); last starts: the 5 latest SM first starts.", "",
             "| MB | programs/SM | variant | µs | TB/s | span µs | end spread | SM busy | earliest ends | latest ends "
             "| latest starts |", "|---:|---:|---|---:|---:|---:|---:|---:|---|---|---|"]
    fmt = lambda v: " ".join(f"{x:.1f}" for x in v)  # noqa: E731
    for r in rows:
        lines.append(f"| {r['mb']:g} | {r['per_sm']} | {r['variant']} | {r['graph_us']:.1f} | {r['tbs']:.2f} | "
                     f"{r['span_us']:.1f} | {r['end_spread']:.2f} | {r['sm_busy']:.2f} | {fmt(r['first_ends_us'])} | "
                     f"{fmt(r['last_ends_us'])} | {fmt(r['last_starts_us'])} |")
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "probe_persistent_balance.md").write_text("\n".join(lines) + "\n")
    (a.out / "probe_persistent_balance.json").write_text(json.dumps({"rows": rows}, indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
