"""The sm_90 SASS of a warp-specialized Gluon prefill build, loop by loop, on the CPU (no GPU needed).

Builds one entry of `tests/test_prefill_compile.py`'s GLUON_WS_BUILDS (Triton 3.6's ptxas, as the CPU tier does),
disassembles the whole cubin with Triton's bundled `cuobjdump -sass` (Triton's own `asm["sass"]` holds one consumer
only) and prints every backward-branch region of at least `--min` instructions: its size and opcode counts, and with
`--seq` the opcodes in order, runs collapsed ("MUFU x2 | F2FP x1 | ..."): where ptxas put what, e.g. the O rescale's
FMULs after P's fence. Session 63 used it to place `gluon_late_scale`'s FMULs before running it.

    python3 scripts/sass_loops.py fp8-d128-h8/1-128-3buf-msum-qregs [--softmax-extra 64] [--out F.sass] [--seq]
    python3 scripts/sass_loops.py --list
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from test_prefill_compile import GLUON_WS_BUILD, GLUON_WS_BUILDS  # noqa: E402

DUMP = """
import os, subprocess, tempfile
cob = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
    f.write(c.asm["cubin"])
open(os.environ["SASS_OUT"], "w").write(subprocess.run([cob, "-sass", f.name], capture_output=True, text=True,
                                                       check=True).stdout)
print(json.dumps(r))"""


def build_sass(name: str, extra: int, out: Path) -> dict:
    """Compile build `name` (SOFTMAX bits | extra) and write its full SASS to `out`; the build's resource dict."""
    src = GLUON_WS_BUILD.replace("print(json.dumps(r))", DUMP)
    if extra:  # the build script's SOFTMAX expression ends with q_regs' bit
        tail = "(32 if qregs else 0))"
        if tail not in src:
            raise SystemExit("the build script's SOFTMAX expression changed: update --softmax-extra's patch")
        src = src.replace(tail, f"(32 if qregs else 0) | {extra})", 1)
    env = dict(os.environ, SASS_OUT=str(out), PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, "-c", src, json.dumps(GLUON_WS_BUILDS[name])], capture_output=True,
                         text=True, env=env)
    if res.returncode:
        raise SystemExit(f"build {name} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def instructions(sass: str) -> list[tuple[int, str]]:
    """(address, instruction text) of every instruction in a cuobjdump listing."""
    return [(int(m.group(1), 16), m.group(2).strip()) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]


def opcode(text: str) -> str:
    """The base opcode of an instruction, its predicate and modifiers dropped (`@!P3 MUFU.EX2 R1, R2` → MUFU)."""
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]


def loops(ins: list[tuple[int, str]], minimum: int) -> list[tuple[int, int]]:
    """(first, last) instruction indices of each region a backward branch closes, at least `minimum` long."""
    index = {a: i for i, (a, _) in enumerate(ins)}
    found = []
    for i, (a, t) in enumerate(ins):
        m = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", t)
        if m and int(m.group(1), 16) < a and int(m.group(1), 16) in index:
            s = index[int(m.group(1), 16)]
            if i - s + 1 >= minimum:
                found.append((s, i))
    return found


def runs(ops: list[str]) -> str:
    out, prev, n = [], None, 0
    for op in ops + [None]:
        if op == prev:
            n += 1
            continue
        if prev is not None:
            out.append(f"{prev} x{n}")
        prev, n = op, 1
    return " | ".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("build", nargs="?", help="a GLUON_WS_BUILDS name (--list shows them)")
    ap.add_argument("--softmax-extra", type=int, default=0, help="SOFTMAX bits or-ed into the build's")
    ap.add_argument("--min", type=int, default=300, help="shortest region shown (instructions)")
    ap.add_argument("--max", type=int, default=1200, help="longest region shown (the whole partitions are longer)")
    ap.add_argument("--seq", action="store_true", help="also the opcodes in order, runs collapsed")
    ap.add_argument("--out", type=Path, help="keep the SASS listing here")
    args = ap.parse_args()
    if args.build is None:
        print("\n".join(GLUON_WS_BUILDS))
        return
    if args.build not in GLUON_WS_BUILDS:
        raise SystemExit(f"unknown build {args.build!r}; --list shows the names")
    out = args.out or Path(tempfile.mkstemp(suffix=".sass")[1])
    r = build_sass(args.build, args.softmax_extra, out)
    print(f"{args.build} (SOFTMAX extra {args.softmax_extra}): {r}\nSASS: {out}")
    ins = instructions(out.read_text())
    for s, e in loops(ins, args.min):
        if e - s + 1 > args.max:
            continue
        ops = [opcode(t) for _, t in ins[s:e + 1]]
        counts = collections.Counter(ops).most_common()
        print(f"\nloop {ins[s][0]:#x}-{ins[e][0]:#x}: {e - s + 1} instructions")
        print("  " + ", ".join(f"{k} {v}" for k, v in counts))
        if args.seq:
            print("  " + runs(ops))


if __name__ == "__main__":
    main()
