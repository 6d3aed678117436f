"""Repairs for Triton's CPU interpreter (TRITON_INTERPRET=1), applied by ``import hpcops``.

The interpreter evaluates kernels with numpy, and numpy has no bfloat16 or float8. Upstream
therefore (a) runs bf16 arithmetic and bf16 `tl.dot` on the raw uint16 bit patterns (decode
attention in bf16 gives values around 1e8, fused_moe 1e10), (b) converts fp32 -> fp8 with a
hand-written rounding that loses the carry out of the mantissa (126.2 -> 64), and (c) converts
fp32 -> bf16 by truncation. We route every float conversion through torch (round-to-nearest-even,
with `satfinite` clamping for fp8 as the sm90 `cvt.rn.satfinite` does) and run bf16 maths in fp32;
masked loads and stores also get a boolean mask. Without this, hpcops on the CPU (the demo,
debugging, the CPU test tier) would return wrong numbers without an error.

When. ``import hpcops`` calls `install_if_interpreting()`: the repair is installed when Triton
kernels will run through the interpreter (`_platform.is_interpreter()`, TRITON_INTERPRET read the
way Triton reads it) and never otherwise: a GPU run does not import the interpreter module. Set
``HPCOPS_INTERPRETER_REPAIR=0`` to leave the interpreter as upstream ships it (to reproduce an
upstream report, say); bf16 and fp8 results through it are then wrong. An explicit `install()`
ignores that variable. Idempotent; `uninstall()` restores upstream's functions (and keeps them
until the next `install()`).

Versions. Written for, and tested on, Triton 3.6 (`SUPPORTED_TRITON`; CI pins it, and
tests/test_interpreter_fidelity.py proves each repair, and with canaries that upstream still needs
it). The repair wraps private interpreter functions, so before patching it checks that each one
exists with the parameters it expects. On another Triton version whose internals match, it is
installed with a warning (once) that the combination is untested. If they do not match, nothing
is patched: `install_if_interpreting()` warns (once) that bf16 and fp8 results through the
interpreter may be wrong, and an explicit `install()` raises RuntimeError. A warning, not an
error, on ``import hpcops``: fp16/fp32 work is unaffected, and refusing the import would stop it too.
"""

from __future__ import annotations

import inspect
import os
import warnings

import numpy as np
import torch

SUPPORTED_TRITON = "3.6"
ENV = "HPCOPS_INTERPRETER_REPAIR"

# The private functions wrapped and their parameters as the wrappers take them ("..." ends those whose
# wrapper passes any further arguments through).
_EXPECTED = {
    "_convert_float": ("input", "input_dtype", "output_dtype", "rounding_mode"),
    "InterpreterBuilder.create_dot": ("self", "a", "b", "d", "input_precision", "max_num_imprecise_acc"),
    "InterpreterBuilder.binary_op": ("self", "lhs", "rhs", "op"),
    "InterpreterBuilder.create_masked_load": ("self", "ptrs", "mask", "other", "..."),
    "InterpreterBuilder.create_masked_store": ("self", "ptrs", "value", "mask", "..."),
}

_SIGNED = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_UNSIGNED_NP = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}

_INSTALLED: dict[str, object] = {}
_WARNED: set[str] = set()
_AUTO = {"on": True}  # off after an explicit uninstall(), until install()


def enabled() -> bool:
    """False when the user turned the automatic repair off (HPCOPS_INTERPRETER_REPAIR=0)."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "off", "no")


def installed() -> bool:
    return bool(_INSTALLED)


def _warn_once(key: str, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def _triton_version() -> str:
    import triton

    return triton.__version__


def incompatibility() -> str | None:
    """Why the repair cannot be applied to the installed Triton (None when it can)."""
    try:
        import triton.runtime.interpreter as interp
    except ImportError as exc:  # pragma: no cover - Triton without an interpreter
        return f"triton.runtime.interpreter does not import ({exc})"
    for path, params in _EXPECTED.items():
        obj = interp
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                return f"triton.runtime.interpreter.{path} is missing"
        try:
            have = tuple(inspect.signature(obj).parameters)
        except (TypeError, ValueError):
            return f"triton.runtime.interpreter.{path} has no inspectable signature"
        prefix = params[-1] == "..."
        want = params[:-1] if prefix else params
        if (have[: len(want)] if prefix else have) != want:
            return f"triton.runtime.interpreter.{path} takes {have}, the repair expects {params}"
    if not hasattr(interp, "TensorHandle"):
        return "triton.runtime.interpreter.TensorHandle is missing"
    return None


def _tables():
    import triton.language as tl

    to_torch = {
        tl.float64: torch.float64, tl.float32: torch.float32, tl.float16: torch.float16,
        tl.bfloat16: torch.bfloat16, tl.float8e4nv: torch.float8_e4m3fn, tl.float8e5: torch.float8_e5m2,
    }
    return tl, to_torch


def _torch_convert(data, src, dst):
    """Convert raw numpy storage `data` holding `src` values into raw storage of `dst` values via torch."""
    raw = np.ascontiguousarray(data).view(_UNSIGNED_NP[src.itemsize])
    t = torch.from_numpy(raw.astype(_UNSIGNED_NP[src.itemsize])).view(_SIGNED[src.itemsize]).view(src)
    if dst.itemsize == 1 and dst.is_floating_point:
        big = torch.finfo(dst).max
        wide = t.float()
        t = torch.where(torch.isnan(wide), wide, wide.clamp(-big, big))
    return t.to(dst).view(_SIGNED[dst.itemsize]).numpy().view(_UNSIGNED_NP[dst.itemsize])


def install() -> None:
    """Install the repairs (idempotent), whatever HPCOPS_INTERPRETER_REPAIR says.

    Raises RuntimeError when this Triton's interpreter internals are not the ones the repair wraps;
    warns once when they match but the Triton version is not `SUPPORTED_TRITON`.
    """
    _AUTO["on"] = True
    if _INSTALLED:
        return
    reason = incompatibility()
    if reason is not None:
        raise RuntimeError(f"hpcops cannot repair the interpreter of Triton {_triton_version()} ({reason}); "
                           f"the repair was written for Triton {SUPPORTED_TRITON}")
    version = _triton_version()
    if version.split(".")[:2] != SUPPORTED_TRITON.split("."):
        _warn_once("version", f"hpcops repairs Triton's interpreter (bf16 maths, fp8/bf16 rounding) for Triton "
                              f"{SUPPORTED_TRITON}; Triton {version} is untested: the repair is applied because "
                              f"the internals it wraps match (check it with tests/test_interpreter_fidelity.py; "
                              f"{ENV}=0 turns it off)")
    _patch()


def numpy_incompatibility() -> str | None:
    """Why Triton's interpreter itself cannot run here (None when it can): Triton 3.6's interpreter
    converts 1-element arrays to Python ints, which numpy 2.4 made an error ("only 0-dimensional arrays
    can be converted to Python scalars" inside a kernel's loop bounds)."""
    import numpy as np

    np_v = tuple(int(p) for p in np.__version__.split(".")[:2] if p.isdigit())
    if _triton_version().startswith("3.6") and np_v >= (2, 4):
        return (f"Triton {_triton_version()}'s interpreter fails with numpy {np.__version__} (\"only 0-dimensional "
                "arrays can be converted to Python scalars\"): install numpy<2.4 to run kernels on the CPU")
    return None


def install_if_interpreting() -> bool:
    """What ``import hpcops`` runs: install when kernels will run through the interpreter and the user has
    not set HPCOPS_INTERPRETER_REPAIR=0; never raises. Returns whether the repair is installed. Also warns
    (once) when the installed numpy breaks the interpreter itself (`numpy_incompatibility`)."""
    from hpcops._platform import is_interpreter

    if is_interpreter() and (why := numpy_incompatibility()) is not None:
        _warn_once("numpy", why)
    if _INSTALLED or not _AUTO["on"] or not is_interpreter() or not enabled():
        return bool(_INSTALLED)
    reason = incompatibility()
    if reason is not None:
        _warn_once("incompatible", f"hpcops could not repair the interpreter of Triton {_triton_version()} "
                                   f"({reason}; the repair was written for Triton {SUPPORTED_TRITON}): bf16 "
                                   "arithmetic and fp8/bf16 rounding through TRITON_INTERPRET=1 may give wrong "
                                   "results")
        return False
    install()
    return True


def _patch() -> None:
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

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return orig["dot"](self, as_fp32(a), as_fp32(b), d, input_precision, max_num_imprecise_acc)

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
    """Restore upstream behaviour (the canary tests use it); hpcops does not reinstall it by itself until
    `install()` is called."""
    _AUTO["on"] = False
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
