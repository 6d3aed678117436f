"""The `hpcops` command: `demo`, `plan`, `bench`, `tune`."""

from __future__ import annotations

import argparse
import os
import sys

from hpcops._platform import DEFAULT_NUM_SMS
from hpcops.attention.plan import (
    DEFAULT_MIN_TILES,
    DEFAULT_PROGRAMS_PER_SM,
    DEFAULT_SNAP,
    DEFAULT_TASK_COST,
    MAX_Q_LEN,
    MAX_SPLIT_COST,
    MAX_TASK_COST,
    TILE,
)
from hpcops.bench.scenarios import MAX_KV_LEN, MAX_REQUESTS, parse_lengths

# Ranges `hpcops plan` accepts. Page sizes: what plan_decode and decode_attention accept (a power of
# two ≤ 256). The other caps are sanity limits; those on programs, the tile floor and the total tiles
# (checked after parsing) keep the plan's int32 stream positions (program × bucket) below 2^31.
BLOCK_SIZES = tuple(1 << i for i in range(9))
MAX_KV_HEADS = 128
MAX_PROGRAMS = 1 << 16
MAX_MIN_TILES = 1 << 14
MAX_TOTAL_TILES = 1 << 30
# `hpcops bench SUITE --grid` runs the suite's generality grid, a suite of its own
GRID_SUITES = {"decode": "decode-grid"}


def _int_in(lo: int, hi: int):
    """An argparse `type` accepting an int in lo..hi (the option is named by argparse's message)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer in {lo}..{hi}, got {text!r}") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"must be in {lo}..{hi}, got {value}")
        return value

    return parse


def _lengths(text: str) -> list[int]:
    try:
        return parse_lengths(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _png_path(text: str) -> str:
    """Fail before the demo's work, not after it, when the picture cannot be written."""
    import importlib.util

    parent = os.path.dirname(os.path.abspath(text))
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a folder; give a file name such as {text.rstrip('/')}/demo.png")
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: folder {parent!r} does not exist")
    if not os.access(parent, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: folder {parent!r} is not writable")
    if importlib.util.find_spec("matplotlib") is None:
        raise argparse.ArgumentTypeError("needs matplotlib (pip install 'hpcops[bench]')")
    return text


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hpcops", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    d = sub.add_parser("demo", help="show the load-balanced decode schedule on the blog's scenarios; "
                                    "check kernels (interpreted on the CPU); time them on a GPU")
    d.add_argument("--no-check", action="store_true", help="skip the small correctness run")
    d.add_argument("--png", default=None, type=_png_path,
                   help="also draw the per-program load into this PNG (needs matplotlib)")

    pl = sub.add_parser(
        "plan", help="print the decode plan for given sequence lengths",
        description=f"Print the decode plan's tasks for a batch. At most {MAX_REQUESTS} requests of at most "
                    f"{MAX_KV_LEN} ({MAX_KV_LEN // 1024}K) tokens each, and at most {MAX_TOTAL_TILES} tiles "
                    f"in all (num_kv_heads × Σ ceil(length / {TILE}); the plan's tables are int32).")
    pl.set_defaults(parser=pl)
    pl.add_argument("lengths", type=_lengths,
                    help="comma-separated KV lengths (e.g. 100,2000) or the scenario grammar COUNTxLENGTH "
                         f"joined by '+', K = 1024 tokens (e.g. 1x128K+31x4K); at most {MAX_REQUESTS} "
                         f"requests, each at most {MAX_KV_LEN // 1024}K tokens")
    pl.add_argument("--num-kv-heads", type=_int_in(1, MAX_KV_HEADS), default=1,
                    help=f"KV heads of the layer, 1..{MAX_KV_HEADS} (default: %(default)s)")
    pl.add_argument("--q-len", type=_int_in(1, MAX_Q_LEN), default=1,
                    help=f"query tokens per request, 1..{MAX_Q_LEN}, > 1 for speculative decode "
                         "(default: %(default)s)")
    pl.add_argument("--block-size", type=int, choices=BLOCK_SIZES, default=64, metavar="{1,2,4,...,256}",
                    help="KV page size in tokens, a power of two ≤ 256 (default: %(default)s)")
    pl.add_argument("--num-programs", type=_int_in(1, MAX_PROGRAMS), default=None,
                    help=f"persistent programs, 1..{MAX_PROGRAMS} (default: {DEFAULT_PROGRAMS_PER_SM} per SM × "
                         f"SMs, {DEFAULT_PROGRAMS_PER_SM * DEFAULT_NUM_SMS} without a GPU, where {DEFAULT_NUM_SMS} "
                         "SMs are assumed; HPCOPS_DECODE_PROGRAMS_PER_SM sets the per-SM count)")
    pl.add_argument("--min-tiles", type=_int_in(1, MAX_MIN_TILES), default=DEFAULT_MIN_TILES,
                    help=f"minimum {TILE}-token tiles per program, 1..{MAX_MIN_TILES} (default: %(default)s)")
    pl.add_argument("--task-cost", type=_int_in(0, MAX_TASK_COST), default=DEFAULT_TASK_COST,
                    help="what the cut charges each (head, request) on top of its tiles, in quarters of a tile, "
                         f"0..{MAX_TASK_COST}; 0 = equal tiles per program (default: %(default)s)")
    pl.add_argument("--snap", type=_int_in(0, MAX_TASK_COST), default=DEFAULT_SNAP,
                    help="a cut that would leave at most this much of a request (quarters of a tile, at most a "
                         f"quarter bucket), 0..{MAX_TASK_COST}, moves to its boundary (default: %(default)s)")
    pl.add_argument("--split-cost", type=_int_in(0, MAX_SPLIT_COST), default=None,
                    help=f"what splitting a request costs, in quarters of a tile, 0..{MAX_SPLIT_COST}: where whole "
                         "requests fit buckets at most this much longer, no request is split; 0 = never (default: "
                         "the plan's kernel's, DecodeConfig.split_cost)")

    b = sub.add_parser("bench", help="benchmark a suite on the GPU against peers (JSON + markdown + PNG)")
    b.add_argument("suites", nargs="+", help="decode, moe, moe-shapes, rope, prefill, layer (or 'all': all of these; "
                                                  "decode-grid, the decode grid, runs by --grid)")
    b.add_argument("--only", default=None,
                   help="run only cases whose name contains this text (several, comma-separated: any of them)")
    b.add_argument("--impls", default=None,
                   help="run only the rows (impls) with these names or shell patterns, comma-separated, e.g. "
                        "'hpcops-fp8q,hpcops-bf16kv*' (the cases' correctness gates still run)")
    b.add_argument("--out", default="bench/results", help="output folder (default: bench/results)")
    b.add_argument("--layers", type=int, default=None, help="layers per CUDA graph (default: L2-cold count)")
    b.add_argument("--no-check", action="store_true", help="skip the correctness gate (not recommended)")
    b.add_argument("--rounds", type=int, default=1,
                   help="time each case's rows in N interleaved rounds (order reversed every other round, 50/N "
                        "replays each) and report the medians: for A/B rows within a few %% (default: 1)")
    b.add_argument("--quick", action="store_true", help="a reduced case list (smoke test)")
    b.add_argument("--grid", action="store_true",
                   help="decode: issue 10's generality grid (GQA, head_dim, page, KV dtype, lengths) against "
                        "FlashInfer, or vLLM's Triton unified attention where FlashInfer cannot run; suite "
                        "decode-grid, reports decode-grid.{md,json,png}; with --quick a 12-case subset")
    b.add_argument("--no-progress", action="store_true")
    b.add_argument("--no-clock", action="store_true",
                   help="do not sample the SM clock (NVML, with the nvidia-ml-py package) while rows are timed; by "
                        "default each row reports its median SM MHz where NVML is there")

    from hpcops.bench.tune.cli import add_parser as add_tune_parser

    add_tune_parser(sub)
    return p


def _bench(args) -> int:
    from hpcops.bench import SUITES, report, run_suite
    from hpcops.bench.registry import suite_finisher
    from hpcops.bench.runner import machine_info

    names = [n for n in sorted(SUITES) if n not in GRID_SUITES.values()] if args.suites == ["all"] else args.suites
    if args.grid:
        if not any(n in GRID_SUITES for n in names):
            print(f"--grid applies to {', '.join(sorted(GRID_SUITES))}; got {' '.join(args.suites)}", file=sys.stderr)
            return 2
        names = [GRID_SUITES.get(n, n) for n in names]
    for n in names:
        if n not in SUITES:
            print(f"unknown suite {n!r}; choose from {sorted(SUITES)} or 'all'", file=sys.stderr)
            return 2
    if args.rounds < 1:
        print(f"--rounds must be >= 1, got {args.rounds}", file=sys.stderr)
        return 2
    opts = {"quick": args.quick}
    if args.layers:
        opts["layers"] = args.layers
    machine = machine_info()
    status = 0
    for n in names:
        finish = suite_finisher(n)

        def write(res, finish=finish):  # a suite's derived rows and extra reports first, then the common ones
            extra = []
            if finish is not None:
                res, extra = finish(res, args.out)
            return res, report.write(res, args.out) + extra

        result = run_suite(n, opts, check=not args.no_check, only=args.only, progress=not args.no_progress,
                           machine=machine, on_case=write, rounds=args.rounds,
                           clocks=not args.no_clock, impls=args.impls)
        result, paths = write(result)
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
    if args.cmd == "plan":
        tiles = args.num_kv_heads * sum(max(1, -(-n // TILE)) for n in args.lengths)
        if tiles > MAX_TOTAL_TILES:
            args.parser.error(f"{args.num_kv_heads} kv heads × {len(args.lengths)} requests make {tiles} tiles "
                              f"of {TILE} tokens; at most {MAX_TOTAL_TILES} are supported (int32 tables)")
    if args.cmd in ("demo", "plan"):
        _use_interpreter_without_gpu()
    try:
        status = _run(args)
        sys.stdout.flush()  # a closed pipe shows here, inside the try, not at interpreter exit
        return status
    except BrokenPipeError:
        # The reader went away (`hpcops plan ... | head`): stop quietly, as other tools do. Point
        # stdout at devnull so that the interpreter's final flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _run(args) -> int:
    if args.cmd == "demo":
        from hpcops.demo import run_demo

        return run_demo(check=not args.no_check, png=args.png)
    if args.cmd == "plan":
        from hpcops.demo import print_plan

        return print_plan(args)
    if args.cmd == "bench":
        return _bench(args)
    if args.cmd == "tune":
        from hpcops.bench.tune.cli import run as run_tune

        return run_tune(args)
    return 2  # pragma: no cover


if __name__ == "__main__":
    raise SystemExit(main())
