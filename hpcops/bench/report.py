"""Reports for a suite run: JSON for machines, a markdown table and a PNG plot for people."""

from __future__ import annotations

import json
import math
from pathlib import Path

from hpcops.bench.registry import suite_hook
from hpcops.bench.runner import Row, SuiteResult


def _primary(rows: list[Row], timing: str = "graph") -> Row | None:
    """Our first timed row of a case among those timed by `timing`: the rows timed alike are compared to it."""
    return next((r for r in rows if r.ours and r.us is not None and r.note != "per-step" and r.timing == timing),
                None)


def _is_primary(r: Row, rows: list[Row]) -> bool:
    return r is _primary(rows, r.timing)


def by_case(result: SuiteResult) -> dict[str, list[Row]]:
    cases: dict[str, list[Row]] = {}
    for r in result.rows:
        cases.setdefault(r.case, []).append(r)
    return cases


def markdown(result: SuiteResult) -> str:
    m = result.machine
    copy = m.get("copy_gbps")
    times = ("Times: µs per layer, median of CUDA-graph replays, layers with their own inputs (L2-cold). "
             "`x ours` = this row's time / our time in the same run (> 1: we are faster).")
    kernel_timed = sorted({r.impl for r in result.rows if r.timing == "kernels"})
    if kernel_timed:
        times += (" Rows " + ", ".join(f"`{i}`" for i in kernel_timed) + " are timed otherwise: the median per "
                  "call of the device time their kernels cover (durations summed, an overlap once; torch.profiler, the "
                  "same layers, eager calls, no launch gaps); their `x ours` is against our row timed that way.")
    clocked = any(r.sm_mhz for r in result.rows)  # a run that sampled the SM clock (NVML): a column for it
    if clocked:
        times += (" `SM MHz`: the median SM clock NVML read while the row was timed (a µs ratio of two rows at "
                  "different clocks holds the clocks' ratio: the power cap slows long bf16 kernels more).")
    lines = [f"# hpcops bench {result.suite}", "",
             f"Machine: {m.get('gpu', 'cpu')}, {m.get('sms', '?')} SMs, torch {m.get('torch')}, "
             f"triton {m.get('triton')}; measured copy bandwidth {copy} GB/s"
             + (f", measured bf16 GEMM ceiling {m['gemm_tflops_bf16']} TFLOP/s (torch matmul, 8192³)"
                if m.get("gemm_tflops_bf16") else "") + ".",
             times, "",
             "| case | impl | µs | GB/s | % copy BW | TFLOP/s | x ours |" + (" SM MHz |" if clocked else "")
             + " status |",
             "|---|---|---:|---:|---:|---:|---:|" + ("---:|" if clocked else "") + "---|"]
    for case, rows in by_case(result).items():
        for r in rows:
            prim = _primary(rows, r.timing)
            gb = f"{r.gbps:.0f}" if r.gbps else ""
            pct = f"{100 * r.gbps / copy:.0f}%" if r.gbps and copy else ""
            tf = f"{r.tflops:.0f}" if r.tflops else ""
            ratio = f"{r.us / prim.us:.2f}" if prim and r.us and r is not prim and r.note != "per-step" else ""
            us = f"{r.us:.1f}" if r.us is not None else "—"
            name = f"**{r.impl}**" if r.ours else r.impl
            mhz = (f" {r.sm_mhz:.0f} |" if r.sm_mhz else "  |") if clocked else ""
            lines.append(f"| {case} | {name} | {us} | {gb} | {pct} | {tf} | {ratio} |{mhz} {r.status} |")
    notes: dict[str, list[str]] = {}  # impl -> its notes' distinct "; "-separated parts, in order
    for r in result.rows:
        if r.note and r.note != "per-step":
            parts = notes.setdefault(r.impl, [])
            parts += [p for p in r.note.split("; ") if p not in parts]
    if notes:
        lines += ["", "Notes:", "", *[f"- `{impl}`: " + "; ".join(parts) for impl, parts in notes.items()]]
    cmds = sorted({r.command for r in result.rows if r.command})
    if cmds:
        lines += ["", "Reproduce:", "", *[f"    {c}" for c in cmds]]
    summary = suite_hook(result.suite, "summary_markdown")  # a suite's own verdicts (the decode grid's targets)
    if summary is not None:
        lines += ["", summary(result).rstrip("\n")]
    return "\n".join(lines) + "\n"


def plot(result: SuiteResult, path: Path) -> bool:
    """Bar chart of peer time / our time per case (log scale). Returns False if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    cases = by_case(result)
    peers = sorted({r.impl for rows in cases.values() for r in rows if r.us and not _is_primary(r, rows)})
    names = list(cases)
    if not names or not peers:
        return False
    fig, ax = plt.subplots(figsize=(max(8, 0.7 * len(names) * max(1, len(peers)) / 2), 5))
    width = 0.8 / len(peers)
    for i, peer in enumerate(peers):
        vals = []
        for c in names:
            row = next((r for r in cases[c] if r.impl == peer and r.us), None)
            prim = _primary(cases[c], row.timing) if row else None
            vals.append(row.us / prim.us if prim and row else math.nan)
        ax.bar([x + i * width for x in range(len(names))], vals, width, label=peer)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_yscale("log")
    label_cases(ax, names, "time / hpcops time, timed alike (>1: hpcops faster)",
                f"hpcops bench {result.suite} on {result.machine.get('gpu', '?')}", offset=0.4 - width / 2)
    return save_figure(fig, path)


def label_cases(ax, names: list[str], ylabel: str, title: str, offset: float = 0.0) -> None:
    """One bar group per case along x (slanted case names), the y label, the title and the legend."""
    ax.set_xticks([x + offset for x in range(len(names))])
    ax.set_xticklabels(names, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=7)


def save_figure(fig, path) -> bool:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def load(path: str | Path) -> SuiteResult:
    """Read a suite's JSON report back (to re-render its table and plot)."""
    from hpcops.bench.runner import Row

    d = json.loads(Path(path).read_text())
    fields = set(Row.__dataclass_fields__)
    rows = [Row(**{k: v for k, v in r.items() if k in fields}) for r in d["rows"]]
    return SuiteResult(d["suite"], rows, d["machine"])


def timed_cases(path: str | Path, suite: str) -> tuple[dict, dict[str, dict[str, Row]]]:
    """A `suite` report's machine and its timed ok rows as {case: {impl: row}} (the targets scripts' view);
    ValueError naming the file if it is another suite's report."""
    result = load(path)
    if result.suite != suite:
        raise ValueError(f"{path}: not a {suite} bench report (suite {result.suite!r})")
    cases = {c: {r.impl: r for r in rows if r.status == "ok" and r.us} for c, rows in by_case(result).items()}
    return result.machine, cases


def write(result: SuiteResult, out_dir: str | Path) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{result.suite}.json", out / f"{result.suite}.md"]
    paths[0].write_text(json.dumps(result.to_json(), indent=1))
    paths[1].write_text(markdown(result))
    png = out / f"{result.suite}.png"
    if (suite_hook(result.suite, "plot") or plot)(result, png):
        paths.append(png)
    return paths


def joined(suite: str, dirs: list[str | Path]) -> SuiteResult:
    """One result of `suite` from several runs' `<suite>.json` (a long suite split over `--only` runs with
    their own `--out`, each under a per-command time limit): cases in the order first seen, a later run's
    rows replacing an earlier run's for a case both measured; the machine (copy bandwidth) of the first run."""
    cases: dict[str, list[Row]] = {}
    machine: dict = {}
    for d in dirs:
        res = load(Path(d) / f"{suite}.json")
        machine = machine or res.machine
        cases.update(by_case(res))
    return SuiteResult(suite, [r for rows in cases.values() for r in rows], machine)


def merge(suite: str, dirs: list[str | Path], out_dir: str | Path) -> list[Path]:
    """`joined` runs of `suite`, written as one report in `out_dir`."""
    return write(joined(suite, dirs), out_dir)


def main(argv: list[str] | None = None) -> int:
    """`python -m hpcops.bench.report SUITE OUT_DIR RUN_DIR...`: `merge` from the command line."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m hpcops.bench.report",
                                 description="Join runs of one bench suite into one report: each RUN_DIR holds a "
                                             "SUITE.json; a later run's rows replace an earlier one's for a case "
                                             "both measured. Writes OUT_DIR/SUITE.{json,md,png}.")
    ap.add_argument("suite", help="the suite's name, e.g. moe, moe-shapes, decode, decode-grid")
    ap.add_argument("out_dir", help="where the joined report goes (may be one of the RUN_DIRs)")
    ap.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="folders holding SUITE.json, earliest first")
    args = ap.parse_args(argv)
    missing = [d for d in args.run_dirs if not (Path(d) / f"{args.suite}.json").is_file()]
    if missing:
        ap.error(f"no {args.suite}.json in {', '.join(missing)}")
    print("wrote " + ", ".join(map(str, merge(args.suite, args.run_dirs, args.out_dir))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
