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


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--layers", type=int, default=8)
    args = ap.parse_args()
    results = []
    for sc in SCENARIOS:
        inputs = [make_decode_inputs(sc.lens, sc.hq, sc.hkv, sc.fp8, seed=i) for i in range(args.layers)]
        rows = {}
        for stages in (2, 3, 4):
            dec.set_decode_config(num_stages=stages)
            for pps in (1, 2, 3, 4):
                for mt in (2, 4, 8, 16):
                    if stages != 3 and (pps, mt) not in ((1, 4), (2, 4), (2, 8)):
                        continue
                    try:
                        us = time_variant(inputs, pps, mt)
                    except Exception as exc:  # noqa: BLE001
                        print(f"{sc.name} stages={stages} pps={pps} mt={mt}: {exc}", file=sys.stderr)
                        continue
                    rows[(stages, pps, mt)] = us
                    results.append(dict(case=sc.name, stages=stages, pps=pps, min_tiles=mt, us=us,
                                        gbps=sc.bytes / us / 1e3))
        dec.set_decode_config(num_stages=3)
        best = min(rows, key=rows.get)
        print(f"{sc.name:32s} best stages={best[0]} pps={best[1]} min_tiles={best[2]}: {rows[best]:.1f} us; "
              + " ".join(f"{k[1]}/{k[2]}:{v:.1f}" for k, v in rows.items() if k[0] == 3))
        del inputs
        torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode_sweep.json").write_text(json.dumps(results, indent=1))
    lines = ["| case | stages | programs/SM | min tiles | µs | GB/s |", "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['case']} | {r['stages']} | {r['pps']} | {r['min_tiles']} | {r['us']:.1f} | {r['gbps']:.0f} |"
              for r in results]
    (out / "decode_sweep.md").write_text("# decode sweep (H200)\n\n" + "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
