"""`hpcops tune OP...`: the parser and the command (wired into hpcops/cli.py)."""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

from hpcops.bench.tune import OPS, get_op
from hpcops.bench.tune.engine import Limits, TuneOp, TuneOptions, TuneResult, on_gpu, phase_a, select, tune
from hpcops.bench.tune.space import label


def default_jobs() -> int:
    """Cores minus two, at most 8: each worker holds a CUDA context and one scenario's layer-0 inputs."""
    return max(1, min(8, (os.cpu_count() or 2) - 2))


def add_parser(sub) -> None:
    t = sub.add_parser(
        "tune", help="tune an op's launch config on the GPU over its bench scenarios (tables, JSON, MoE table)",
        description="For each bench scenario of OP: the heuristic config and its one-knob moves, then the "
                    "winning moves combined; every candidate gated against the suite's reference, then timed "
                    "like the bench. Writes OUT/<op>_tune.{md,json}; moe also OUT/moe_tuned.json (use it with "
                    "HPCOPS_MOE_TUNED=OUT/moe_tuned.json, or --write / --merge into hpcops/moe/tuned.py).")
    t.add_argument("ops", nargs="+", metavar="OP", help=f"{', '.join(OPS)} (or 'all')")
    t.add_argument("--only", default=None,
                   help="only scenarios whose name contains this text (several, comma-separated: any of them)")
    t.add_argument("--quick", action="store_true", help="the bench's quick scenarios, at most 6 candidates each")
    t.add_argument("--smoke", action="store_true",
                   help="smallest complete run: the first scenario, 2 candidates, 2 layers")
    t.add_argument("--out", default="bench/results", help="output folder (default: bench/results)")
    t.add_argument("--write", action="store_true", help="moe: merge the winners into hpcops/moe/tuned.py")
    t.add_argument("--merge", metavar="JSON", default=None,
                   help="moe: merge a moe_tuned.json from an earlier run into hpcops/moe/tuned.py (no GPU, no run)")
    t.add_argument("--jobs", type=int, default=default_jobs(),
                   help="processes compiling candidates ahead (0: compile while timing; default: %(default)s)")
    t.add_argument("--budget-s", type=float, default=240.0,
                   help="seconds per op; candidates past each scenario's share are skipped (0: no limit; "
                        "default: %(default)s)")
    t.add_argument("--timing", choices=("graph", "kernels"), default=None,
                   help="graph replay or the profiler's kernel time (default: the op's; moe: kernels)")
    t.add_argument("--layers", type=int, default=None, help="layers per timing (default: the bench's L2-cold count)")
    t.add_argument("--margin", type=float, default=0.03,
                   help="a winner must beat the heuristic by this fraction (default: %(default)s)")
    t.add_argument("--knobs", default=None, metavar="F1,F2",
                   help="move only the knobs whose config fields are all among these (e.g. task_cost,min_tiles)")
    t.add_argument("--dry-run", action="store_true", help="list the phase-A candidates and exit (no GPU needed)")
    t.add_argument("--no-progress", action="store_true")


def _options(args) -> TuneOptions:
    layers = args.layers or (2 if args.smoke else None)
    return TuneOptions(only=args.only, quick=args.quick, smoke=args.smoke, jobs=max(0, args.jobs),
                       budget_s=args.budget_s or None, timing=args.timing, layers=layers, margin=args.margin,
                       progress=not args.no_progress)


def narrowed(op: TuneOp, knobs: str | None) -> TuneOp:
    """`op` with only the knobs of its space whose fields are all in the comma-separated `knobs`."""
    if not knobs:
        return op
    want = {k.strip() for k in knobs.split(",") if k.strip()}
    space = tuple(k for k in op.space if set(k.fields) <= want)
    if not space:
        fields = sorted({f for k in op.space for f in k.fields})
        raise ValueError(f"--knobs {knobs!r} names no knob of {op.name}; its fields: {', '.join(fields)}")
    op = copy.copy(op)
    op.space = space
    return op


def _command(name: str, args) -> str:
    parts = ["hpcops", "tune", name]
    if args.only:
        parts += ["--only", repr(args.only) if " " in args.only else args.only]
    parts += [f for f, on in (("--quick", args.quick), ("--smoke", args.smoke)) if on]
    if args.timing:
        parts += ["--timing", args.timing]
    if args.layers:
        parts += ["--layers", str(args.layers)]
    if args.knobs:
        parts += ["--knobs", args.knobs]
    return " ".join(parts)


def dry_run(op: TuneOp, opts: TuneOptions) -> int:
    limits = Limits.of(opts.quick, opts.smoke)
    scenarios = select(op, opts)
    print(f"{op.name}: {len(scenarios)} scenarios; each: the heuristic, its one-knob moves (phase A), then up to "
          f"{limits.phase_b} combinations of the moves that win (phase B)")
    total = 0
    for s in scenarios:
        cands = phase_a(op, s, limits)
        total += len(cands)
        base = cands[0][1]
        print(f"{s.name}: {len(cands)} candidates; heuristic " + " ".join(f"{k}={v}" for k, v in base.items()))
        for phase, c in cands[1:]:
            print(f"  {phase} {label(c, base)}")
    print(f"{total} phase-A candidates")
    return 0


def _write(op: TuneOp, result: TuneResult, out: str, command: str) -> list[Path]:
    from hpcops.bench.tune import report

    paths = report.write(result, out, command=command, entries=op.table_notes(result))
    extra = op.write_table(result, out)
    return paths + ([extra] if extra else [])


def _machine() -> dict:
    from hpcops.bench import timing
    from hpcops.bench.runner import machine_info

    m = machine_info(measure=False)
    if on_gpu():  # also lifts an idle GPU out of its low clocks before the first timing
        copy = timing.copy_bandwidth_gbps(1 << 30)
        m["copy_gbps"] = round(max(copy.values()), 1)
    return m


def run(args) -> int:
    from hpcops._platform import is_interpreter
    from hpcops.bench.tune import report

    names = sorted(OPS) if args.ops == ["all"] else args.ops
    bad = [n for n in names if n not in OPS]
    if bad:
        print(f"unknown op {bad[0]!r}; choose from {sorted(OPS)} or 'all'", file=sys.stderr)
        return 2
    if args.merge or args.write:
        no_table = [n for n in names if not get_op(n).has_table]
        if no_table:
            print(f"--write/--merge: {no_table[0]} has no tuned table (only moe has one)", file=sys.stderr)
            return 2
    if args.merge:
        from hpcops.bench.tune import moe

        dev, n, total = moe.merge_json(args.merge)
        print(f"merged {n} entries for {dev!r} into {moe.table_path()} ({total} entries for it now)")
        return 0
    opts = _options(args)
    try:
        ops = {n: narrowed(get_op(n), args.knobs) for n in names}
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    if args.dry_run:
        for n in names:
            dry_run(ops[n], opts)
        return 0
    if not on_gpu() and not is_interpreter():
        print("hpcops tune times on a CUDA GPU and none is visible (--dry-run lists the candidates)", file=sys.stderr)
        return 2
    machine = _machine()
    status = 0
    for n in names:
        op, command = ops[n], _command(n, args)

        def partial(res: TuneResult, op=op, command=command) -> None:
            res.machine = machine
            _write(op, res, args.out, command)

        result = tune(op, opts, partial)
        result.machine = machine
        paths = _write(op, result, args.out, command)
        print(report.markdown(result, command=command, entries=op.table_notes(result), summary_only=True))
        print("wrote " + ", ".join(str(p) for p in paths))
        if args.write:
            print(op.merge_into_table(result))
        if result.aborted or any(s.rows and s.heuristic.status.startswith("check-failed") for s in result.scenarios):
            status = 1
        if result.aborted:  # this process's CUDA context is gone
            break
    return status

