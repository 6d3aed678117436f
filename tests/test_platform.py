"""hpcops on a CPU, as a user meets it: the in-package interpreter repair and the clear error for CPU
tensors without the interpreter. The user-facing cases run in a plain subprocess (cwd outside tests/,
so without this suite's conftest), the way `python -c` or a notebook would."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import triton

from hpcops import _checks, _platform

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU_ERROR = "is on cpu, but hpcops kernels need a CUDA device"


def _run(script: str, tmp_path, **env_changes: str | None) -> dict:
    """Run `script` in a fresh interpreter outside tests/; it prints one JSON line last."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRITON_INTERPRET", "HPCOPS_INTERPRETER_REPAIR", "HPCOPS_CHECK")}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.update({k: v for k, v in env_changes.items() if v is not None})
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------- TRITON_INTERPRET parsing
@pytest.mark.parametrize("value", ["1", "true", "TRUE", "on", "Yes", "y", "0", "", "2", "false", "off", " 1"])
def test_is_interpreter_reads_the_variable_like_triton(value, monkeypatch):
    """hpcops and Triton agree on the mode (else the repair could patch a GPU run, or miss a CPU one)."""
    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert _platform.is_interpreter() == triton.knobs.runtime.interpret


# ---------------------------------------------------------------- the interpreter repair
BF16_OPS = """
import json, torch, hpcops
from hpcops.attention import reference as aref
from hpcops.moe import reference as mref
from hpcops.testing import assert_close, make_paged_kv

def top(t):
    return f"{t.float().abs().max().item():.3g}"


torch.manual_seed(0)
res = {}
kv = make_paged_kv([70, 5, 130], num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.bfloat16)
q = torch.randn(3, 8, 64).bfloat16()
plan = hpcops.plan_decode(kv.seq_lens, num_kv_heads=2, block_size=16, num_programs=4, min_tiles=1)
got = hpcops.decode_attention(q, kv.k_cache, kv.v_cache, kv.block_table, kv.seq_lens, plan=plan)
want = aref.decode_attention(q, kv.k_cache, kv.v_cache, kv.block_table, kv.seq_lens)
T, H, I, E, k = 5, 128, 64, 4, 2
x = torch.randn(T, H).bfloat16()
w13 = (torch.randn(E, 2 * I, H) / H ** 0.5).bfloat16()
w2 = (torch.randn(E, H, I) / I ** 0.5).bfloat16()
w, ids = hpcops.select_experts(torch.randn(T, E), k)
got_moe = hpcops.fused_moe(x, w13, w2, w, ids)
want_moe = mref.fused_moe(x, w13, w2, w, ids)
for name, g, r in (("decode_attention", got, want), ("fused_moe", got_moe, want_moe)):
    try:
        assert_close(r, g, name=name)  # the bf16 tolerances of the test suite
        res[name] = "ok"
    except AssertionError as exc:
        res[name] = f"{exc} (max |got| {top(g)}, max |ref| {top(r)})"
print(json.dumps(res))
"""


# Runs Triton's interpreter in a subprocess: it needs the CPU tier's numpy<2.4 (the GPU image has numpy 2.5).
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-tier check (the interpreter needs numpy<2.4; the GPU "
                                                      "image has its own numpy)")
def test_bf16_through_the_public_api_on_the_cpu(tmp_path):
    """TRITON_INTERPRET=1 and a plain `import hpcops`: bf16 decode and MoE match the torch references
    (unrepaired, the interpreter gives ~1e8 and ~1e10 where the references are ~3 and ~1)."""
    res = _run(BF16_OPS, tmp_path, TRITON_INTERPRET="1")
    assert res == {"decode_attention": "ok", "fused_moe": "ok"}, res


PATCHED = """
import json, sys
import hpcops
hpcops.decode_attention, hpcops.fused_moe  # the ops' modules (and their kernels) load
from hpcops import _interpreter
interp = sys.modules.get("triton.runtime.interpreter")
funcs = [] if interp is None else [interp._convert_float, interp.InterpreterBuilder.binary_op,
                                   interp.InterpreterBuilder.create_dot]
print(json.dumps({"installed": _interpreter.installed(), "interpreter_loaded": interp is not None,
                  "patched": [f.__module__ == "hpcops._interpreter" for f in funcs]}))
"""


@pytest.mark.parametrize("env, want", [
    ({"TRITON_INTERPRET": "1"}, {"installed": True, "interpreter_loaded": True, "patched": [True] * 3}),
    ({"TRITON_INTERPRET": "1", "HPCOPS_INTERPRETER_REPAIR": "0"},
     {"installed": False, "interpreter_loaded": True, "patched": [False] * 3}),
    ({}, {"installed": False, "interpreter_loaded": False, "patched": []}),  # a GPU run: Triton untouched
], ids=["interpreter", "repair-off", "no-interpreter"])
def test_repair_installed_only_under_the_interpreter(env, want, tmp_path):
    assert _run(PATCHED, tmp_path, **env) == want


# ---------------------------------------------------------------- CPU tensors without the interpreter
CPU_OPS = """
import json, torch, hpcops
from hpcops.testing import make_paged_kv

kv = make_paged_kv([30, 50], num_kv_heads=2, head_dim=64, block_size=16)
q = torch.randn(2, 4, 64).bfloat16()
qkv = torch.randn(3, (4 + 2 * 2) * 64).bfloat16()
pos = torch.arange(3)
cos_sin = torch.randn(64, 64)
x = torch.randn(3, 128).bfloat16()
w, ids = hpcops.select_experts(torch.randn(3, 4), 2)  # without the interpreter: its torch reference
calls = {
    "plan_decode": lambda: hpcops.plan_decode(kv.seq_lens, num_kv_heads=2, block_size=16),
    "decode_attention": lambda: hpcops.decode_attention(q, kv.k_cache, kv.v_cache, kv.block_table, kv.seq_lens),
    "prefill_attention": lambda: hpcops.prefill_attention(
        q, kv.k_cache, kv.v_cache, kv.block_table, kv.seq_lens, torch.tensor([0, 1, 2], dtype=torch.int32),
        max_seqlen_q=1),
    "rope_norm_store_kv": lambda: hpcops.rope_norm_store_kv(
        qkv, pos, cos_sin, kv.k_cache, kv.v_cache, pos, num_q_heads=4, num_kv_heads=2, head_dim=64, order="rope"),
    "fused_moe": lambda: hpcops.fused_moe(x, torch.randn(4, 128, 128).bfloat16(), torch.randn(4, 128, 64).bfloat16(),
                                          w, ids),
}
res = {}
for name, call in calls.items():
    try:
        call()
        res[name] = "no error"
    except Exception as exc:
        res[name] = f"{type(exc).__name__}: {exc}"
print(json.dumps(res))
"""


@pytest.fixture(scope="module")
def cpu_errors(tmp_path_factory):
    return _run(CPU_OPS, tmp_path_factory.mktemp("cpu_ops"))


@pytest.mark.parametrize("op, arg", [
    ("plan_decode", "seq_lens"), ("decode_attention", "q"), ("prefill_attention", "q"),
    ("rope_norm_store_kv", "qkv"), ("fused_moe", "x"),
])
def test_cpu_tensors_without_the_interpreter(op, arg, cpu_errors):
    """Without TRITON_INTERPRET, CPU tensors get a ValueError naming the argument and the way out,
    not Triton's "0 active drivers"."""
    assert cpu_errors[op].startswith(f"ValueError: {arg} {CPU_ERROR}"), cpu_errors[op]
    assert "TRITON_INTERPRET=1" in cpu_errors[op]


def test_check_kernel_device(monkeypatch):
    monkeypatch.setattr(_checks, "is_interpreter", lambda: False)
    t = torch.zeros(3)
    with pytest.raises(ValueError, match=f"t {CPU_ERROR}"):
        _checks.check_kernel_device("t", t)
    assert not _checks.kernels_are_replaced()
    with _checks.kernels_replaced():  # stand-in kernels (recorded launches) run nowhere
        _checks.check_kernel_device("t", t)
        assert _checks.kernels_are_replaced()  # and compute nothing: no plan tables to compare
    with pytest.raises(ValueError, match=CPU_ERROR):
        _checks.check_kernel_device("t", t)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():  # tracing (torch.compile, opcheck): nothing launches
        _checks.check_kernel_device("t", torch.zeros(3))
    monkeypatch.setattr(_checks, "is_interpreter", lambda: True)
    _checks.check_kernel_device("t", t)


def test_numpy_that_breaks_the_interpreter_is_named(monkeypatch):
    """Triton 3.6's interpreter fails inside kernels with numpy >= 2.4: hpcops says so in one sentence."""
    import numpy as np

    from hpcops import _interpreter

    monkeypatch.setattr(_interpreter, "_triton_version", lambda: "3.6.0")
    monkeypatch.setattr(np, "__version__", "2.5.2")
    assert "install numpy<2.4" in _interpreter.numpy_incompatibility()
    monkeypatch.setattr(np, "__version__", "2.3.5")
    assert _interpreter.numpy_incompatibility() is None
