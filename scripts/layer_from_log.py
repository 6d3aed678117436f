"""Rebuild the `layer` suite's per-part `layer.json` from the tables a run printed to its log.

For a layer sweep whose archive was lost (at b6c7272 a second `gpu_check.sh` invocation in the same device call
replaced the first one's results.tar.gz; fixed since). The rows' µs come from the printed tables (to 0.1 µs);
their params, bytes and layer counts from the suite's own scenarios; the machine's copy bandwidth and GEMM ceiling
from the table's header. The derived `baseline` rows are left out: `_layer_report` makes them again.

    python3 scripts/layer_from_log.py bench.log OUT_DIR   # → OUT_DIR/layer_<kv>-<layout>/layer.json per part
    python3 -m hpcops.bench.suites._layer_report JOINED OUT_DIR/layer_* ...
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from hpcops.bench.runner import Row, SuiteResult
from hpcops.bench.suites import layer as L


def parts(log: str) -> list[tuple[dict, list[Row], str]]:
    scen = {s.name: s for s in L.scenarios(False)}
    cases = {name: L.case_for(s) for name, s in scen.items()}
    out = []
    for chunk in log.split("# hpcops bench ")[1:]:
        if not chunk.startswith("layer"):
            continue
        m = re.search(r"Machine: (.+?), (\d+) SMs, torch (\S+), triton (\S+); measured copy bandwidth ([\d.]+) GB/s, "
                      r"measured bf16 GEMM ceiling ([\d.]+)", chunk)
        if m is None:
            raise ValueError("log: a layer table without its Machine line")
        machine = {"gpu": m[1], "sms": int(m[2]), "torch": m[3], "triton": m[4].rstrip(";"),
                   "copy_gbps": float(m[5]), "gemm_tflops_bf16": float(m[6]),
                   "rebuilt_from": "the run's printed tables (µs to 0.1): scripts/layer_from_log.py"}
        rows, name = [], None
        for line in chunk.splitlines():
            c = [x.strip() for x in line.strip().strip("|").split("|")]
            if len(c) < 8 or c[0] not in scen or c[1].strip("*") == "baseline":
                continue
            s, case, impl = scen[c[0]], cases[c[0]], c[1].strip("*")
            imp = next(i for i in case.impls if i.name == impl)
            rows.append(Row(suite="layer", case=c[0], impl=impl, ours=imp.ours, us=float(c[2]) if c[2] else None,
                            status=c[7], layers=case.layers or 8, bytes=case.bytes, params=case.params,
                            command=case.command, note=imp.note, timing=imp.timing))
            name = f"{s.kv}-{s.layout}"
        if rows:
            out.append((machine, rows, name))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log")
    ap.add_argument("out")
    args = ap.parse_args()
    for machine, rows, name in parts(Path(args.log).read_text()):
        d = Path(args.out) / f"layer_{name}"
        d.mkdir(parents=True, exist_ok=True)
        (d / "layer.json").write_text(json.dumps(SuiteResult("layer", rows, machine).to_json(), indent=1))
        print(f"{d / 'layer.json'}: {len(rows)} rows")


if __name__ == "__main__":
    main()
