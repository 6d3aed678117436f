"""Issue 10's decode targets from a `hpcops bench decode` JSON report, and how far the copy floor leaves them (no GPU).

Every ratio is FlashInfer's best path (the faster of `flashinfer-decode` and `flashinfer-tc`, same run) over our
row: > 1 means we are faster. Over fp8 KV the row that counts is `hpcops-fp8q` (an fp8 q, as the pipeline runs);
over 16-bit KV it is `hpcops`. The targets (issue 10, "Deliver" 1-2):

- h8/1 fp8 geomean over the six blog scenarios >= 1.5; h8/1 bf16 geomean >= 1.3; any single h8/1 row >= 1.1;
- h64/8 fp8 skew (2x32K+30x4K, 1x128K+31x4K) >= 3.5; every other h64/8 row >= 0.95;
- table 4 (h64/8 bf16): 8x1K, 16x2K, 32x1K >= 1.0, 64x4K >= 0.95;
- the dynamic plan (`hpcops`) at most 3 % slower than its static split (`hpcops-static`) in every case.

The floor section asks whether a group's geomean target is within reach of a bandwidth-bound kernel: a case's
floor is its KV bytes over the run's measured copy bandwidth; FlashInfer's time over that floor bounds our ratio
there; and `cut` is the time a call would have to lose in every case of the group (never below its floor) for
the geomean to reach the target.

    python scripts/decode_targets.py bench/results/decode.json [--floor-group "h8/1 bf16"]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout

from hpcops.bench import report  # noqa: E402
from hpcops.bench.suites.decode_grid import _geomean as geomean  # noqa: E402

BLOG = ("64x0.5K", "64x4K", "32x0.125K+32x4K", "2x32K+30x4K", "1x64K+15x4K", "1x128K+31x4K")
SKEW = ("2x32K+30x4K", "1x128K+31x4K")
TABLE4 = {"8x1K": 1.0, "16x2K": 1.0, "32x1K": 1.0, "64x4K": 0.95}
PEERS = ("flashinfer-decode", "flashinfer-tc")


def load(path: str | Path) -> tuple[dict, dict[str, dict[str, report.Row]]]:
    """The report's machine and its timed ok rows as {case: {impl: row}}."""
    return report.timed_cases(path, "decode")


def ours_impl(case: str) -> str:
    """The row that counts in a case named '<spec> <heads> <kv>': the fp8 q over fp8 KV, else `hpcops`."""
    return "hpcops-fp8q" if case.rsplit(maxsplit=1)[-1] == "fp8" else "hpcops"


def ratio(rows: dict[str, report.Row], impl: str) -> float | None:
    """FlashInfer's best µs over `impl`'s µs in one case (None where either did not run)."""
    peer = [rows[p].us for p in PEERS if p in rows]
    if not peer or impl not in rows:
        return None
    return min(peer) / rows[impl].us


def _row(name: str, value: float | None, target: float, detail: str = "") -> str:
    if value is None:
        return f"| {name} | — | >= {target} | not run | {detail} |"
    return f"| {name} | {value:.3f} | >= {target} | {'pass' if value >= target else '**short**'} | {detail} |"


def targets_markdown(cases: dict[str, dict[str, report.Row]]) -> str:
    out = ["| target | value | goal | | detail |", "|---|---:|---:|---|---|"]
    for heads, kv, goal in (("h8/1", "fp8", 1.5), ("h8/1", "bf16", 1.3)):
        rs = {s: ratio(cases.get(c := f"{s} {heads} {kv}", {}), ours_impl(c)) for s in BLOG}
        got = [v for v in rs.values() if v is not None]
        detail = ", ".join(f"{s} {v:.3f}" for s, v in rs.items() if v is not None)
        out.append(_row(f"{heads} {kv} geomean ({len(got)} of {len(BLOG)})", geomean(got) if got else None, goal,
                        detail))
    single = [(c, ratio(rows, ours_impl(c))) for c, rows in sorted(cases.items()) if " h8/1 " in c]
    single = [(c, v) for c, v in single if v is not None]
    if single:
        c, v = min(single, key=lambda t: t[1])
        out.append(_row("lowest single h8/1 row", v, 1.1, c))
    for s in SKEW:
        c = f"{s} h64/8 fp8"
        out.append(_row(f"h64/8 fp8 skew {s}", ratio(cases.get(c, {}), "hpcops-fp8q"), 3.5))
    others = [(c, ratio(rows, ours_impl(c))) for c, rows in sorted(cases.items())
              if " h64/8 " in c and not any(c.startswith(s + " ") and c.endswith(" fp8") for s in SKEW)]
    others = [(c, v) for c, v in others if v is not None]
    if others:
        c, v = min(others, key=lambda t: t[1])
        out.append(_row("lowest other h64/8 row", v, 0.95, c))
    for s, goal in TABLE4.items():
        out.append(_row(f"table 4 {s} h64/8 bf16", ratio(cases.get(f"{s} h64/8 bf16", {}), "hpcops"), goal))
    worst = None
    for c, rows in sorted(cases.items()):
        if "hpcops" in rows and "hpcops-static" in rows:
            x = rows["hpcops"].us / rows["hpcops-static"].us
            if worst is None or x > worst[1]:
                worst = (c, x)
    if worst:
        c, x = worst
        ok = "pass" if x <= 1.03 else "**short**"
        out.append(f"| dynamic / static, worst case | {x:.3f} | <= 1.03 | {ok} | {c} (hpcops over hpcops-static) |")
    return "\n".join(out) + "\n"


def needed_cut(rows: list[tuple[float, float, float]], goal: float) -> float | None:
    """The µs every case must lose (each never below its floor) for the geomean of peer / ours to reach `goal`;
    rows are (ours µs, peer µs, floor µs). None where even every case at its floor falls short."""
    def gm(cut: float) -> float:
        return geomean([peer / max(floor, ours - cut) for ours, peer, floor in rows])

    if gm(0.0) >= goal:
        return 0.0
    hi = max(ours - floor for ours, _, floor in rows)
    if gm(hi) < goal:
        return None
    lo = 0.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if gm(mid) < goal else (lo, mid)
    return hi


def floor_markdown(machine: dict, cases: dict[str, dict[str, report.Row]], group: str, goal: float) -> str:
    bw = machine.get("copy_gbps")
    if not bw:
        return f"(no measured copy bandwidth in the report: no floor for {group})\n"
    heads, kv = group.split()
    out = [f"Floor: KV bytes / {bw:.1f} GB/s (the run's measured copy bandwidth).", "",
           "| case | ours µs | floor µs | ours - floor | peer µs | ratio | peer / floor (bound) |",
           "|---|---:|---:|---:|---:|---:|---:|"]
    rows = []
    for s in BLOG:
        c = f"{s} {heads} {kv}"
        r = cases.get(c, {})
        impl = ours_impl(c)
        peer = [r[p].us for p in PEERS if p in r]
        if impl not in r or not peer:
            continue
        ours, floor = r[impl].us, r[impl].bytes / bw / 1e3
        rows.append((ours, min(peer), floor))
        out.append(f"| {c} | {ours:.1f} | {floor:.1f} | {ours - floor:.1f} | {min(peer):.1f} | "
                   f"{min(peer) / ours:.3f} | {min(peer) / floor:.3f} |")
    if not rows:
        return f"(no {group} rows with a peer)\n"
    bound = geomean([peer / floor for _, peer, floor in rows])
    cut = needed_cut(rows, goal)
    out += ["", f"Geomean bound (every case at its floor): {bound:.3f} against the target {goal}."]
    out.append("Out of reach of a bandwidth-bound kernel." if cut is None else
               f"A call {cut:.2f} µs shorter in every case (never below its floor) reaches {goal}.")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("report", help="decode.json written by `hpcops bench decode --out DIR`")
    p.add_argument("--floor-group", default="h8/1 bf16", help='heads and KV dtype of the floor section ("h8/1 fp8")')
    p.add_argument("--floor-goal", type=float, default=None, help="its geomean target (default: 1.3 bf16, 1.5 fp8)")
    args = p.parse_args(argv)
    machine, cases = load(args.report)
    group = args.floor_group.split()
    if len(group) != 2 or group[0] not in ("h8/1", "h64/8") or group[1] not in ("bf16", "fp8"):
        p.error(f"--floor-group must be '<h8/1|h64/8> <bf16|fp8>', got {args.floor_group!r}")
    goal = args.floor_goal or (1.5 if group[1] == "fp8" else 1.3)
    print(f"# Issue 10 decode targets ({machine.get('gpu', '?')}, {args.report})\n")
    print(targets_markdown(cases))
    print(f"## {args.floor_group}: the copy floor\n")
    print(floor_markdown(machine, cases, args.floor_group, goal), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
