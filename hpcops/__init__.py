"""hpcops: Triton kernels for LLM serving on Hopper.

Public functional API (each op has a torch reference with the same signature in
``hpcops.<area>.reference``). Submodules load on first use, so ``import hpcops`` stays cheap and
does not import Triton kernels until an op is called.

Under Triton's CPU interpreter (TRITON_INTERPRET=1, set before importing hpcops) the import also
repairs the interpreter's bf16 arithmetic and fp8/bf16 rounding, without which bf16 and fp8 results
on the CPU are silently wrong (``hpcops/_interpreter.py``; HPCOPS_INTERPRETER_REPAIR=0 turns it off).
Nothing is patched otherwise.
"""

from __future__ import annotations

import importlib

from hpcops import _platform

__version__ = "0.1.0"

_EXPORTS = {
    "DecodePlan": "hpcops.attention.plan",
    "plan_decode": "hpcops.attention.plan",
    "decode_attention": "hpcops.attention.decode",
    "prefill_attention": "hpcops.attention.prefill",
    "rope_norm_store_kv": "hpcops.rope.prologue",
    "store_kv": "hpcops.attention.kv_store",
    "fused_moe": "hpcops.moe.fused_moe",
    "select_experts": "hpcops.moe.routing",
    "route": "hpcops.moe.routing",
    "Fp8PerTensor": "hpcops.quant",
    "Fp8Block128": "hpcops.quant",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def _repair_interpreter() -> None:
    if _platform.is_interpreter():
        from hpcops import _interpreter

        _interpreter.install_if_interpreting()


_repair_interpreter()


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hpcops' has no attribute {name!r}")
    _repair_interpreter()  # TRITON_INTERPRET may have been set after `import hpcops` (the CLI does so)
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
