"""Environment switches of the vLLM integration (read at call time, in every vLLM process)."""

from __future__ import annotations

import os

ENV_MOE = "HPCOPS_MOE"


def moe_enabled() -> bool:
    """``HPCOPS_MOE=1``: route vLLM's fused MoE to `HpcopsExperts` where it supports the config."""
    return os.environ.get(ENV_MOE, "0").strip().lower() not in ("", "0", "false", "no", "off")
