"""scripts/fuzz_cpu.py keeps working: one random case per op (fixed seeds) through the same runners."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_fuzz_one_case_per_op():
    res = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "fuzz_cpu.py"), "--cases", "4", "--seed", "3"],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    lines = [line for line in res.stdout.splitlines() if "seed=" in line]
    assert len(lines) == 4 and all(" ok " in line for line in lines), res.stdout
    assert {line.split()[3] for line in lines} == {"decode", "prefill", "rope", "moe"}
