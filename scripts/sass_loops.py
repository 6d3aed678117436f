"""The sm_90 SASS of a warp-specialized Gluon prefill build, its softmax loops one by one, on the CPU (no GPU).

Builds one entry of `tests/test_prefill_compile.py`'s GLUON_WS_BUILDS (Triton 3.6's ptxas, as the CPU tier does),
disassembles the whole cubin with Triton's bundled `cuobjdump -sass` (Triton's own `asm["sass"]` holds one consumer
only) and prints every innermost loop with at least `--min-ex2` MUFU.EX2 (each consumer's softmax loop; found as
`ncu_sass_summary.py` finds them on a GPU profile): its size and opcode counts, and with `--seq` the opcodes in order,
runs collapsed ("MUFU x2 | F2FP x1 | ..."): where ptxas put what, e.g. the O rescale's FMULs after P's fence.
Session 63 used it to place `gluon_late_scale`'s FMULs before running it.

    python3 scripts/sass_loops.py fp8-d128-h8/1-128-3buf-msum-qregs [--softmax-extra 64] [--out F.sass] [--seq]
    python3 scripts/sass_loops.py --list
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "scripts")]

from ncu_sass_summary import opcode, softmax_loops  # noqa: E402
from test_prefill_compile import GLUON_WS_BUILD, GLUON_WS_BUILDS  # noqa: E402

DUMP = """
import os, subprocess, tempfile
cob = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
with tempfile.TemporaryDirectory() as d:
    cubin = os.path.join(d, "k.cubin")
    open(cubin, "wb").write(c.asm["cubin"])
    sass = subprocess.run([cob, "-sass", cubin], capture_output=True, text=True, check=True).stdout
open(os.environ["SASS_OUT"], "w").write(sass)
print(json.dumps(r))"""


def build_sass(name: str, extra: int, out: Path) -> dict:
    """Compile build `name` (SOFTMAX bits | extra) and write its full SASS to `out`; the build's resource dict."""
    src = GLUON_WS_BUILD.replace("print(json.dumps(r))", DUMP)
    if extra:  # the build script's SOFTMAX expression ends with q_regs' bit
        tail = "(128 if prmt else 0))"
        if tail not in src:
            raise SystemExit("the build script's SOFTMAX expression changed: update --softmax-extra's patch")
        src = src.replace(tail, f"(128 if prmt else 0) | {extra})", 1)
    env = dict(os.environ, SASS_OUT=str(out), PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, "-c", src, json.dumps(GLUON_WS_BUILDS[name])], capture_output=True,
                         text=True, env=env)
    if res.returncode:
        raise SystemExit(f"build {name} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def instruction_rows(sass: str) -> list[dict]:
    """A cuobjdump listing's instructions as `ncu_sass_summary`'s rows: {"Address": "0x…", "Source": text}."""
    return [{"Address": f"0x{m.group(1)}", "Source": m.group(2).strip()}
            for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]


def runs(ops: list[str]) -> str:
    """The opcodes in order with repeats collapsed: ["MUFU", "MUFU", "F2FP"] → "MUFU x2 | F2FP x1"."""
    return " | ".join(f"{op} x{len(list(group))}" for op, group in itertools.groupby(ops))


def loop_lines(sass: str, min_ex2: int, seq: bool) -> list[str]:
    """Each softmax loop of the listing: its address range, size and opcode counts (and with `seq`, the order)."""
    rows = instruction_rows(sass)
    out = []
    for a, b in softmax_loops(rows, min_ex2):
        ops = [opcode(r["Source"]) for r in rows[a:b + 1]]
        out.append(f"loop {rows[a]['Address']}-{rows[b]['Address']}: {len(ops)} instructions")
        out.append("  " + ", ".join(f"{k} {v}" for k, v in collections.Counter(ops).most_common()))
        if seq:
            out.append("  " + runs(ops))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("build", nargs="?", help="a GLUON_WS_BUILDS name (--list shows them)")
    ap.add_argument("--list", action="store_true", help="the build names")
    ap.add_argument("--softmax-extra", type=int, default=0, help="SOFTMAX bits or-ed into the build's")
    ap.add_argument("--min-ex2", type=int, default=60, help="MUFU.EX2 a loop needs to be listed")
    ap.add_argument("--seq", action="store_true", help="also the opcodes in order, runs collapsed")
    ap.add_argument("--out", type=Path, help="keep the SASS listing here")
    args = ap.parse_args()
    if args.list or args.build is None:
        print("\n".join(GLUON_WS_BUILDS))
        return
    if args.build not in GLUON_WS_BUILDS:
        raise SystemExit(f"unknown build {args.build!r}; --list shows the names")
    with tempfile.TemporaryDirectory() as d:
        out = args.out or Path(d) / "build.sass"
        r = build_sass(args.build, args.softmax_extra, out)
        print(f"{args.build} (SOFTMAX extra {args.softmax_extra}): {r}" + (f"\nSASS: {out}" if args.out else ""))
        print("\n".join(loop_lines(out.read_text(), args.min_ex2, args.seq)))


if __name__ == "__main__":
    main()
