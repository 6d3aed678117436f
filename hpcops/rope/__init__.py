"""Fused attention prologue: `rope_norm_store_kv` (QK-RMSNorm + RoPE + paged KV write + fp8 q).

Launcher: `hpcops.rope.prologue`; kernels: `_rope_kernels`; torch reference: `hpcops.rope.reference`.
Submodules load on first use so that `import hpcops.rope.reference` does not import Triton.
"""

from __future__ import annotations

import importlib

__all__ = ["rope_norm_store_kv"]


def __getattr__(name: str):
    if name == "rope_norm_store_kv":
        return importlib.import_module("hpcops.rope.prologue").rope_norm_store_kv
    raise AttributeError(f"module 'hpcops.rope' has no attribute {name!r}")
