"""Test-only repairs for Triton's CPU interpreter (TRITON_INTERPRET=1), Triton 3.6 + torch 2.13 CPU.

The interpreter evaluates kernels with numpy, and numpy has no bfloat16 or float8. Upstream
therefore (a) runs bf16 arithmetic and bf16 `tl.dot` on the raw uint16 bit patterns, (b) converts
fp32 -> fp8 with a hand-written rounding that loses the carry out of the mantissa (126.2 -> 64),
and (c) converts fp32 -> bf16 by truncation. Each defect would make CPU tests either fail on
correct kernels or pass wrong ones, exactly on our workloads (bf16 attention, fp8 KV writes, fp8
MoE activations). We route every float conversion through torch (round-to-nearest-even, with
`satfinite` clamping for fp8 as the sm90 `cvt.rn.satfinite` does) and run bf16 maths in fp32.

This patches private interpreter internals, so Triton is pinned in CI and
`tests/test_interpreter_fidelity.py` proves each repair (with the patch) and each defect
(without it: the canary that tells us when upstream has fixed it and this file can go).
"""

from __future__ import annotations

import numpy as np
import torch

_INSTALLED: dict[str, object] = {}


def _tables():
    import triton.language as tl

    to_torch = {
        tl.float64: torch.float64, tl.float32: torch.float32, tl.float16: torch.float16,
        tl.bfloat16: torch.bfloat16, tl.float8e4nv: torch.float8_e4m3fn, tl.float8e5: torch.float8_e5m2,
    }
    return tl, to_torch


_SIGNED = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_UNSIGNED_NP = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _torch_convert(data: np.ndarray, src: torch.dtype, dst: torch.dtype) -> np.ndarray:
    """Convert raw storage `data` holding `src` values into raw storage of `dst` values via torch."""
    raw = np.ascontiguousarray(data).view(_UNSIGNED_NP[src.itemsize])
    t = torch.from_numpy(raw.astype(_UNSIGNED_NP[src.itemsize])).view(_SIGNED[src.itemsize]).view(src)
    if dst.itemsize == 1 and dst.is_floating_point:
        big = torch.finfo(dst).max
        wide = t.float()
        t = torch.where(torch.isnan(wide), wide, wide.clamp(-big, big))
    return t.to(dst).view(_SIGNED[dst.itemsize]).numpy().view(_UNSIGNED_NP[dst.itemsize])


def install() -> None:
    """Install the repairs (idempotent). Call after TRITON_INTERPRET=1 is set, before kernels run."""
    if _INSTALLED:
        return
    import triton.runtime.interpreter as interp

    tl, to_torch = _tables()
    builder = interp.InterpreterBuilder
    orig = {
        "convert": interp._convert_float,
        "dot": builder.create_dot,
        "binary": builder.binary_op,
        "load": builder.create_masked_load,
        "store": builder.create_masked_store,
    }

    def convert_float(data, src_tl, dst_tl, rounding_mode):
        src, dst = to_torch.get(src_tl), to_torch.get(dst_tl)
        round_to_zero = rounding_mode is not None and "RTZ" in str(rounding_mode).upper()
        if src is None or dst is None or round_to_zero:
            return orig["convert"](data, src_tl, dst_tl, rounding_mode)
        return _torch_convert(data, src, dst)

    def as_fp32(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        return interp.TensorHandle(convert_float(handle.data, tl.bfloat16, tl.float32, None).view(np.float32),
                                   tl.float32)

    def create_dot(self, a, b, acc, input_precision, max_num_imprecise_acc):
        return orig["dot"](self, as_fp32(a), as_fp32(b), acc, input_precision, max_num_imprecise_acc)

    def binary_op(self, lhs, rhs, op):
        if tl.bfloat16 not in (lhs.dtype.scalar, rhs.dtype.scalar):
            return orig["binary"](self, lhs, rhs, op)
        out = orig["binary"](self, as_fp32(lhs), as_fp32(rhs), op)
        if out.data.dtype != np.float32:  # comparisons give bool
            return out
        bits = convert_float(out.data, tl.float32, tl.bfloat16, None).view(np.uint16)
        return interp.TensorHandle(bits, tl.bfloat16)

    def bool_mask(mask):
        # tensor-descriptor loads hand in a raw numpy mask; ordinary loads a TensorHandle
        if not isinstance(mask, interp.TensorHandle):
            return mask
        return interp.TensorHandle(mask.data.astype(np.bool_), tl.int1)

    def masked_load(self, ptrs, mask, other, *rest, **kw):
        return orig["load"](self, ptrs, bool_mask(mask), other, *rest, **kw)

    def masked_store(self, ptrs, value, mask, *rest, **kw):
        return orig["store"](self, ptrs, value, bool_mask(mask), *rest, **kw)

    interp._convert_float = convert_float
    builder.create_dot = create_dot
    builder.binary_op = binary_op
    builder.create_masked_load = masked_load
    builder.create_masked_store = masked_store
    _INSTALLED.update(orig)


def uninstall() -> None:
    """Restore upstream behaviour (used by the canary tests)."""
    if not _INSTALLED:
        return
    import triton.runtime.interpreter as interp

    builder = interp.InterpreterBuilder
    interp._convert_float = _INSTALLED["convert"]
    builder.create_dot = _INSTALLED["dot"]
    builder.binary_op = _INSTALLED["binary"]
    builder.create_masked_load = _INSTALLED["load"]
    builder.create_masked_store = _INSTALLED["store"]
    _INSTALLED.clear()
