"""Where a kernel's warps wait, from an Nsight Compute SASS source page (`gpu_check.sh profile:prefill` with
NCU_SASS=1 writes one as CSV: `ncu --page source --print-source sass --csv`): the warp stall samples summed by
instruction kind (the SASS opcode without its modifiers) and by stall reason, for every innermost loop whose body
holds at least `--min-ex2` MUFU.EX2 (the attention kernels' softmax loops: one a consumer warpgroup) and for the
whole kernel. A sample counts against the instruction the warp was about to issue, so "MUFU: wait" is an exp2
waiting on its operand's fixed latency, not the MUFU pipe.

    python3 scripts/ncu_sass_summary.py bench/results/ncu_prefill_sass_q8k_h8_fp8_h100_2dbc81d.csv.gz
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip
import io
import re

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def _num(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def read_rows(path: str) -> list[dict]:
    """The CSV's instruction rows (ncu prints its report's other sections above the table: skipped)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        text = f.read()
    start = text.find('"Address"')
    if start < 0:
        raise ValueError(f"{path}: no SASS source table (a header row starting with \"Address\")")
    return [r for r in csv.DictReader(io.StringIO(text[start:])) if r["Address"].startswith("0x")]


def opcode(sass: str) -> str:
    """`@!P3 BAR.SYNC.DEFER_BLOCKING 0x2, 0x80` -> BAR: the opcode without a predicate or modifiers."""
    words = sass.split()
    if not words:
        return ""
    return (words[1] if words[0].startswith("@") and len(words) > 1 else words[0]).split(".")[0]


def softmax_loops(rows: list[dict], min_ex2: int) -> list[tuple[int, int]]:
    """Innermost [first, last] row ranges closed by a backward branch whose body has >= min_ex2 MUFU.EX2, none
    overlapping another. ncu's addresses are absolute and a branch's target is the function's offset: both forms
    are tried."""
    addr = [int(r["Address"], 16) for r in rows]
    index = {a: i for i, a in enumerate(addr)}
    loops = set()
    for i, r in enumerate(rows):
        m = re.search(r"\bBRA (0x[0-9a-f]+)", r["Source"])
        if not m:
            continue
        for target in (int(m.group(1), 16), addr[0] + int(m.group(1), 16)):
            j = index.get(target)
            if j is not None and j < i and sum("MUFU.EX2" in x["Source"] for x in rows[j:i + 1]) >= min_ex2:
                loops.add((j, i))
    kept: list[tuple[int, int]] = []  # the shortest first; a range overlapping a kept one (an outer loop, or a
    for lp in sorted(loops, key=lambda x: x[1] - x[0]):  # retry branch reaching back across it) is not a loop body
        if not any(lp[0] <= o[1] and o[0] <= lp[1] for o in kept):
            kept.append(lp)
    return sorted(kept)


def summarize(rows: list[dict], top: int = 12) -> dict:
    """Samples, executed instructions, samples by opcode and by stall reason, and each top opcode's reasons."""
    reasons = [k for k in (rows[0] if rows else {}) if k.startswith("stall_") and "Not Issued" not in k]
    by_op: collections.Counter = collections.Counter()
    by_reason: collections.Counter = collections.Counter()
    op_reasons: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for r in rows:
        op = opcode(r["Source"])
        by_op[op] += _num(r[SAMPLES])
        for k in reasons:
            by_reason[k[len("stall_"):]] += _num(r[k])
            op_reasons[op][k[len("stall_"):]] += _num(r[k])
    return {"instructions": len(rows), "samples": sum(by_op.values()),
            "executed": sum(_num(r[EXECUTED]) for r in rows), "by_op": by_op.most_common(top),
            "by_reason": by_reason.most_common(top),
            "op_reasons": {op: op_reasons[op].most_common(4) for op, _ in by_op.most_common(6)}}


def report(path: str, min_ex2: int = 60) -> str:
    rows = read_rows(path)
    whole = summarize(rows)
    out = [f"# {path}: {whole['instructions']} instructions, {whole['samples']:.0f} stall samples"]
    parts = [(f"loop {rows[a]['Address']}..{rows[b]['Address']}", summarize(rows[a:b + 1]))
             for a, b in softmax_loops(rows, min_ex2)]
    for name, s in parts + [("whole kernel", whole)]:
        share = 100 * s["samples"] / max(whole["samples"], 1)
        out.append(f"\n## {name}: {s['instructions']} instructions, {s['samples']:.0f} samples ({share:.1f} %), "
                   f"{s['executed']:.0f} executed")
        out.append("by opcode: " + ", ".join(f"{k} {v:.0f}" for k, v in s["by_op"]))
        out.append("by reason: " + ", ".join(f"{k} {v:.0f}" for k, v in s["by_reason"]))
        for op, rs in s["op_reasons"].items():
            out.append(f"  {op}: " + ", ".join(f"{k} {v:.0f}" for k, v in rs))
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", help="ncu's SASS source page as CSV (.csv or .csv.gz)")
    ap.add_argument("--min-ex2", type=int, default=60, help="MUFU.EX2 a loop body needs to be listed (default 60)")
    args = ap.parse_args()
    print(report(args.csv, args.min_ex2))


if __name__ == "__main__":
    main()
