"""scripts/fuzz_cpu.py keeps working: one random case per op (fixed seeds) through the same runners."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# The fuzzer runs Triton's interpreter in its own process; the interpreter needs the CPU tier's pins
# (numpy<2.4 with Triton 3.6), which the GPU image does not have (numpy 2.5 there).
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-tier check (the interpreter needs numpy<2.4; "
                                                      "the GPU image has its own numpy)")
def test_fuzz_one_case_per_op():
    res = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "fuzz_cpu.py"), "--cases", "4", "--seed", "3"],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    lines = [line for line in res.stdout.splitlines() if "seed=" in line]
    assert len(lines) == 4 and all(" ok " in line for line in lines), res.stdout
    assert {line.split()[3] for line in lines} == {"decode", "prefill", "rope", "moe"}
