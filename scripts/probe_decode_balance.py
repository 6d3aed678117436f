"""Probe: when do the persistent decode kernel's programs finish, and why (issue 10)?

Nsight Compute put the `tl` persistent kernel's SMs idle 15-23 % of its duration on h8/1 bf16
(`bench/results/ncu_decode_bf16_h8_4f79be8.txt`), while a bare persistent streaming read with equal static
shares keeps them 94-96 % busy (`probe_persistent_balance.md`). This runs the decode bench's scenarios (the
bench's inputs and plan, one eager call on L2-cold inputs after warm-up) with the kernel's `times_ptr` hook: each
program records its SM, start, end, tasks, tiles and the end of its first task on the global timer. It reports
per scenario: the span, the SMs' busy fraction (ncu's SM active / elapsed), the spread of program ends, and the
programs' durations grouped by their task count (mean µs a program, mean tiles, mean µs a tile), so that the
plan's cost model (a tile = 1, a task start = `task_cost` / 4 tiles) can be checked against measured time.
With `--split`, also CUDA-graph µs per layer (the bench's method, L2-cold) of the whole call, of the attention
kernel alone (the combine launch skipped) and of the combine alone (the attention launch skipped; it merges the
partials the last real call left), so that what the combine and the dependency between the two cost shows.

    python3 scripts/probe_decode_balance.py --out DIR [--specs 64x4K,1x64K+15x4K] [--heads 8/1] [--kv bf16]

The hook is not in the library's kernel (it was measured in session 45 and kept out of `main` until the GPU tier
runs on it); bring it into a working tree first:

    git show ffa8b15 -- hpcops/attention/_decode_kernels.py | git apply
"""

from __future__ import annotations

import argparse
import inspect
import json
from pathlib import Path

import torch

import hpcops
from hpcops.attention import _decode_kernels as DK
from hpcops.bench.suites.decode import PAGE, Scenario, make_decode_inputs
from hpcops.bench.timing import graph_time_us, layers_for

SPECS = "64x0.5K,64x4K,32x0.125K+32x4K,2x32K+30x4K,1x64K+15x4K,1x128K+31x4K"


class _Timed:
    """`decode_persistent_kernel` with `times_ptr` added to every launch (the hook `ffa8b15` adds)."""

    def __init__(self, fn, times: torch.Tensor):
        self.fn, self.times = fn, times

    def __getitem__(self, grid):
        launch = self.fn[grid]
        return lambda *a, **k: launch(*a, times_ptr=self.times, **k)


class _Skipped:
    """A kernel whose launches do nothing (to time the rest of the call alone)."""

    def __getitem__(self, grid):
        return lambda *a, **k: None


def split_times(spec: str, hq: int, hkv: int, fp8: bool) -> dict:
    """Graph µs per layer of the whole call, the attention kernel alone and the combine alone."""
    sc = Scenario(spec, hq, hkv, fp8)
    xs = [make_decode_inputs(sc.lens, hq, hkv, sc.fp8, seed=i) for i in range(layers_for(int(sc.bytes)))]
    x0 = xs[0]
    plan = hpcops.plan_decode(x0["seq_lens"], num_kv_heads=hkv, block_size=PAGE, num_q_heads=hq,
                              head_dim=x0["q"].shape[-1], q_dtype=x0["q"].dtype, kv_dtype=x0["k_cache"].dtype)
    fns = [lambda x=x: hpcops.decode_attention(x["q"], x["k_cache"], x["v_cache"], x["block_table"], x["seq_lens"],
                                               plan=plan, k_scale=x["k_scale"], v_scale=x["v_scale"], out=x["out"])
           for x in xs]
    out = {"whole_us": graph_time_us(fns, replays=20)}
    for name, attr in (("attention_us", "decode_combine_kernel"), ("combine_us", "decode_persistent_kernel")):
        real = getattr(DK, attr)
        setattr(DK, attr, _Skipped())
        try:
            out[name] = graph_time_us(fns, replays=20)
        finally:
            setattr(DK, attr, real)
    return out


def _summary(t: torch.Tensor) -> dict:
    sm, t0, t1, tasks, tiles, tf = (t[:, i].double() for i in range(6))
    base = float(t0.min())
    span = float(t1.max()) - base
    per_sm: dict[int, tuple[float, float]] = {}
    for s, a, b in zip(sm.tolist(), t0.tolist(), t1.tolist()):
        lo, hi = per_sm.get(int(s), (a, b))
        per_sm[int(s)] = (min(lo, a), max(hi, b))
    busy = sum(hi - lo for lo, hi in per_sm.values()) / (len(per_sm) * span)
    dur = (t1 - t0) / 1e3
    groups = {}
    for n in sorted({int(x) for x in tasks.tolist()}):
        sel = tasks == n
        d, ti = dur[sel], tiles[sel]
        first = ((tf - t0)[sel] / 1e3)
        groups[n] = {"programs": int(sel.sum()), "us": float(d.mean()), "us_max": float(d.max()),
                     "tiles": float(ti.mean()), "us_per_tile": float((d / ti.clamp(min=1)).mean()),
                     "first_task_us": float(first.mean())}
    late = torch.argsort(t1, descending=True)[:5].tolist()
    return {"programs": t.shape[0], "span_us": span / 1e3, "sm_busy": busy,
            "start_spread_us": float(t0.max() - t0.min()) / 1e3, "end_spread_us": float(t1.max() - t1.min()) / 1e3,
            "by_tasks": groups,
            "latest": [{"pid": p, "end_us": (float(t1[p]) - base) / 1e3, "tasks": int(tasks[p]), "tiles": int(tiles[p]),
                        "start_us": (float(t0[p]) - base) / 1e3} for p in late]}


def probe(spec: str, hq: int, hkv: int, fp8: bool) -> dict:
    sc = Scenario(spec, hq, hkv, fp8)
    layers = [make_decode_inputs(sc.lens, hq, hkv, sc.fp8, seed=i) for i in range(6)]
    x0 = layers[0]
    plan = hpcops.plan_decode(x0["seq_lens"], num_kv_heads=hkv, block_size=PAGE, num_q_heads=hq,
                              head_dim=x0["q"].shape[-1], q_dtype=x0["q"].dtype, kv_dtype=x0["k_cache"].dtype)
    if plan.kernel != "tl":
        raise SystemExit(f"{sc.name}: the plan picked the {plan.kernel} kernel; this probe times the tl one")
    times = torch.zeros((plan.num_programs, 6), dtype=torch.int64, device=x0["q"].device)
    real = DK.decode_persistent_kernel
    DK.decode_persistent_kernel = _Timed(real, times)
    try:
        def call(x):
            hpcops.decode_attention(x["q"], x["k_cache"], x["v_cache"], x["block_table"], x["seq_lens"], plan=plan,
                                    k_scale=x["k_scale"], v_scale=x["v_scale"], out=x["out"])
        for x in layers:  # warm-up (compiles), each layer's cache once
            call(x)
        torch.cuda.synchronize()
        times.zero_()
        call(layers[-1])  # L2-cold enough: five other layers' caches were read since
        torch.cuda.synchronize()
    finally:
        DK.decode_persistent_kernel = real
    return {"scenario": sc.name, "mb": sc.bytes / 1e6, **_summary(times.cpu())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--specs", default=SPECS)
    ap.add_argument("--heads", default="8/1")
    ap.add_argument("--kv", default="bf16", choices=("bf16", "fp8"))
    ap.add_argument("--split", action="store_true", help="also time the attention and combine kernels apart")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("probe_decode_balance.py needs a CUDA GPU")
    if "times_ptr" not in inspect.signature(DK.decode_persistent_kernel.fn).parameters:
        raise SystemExit("decode_persistent_kernel has no times_ptr hook here: first "
                         "`git show ffa8b15 -- hpcops/attention/_decode_kernels.py | git apply`")
    hq, hkv = (int(v) for v in a.heads.split("/"))
    rows = [probe(s, hq, hkv, a.kv == "fp8") for s in a.specs.split(",")]
    if a.split:
        for r, s in zip(rows, a.specs.split(",")):
            r.update(split_times(s, hq, hkv, a.kv == "fp8"))
    lines = ["# probe_decode_balance", "",
             f"{torch.cuda.get_device_name()}: the `tl` persistent decode kernel's programs on the global timer (one "
             "eager call after warm-up; see the script's docstring). busy: SMs' first start to last end over the span.",
             "", "| scenario | MB | programs | span µs | SM busy | start spread µs | end spread µs | by tasks: n "
             "(programs) µs/program, tiles, µs/tile, first task µs |", "|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        g = "; ".join(f"{n} ({v['programs']}) {v['us']:.1f} (max {v['us_max']:.1f}), {v['tiles']:.1f}, "
                      f"{v['us_per_tile']:.2f}, {v['first_task_us']:.1f}" for n, v in r["by_tasks"].items())
        lines.append(f"| {r['scenario']} | {r['mb']:.0f} | {r['programs']} | {r['span_us']:.1f} | {r['sm_busy']:.2f} | "
                     f"{r['start_spread_us']:.1f} | {r['end_spread_us']:.1f} | {g} |")
    if a.split:
        lines += ["", "CUDA-graph µs per layer (L2-cold): the whole call, the attention kernel alone, the combine "
                  "alone.",
                  "", "| scenario | whole | attention alone | combine alone | whole − attention |",
                  "|---|---:|---:|---:|---:|"]
        lines += [f"| {r['scenario']} | {r['whole_us']:.1f} | {r['attention_us']:.1f} | {r['combine_us']:.1f} | "
                  f"{r['whole_us'] - r['attention_us']:.1f} |" for r in rows]
    lines += ["", "Latest programs (pid: start → end µs, tasks, tiles):", ""]
    for r in rows:
        lines.append(f"- {r['scenario']}: " + "; ".join(
            f"{p['pid']}: {p['start_us']:.1f} → {p['end_us']:.1f}, {p['tasks']}, {p['tiles']}" for p in r["latest"]))
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "probe_decode_balance.md").write_text("\n".join(lines) + "\n")
    (a.out / "probe_decode_balance.json").write_text(json.dumps({"rows": rows}, indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
