"""Fused MoE: routing (`select_experts`, `route`), the device-side index, and `fused_moe` (see README.md).

The function is `hpcops.fused_moe` (or `hpcops.moe.fused_moe.fused_moe`): `hpcops.moe.fused_moe` is its module, as
Python's imports make a submodule's name an attribute of its package (a lazy attribute of the same name recursed).
"""

from __future__ import annotations

__all__ = ["select_experts", "route", "MoeConfig", "get_config", "build_moe_index", "MoeIndex"]


def __getattr__(name: str):
    if name in ("select_experts", "route", "build_moe_index", "MoeIndex"):
        from hpcops.moe import routing as _r

        return getattr(_r, name)
    if name in ("MoeConfig", "get_config"):
        from hpcops.moe import configs as _c

        return getattr(_c, name)
    raise AttributeError(f"module 'hpcops.moe' has no attribute {name!r}")
