"""Probe (issue 9, EP8 fp8 128-block B4): does the gate-up GEMM's time follow its K steps or its bytes?

Per-kernel device µs (torch.profiler, `profile_moe.per_kernel_us`, L2-cold layers, pdl 0) of `fused_moe` on the
moe suite's EP8 shape at B = 4 with the hidden size H cut to 4096 / 2048 / 1024 (the same routing, experts and
I): a program's K loop then takes 32 / 16 / 8 steps of 128 while the N tiling stays. If the gate-up time halves
with H, a program is bound by its step latency and splitting K over more programs pays; if it stays, by bytes.
A GPU tool:

    python3 scripts/probe_moe_ksteps.py [--kinds fp8_block,fp8_tensor] [--configs "block_n=64,num_warps=4"]
"""

from __future__ import annotations

import argparse

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kinds", default="fp8_block,fp8_tensor")
    ap.add_argument("--hidden", default="4096,2048,1024")
    ap.add_argument("--configs", default="", help='MoeConfig overrides beside the default, ";"-separated')
    ap.add_argument("--t", type=int, default=4)
    ap.add_argument("--layers", type=int, default=8)
    args = ap.parse_args()
    from profile_moe import per_kernel_us

    from hpcops.bench.suites import _moe_common as common
    from hpcops.bench.suites import moe as suite

    variants = [{}, *common.config_overrides(args.configs)]
    print("| kind | H | config | gate-up µs | down µs | total µs |")
    print("|---|---:|---|---:|---:|---:|")
    for kind in args.kinds.split(","):
        for h in map(int, args.hidden.split(",")):
            suite.HIDDEN = h  # Hy3Rank reads the module's constants when asked
            s = suite.Scenario("ep8", args.t, kind)
            layers = [common.make_inputs(s, i) for i in range(args.layers)]
            for kw in variants:
                fns = [common.ours(s, {"pdl": 0, **kw})(x) for x in layers]
                try:
                    times = per_kernel_us(fns)
                except Exception as exc:  # out of shared memory, say: the rest still run
                    print(f"| {kind} | {h} | {common.override_label(kw)} | failed: {type(exc).__name__} | | |")
                    continue
                gu = sum(us for name, (_, us) in times.items() if "gate_up" in name)
                dn = sum(us for name, (_, us) in times.items() if "moe_down" in name)
                total = sum(us for _, us in times.values())
                print(f"| {kind} | {h} | {common.override_label(kw) if kw else 'default'} | {gu:.1f} | {dn:.1f} "
                      f"| {total:.1f} |", flush=True)
            del layers
            torch.cuda.empty_cache()
    suite.HIDDEN = 4096
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
