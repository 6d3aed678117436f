"""Probe: where a warp-specialized prefill kernel's time goes, from clock stamps inside it (issue 12).

Nsight Compute gives stall totals; this gives the timeline. The kernels' opt-in trace (`_prefill_gluon.py`'s
`_stamp`, `TRACE=True`) records the SM clock where each partition passes its waits: a consumer warpgroup at the
start of a q tile, after its first P, after its loop, after its last P·V and after its output stores, and in every
K/V step after the K wait, the Vᵀ wait (fp8), the turn, the S wait, the softmax and the P·V wait; the fp8 producer
in every step after the V wait, the Vᵀ buffer's release and the transpose; plus the SM id and the global timer at a
tile's start and end. From them, per case and kernel:

- the SMs' timeline (global timer): when each SM starts its first tile and ends its last, against the launch's span
  (idle SMs at the end = imbalance);
- each q tile's phases in cycles (first S + softmax, the loop per step, the last P·V, the epilogue, and in the
  persistent kernel the gap to the next tile);
- each step's segments (the waits and the work between them), median over the steps;
- the fp8 producer's step: waiting for V, for a free Vᵀ buffer, and the transpose.

Kernels: `fp8` (the fp8-q default: persistent, the producer prefetching q; `gluon_config(fp8=True)`), `fp8-ws` (the
same tile a program a q tile), `bf16` (the bf16 default over bf16 KV, a program a q tile); `fp8-narrow`,
`bf16-narrow`: the defaults storing the output in 4-byte pieces (`PrefillConfig.gluon_wide_store=False`, the default
until session 72). Beside the
medians, the SMs that end last against the median SM: their tiles, steps and the cycles of each step segment summed
(consumer 0), so that a late SM shows what it waited for. Inputs: the prefill
bench's (`_make_inputs`, layer 0), L2 flushed before each launch. The stamps cost a few instructions each
(ptxas spills a few bytes more): the traced launch's µs is printed beside the untraced one. In the fp8 kernel they
also change the schedule: untraced, ptxas moves each consumer's K release, P·V wait and Vᵀ release above the
softmax; the clock reads keep them after it, so the producer refills and transposes later under the trace
(`hpcops/attention/PREFILL.md`, session 73): read the fp8 consumers' Vᵀ and turn waits as the traced kernel's.

    python3 scripts/probe_prefill_trace.py --out DIR [--cases 'h8x1-q4k,h64x8-q4k'] [--kernels fp8,fp8-ws,bf16]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import numpy as np
import torch

from hpcops.attention._prefill_gluon import TRACE_KINDS, TRACE_STEPS
from hpcops.attention.prefill import _choose_kernel, _launch_gluon, _without_prefetch, gluon_programs, tile_bounds
from hpcops.bench.suites.prefill import Scenario, _make_inputs
from hpcops.bench.timing import eager_time_us

KINDS, STEPS = int(TRACE_KINDS.value), int(TRACE_STEPS.value)
MISSING = -(2**31)
KERNELS = ("fp8", "fp8-ws", "bf16", "fp8-narrow", "bf16-narrow")
# consumer step segments: (name, from kind, to kind); the fp8 loop waits for Vᵀ_j (kind 10) between K and the turn
STEP_SEGMENTS_FP8 = (("wait K", 8, 9), ("wait Vt", 9, 10), ("turn", 10, 11), ("S wait", 11, 12),
                     ("softmax", 12, 13), ("P.V wait + P", 13, 14), ("step", 8, 14))
STEP_SEGMENTS_16 = (("wait K", 8, 9), ("turn", 9, 11), ("S wait", 11, 12), ("softmax", 12, 13),
                    ("P.V wait + P", 13, 14), ("step", 8, 14))
TILE_SEGMENTS = (("first S+softmax", 0, 1), ("loop", 1, 2), ("last P.V", 2, 3), ("epilogue", 3, 4))
PRODUCER_SEGMENTS = (("wait V", 8, 9), ("wait Vt buffer", 9, 10), ("transpose", 10, 11), ("step", 8, 11))


def _diff(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a - b of 32-bit counters (they wrap), as signed int64; NaN where either is missing."""
    d = ((a.astype(np.int64) - b.astype(np.int64) + 2**31) % 2**32) - 2**31
    return np.where((a == MISSING) | (b == MISSING), np.nan, d.astype(np.float64))


def _med(x: np.ndarray) -> float:
    x = x[np.isfinite(x)]
    return float(np.median(x)) if x.size else float("nan")


def _launch(case: str, kernel: str):
    """(launch(trace=None) → out, the number of programs it launches, its PrefillConfig)."""
    heads, spec = case.split("-")
    hq, hkv = (int(h) for h in heads[1:].split("x"))
    fp8 = kernel.startswith("fp8")
    x = _make_inputs(Scenario(spec, hq, hkv, fp8), 0)  # fp8: fp8 KV and q; bf16: bf16 KV
    kv = x["kv"]
    q, q_scale = (x["q8"], x["q_scale"]) if fp8 else (x["q"], None)
    out = torch.full(x["q"].shape, float("nan"), dtype=torch.bfloat16, device=q.device)
    config, why = _choose_kernel(q, kv.k_cache, kv.v_cache, x["max_q"], x["scale"], out, None)
    if kernel == "fp8-ws":
        config = _without_prefetch(config)
    if kernel.endswith("-narrow"):
        config = dataclasses.replace(config, gluon_wide_store=False)
    if why is not None or not config.gluon_ws:
        raise SystemExit(f"{case} {kernel}: the default is not a warp-specialized Gluon kernel ({why or config})")
    tiles_per_head, block_b = tile_bounds(q.shape[0], kv.block_table.shape[0], config.block_m, hq // hkv)
    programs = gluon_programs(config, tiles_per_head * hkv, q.device)

    def run(trace=None):
        _launch_gluon(q, kv.k_cache, kv.v_cache, kv.block_table, kv.seq_lens, x["cu"], out, x["scale"],
                      tiles_per_head, block_b, config, q_scale, kv.k_scale, kv.v_scale, trace=trace)
        return out

    return run, programs, config


def _time(fn, flush: torch.Tensor) -> float:
    """Median µs of one launch after an L2 flush (CUDA events)."""
    return eager_time_us(fn, replays=7, warmup=0, before=lambda: flush.add_(1))


def analyse(tr: np.ndarray, persistent: bool, fp8: bool) -> dict:
    """The summary of one traced launch, tr [programs, 3, KINDS, STEPS] int32."""
    res: dict = {}
    # the SMs' timeline, global timer ns: a tile's start / end over both consumers
    start = tr[:, 0:2, 6, :]
    end = tr[:, 0:2, 7, :]
    smid = tr[:, 0, 5, 0]
    seen = start[start != MISSING]
    ref = np.full_like(seen, seen[0])
    t0 = seen[int(np.argmin(_diff(seen, ref)))]  # the earliest tile start (the timer wraps: compare differences)
    base = np.full_like(start[:, 0, :], t0)
    s_ns = np.fmin(_diff(start[:, 0, :], base), _diff(start[:, 1, :], base))
    e_ns = np.fmax(_diff(end[:, 0, :], base), _diff(end[:, 1, :], base))
    valid_sm = smid != MISSING
    # per SM (consumer 0): its first start and last end, tiles, steps and each step and tile segment summed
    segs = STEP_SEGMENTS_FP8 if fp8 else STEP_SEGMENTS_16
    per_sm: dict[int, dict] = {}
    for p in np.nonzero(valid_sm)[0]:
        d = per_sm.setdefault(int(smid[p]), {"end_us": -np.inf, "tiles": 0, "steps": 0, "first_us": np.inf,
                                             **{name: 0.0 for name, _, _ in segs},
                                             **{name: 0.0 for name, _, _ in TILE_SEGMENTS}})
        d["end_us"] = max(d["end_us"], float(np.nanmax(e_ns[p])) / 1e3)
        d["first_us"] = min(d["first_us"], float(np.nanmin(s_ns[p])) / 1e3)
        d["tiles"] += int(np.isfinite(s_ns[p]).sum())
        d["steps"] += int((tr[p, 0, 8, :] != MISSING).sum())
        for name, a, b in (*segs, *TILE_SEGMENTS):
            d[name] += float(np.nansum(_diff(tr[p, 0, b, :], tr[p, 0, a, :])))
    firsts = np.array([d["first_us"] for d in per_sm.values()])
    lasts = np.array([d["end_us"] for d in per_sm.values()])
    res["sms"] = len(per_sm)
    res["span_us"] = float(np.nanmax(lasts))
    res["sm_first_start_us"] = {"median": float(np.median(firsts)), "max": float(np.max(firsts))}
    res["sm_last_end_us"] = {"min": float(np.min(lasts)), "median": float(np.median(lasts)),
                             "max": float(np.max(lasts))}
    tiles = [d["tiles"] for d in per_sm.values()]
    res["tiles_per_sm"] = {"min": min(tiles), "max": max(tiles)}
    order = sorted(per_sm, key=lambda sm: per_sm[sm]["end_us"])
    pick = [order[len(order) // 2]] + order[-3:]  # the median SM and the three latest
    res["sm_rows"] = [{"sm": sm, "role": "median" if k == 0 else f"late {4 - k}", **per_sm[sm]}
                      for k, sm in enumerate(pick)]
    if not persistent:  # programs back to back on one SM: the gap between one's end and the next's start
        gaps = []
        by_sm: dict[int, list[tuple[float, float]]] = {}
        for p in np.nonzero(valid_sm)[0]:
            by_sm.setdefault(int(smid[p]), []).append((float(np.nanmin(s_ns[p])), float(np.nanmax(e_ns[p]))))
        for lst in by_sm.values():
            lst.sort()
            gaps += [b[0] - a[1] for a, b in zip(lst, lst[1:])]
        res["cta_gap_us"] = {"median": _med(np.array(gaps)) / 1e3, "n": len(gaps)} if gaps else None
    # the clock rate: cycles over ns across a tile (consumer 0)
    cyc = _diff(tr[:, 0, 4, :], tr[:, 0, 0, :])
    ns = _diff(tr[:, 0, 7, :], tr[:, 0, 6, :])
    good = np.isfinite(cyc) & np.isfinite(ns) & (ns >= 1000)
    res["mhz"] = float(np.median(cyc[good] / ns[good]) * 1e3) if good.any() else float("nan")
    mhz = res["mhz"] if np.isfinite(res["mhz"]) else 1980.0
    # tile phases, cycles (both consumers)
    phases = {}
    for name, a, b in TILE_SEGMENTS:
        d = _diff(tr[:, 0:2, b, :], tr[:, 0:2, a, :])
        phases[name] = {"median": _med(d), "first_tile": _med(d[:, :, 0]), "later_tiles": _med(d[:, :, 1:])}
    whole = _diff(tr[:, 0:2, 4, :], tr[:, 0:2, 0, :])
    phases["whole tile"] = {"median": _med(whole), "first_tile": _med(whole[:, :, 0]),
                            "later_tiles": _med(whole[:, :, 1:])}
    if persistent:  # the end of tile i's stores to the start of tile i+1
        gap = _diff(tr[:, 0:2, 0, 1:], tr[:, 0:2, 4, :-1])
        phases["gap to next tile"] = {"median": _med(gap), "first_tile": _med(gap[:, :, 0]),
                                      "later_tiles": _med(gap[:, :, 1:])}
    res["tile_cycles"] = phases
    steps = {}
    for role in (0, 1):
        for name, a, b in segs:
            d = _diff(tr[:, role, b, :], tr[:, role, a, :])
            steps.setdefault(name, {})[f"c{role}"] = _med(d)
    res["step_cycles"] = steps
    if fp8:
        prod = {}
        for name, a, b in PRODUCER_SEGMENTS:
            prod[name] = _med(_diff(tr[:, 2, b, :], tr[:, 2, a, :]))
        if persistent:
            prod["first loads + first Vt + publish"] = _med(_diff(tr[:, 2, 1, :], tr[:, 2, 0, :]))
        res["producer_cycles"] = prod
    res["us_per_kcycle"] = 1e3 / mhz
    return res


def _table(name: str, r: dict) -> list[str]:
    k = r["us_per_kcycle"] / 1e3
    lines = [f"### {name}", "",
             f"{r['us']:.1f} µs untraced, {r['us_traced']:.1f} traced (one launch after an L2 flush); "
             f"{r['sms']} SMs, {r['tiles_per_sm']['min']}-{r['tiles_per_sm']['max']} tiles an SM, "
             f"clock {r['mhz']:.0f} MHz (cycles over the global timer).", "",
             f"SM timeline (global timer, from the first tile's start): first tile starts median "
             f"{r['sm_first_start_us']['median']:.2f} µs, last {r['sm_first_start_us']['max']:.2f}; SMs end "
             f"min {r['sm_last_end_us']['min']:.1f} / median {r['sm_last_end_us']['median']:.1f} / max "
             f"{r['sm_last_end_us']['max']:.1f} µs." + (
                 f" Back-to-back programs on one SM: {r['cta_gap_us']['median']:.2f} µs between one's end and the "
                 f"next's start (median of {r['cta_gap_us']['n']})." if r.get("cta_gap_us") else ""), "",
             "| q tile phase (cycles) | median | first tile | later tiles | median µs |", "|---|---:|---:|---:|---:|"]
    for ph, v in r["tile_cycles"].items():
        lines.append(f"| {ph} | {v['median']:.0f} | {v['first_tile']:.0f} | {v['later_tiles']:.0f} | "
                     f"{v['median'] * k:.2f} |")
    lines += ["", "| step segment (cycles, median) | consumer 0 | consumer 1 |", "|---|---:|---:|"]
    for seg, v in r["step_cycles"].items():
        lines.append(f"| {seg} | {v['c0']:.0f} | {v['c1']:.0f} |")
    if "producer_cycles" in r:
        lines += ["", "| producer (cycles, median) | |", "|---|---:|"]
        lines += [f"| {seg} | {v:.0f} |" for seg, v in r["producer_cycles"].items()]
    if r.get("sm_rows"):
        keys = [k for k in r["sm_rows"][0] if k not in ("sm", "role", "end_us", "first_us", "tiles", "steps")]
        lines += ["", "The median SM and the three that end last (consumer 0; cycles summed over the SM's steps or "
                  "tiles):", "",
                  "| SM | | starts µs | ends µs | tiles | steps | " + " | ".join(keys) + " |",
                  "|---|---|---:|---:|---:|---:|" + "---:|" * len(keys)]
        for row in r["sm_rows"]:
            lines.append(f"| {row['sm']} | {row['role']} | {row['first_us']:.2f} | {row['end_us']:.1f} | "
                         f"{row['tiles']} | {row['steps']} | " + " | ".join(f"{row[k]:.0f}" for k in keys) + " |")
    return lines + [""]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--cases", default="h8x1-q4k,h64x8-q4k", help="comma list of h<Hq>x<Hkv>-<bench spec>")
    ap.add_argument("--kernels", default=",".join(KERNELS), help="comma list of: " + ", ".join(KERNELS))
    ap.add_argument("--label", default="", help="names the output files")
    ap.add_argument("--raw", action="store_true", help="also save the raw stamps (.npz, compressed)")
    args = ap.parse_args()
    kernels = args.kernels.split(",")
    if set(kernels) - set(KERNELS):
        ap.error(f"--kernels: unknown {sorted(set(kernels) - set(KERNELS))}")
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    results, raw = {}, {}
    stem = "probe_prefill_trace" + (f"_{args.label}" if args.label else "")
    args.out.mkdir(parents=True, exist_ok=True)
    lines = [f"# Prefill kernel trace ({torch.cuda.get_device_name()})", "",
             "`python3 scripts/probe_prefill_trace.py` (`_stamp`: SM clock cycles where the partitions pass their "
             "waits; medians over tiles / steps / programs)", ""]
    for case in args.cases.split(","):
        for kernel in kernels:
            run, programs, config = _launch(case, kernel)
            run()
            torch.cuda.synchronize()
            us = _time(run, flush)
            trace = torch.full((programs, 3, KINDS, STEPS), MISSING, dtype=torch.int32, device="cuda")
            run(trace)  # compile the traced kernel
            trace.fill_(MISSING)
            flush.add_(1)
            out = run(trace)
            torch.cuda.synchronize()
            if not torch.isfinite(out).all():
                raise RuntimeError(f"{case} {kernel}: non-finite output under the trace")
            tr = trace.cpu().numpy()
            us_traced = _time(lambda run=run, trace=trace: run(trace), flush)
            r = analyse(tr, bool(config.gluon_prefetch), kernel.startswith("fp8"))
            r.update(us=us, us_traced=us_traced, programs=programs)
            name = f"{case} {kernel}"
            results[name] = r
            if args.raw:
                raw[name.replace(" ", "_")] = tr
            print(f"{name}: {us:.1f} µs ({us_traced:.1f} traced)", flush=True)
            lines += _table(name, r)
            (args.out / f"{stem}.md").write_text("\n".join(lines) + "\n")
            (args.out / f"{stem}.json").write_text(json.dumps(results, indent=1))
    if raw:
        np.savez_compressed(args.out / f"{stem}_raw.npz", **raw)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
