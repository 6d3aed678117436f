"""hpcops inside vLLM, through a ``vllm.general_plugins`` entry point (no vLLM source change).

``register()`` (the entry point, run by vLLM in every process before it parses its config):

* registers the attention backend ``HPCOPS`` → `hpcops.integrations.vllm.attention.HpcopsAttentionBackend`
  (``vllm serve MODEL --attention-backend HPCOPS``);
* with ``HPCOPS_MOE=1``, hooks `hpcops.integrations.vllm.moe.HpcopsExperts` into vLLM's unquantized
  and fp8 MoE backend oracles.

Supported vLLM: ``>=0.30,<0.35`` (tested 0.32.0, 0.33.0, 0.34.0). Outside that range the backend name is still
registered, so that ``--attention-backend HPCOPS`` fails at selection with the version message
(rather than "unknown backend"), and ``HPCOPS_MOE=1`` raises at plugin load. This module imports
vLLM only inside `register`.
"""

from __future__ import annotations

import logging

from hpcops.integrations.vllm._version import SUPPORTED_RANGE, TESTED_VLLM, unsupported_reason

BACKEND_NAME = "HPCOPS"
BACKEND_PATH = "hpcops.integrations.vllm.attention.HpcopsAttentionBackend"

__all__ = ["BACKEND_NAME", "BACKEND_PATH", "SUPPORTED_RANGE", "TESTED_VLLM", "register"]

logger = logging.getLogger("hpcops.integrations.vllm")


def _register_attention() -> None:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    member = AttentionBackendEnum.__members__.get(BACKEND_NAME)
    if member is None:
        register_backend(BACKEND_NAME, BACKEND_PATH)
    elif member.get_path() != BACKEND_PATH:
        register_backend(member, BACKEND_PATH)


def register() -> None:
    """The ``vllm.general_plugins`` entry point. Re-entrant: vLLM calls it in every process."""
    from hpcops.integrations.vllm._env import moe_enabled

    reason = unsupported_reason()
    try:
        _register_attention()
    except ImportError as e:  # a vLLM without the backend registry (< 0.30)
        logger.warning("hpcops: attention backend HPCOPS not registered: %s (%s)", reason or "", e)
    if reason is not None:
        if moe_enabled():
            raise RuntimeError(f"HPCOPS_MOE=1: {reason}")
        logger.warning("hpcops: %s", reason)
        return
    if moe_enabled():
        from hpcops.integrations.vllm.moe import install_moe_hook

        install_moe_hook()
