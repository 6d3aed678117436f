"""hpcops: Triton kernels for LLM serving on Hopper.

Public functional API (each op has a torch reference with the same signature in
``hpcops.<area>.reference``). Submodules load on first use, so ``import hpcops`` stays cheap and
does not import Triton kernels until an op is called.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "DecodePlan": "hpcops.attention.plan",
    "plan_decode": "hpcops.attention.plan",
    "decode_attention": "hpcops.attention.decode",
    "prefill_attention": "hpcops.attention.prefill",
    "rope_norm_store_kv": "hpcops.rope.prologue",
    "fused_moe": "hpcops.moe.fused_moe",
    "select_experts": "hpcops.moe.routing",
    "Fp8PerTensor": "hpcops.quant",
    "Fp8Block128": "hpcops.quant",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hpcops' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
