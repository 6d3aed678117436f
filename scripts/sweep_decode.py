"""H200 sweep of the decode launch knobs (DecodeConfig fields × plan programs-per-SM × min tiles).

Every variant is timed on the same inputs in one process (CUDA-graph replay of 8 layers, L2-cold).
Prints the best variant per scenario against the default and writes decode_sweep.{json,md} under
--out. `--dry-run` lists the variants without a GPU.

    python scripts/sweep_decode.py --out bench/results
    python scripts/sweep_decode.py --smoke --out /tmp/s     # smallest complete run
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

import hpcops
from hpcops.attention import decode as dec
from hpcops.attention.plan import DEFAULT_MIN_TILES, DEFAULT_PROGRAMS_PER_SM
from hpcops.bench import timing
from hpcops.bench.suites.decode import PAGE, Scenario, make_decode_inputs

SCENARIOS = [Scenario(s, 8, 1, True) for s in
             ("64x0.5K", "64x4K", "32x0.125K+32x4K", "2x32K+30x4K", "1x64K+15x4K", "1x128K+31x4K")]
SCENARIOS += [Scenario("64x4K", 8, 1, False), Scenario("64x4K", 64, 8, False),
              Scenario("32x0.125K+32x4K", 64, 8, True), Scenario("1x128K+31x4K", 64, 8, True)]

DEFAULT = dict(num_stages=3, num_warps=None, use_tma=False, pdl=False, min_rows=16, pps=DEFAULT_PROGRAMS_PER_SM,
               min_tiles=DEFAULT_MIN_TILES)


def variants() -> list[dict]:
    out = [dict(DEFAULT)]
    for tma in (False, True):
        for pps in (1, 2, 3, 4):
            for mt in (2, 4, 8):
                out.append(dict(DEFAULT, use_tma=tma, pps=pps, min_tiles=mt))
        for stages in (2, 4):
            out.append(dict(DEFAULT, use_tma=tma, num_stages=stages))
        out.append(dict(DEFAULT, use_tma=tma, num_warps=8))
        out.append(dict(DEFAULT, use_tma=tma, pdl=True))
    # One or two warps per program keep each score row inside a warp: the 4-warp tile splits the 64
    # keys across warps and its softmax reductions cost ~9 block barriers per tile (sm_90 SASS).
    # Fewer warps need more programs per SM (shared memory: ~70 KB/program bf16 at 3 stages).
    for warps in (1, 2):
        for pps in (3, 4, 6):
            for stages in (2, 3):
                out.append(dict(DEFAULT, num_warps=warps, pps=pps, num_stages=stages, pdl=True))
    # or 4 warps over a 64-row tile (rows padded): warps split rows, reductions stay in a warp
    for pps in (2, 3):
        out.append(dict(DEFAULT, min_rows=64, pps=pps, pdl=True))
    unique = []
    for v in out:
        if v not in unique:
            unique.append(v)
    return unique


def time_variant(inputs, v: dict) -> float:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    old = dec.set_decode_config(num_stages=v["num_stages"], num_warps=v["num_warps"], use_tma=v["use_tma"],
                                pdl=v["pdl"], min_rows=v["min_rows"])
    try:
        fns = []
        for x in inputs:
            plan = hpcops.plan_decode(x["seq_lens"], num_kv_heads=x["k_cache"].shape[2], block_size=PAGE,
                                      num_programs=v["pps"] * sms, min_tiles=v["min_tiles"])
            fns.append(lambda x=x, plan=plan: hpcops.decode_attention(
                x["q"], x["k_cache"], x["v_cache"], x["block_table"], x["seq_lens"], plan=plan,
                k_scale=x["k_scale"], v_scale=x["v_scale"], out=x["out"]))
        return timing.graph_time_us(fns)
    finally:
        dec.set_decode_config(**old.__dict__)


def _key(v: dict) -> str:
    return (f"stages={v['num_stages']} warps={v['num_warps'] or 'auto'} tma={int(v['use_tma'])} pdl={int(v['pdl'])} "
            f"rows={v['min_rows']} "
            f"pps={v['pps']} min_tiles={v['min_tiles']}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--quick", action="store_true", help="3 scenarios x {default, tma, pdl, tma+pdl}")
    ap.add_argument("--smoke", action="store_true", help="smallest complete run: 64x4K h8/1 fp8, default and pdl, "
                                                         "2 layers")
    args = ap.parse_args()
    vs = variants()
    scenarios = SCENARIOS
    if args.quick:
        vs = [dict(DEFAULT, use_tma=tma, pdl=pdl) for tma in (False, True) for pdl in (False, True)]
        vs += [dict(DEFAULT, num_warps=w, pps=p, num_stages=2, pdl=True) for w in (1, 2) for p in (4, 6)]
        vs += [dict(DEFAULT, min_rows=64, pdl=True)]
        scenarios = [SCENARIOS[1], SCENARIOS[5], SCENARIOS[7]]
    if args.smoke:
        vs, scenarios, args.layers = [DEFAULT, dict(DEFAULT, pdl=True)], [SCENARIOS[1]], 2
    if args.dry_run:
        print("\n".join(_key(v) for v in vs))
        print(f"{len(vs)} variants x {len(scenarios)} scenarios")
        return 0
    results = []
    for sc in scenarios:
        inputs = [make_decode_inputs(sc.lens, sc.hq, sc.hkv, sc.fp8, seed=i) for i in range(args.layers)]
        times = {}
        for v in vs:
            try:
                us = time_variant(inputs, v)
            except Exception as exc:  # noqa: BLE001 - report and keep sweeping
                print(f"{sc.name} {_key(v)}: {type(exc).__name__}: {str(exc)[:200]}", file=sys.stderr)
                continue
            times[_key(v)] = us
            results.append(dict(case=sc.name, **v, us=us, gbps=sc.bytes / us / 1e3))
        if not times:
            print(f"{sc.name:28s} no variant ran", flush=True)
            continue
        best = min(times, key=times.get)
        print(f"{sc.name:28s} default {times.get(_key(DEFAULT), float('nan')):7.1f} us | best {times[best]:7.1f} us "
              f"({best})", flush=True)
        del inputs
        torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode_sweep.json").write_text(json.dumps(results, indent=1))
    lines = ["| case | stages | warps | tma | pdl | programs/SM | min tiles | µs | GB/s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['case']} | {r['num_stages']} | {r['num_warps'] or 'auto'} | {int(r['use_tma'])} | "
              f"{int(r['pdl'])} | {r['pps']} | {r['min_tiles']} | {r['us']:.1f} | {r['gbps']:.0f} |" for r in results]
    (out / "decode_sweep.md").write_text("# decode sweep (H200)\n\n" + "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
