"""The `hpcops` command: `demo`, `plan`, `bench`."""

from __future__ import annotations

import argparse
import sys


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hpcops", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    d = sub.add_parser("demo", help="show the load-balanced decode schedule on the blog's scenarios; "
                                    "check kernels (interpreted on the CPU); time them on a GPU")
    d.add_argument("--no-check", action="store_true", help="skip the small correctness run")
    d.add_argument("--png", default=None, help="also draw the per-program load into this PNG")

    pl = sub.add_parser("plan", help="print the decode plan for given sequence lengths")
    pl.add_argument("lengths", help="comma-separated KV lengths or scenario grammar, e.g. 1x128K+31x4K")
    pl.add_argument("--num-kv-heads", type=int, default=1)
    pl.add_argument("--q-len", type=int, default=1)
    pl.add_argument("--block-size", type=int, default=64)
    pl.add_argument("--num-programs", type=int, default=None, help="persistent programs (default: 4 x SMs)")
    pl.add_argument("--min-tiles", type=int, default=None, help="minimum 64-token tiles per program")

    b = sub.add_parser("bench", help="benchmark a suite on the GPU against peers (JSON + markdown + PNG)")
    b.add_argument("suites", nargs="+", help="decode, moe, rope, prefill (or 'all')")
    b.add_argument("--only", default=None, help="run only cases whose name contains this text")
    b.add_argument("--out", default="bench/results", help="output folder (default: bench/results)")
    b.add_argument("--layers", type=int, default=None, help="layers per CUDA graph (default: L2-cold count)")
    b.add_argument("--no-check", action="store_true", help="skip the correctness gate (not recommended)")
    b.add_argument("--quick", action="store_true", help="a reduced case list (smoke test)")
    b.add_argument("--no-progress", action="store_true")
    return p


def _bench(args) -> int:
    from hpcops.bench import SUITES, report, run_suite
    from hpcops.bench.runner import machine_info

    names = sorted(SUITES) if args.suites == ["all"] else args.suites
    for n in names:
        if n not in SUITES:
            print(f"unknown suite {n!r}; choose from {sorted(SUITES)} or 'all'", file=sys.stderr)
            return 2
    opts = {"quick": args.quick}
    if args.layers:
        opts["layers"] = args.layers
    machine = machine_info()
    status = 0
    for n in names:
        result = run_suite(n, opts, check=not args.no_check, only=args.only, progress=not args.no_progress,
                           machine=machine, on_case=lambda partial: report.write(partial, args.out))
        paths = report.write(result, args.out)
        print(report.markdown(result))
        print("wrote " + ", ".join(str(p) for p in paths))
        if any(r.status == "check-failed" for r in result.rows):
            status = 1
    return status


def _use_interpreter_without_gpu() -> None:
    """Without a GPU, kernels run through Triton's interpreter; it must be chosen before triton loads."""
    import os

    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.cmd in ("demo", "plan"):
        _use_interpreter_without_gpu()
    if args.cmd == "demo":
        from hpcops.demo import run_demo

        return run_demo(check=not args.no_check, png=args.png)
    if args.cmd == "plan":
        from hpcops.demo import print_plan

        return print_plan(args)
    if args.cmd == "bench":
        return _bench(args)
    return 2  # pragma: no cover


if __name__ == "__main__":
    raise SystemExit(main())
