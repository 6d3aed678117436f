"""Fused MoE: routing (`select_experts`, `route`), the device-side index, and `fused_moe` (see README.md)."""

from __future__ import annotations

__all__ = ["fused_moe", "select_experts", "route", "MoeConfig", "get_config", "build_moe_index", "MoeIndex"]


def __getattr__(name: str):
    if name in ("fused_moe",):
        from hpcops.moe import fused_moe as _m

        return getattr(_m, name)
    if name in ("select_experts", "route", "build_moe_index", "MoeIndex"):
        from hpcops.moe import routing as _r

        return getattr(_r, name)
    if name in ("MoeConfig", "get_config"):
        from hpcops.moe import configs as _c

        return getattr(_c, name)
    raise AttributeError(f"module 'hpcops.moe' has no attribute {name!r}")
