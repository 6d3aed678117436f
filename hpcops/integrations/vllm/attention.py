"""vLLM attention backend ``HPCOPS``: hpcops decode (load-balanced plan) + prefill/extend kernels.

Imported only by vLLM (through the name registered by `hpcops.integrations.vllm.register`); it
imports vLLM at module level. Written against vLLM's 0.30+ interfaces (see `_version.py`):

* KV cache: vLLM hands each layer the logical packed view ``[num_blocks, Hkv, block_size, 2·D]``
  whose physical order is the resolved `KVCacheLayout` (we ask for LBNHC, vLLM's default: memory
  ``[num_blocks, block_size, Hkv, K|V]``). ``kv_cache.transpose(1, 2).split(D, -1)`` gives two
  strided ``[num_blocks, block_size, Hkv, D]`` views, exactly what the hpcops kernels take.
* KV write: ``forward_includes_kv_cache_update = False``; vLLM calls `do_kv_cache_update` before `forward`:
  `hpcops.store_kv`, one launch (fp8-quantized with ``layer._k_scale/_v_scale`` for an fp8 cache).
* Prefill over an fp8 cache: q quantized per (token, head) to e4m3 and the fp8-q kernels
  (`prefill_attention(quantize_q=True)`), as vLLM's FlashAttention backend quantizes q over an fp8 cache;
  ``HPCOPS_PREFILL_QUANT_Q=0`` keeps the 16-bit q. Decode keeps the 16-bit q.
* Metadata: decodes first (``reorder_batch_threshold`` = 1 + speculative tokens); `build` runs
  `hpcops.plan_decode` once per step into a plan allocated in ``__init__`` for
  (max_num_seqs, max_model_len); every layer's decode reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from hpcops.integrations.vllm._version import check_vllm_version

check_vllm_version()

from vllm.config import VllmConfig  # noqa: E402
from vllm.config.cache import CacheDType  # noqa: E402
from vllm.platforms import current_platform  # noqa: E402
from vllm.platforms.interface import DeviceCapability  # noqa: E402
from vllm.v1.attention.backend import (  # noqa: E402
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.attention.backends.utils import split_decodes_and_prefills  # noqa: E402
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout, KVCacheSpec  # noqa: E402

import hpcops  # noqa: E402
from hpcops.attention.decode import MAX_GQA  # noqa: E402
from hpcops.attention.plan import MAX_Q_LEN  # noqa: E402
from hpcops.integrations.vllm._env import prefill_quantize_q  # noqa: E402

BACKEND_NAME = "HPCOPS"
FP8 = torch.float8_e4m3fn
# Head sizes both the decode and the prefill kernel take (decode alone also takes 96).
SUPPORTED_HEAD_SIZES = [64, 128, 256]
SUPPORTED_BLOCK_SIZES = [16, 32, 64, 128, 256]
FP8_KV_DTYPES = ("fp8", "fp8_e4m3")


@dataclass
class HpcopsAttentionMetadata(AttentionMetadata):
    """Per-step metadata (decodes are the first `num_decodes` requests / `num_decode_tokens` rows)."""

    num_actual_tokens: int
    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    num_prefill_tokens: int
    decode_q_len: int
    """Query tokens of every decode request (1, or 1 + speculative tokens: uniform)."""
    max_query_len: int
    seq_lens: torch.Tensor
    """int32 [num_reqs], KV length including the new tokens."""
    block_table: torch.Tensor
    """int32 [num_reqs, max_blocks] in kernel blocks."""
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    decode_plan: object | None = None
    """`hpcops.DecodePlan` for the decodes of this step (shared by all layers), None without decodes."""
    prefill_cu_seqlens: torch.Tensor | None = None
    """int32 [num_prefills + 1], query offsets of the prefill/extend requests rebased to 0."""
    prefill_max_query_len: int = 0


class HpcopsAttentionMetadataBuilder(AttentionMetadataBuilder[HpcopsAttentionMetadata]):
    """Splits decodes (uniform q_len) from prefills/extends and plans the decode once per step."""

    # Decode batches of one uniform q_len (1 + speculative tokens) are graph safe: the plan is
    # written in `build` (outside the graph) into persistent buffers that the kernels read.
    # Mixed prefill/decode batches launch grids sized from host shapes, so they run piecewise.
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH

    def __init__(self, kv_cache_spec: KVCacheSpec, layer_names: list[str], vllm_config: VllmConfig,
                 device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        assert isinstance(kv_cache_spec, AttentionSpec)
        self.num_kv_heads = kv_cache_spec.num_kv_heads
        self.head_size = kv_cache_spec.head_size
        self.block_size = kv_cache_spec.block_size
        self._init_reorder_batch_threshold(1, supports_spec_as_decode=True)
        max_q = self.reorder_batch_threshold or 1
        if max_q > MAX_Q_LEN:
            raise ValueError(
                f"HPCOPS attention decodes at most {MAX_Q_LEN} query tokens per request "
                f"(num_speculative_tokens ≤ {MAX_Q_LEN - 1}); this config needs {max_q}. Reduce "
                "num_speculative_tokens or pick another --attention-backend.")
        self.max_num_seqs = vllm_config.scheduler_config.max_num_seqs
        self.max_model_len = vllm_config.model_config.max_model_len
        try:
            hq = vllm_config.model_config.get_num_attention_heads(vllm_config.parallel_config)
        except Exception:  # a config without attention heads (e.g. a hand-built test config)
            hq = None
        # One persistent plan per possible decode q_len, allocated once for max_num_seqs requests
        # (plan buffers do not depend on max_model_len; it is passed for the record), told what every
        # layer's call takes, as `hpcops.plan_decode` asks: its kernel, tail merge and cut costs follow them.
        empty = torch.zeros(0, dtype=torch.int32, device=device)
        self.plans = {
            q: hpcops.plan_decode(empty, num_kv_heads=self.num_kv_heads, q_len=q, block_size=self.block_size,
                                  max_batch=self.max_num_seqs, max_seq_len=self.max_model_len,
                                  **self._plan_hints(vllm_config, kv_cache_spec, hq))
            for q in range(1, max_q + 1)
        }
        # Pre-allocate the split-KV workspace so that no allocation happens during graph capture.
        if hq and hq % self.num_kv_heads == 0:
            for q, plan in self.plans.items():
                plan.workspace(q * (hq // self.num_kv_heads), self.head_size)

    def _plan_hints(self, vllm_config: VllmConfig, kv_cache_spec: AttentionSpec, hq: int | None) -> dict:
        """`plan_decode`'s hints for this model's decode calls (none where the q heads are unknown): q in the
        model's dtype (this backend takes no quantized q), the cache's dtype (an fp8 cache, which vLLM may
        describe as uint8, is e4m3: `FP8_KV_DTYPES`)."""
        if not hq or hq % self.num_kv_heads:
            return {}
        cache_dtype = getattr(vllm_config.cache_config, "cache_dtype", "auto")
        kv_dtype = FP8 if cache_dtype in FP8_KV_DTYPES or kv_cache_spec.dtype == torch.uint8 else kv_cache_spec.dtype
        return dict(num_q_heads=hq, head_dim=self.head_size, q_dtype=vllm_config.model_config.dtype,
                    kv_dtype=kv_dtype)

    @classmethod
    def get_cudagraph_support(cls, vllm_config: VllmConfig, kv_cache_spec: KVCacheSpec) -> AttentionCGSupport:
        return cls._cudagraph_support

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> HpcopsAttentionMetadata:
        cm = common_attn_metadata
        threshold = self.reorder_batch_threshold or 1
        nd, npf, ndt, npt = split_decodes_and_prefills(cm, decode_threshold=threshold,
                                                       require_uniform=threshold > 1)
        qsl_cpu = cm.query_start_loc_cpu
        decode_q_len = 1
        plan = None
        if nd > 0:
            decode_q_len = max(1, int((qsl_cpu[1:nd + 1] - qsl_cpu[:nd]).max()))
            plan = hpcops.plan_decode(cm.seq_lens[:nd], num_kv_heads=self.num_kv_heads, q_len=decode_q_len,
                                      block_size=self.block_size, out=self.plans[decode_q_len])
        prefill_cu = None
        prefill_max = 0
        if npf > 0:
            qsl = cm.query_start_loc[nd:cm.num_reqs + 1]
            prefill_cu = (qsl - qsl[:1]).to(torch.int32)
            prefill_max = int((qsl_cpu[nd + 1:cm.num_reqs + 1] - qsl_cpu[nd:cm.num_reqs]).max())
        return HpcopsAttentionMetadata(
            num_actual_tokens=cm.num_actual_tokens, num_decodes=nd, num_decode_tokens=ndt, num_prefills=npf,
            num_prefill_tokens=npt, decode_q_len=decode_q_len, max_query_len=cm.max_query_len,
            seq_lens=cm.seq_lens, block_table=cm.block_table_tensor, slot_mapping=cm.slot_mapping,
            query_start_loc=cm.query_start_loc, decode_plan=plan, prefill_cu_seqlens=prefill_cu,
            prefill_max_query_len=prefill_max,
        )


class HpcopsAttentionBackend(AttentionBackend):
    """``--attention-backend HPCOPS``: hpcops Triton kernels (Hopper, SM ≥ 9.0; CPU via the interpreter)."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list[CacheDType]] = ["auto", "float16", "bfloat16", "fp8", "fp8_e4m3"]
    forward_includes_kv_cache_update: bool = False

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type[HpcopsAttentionImpl]:
        return HpcopsAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[HpcopsAttentionMetadataBuilder]:
        return HpcopsAttentionMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        # Powers of two 16..256; a larger manager block size that is a multiple of one of these is
        # split into kernel blocks by vLLM.
        return list(SUPPORTED_BLOCK_SIZES)

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(SUPPORTED_HEAD_SIZES)

    @classmethod
    def supports_block_size(cls, block_size: int | None) -> bool:
        if block_size is None:
            return True
        return any(block_size % s == 0 for s in SUPPORTED_BLOCK_SIZES)

    @classmethod
    def supports_compute_capability(cls, capability: DeviceCapability | None) -> bool:
        if capability is None:  # the CPU platform reports none: the Triton interpreter path (tests)
            return current_platform.is_cpu()
        return capability >= DeviceCapability(9, 0)

    @classmethod
    def supports_combination(cls, head_size, dtype, kv_cache_dtype, block_size, use_mla, has_sink, use_sparse,
                             use_mm_prefix, device_capability) -> str | None:
        if kv_cache_dtype in ("float16", "bfloat16") and dtype is not None:
            want = torch.float16 if kv_cache_dtype == "float16" else torch.bfloat16
            if dtype != want:
                return f"kv_cache_dtype {kv_cache_dtype} with model dtype {dtype} (a 16-bit cache must match it)"
        return None

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBNHC,)


class HpcopsAttentionImpl(AttentionImpl[HpcopsAttentionMetadata]):
    """Causal decoder self-attention over vLLM's paged, packed K|V cache."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 alibi_slopes: list[float] | None = None, sliding_window: int | None = None,
                 kv_cache_dtype: str = "auto", logits_soft_cap: float | None = None,
                 attn_type: str = AttentionType.DECODER, kv_sharing_target_layer_name: str | None = None) -> None:
        num_kv_heads = num_kv_heads or num_heads
        unsupported = []
        if attn_type != AttentionType.DECODER:
            unsupported.append(f"attn_type={attn_type} (decoder self-attention only)")
        if alibi_slopes is not None:
            unsupported.append("ALiBi")
        if sliding_window is not None:
            unsupported.append(f"sliding_window={sliding_window}")
        if logits_soft_cap:
            unsupported.append(f"logits_soft_cap={logits_soft_cap}")
        if head_size not in SUPPORTED_HEAD_SIZES:
            unsupported.append(f"head_size={head_size} (supported: {SUPPORTED_HEAD_SIZES})")
        if num_heads % num_kv_heads or not 1 <= num_heads // num_kv_heads <= MAX_GQA:
            unsupported.append(f"num_heads={num_heads}, num_kv_heads={num_kv_heads} (GQA ratio 1..{MAX_GQA})")
        if kv_cache_dtype not in HpcopsAttentionBackend.supported_kv_cache_dtypes:
            unsupported.append(f"kv_cache_dtype={kv_cache_dtype} "
                               f"(supported: {HpcopsAttentionBackend.supported_kv_cache_dtypes})")
        if unsupported:
            raise NotImplementedError("HPCOPS attention does not support: " + "; ".join(unsupported))
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_fp8 = kv_cache_dtype in FP8_KV_DTYPES
        # over an fp8 cache prefill runs the fp8-q path, as vLLM's FlashAttention backend does (HPCOPS_PREFILL_QUANT_Q)
        self.prefill_quantize_q = self.kv_fp8 and prefill_quantize_q()
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.supports_quant_query_input = False

    # ---- KV cache

    def _kv_views(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Logical [num_blocks, Hkv, block_size, 2·D] → K, V views [num_blocks, block_size, Hkv, D]."""
        if self.kv_fp8 and kv_cache.dtype != FP8:
            kv_cache = kv_cache.view(FP8)
        k_cache, v_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
        return k_cache, v_cache

    def do_kv_cache_update(self, layer, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> None:
        """The new tokens' K/V into the paged cache: `hpcops.store_kv`, one launch (fp8: e4m3(x / scale),
        saturated, with ``layer._k_scale/_v_scale``). Slots < 0 (padding) write nothing. No host sync, no
        data-dependent shapes (graph safe)."""
        k_cache, v_cache = self._kv_views(kv_cache)
        n = slot_mapping.shape[0]
        scales = {}
        if self.kv_fp8:
            scales = dict(k_scale=layer._k_scale.float().reshape(1), v_scale=layer._v_scale.float().reshape(1))
        hpcops.store_kv(key[:n], value[:n], k_cache, v_cache, slot_mapping, **scales)

    # ---- attention

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: HpcopsAttentionMetadata | None, output: torch.Tensor | None = None,
                output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        """query [T, Hq, D]; output [T, Hq, D] (rows past num_actual_tokens are padding)."""
        assert output is not None, "HPCOPS attention needs vLLM's preallocated output buffer"
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("HPCOPS attention does not fuse output quantization")
        if attn_metadata is None:  # profiling run: no KV cache yet
            return output.fill_(0)
        md = attn_metadata
        k_cache, v_cache = self._kv_views(kv_cache)
        scales = {}
        if self.kv_fp8:
            scales = dict(k_scale=layer._k_scale.float().reshape(1), v_scale=layer._v_scale.float().reshape(1))
        nd, ndt = md.num_decodes, md.num_decode_tokens
        if nd > 0:
            rows = nd * md.decode_q_len
            hpcops.decode_attention(query[:rows], k_cache, v_cache, md.block_table[:nd], md.seq_lens[:nd],
                                    plan=md.decode_plan, scale=self.scale, out=output[:rows], **scales)
        if md.num_prefills > 0:
            end = ndt + md.num_prefill_tokens
            nreq = nd + md.num_prefills
            hpcops.prefill_attention(query[ndt:end], k_cache, v_cache, md.block_table[nd:nreq],
                                     md.seq_lens[nd:nreq], md.prefill_cu_seqlens,
                                     max_seqlen_q=md.prefill_max_query_len, scale=self.scale,
                                     out=output[ndt:end], quantize_q=self.prefill_quantize_q, **scales)
        return output

