"""Issue 12's prefill targets from a `hpcops bench prefill` JSON report (no GPU).

A ratio is the other row's µs over ours in the same case and run: > 1 means ours is faster. The targets (issue 12,
"Deliver" 1-2):

- bf16, h64/8 and h8/1, q2k-q8k and the extend cases (q1ks2k, 2q1ks4k): the default row `hpcops` at >= 0.9x
  FlashInfer (`flashinfer`) and >= 0.85x cuDNN SDPA (`sdpa-cudnn`) where cuDNN runs the shape;
- fp8 KV with an fp8 q (`hpcops-fp8q`) at >= 1.3x our own bf16 (`hpcops` of the same shape over bf16 KV) at q4k
  and q8k. Our bf16 is the fp8 case's own `hpcops-bf16kv` row where the report has it (timed beside the fp8 rows,
  interleaved under `--rounds`, so clock drift over the minutes between two cases does not enter the ratio), else
  the bf16 case's `hpcops` row; the table names which, and gives the other ratio beside it.

For an fp8 case short of its goal the table gives the time it must reach (bf16 µs / 1.3) and the TFLOP/s that
is, beside the run's measured bf16 GEMM ceiling. A case absent from the report (a `--only` run) is named as not
run, never passed. A last table puts every fp8-q variant row of the run (`hpcops-fp8q-*`, opt-in configs: the
candidates for the default) against the same bf16 row and against the default fp8q row: which would pass.

    python scripts/prefill_targets.py bench/results/prefill.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout

from hpcops.bench import report  # noqa: E402

HEADS = ("h64x8", "h8x1")
BF16_SPECS = ("q2k", "q4k", "q8k", "q1ks2k", "2q1ks4k")
FP8_SPECS = ("q4k", "q8k")
PEER_GOALS = (("flashinfer", 0.9), ("sdpa-cudnn", 0.85))
FP8_GOAL = 1.3


def load(path: str | Path) -> tuple[dict, dict[str, dict[str, report.Row]]]:
    """The report's machine and its timed ok rows as {case: {impl: row}}."""
    return report.timed_cases(path, "prefill")


def _verdict(value: float, goal: float) -> str:
    return "pass" if value >= goal else "**short**"


def _tflops(row: report.Row) -> str:
    return f"{row.tflops:.0f}" if row.tflops else ""


def bf16_markdown(cases: dict[str, dict[str, report.Row]]) -> str:
    out = ["| case | hpcops µs | TFLOP/s | peer | peer µs | ratio | goal | |", "|---|---:|---:|---|---:|---:|---:|---|"]
    for heads in HEADS:
        for spec in BF16_SPECS:
            case = f"{heads}-bf16-{spec}"
            rows = cases.get(case, {})
            ours = rows.get("hpcops")
            if ours is None:
                out.append(f"| {case} | — | | | | — | | not run |")
                continue
            for peer, goal in PEER_GOALS:
                if peer not in rows:
                    out.append(f"| {case} | {ours.us:.1f} | {_tflops(ours)} | {peer} | — | — | >= {goal} | "
                               "peer did not run |")
                    continue
                r = rows[peer].us / ours.us
                out.append(f"| {case} | {ours.us:.1f} | {_tflops(ours)} | {peer} | {rows[peer].us:.1f} | {r:.3f} | "
                           f">= {goal} | {_verdict(r, goal)} |")
    return "\n".join(out) + "\n"


def our_bf16(cases: dict[str, dict[str, report.Row]], heads: str, spec: str) -> tuple[report.Row | None, str]:
    """Our bf16 row for the fp8 goal at (heads, spec) and where it comes from: the fp8 case's `hpcops-bf16kv` when
    the report has it, else the bf16 case's `hpcops`."""
    in_case = cases.get(f"{heads}-fp8-{spec}", {}).get("hpcops-bf16kv")
    if in_case is not None:
        return in_case, "in case"
    return cases.get(f"{heads}-bf16-{spec}", {}).get("hpcops"), "bf16 case"


def _clocks(bf16: report.Row, fp8: report.Row) -> str:
    """'bf16 MHz / fp8q MHz | ratio in cycles' where both rows carry their median SM clock, else two empty cells."""
    if not (bf16.sm_mhz and fp8.sm_mhz):
        return " | "
    return f"{bf16.sm_mhz:.0f} / {fp8.sm_mhz:.0f} | {bf16.us * bf16.sm_mhz / (fp8.us * fp8.sm_mhz):.3f}"


def fp8_markdown(machine: dict, cases: dict[str, dict[str, report.Row]]) -> str:
    ceiling = machine.get("gemm_tflops_bf16")
    out = ["| case | bf16 µs | bf16 from | bf16 TFLOP/s | fp8q µs | fp8q TFLOP/s | ratio | goal | | fp8q µs needed | "
           "TFLOP/s needed | other bf16 row's ratio | SM MHz bf16 / fp8q | ratio in cycles |",
           "|---|---:|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    for heads in HEADS:
        for spec in FP8_SPECS:
            bf16, source = our_bf16(cases, heads, spec)
            fp8 = cases.get(f"{heads}-fp8-{spec}", {}).get("hpcops-fp8q")
            name = f"{heads} {spec}"
            if bf16 is None or fp8 is None:
                out.append(f"| {name} | — | | | — | | — | >= {FP8_GOAL} | not run | | | | | |")
                continue
            r = bf16.us / fp8.us
            need_us = bf16.us / FP8_GOAL
            need = f"{need_us:.1f} | {fp8.flops / (need_us * 1e-6) / 1e12:.0f}" if r < FP8_GOAL and fp8.flops else " | "
            other = cases.get(f"{heads}-bf16-{spec}", {}).get("hpcops") if source == "in case" else None
            other = f"{other.us / fp8.us:.3f} (bf16 case)" if other is not None else ""
            out.append(f"| {name} | {bf16.us:.1f} | {source} | {_tflops(bf16)} | {fp8.us:.1f} | {_tflops(fp8)} | "
                       f"{r:.3f} | >= {FP8_GOAL} | {_verdict(r, FP8_GOAL)} | {need} | {other} | {_clocks(bf16, fp8)} |")
    out += ["", "The ratio in cycles is (bf16 µs x its median SM MHz) / (fp8q µs x its): the ratio at equal clocks, "
            "where the run sampled them (NVML; `hpcops.bench.clock`). The goal is the µs ratio."]
    if ceiling:
        out += ["", f"The run's measured bf16 GEMM ceiling: {ceiling:.1f} TFLOP/s (torch matmul, 8192³)."]
    return "\n".join(out) + "\n"


def variants_markdown(cases: dict[str, dict[str, report.Row]]) -> str:
    """Each `hpcops-fp8q-*` variant at q4k/q8k: its µs, our bf16 (`our_bf16`) over it (the goal's ratio), the default
    fp8q row's µs over it (> 1: the variant is faster). Empty where the run has no variant rows."""
    out = []
    for heads in HEADS:
        for spec in FP8_SPECS:
            bf16, _ = our_bf16(cases, heads, spec)
            rows = cases.get(f"{heads}-fp8-{spec}", {})
            default = rows.get("hpcops-fp8q")
            for impl in sorted(i for i in rows if i.startswith("hpcops-fp8q-")):
                us = rows[impl].us
                goal = f"{bf16.us / us:.3f} | {_verdict(bf16.us / us, FP8_GOAL)}" if bf16 else "— | bf16 not run"
                vs = f"{default.us / us:.3f}" if default else "—"
                out.append(f"| {heads} {spec} | {impl} | {us:.1f} | {goal} | {vs} |")
    if not out:
        return ""
    return "\n".join(["| case | variant | µs | bf16 / variant | >= 1.3 | fp8q default / variant |",
                      "|---|---|---:|---:|---|---:|", *out]) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("report", help="prefill.json written by `hpcops bench prefill --out DIR`")
    args = p.parse_args(argv)
    try:
        machine, cases = load(args.report)
    except (OSError, ValueError) as exc:
        p.error(str(exc))
    print(f"# Issue 12 prefill targets ({machine.get('gpu', '?')}, {args.report})\n")
    print("## bf16: the default row against FlashInfer (FA3 path) and cuDNN SDPA\n")
    print(bf16_markdown(cases))
    print("## fp8 KV with an fp8 q against our bf16\n")
    print(fp8_markdown(machine, cases), end="")
    variants = variants_markdown(cases)
    if variants:
        print("\n## fp8-q variants (opt-in configs) against our bf16 and the fp8q default\n")
        print(variants, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
