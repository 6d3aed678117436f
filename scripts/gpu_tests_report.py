"""Summarize a GPU test-tier run (one JUnit XML report per test file) into `gpu_tests.txt`.

`scripts/gpu_check.sh tests` runs every tests/test_*.py in its own pytest process with
`--junitxml=DIR/junit_<file>.xml` and then calls this script. The report opens with the tested tree
(`--rev`, the commit the working tree was at) and the versions, then gives one line per file, the
totals as `N passed, M failed, K errors, S skipped`, every skip with its reason, and every failure or
error with its message. A file without a report (its process crashed or timed out) counts as an error.

    python scripts/gpu_tests_report.py DIR --rev HASH --files tests/test_a.py,tests/test_b.py > gpu_tests.txt

Exit status 1 when anything failed or errored.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path


def read_report(path: Path) -> tuple[Counter, list[tuple[str, str]], list[tuple[str, str, str]]]:
    """(counts by outcome, [(test, skip reason)], [(outcome, test, message)]) of one JUnit XML file."""
    counts: Counter = Counter()
    skips: list[tuple[str, str]] = []
    bad: list[tuple[str, str, str]] = []
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = child.tag
                msg = (child.get("message") or "").strip().splitlines()
                msg = msg[0] if msg else ""
                if child.tag == "skipped" and msg == "collection skipped" and child.text:
                    # a module skipped at collection: the reason is in the text, "(path, line, 'Skipped: why')"
                    with contextlib.suppress(ValueError, SyntaxError, IndexError, TypeError):
                        msg = str(ast.literal_eval(child.text)[-1]).removeprefix("Skipped: ")
                if child.tag == "skipped":
                    skips.append((name, msg))
                else:
                    bad.append((child.tag, name, msg[:300]))
                break
        counts[{"failure": "failed", "error": "errors", "skipped": "skipped"}.get(outcome, outcome)] += 1
    return counts, skips, bad


def summarize(report_dir: Path, files: list[str], rev: str, versions: str) -> tuple[str, bool]:
    """The text of gpu_tests.txt and whether the run was clean (no failure, no error)."""
    total: Counter = Counter()
    per_file, skips, bad = [], [], []
    for f in files:
        stem = Path(f).stem
        xml = report_dir / f"junit_{stem}.xml"
        if not xml.exists():
            total["errors"] += 1
            per_file.append(f"{f}: no report (the process crashed or timed out; see {stem}.log)")
            bad.append(("error", f, "no JUnit report"))
            continue
        c, s, b = read_report(xml)
        total.update(c)
        skips += s
        bad += b
        per_file.append(f"{f}: " + ", ".join(f"{c[k]} {k}" for k in ("passed", "failed", "errors", "skipped")
                                              if c[k]))
    summary = ", ".join(f"{total[k]} {k}" for k in ("passed", "failed", "errors", "skipped"))
    lines = [f"tree: {rev}", f"versions: {versions}", "command: bash scripts/gpu_check.sh tests", "",
             f"summary: {summary}", "", "## per file", *per_file]
    reasons = Counter(reason for _, reason in skips)
    lines += ["", f"## skipped ({len(skips)}), by reason"]
    lines += [f"{n:4d} × {reason}" for reason, n in reasons.most_common()]
    lines += ["", "## skipped tests"] + [f"{name}: {reason}" for name, reason in skips]
    if bad:
        lines += ["", f"## failures and errors ({len(bad)})"]
        lines += [f"{'FAILED' if kind == 'failure' else 'ERROR'} {name}: {msg}" for kind, name, msg in bad]
    return "\n".join(lines) + "\n", not bad


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("report_dir", type=Path, help="folder holding junit_<test file>.xml")
    ap.add_argument("--files", required=True, help="comma-separated test files that were run")
    ap.add_argument("--rev", default="unknown", help="commit of the tested tree")
    ap.add_argument("--versions", default="", help="torch / Triton / GPU line")
    args = ap.parse_args(argv)
    text, ok = summarize(args.report_dir, [f for f in args.files.split(",") if f], args.rev, args.versions)
    sys.stdout.write(text)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
