"""vLLM fused-MoE experts over `hpcops.fused_moe`, and the opt-in hook into vLLM's MoE backend oracle.

`HpcopsExperts` is a `FusedMoEExpertsModular` (Standard activation format): vLLM's router gives
top-k ids/weights, vLLM's no-DP/EP prepare step hands over the *unquantized* activations
(``expects_unquantized_inputs``: our kernel quantizes inside), and the kernel does the gate-up GEMM,
SiLU-and-mul, down GEMM and the top-k weighted reduction, so the finalize step is
`TopKWeightAndReduceNoOP`.

vLLM has no registry for out-of-tree MoE backends and ``--moe-backend`` is a closed list, so with
``HPCOPS_MOE=1`` the plugin wraps two module-level functions of the unquantized and fp8 oracles
(looked up by name at call time, so no vLLM file is edited):

* ``_get_priority_backends``: the TRITON backend is moved to the front of the priority list;
* ``backend_to_kernel_cls(TRITON)``: returns ``[HpcopsExperts, <vLLM's Triton experts>...]``.

The oracle then asks ``HpcopsExperts.is_supported_config`` first and falls back to vLLM's own classes
for anything we do not support. The TRITON branch keeps vLLM's standard weight layout (w13
``[E, 2I, H]`` gate rows then up rows, w2 ``[E, H, I]``) and its standard fp8 quant config, which
is what `hpcops.fused_moe` takes. ``--moe-backend triton`` or ``auto`` both reach it.
"""

from __future__ import annotations

import functools

import torch

from hpcops.integrations.vllm._version import check_vllm_version

check_vllm_version()

import vllm.model_executor.layers.fused_moe.modular_kernel as mk  # noqa: E402
from vllm.model_executor.layers.fused_moe.activation import MoEActivation  # noqa: E402
from vllm.model_executor.layers.fused_moe.config import (  # noqa: E402
    FusedMoEConfig,
    FusedMoEParallelConfig,
    FusedMoEQuantConfig,
)
from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import TopKWeightAndReduceNoOP  # noqa: E402
from vllm.model_executor.layers.quantization.utils.quant_utils import (  # noqa: E402
    QuantKey,
    kFp8Dynamic128Sym,
    kFp8DynamicTokenSym,
    kFp8Static128BlockSym,
    kFp8StaticTensorSym,
)
from vllm.platforms import current_platform  # noqa: E402

import hpcops  # noqa: E402
from hpcops._platform import is_interpreter  # noqa: E402
from hpcops.integrations.vllm._env import ENV_MOE, moe_enabled  # noqa: E402,F401

# (weight key, activation key) pairs; None, None = bf16/fp16 weights and activations.
SUPPORTED_QUANT_SCHEMES = [
    (None, None),
    (kFp8StaticTensorSym, kFp8StaticTensorSym),  # fp8 per-tensor, static activation scales
    (kFp8StaticTensorSym, kFp8DynamicTokenSym),  # fp8 per-tensor weights, dynamic per-token activations
    (kFp8Static128BlockSym, kFp8Dynamic128Sym),  # fp8 128×128 blocks, activations per token per 128
]


def _device_ok() -> bool:
    if current_platform.is_cuda():
        cap = current_platform.get_device_capability()
        return cap is not None and cap.major >= 9
    # The CPU platform runs our kernels through the Triton interpreter (tests only: slow).
    return current_platform.is_cpu() and is_interpreter()


class HpcopsExperts(mk.FusedMoEExpertsModular):
    """Fused MoE experts backed by `hpcops.fused_moe` (bf16/fp16, fp8 per-tensor, fp8 128×128 block)."""

    def __init__(self, moe_config: FusedMoEConfig, quant_config: FusedMoEQuantConfig):
        super().__init__(moe_config, quant_config)
        self.out_dtype = moe_config.in_dtype

    @property
    def expects_unquantized_inputs(self) -> bool:
        return True  # hpcops.fused_moe quantizes the activations itself (static scale, per token or per group)

    @staticmethod
    def activation_format() -> mk.FusedMoEActivationFormat:
        return mk.FusedMoEActivationFormat.Standard

    @staticmethod
    def _supports_current_device() -> bool:
        return _device_ok()

    @staticmethod
    def _supports_no_act_and_mul() -> bool:
        return False

    @staticmethod
    def _supports_quant_scheme(weight_key: QuantKey | None, activation_key: QuantKey | None) -> bool:
        return (weight_key, activation_key) in SUPPORTED_QUANT_SCHEMES

    @staticmethod
    def _supports_activation(activation: MoEActivation) -> bool:
        return activation == MoEActivation.SILU

    @staticmethod
    def _supports_shape(hidden_dim: int) -> bool:
        return hidden_dim % 16 == 0

    @staticmethod
    def _supports_parallel_config(moe_parallel_config: FusedMoEParallelConfig) -> bool:
        # TP and EP (through expert_map) with the no-DP prepare/finalize; no all2all dispatchers.
        return not moe_parallel_config.use_all2all_kernels

    def supports_expert_map(self) -> bool:
        return True

    def supports_chunking(self) -> bool:
        return True

    def finalize_weight_and_reduce_impl(self) -> mk.TopKWeightAndReduce:
        return TopKWeightAndReduceNoOP()

    def workspace_shapes(self, M: int, N: int, K: int, topk: int, global_num_experts: int,
                         local_num_experts: int, expert_tokens_meta: mk.ExpertTokensMetadata | None,
                         activation: MoEActivation) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        # The kernel keeps its intermediates internal; vLLM only provides the [M, K] output.
        return (0,), (0,), (M, K)

    def _quant(self):
        qc = self.quant_config
        if qc.quant_dtype is None:
            return None
        if qc.quant_dtype != torch.float8_e4m3fn:
            raise NotImplementedError(f"HpcopsExperts: unsupported quant dtype {qc.quant_dtype}")
        if qc.is_block_quantized:
            if list(qc.block_shape) != [128, 128]:
                raise NotImplementedError(f"HpcopsExperts: fp8 block shape {qc.block_shape} (only [128, 128])")
            return hpcops.Fp8Block128(qc.w1_scale.float(), qc.w2_scale.float())
        a1 = qc.a1_scale.float().reshape(1) if qc.a1_scale is not None else None
        a2 = qc.a2_scale.float().reshape(1) if qc.a2_scale is not None else None
        return hpcops.Fp8PerTensor(qc.w1_scale.float().reshape(-1), qc.w2_scale.float().reshape(-1), a1, a2)

    def apply(self, output: torch.Tensor, hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: MoEActivation,
              global_num_experts: int, expert_map: torch.Tensor | None, a1q_scale: torch.Tensor | None,
              a2_scale: torch.Tensor | None, workspace13: torch.Tensor | None, workspace2: torch.Tensor | None,
              expert_tokens_meta: mk.ExpertTokensMetadata | None,
              apply_router_weight_on_input: bool | None) -> None:
        if activation != MoEActivation.SILU:
            raise NotImplementedError(f"HpcopsExperts supports SiLU-and-mul only, got {activation}")
        if apply_router_weight_on_input:
            raise NotImplementedError("HpcopsExperts applies the router weights in its reduction, "
                                      "not on the input (apply_router_weight_on_input=True)")
        if expert_map is not None and expert_map.dtype != torch.int32:
            expert_map = expert_map.to(torch.int32)
        hpcops.fused_moe(hidden_states, w1, w2, topk_weights.float(), topk_ids.to(torch.int32),
                         quant=self._quant(), expert_map=expert_map, out=output)


# ---- the oracle hook

_HOOKED = "_hpcops_hooked"


def _wrap_oracle(module, backend_enum) -> bool:
    """Wrap `module`'s `backend_to_kernel_cls` and `_get_priority_backends` (idempotent)."""
    b2k = module.backend_to_kernel_cls
    prio = module._get_priority_backends
    if getattr(b2k, _HOOKED, False):
        return False
    triton = backend_enum.TRITON

    @functools.wraps(b2k)
    def backend_to_kernel_cls(backend, *args, **kwargs):
        classes = b2k(backend, *args, **kwargs)
        if backend == triton and moe_enabled():
            return [HpcopsExperts, *[c for c in classes if c is not HpcopsExperts]]
        return classes

    @functools.wraps(prio)
    def _get_priority_backends(*args, **kwargs):
        backends = list(prio(*args, **kwargs))
        if moe_enabled():
            if triton in backends:
                backends.remove(triton)
            backends.insert(0, triton)
        return backends

    setattr(backend_to_kernel_cls, _HOOKED, True)
    setattr(_get_priority_backends, _HOOKED, True)
    module.backend_to_kernel_cls = backend_to_kernel_cls
    module._get_priority_backends = _get_priority_backends
    return True


def install_moe_hook() -> list[str]:
    """Hook HpcopsExperts into vLLM's unquantized and fp8 MoE oracles; returns the oracles hooked now."""
    from vllm.model_executor.layers.fused_moe.oracle import fp8 as fp8_oracle
    from vllm.model_executor.layers.fused_moe.oracle import unquantized as unq_oracle

    done = []
    if _wrap_oracle(unq_oracle, unq_oracle.UnquantizedMoeBackend):
        done.append("unquantized")
    if _wrap_oracle(fp8_oracle, fp8_oracle.Fp8MoeBackend):
        done.append("fp8")
    return done
