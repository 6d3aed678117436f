"""Where a fused MoE call spends its device time: per-kernel µs of `fused_moe` (and of vLLM's two Triton
GEMMs where `.peers/` has them) on the `moe` bench suite's Hy3 scenarios, L2-cold (each layer its own
weights), from torch.profiler. A GPU tool: run through gpu_check.sh's `profile:moe` stage, or

    python3 scripts/profile_moe.py --only B4-tp8-fp8t,B64-tp8-fp8t [--configs "block_n=64;down_block_n=128"]

Each config (the suite's own, then every `--configs` item, as `HPCOPS_MOE_CONFIGS` spells them) prints one
table: kernel name, launches per call, µs per call, and the share of the call. Every config runs with
`pdl=0` unless it names `pdl`: under programmatic dependent launch a kernel starts early and waits, and its
duration then holds that wait (the bench's `hpcops-kernels` rows count the kernels' covered time instead).
"""

from __future__ import annotations

import argparse
import collections

import torch


def per_kernel_us(fns, calls: int = 5) -> dict[str, tuple[float, float]]:
    """{kernel name: (launches per call, device µs per call)} over `calls` rounds of every fn (one per layer)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    for fn in fns:  # compile and warm up outside the profile
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            for fn in fns:
                fn()
        torch.cuda.synchronize()
    total: dict[str, float] = collections.defaultdict(float)
    count: dict[str, int] = collections.defaultdict(int)
    for ev in prof.events():
        if ev.device_type == DeviceType.CUDA:
            total[ev.name] += ev.device_time
            count[ev.name] += 1
    n = calls * len(fns)
    return {k: (count[k] / n, total[k] / n) for k in sorted(total, key=total.get, reverse=True)}


def print_kernel_table(title: str, times: dict[str, tuple[float, float]]) -> None:
    """`per_kernel_us`'s result as a table: the call's total, then µs, share and launches per kernel."""
    call = sum(us for _, us in times.values())
    print(f"\n{title}: {call:.1f} µs of device time per call")
    for name, (launches, us) in times.items():
        print(f"  {us:8.1f} µs {100 * us / call:5.1f}%  x{launches:g}  {name[:100]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="B4-tp8-fp8t,B16-tp8-fp8t,B64-tp8-fp8t,B512-tp8-fp8t,B2048-tp8-fp8t,"
                                       "B4-ep8-fp8t,B512-ep8-fp8t")
    ap.add_argument("--configs", default="", help='extra MoeConfig overrides, e.g. "block_n=64;num_stages=3"')
    ap.add_argument("--layers", type=int, default=8)
    args = ap.parse_args()
    from hpcops.bench.suites import _moe_common as common
    from hpcops.bench.suites import moe as suite

    variants = [None, *common.config_overrides(args.configs)]
    wanted = args.only.split(",")
    known = [s.name for s in suite.scenarios()]
    unknown = [w for w in wanted if w not in known]
    if unknown:  # a name that matches nothing would profile nothing and still exit 0
        raise SystemExit(f"--only: unknown scenario(s) {', '.join(map(repr, unknown))}; known: {', '.join(known)}")
    for s in [s for s in suite.scenarios() if s.name in wanted]:
        layers = [common.make_inputs(s, i) for i in range(args.layers)]
        rows = [(common.override_label(kw) if kw else "hpcops", [common.ours(s, {"pdl": 0, **(kw or {})})(x)
                                                                 for x in layers]) for kw in variants]
        try:
            rows.append(("vllm-triton", [common.vllm(s)(x) for x in layers]))
        except Exception as exc:  # no .peers here: ours only
            print(f"{s.name}: vllm-triton unavailable ({type(exc).__name__}: {str(exc)[:100]})")
        for label, fns in rows:
            try:
                times = per_kernel_us(fns)
            except Exception as exc:  # a config that cannot run here (e.g. out of shared memory): the rest still run
                print(f"\n{s.name} {label}: failed ({type(exc).__name__}: {str(exc)[:200]})")
                continue
            print_kernel_table(f"{s.name} {label}", times)
        del layers
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
