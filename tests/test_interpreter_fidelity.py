"""Proves each interpreter repair of `hpcops._interpreter` and, as a canary, that upstream still needs it.

If a canary fails, upstream Triton fixed that defect: drop the matching repair."""

from __future__ import annotations

import warnings

import pytest
import torch
import triton
import triton.language as tl
from conftest import HAS_CUDA

from hpcops import _interpreter

pytestmark = pytest.mark.skipif(HAS_CUDA, reason="interpreter-only checks")


@triton.jit
def _probe_dot_kernel(a_ptr, b_ptr, c_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    a = tl.load(a_ptr + i[:, None] * N + i[None, :])
    b = tl.load(b_ptr + i[:, None] * N + i[None, :])
    c = tl.dot(a, b)
    tl.store(c_ptr + i[:, None] * N + i[None, :], c)


@triton.jit
def _probe_add_kernel(a_ptr, b_ptr, c_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(c_ptr + i, tl.load(a_ptr + i) + tl.load(b_ptr + i))


@triton.jit
def _probe_cast_kernel(x_ptr, y_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(y_ptr + i, tl.load(x_ptr + i).to(y_ptr.dtype.element_ty))


def _dot_bf16():
    a = torch.randn(16, 16).bfloat16()
    b = torch.randn(16, 16).bfloat16()
    c = torch.full((16, 16), float("nan"))
    _probe_dot_kernel[(1,)](a, b, c, N=16)
    return (c - a.float() @ b.float()).abs().max().item()


def _add_bf16():
    a, b = torch.randn(64).bfloat16(), torch.randn(64).bfloat16()
    c = torch.empty(64, dtype=torch.bfloat16)
    _probe_add_kernel[(1,)](a, b, c, N=64)
    return torch.equal(c, a + b)


def _cast(x: torch.Tensor, dtype: torch.dtype) -> bool:
    y = torch.empty(x.shape, dtype=dtype)
    _probe_cast_kernel[(1,)](x, y, N=x.numel())
    return torch.equal(y.view(torch.uint8) if dtype.itemsize == 1 else y.view(torch.int16),
                       x.to(dtype).view(torch.uint8) if dtype.itemsize == 1 else x.to(dtype).view(torch.int16))


def _fp8_probe_values():
    # 126.24 rounds up to 128 (a carry out of the mantissa); the rest are random, in range.
    return torch.cat([torch.tensor([126.24, -126.24, 0.0, 1.0, 447.0]), torch.randn(59) * 40])


def _bf16_probe_values():
    return torch.randn(64) * 3


PROBES = {
    "bf16_dot": lambda: _dot_bf16() < 1e-3,
    "bf16_add": _add_bf16,
    "fp32_to_fp8": lambda: _cast(_fp8_probe_values(), torch.float8_e4m3fn),
    "fp32_to_bf16": lambda: _cast(_bf16_probe_values(), torch.bfloat16),
}


@pytest.mark.parametrize("probe", sorted(PROBES))
def test_repaired(probe):
    _interpreter.install()
    assert PROBES[probe](), f"{probe} is wrong even with the fidelity repairs installed"


@pytest.mark.parametrize("probe", sorted(PROBES))
def test_canary_upstream_still_broken(probe):
    _interpreter.uninstall()
    try:
        broken = not PROBES[probe]()
    except Exception:  # upstream raising on bf16 is also "broken"
        broken = True
    finally:
        _interpreter.install()
    assert broken, f"upstream Triton now gets {probe} right: remove that repair from hpcops/_interpreter.py"


# ---------------------------------------------------------------- installing
def test_install_is_idempotent():
    import triton.runtime.interpreter as interp

    _interpreter.install()
    patched = (interp._convert_float, interp.InterpreterBuilder.binary_op)
    _interpreter.install()
    assert (interp._convert_float, interp.InterpreterBuilder.binary_op) == patched
    assert patched[0].__module__ == "hpcops._interpreter"


def test_uninstall_holds_until_install(monkeypatch):
    monkeypatch.delenv("HPCOPS_INTERPRETER_REPAIR", raising=False)
    _interpreter.uninstall()
    try:
        assert _interpreter.install_if_interpreting() is False  # `import hpcops` paths do not undo it
        assert not _interpreter.installed()
    finally:
        _interpreter.install()
    assert _interpreter.installed()


def test_other_triton_version_warns_once(monkeypatch):
    monkeypatch.setattr(_interpreter, "_triton_version", lambda: "3.9.0")
    monkeypatch.setattr(_interpreter, "_WARNED", set())
    _interpreter.uninstall()
    try:
        with pytest.warns(RuntimeWarning, match="Triton 3.9.0 is untested"):
            _interpreter.install()
        assert _interpreter.installed()
        _interpreter.uninstall()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            _interpreter.install()
    finally:
        _interpreter.install()


def test_unknown_internals_are_not_patched(monkeypatch):
    """Internals other than those the repair wraps: an explicit install raises, the automatic one (what
    `import hpcops` runs) warns that bf16/fp8 results may be wrong; neither patches anything."""
    import triton.runtime.interpreter as interp

    monkeypatch.delenv("HPCOPS_INTERPRETER_REPAIR", raising=False)
    monkeypatch.setattr(_interpreter, "_WARNED", set())
    _interpreter.uninstall()
    try:
        monkeypatch.setattr(interp.InterpreterBuilder, "binary_op", lambda self, lhs, rhs, op, flags: None)
        original_convert = interp._convert_float
        with pytest.raises(RuntimeError, match="binary_op takes"):
            _interpreter.install()
        with pytest.warns(RuntimeWarning, match="may give wrong results"):
            assert _interpreter.install_if_interpreting() is False
        assert not _interpreter.installed() and interp._convert_float is original_convert
    finally:
        monkeypatch.undo()
        _interpreter.install()
