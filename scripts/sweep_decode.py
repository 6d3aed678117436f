"""H200 sweep of the decode launch knobs: programs per SM × min tiles per program × pipeline depth.

Every variant is timed on the same inputs in one process (CUDA-graph replay of 8 layers, L2-cold);
prints a table per scenario and writes decode_sweep.{json,md} under --out.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

import hpcops
from hpcops.attention import decode as dec
from hpcops.bench import timing
from hpcops.bench.suites.decode import PAGE, Scenario, make_decode_inputs

SCENARIOS = [Scenario(s, 8, 1, True) for s in
             ("64x0.5K", "64x4K", "32x0.125K+32x4K", "2x32K+30x4K", "1x64K+15x4K", "1x128K+31x4K")]
SCENARIOS += [Scenario("64x4K", 64, 8, False), Scenario("1x128K+31x4K", 64, 8, True),
              Scenario("64x0.5K", 8, 1, False)]


def time_variant(inputs, pps: int, min_tiles: int) -> float:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    fns = []
    for x in inputs:
        plan = hpcops.plan_decode(x["seq_lens"], num_kv_heads=x["k_cache"].shape[2], block_size=PAGE,
                                  num_programs=pps * sms, min_tiles=min_tiles)
        fns.append(lambda x=x, plan=plan: hpcops.decode_attention(
            x["q"], x["k_cache"], x["v_cache"], x["block_table"], x["seq_lens"], plan=plan,
            k_scale=x["k_scale"], v_scale=x["v_scale"], out=x["out"]))
    return timing.graph_time_us(fns)


def _variant(inputs, stages, warps, bn, pps, mt):
    dec.set_decode_config(num_stages=stages, num_warps=warps, block_n=bn)
    try:
        return time_variant(inputs, pps, mt)
    finally:
        dec.set_decode_config(num_stages=3, num_warps=None, block_n=64)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--layers", type=int, default=8)
    args = ap.parse_args()
    results = []
    for sc in SCENARIOS:
        inputs = [make_decode_inputs(sc.lens, sc.hq, sc.hkv, sc.fp8, seed=i) for i in range(args.layers)]
        rows = {}

        def run(key, sc=sc, inputs=inputs, rows=rows):
            if key in rows:
                return
            try:
                rows[key] = us = _variant(inputs, *key)
            except Exception as exc:  # noqa: BLE001 - report and keep sweeping
                print(f"{sc.name} {key}: {type(exc).__name__}: {str(exc)[:200]}", file=sys.stderr)
                return
            stages, warps, bn, pps, mt = key
            results.append(dict(case=sc.name, stages=stages, warps=warps, block_n=bn, pps=pps, min_tiles=mt,
                                us=us, gbps=sc.bytes / us / 1e3))

        for bn in (64, 128):
            for pps in (1, 2, 3, 4):
                for mt in (2, 4, 8, 16):
                    run((3, 4, bn, pps, mt))
        best = min(rows, key=rows.get)
        for stages in (2, 4):
            run((stages, 4) + best[2:])
        for warps in (8,):
            run((best[0], warps) + best[2:])
        best = min(rows, key=rows.get)
        print(f"{sc.name:30s} best (stages, warps, block_n, programs/SM, min_tiles) = {best}: {rows[best]:.1f} us"
              f" | default (3,4,64,2,4): {rows.get((3, 4, 64, 2, 4), float('nan')):.1f} us", flush=True)
        del inputs
        torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode_sweep.json").write_text(json.dumps(results, indent=1))
    lines = ["| case | stages | warps | block_n | programs/SM | min tiles | µs | GB/s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['case']} | {r['stages']} | {r['warps']} | {r['block_n']} | {r['pps']} | {r['min_tiles']} | "
              f"{r['us']:.1f} | {r['gbps']:.0f} |" for r in results]
    (out / "decode_sweep.md").write_text("# decode sweep (H200)\n\n" + "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
