"""The committed H200 results measured the kernels this tree launches by default.

`bench/results/fingerprints.json` holds the sm_90 PTX fingerprints of every launch the decode and MoE
benchmarks make (recorded when their results were, `scripts/ptx_fingerprint.py`). A change to a
default kernel or to the launches the defaults pick fails here: measure it on the GPU, commit the new
results, then re-record the fingerprints (`python scripts/ptx_fingerprint.py > bench/results/fingerprints.json`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import load_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "ptx_fingerprint.py")
RECORDED = os.path.join(ROOT, "bench", "results", "fingerprints.json")


def _module():
    return load_script("ptx_fingerprint")


def _row(run, kernel, sha):
    return {"run": run, "kernel": kernel, "constexprs": {}, "warps": 4, "stages": 3, "sha": sha, "instructions": 1}


def test_compare_flags_changed_ptx_and_launches(capsys):
    fp = _module()
    old = [_row("a", "k1", "x"), _row("a", "k2", "y"), _row("b", "k1", "x")]
    assert fp.compare(old, [dict(r) for r in old]) == 0
    assert fp.compare(old, [_row("a", "k1", "x"), _row("a", "k2", "z"), _row("b", "k1", "x")]) == 1
    assert fp.compare(old, [_row("a", "k1", "x"), _row("b", "k1", "x")]) == 1  # a launch fewer
    assert fp.compare(old, old[:2]) == 1  # a run missing
    out = capsys.readouterr().out
    assert "PTX differs: k2" in out and "launches differ" in out


def test_normalized_ptx_ignores_parameter_numbering_and_debug_info():
    fp = _module()
    a = ".version 8.7\n.param .u64 k_param_0,\nld.param.u64 %rd1, [k_param_0];\n.loc 1 2 3\nadd.s32 %r1, %r2, 1;"
    b = ".version 8.8\n.param .u64 k_param_3,\nld.param.u64 %rd1, [k_param_3];\n.loc 1 9 9\nadd.s32 %r1, %r2, 1;"
    c = b.replace("add.s32", "sub.s32")
    assert fp._normalized_ptx(a) == fp._normalized_ptx(b) != fp._normalized_ptx(c)


@pytest.mark.slow
def test_default_kernels_are_the_measured_ones():
    with open(RECORDED) as f:
        kernels = {r["kernel"] for r in json.load(f)}
    assert kernels >= {"decode_persistent_kernel", "decode_gluon_kernel", "moe_gate_up_kernel", "router_gemm_kernel"}
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, SCRIPT, "--check", RECORDED], env=env, capture_output=True, text=True,
                         timeout=900)
    assert res.returncode == 0, (
        "a default decode/MoE launch differs from what bench/results measured on the H200: measure the change "
        "there, commit the results, then re-record bench/results/fingerprints.json "
        "(python scripts/ptx_fingerprint.py > bench/results/fingerprints.json)\n"
        + "\n".join(line for line in res.stdout.splitlines() if "same PTX" not in line) + res.stderr[-3000:])
