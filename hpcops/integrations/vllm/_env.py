"""Environment switches of the vLLM integration (read at call time, in every vLLM process)."""

from __future__ import annotations

import os

ENV_MOE = "HPCOPS_MOE"


def moe_enabled() -> bool:
    """``HPCOPS_MOE=1``: route vLLM's fused MoE to `HpcopsExperts` where it supports the config."""
    return os.environ.get(ENV_MOE, "0").strip().lower() not in ("", "0", "false", "no", "off")


ENV_PREFILL_QUANT_Q = "HPCOPS_PREFILL_QUANT_Q"


def prefill_quantize_q() -> bool:
    """Over an fp8 KV cache, prefill/extend runs with q quantized per (token, head) to e4m3
    (`prefill_attention(quantize_q=True)`), as vLLM's FlashAttention backend quantizes q over an fp8 cache (there
    with a per-tensor scale). On by default; ``HPCOPS_PREFILL_QUANT_Q=0`` keeps the 16-bit q (slower: the tl
    kernel widening each fp8 K tile)."""
    return os.environ.get(ENV_PREFILL_QUANT_Q, "1").strip().lower() not in ("0", "false", "no", "off")
