"""rope_norm_store_kv: fused kernel vs the torch reference (CPU tier through the interpreter; GPU tier)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from hpcops.rope import prologue, reference
from hpcops.rope.prologue import RopeConfig
from hpcops.testing import assert_close, capture_graph, nan_like

FP8 = torch.float8_e4m3fn
SENTINEL = 3.0  # every cache slot starts here; slots not in slot_mapping (or -1 rows) must keep it


@dataclass(frozen=True)
class Case:
    t: int = 7
    hq: int = 4
    hkv: int = 2
    d: int = 64
    order: str = "norm_rope"
    style: str = "neox"
    rot: int | None = None
    kv: torch.dtype = torch.bfloat16
    quantize_q: bool = False
    packed: bool = False
    skip: bool = True  # some slot_mapping rows are -1
    dtype: torch.dtype = torch.bfloat16
    cs_dtype: torch.dtype = torch.float32
    block_size: int = 16
    block_t: int = 4
    block_kv: int | None = None  # kv programs' tokens (None: the launcher's default)
    strided_blocks: bool = False  # cache blocks not adjacent: block stride != block_size * slot stride
    cs_smem: bool = False  # RopeConfig.cos_sin_smem
    pad_cols: int = 24  # qkv row stride = width + pad_cols

    @property
    def id(self) -> str:
        parts = [f"T{self.t}", f"h{self.hq}x{self.hkv}", f"d{self.d}", self.order, self.style]
        if self.rot is not None:
            parts.append(f"rot{self.rot}")
        parts.append(str(self.kv).replace("torch.", "").replace("float8_e4m3fn", "fp8kv"))
        if self.quantize_q:
            parts.append("fp8q")
        if self.packed:
            parts.append("packed")
        if self.dtype != torch.bfloat16:
            parts.append(str(self.dtype).replace("torch.", ""))
        if self.cs_dtype != torch.float32:
            parts.append("cs-half")
        parts.append(f"bt{self.block_t}")
        if self.block_kv is not None:
            parts.append(f"bkv{self.block_kv}")
        if self.strided_blocks:
            parts.append("strided-blocks")
        if self.cs_smem:
            parts.append("cs-smem")
        return "-".join(parts)


def cos_sin(max_pos: int, rot: int, theta: float = 10000.0, dtype=torch.float32,
            device="cpu") -> torch.Tensor:
    inv = 1.0 / theta ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot)
    f = torch.outer(torch.arange(max_pos, dtype=torch.float64), inv)
    return torch.cat([f.cos(), f.sin()], dim=-1).to(dtype).to(device)


def make_inputs(c: Case, device="cpu", max_pos: int = 300):
    g = torch.Generator().manual_seed(1234 + c.t)
    width = (c.hq + 2 * c.hkv) * c.d
    qkv = (torch.randn(c.t, width + c.pad_cols, generator=g) * 2).to(c.dtype)[:, :width].to(device)
    positions = torch.randint(0, max_pos, (c.t,), generator=g).to(device)
    rot = c.d if c.rot is None else c.rot
    cs = cos_sin(max_pos, rot, dtype=c.cs_dtype, device=device)
    norm = c.order != "rope"
    qw = (torch.rand(c.d, generator=g) + 0.5).to(device) if norm else None
    kw = (torch.rand(c.d, generator=g) + 0.5).to(c.dtype).to(device) if norm else None
    nslots = max(c.t, 1) + 5
    nblocks = -(-nslots // c.block_size) + 1
    store = FP8 if c.kv == FP8 else c.dtype
    every = 2 if c.strided_blocks else 1
    if c.packed:
        buf = torch.full((nblocks * every, c.block_size, c.hkv, 2 * c.d), SENTINEL).to(store).to(device)[::every]
        k_cache, v_cache = buf[..., : c.d], buf[..., c.d:]
    else:
        k_cache = torch.full((nblocks * every, c.block_size, c.hkv, c.d), SENTINEL).to(store).to(device)[::every]
        v_cache = torch.full((nblocks * every, c.block_size, c.hkv, c.d), SENTINEL).to(store).to(device)[::every]
    slots = torch.randperm(nblocks * c.block_size, generator=g)[: c.t]
    if c.skip and c.t > 1:
        slots[1::3] = -1
    slot_mapping = slots.to(torch.int64).to(device)
    scales = {}
    if c.kv == FP8:
        scales = {"k_scale": torch.tensor([0.05], device=device),
                  "v_scale": torch.tensor([0.03], device=device)}
    args = (qkv, positions, cs, k_cache, v_cache, slot_mapping)
    kwargs = dict(num_q_heads=c.hq, num_kv_heads=c.hkv, head_dim=c.d, q_norm_weight=qw, k_norm_weight=kw,
                  eps=1e-5, order=c.order, style=c.style, rotary_dim=c.rot, quantize_q=c.quantize_q, **scales)
    return args, kwargs


def clone_caches(args):
    qkv, positions, cs, k_cache, v_cache, slots = args
    if k_cache.data_ptr() + k_cache.shape[-1] * k_cache.element_size() == v_cache.data_ptr():
        # keep the packed layout; concatenate raw bytes (cat has no float8 kernel on every backend)
        buf = torch.cat([k_cache.view(torch.uint8), v_cache.view(torch.uint8)], dim=-1).view(k_cache.dtype)
        d = k_cache.shape[-1]
        return (qkv, positions, cs, buf[..., :d], buf[..., d:], slots)
    return (qkv, positions, cs, k_cache.clone(), v_cache.clone(), slots)


def run_and_compare(c: Case, device="cpu", config: RopeConfig | None = None):
    args, kwargs = make_inputs(c, device)
    ref_args = clone_caches(args)
    q_ref, qs_ref = reference.rope_norm_store_kv(*ref_args, **kwargs)
    q, qs = prologue.rope_norm_store_kv(*args, **kwargs, config=config)
    assert q.shape == (c.t, c.hq, c.d)
    assert q.dtype == (FP8 if c.quantize_q else c.dtype)
    assert_close(q_ref, q, name="q")
    if c.quantize_q:
        assert_close(qs_ref, qs, name="q_scale", maxtol=1e-5, rmstol=1e-6)
    else:
        assert qs is None
    for name, out, ref in (("k_cache", args[3], ref_args[3]), ("v_cache", args[4], ref_args[4])):
        assert_close(ref, out, name=name)
        # the slots nobody wrote (incl. the -1 rows) still hold the sentinel, bit for bit
        written = torch.zeros(out.shape[0] * out.shape[1], dtype=torch.bool, device=out.device)
        valid = args[5][args[5] >= 0]
        written[valid] = True
        sentinel = torch.tensor([SENTINEL]).to(out.dtype).view(torch.uint8).to(out.device)
        untouched = out.view(torch.uint8).reshape(written.numel(), -1, out.element_size())[~written]
        assert (untouched == sentinel).all(), f"{name}: a slot outside slot_mapping was written"
    return q, qs


CPU_CASES = [
    Case(),
    Case(t=9, order="rope_norm", block_t=2),
    Case(t=5, order="rope", style="gptj"),
    Case(t=6, style="gptj", rot=48, block_t=8),
    Case(t=5, order="rope_norm", style="neox", rot=32, d=64, hq=3, hkv=1),
    Case(t=5, hq=8, hkv=2, d=128, kv=FP8, quantize_q=True, packed=True),
    Case(t=11, hq=3, hkv=3, d=64, kv=FP8, order="rope", block_t=16),
    Case(t=3, hq=2, hkv=1, d=128, quantize_q=True, style="gptj", order="rope_norm", rot=96),
    Case(t=7, hq=6, hkv=2, d=64, packed=True, dtype=torch.float16, cs_dtype=torch.float16),
    Case(t=1, hq=4, hkv=1, d=64, skip=False, block_t=1),
    Case(t=2, hq=2, hkv=1, d=256, kv=FP8, quantize_q=True, block_t=2),
    # kv programs of other sizes than the default; caches whose blocks are not adjacent (slot → block
    # and offset by division, not slot · stride)
    Case(t=9, hq=8, hkv=2, d=64, block_kv=1),
    Case(t=10, hq=8, hkv=1, d=128, kv=FP8, quantize_q=True, block_t=2, block_kv=8, strided_blocks=True),
    Case(t=7, hq=6, hkv=3, d=64, style="gptj", rot=32, packed=True, strided_blocks=True, block_kv=4),
    # cos/sin gathered once per program and broadcast through shared memory
    Case(t=6, hq=8, hkv=2, d=64, kv=FP8, quantize_q=True, cs_smem=True),
    Case(t=5, hq=4, hkv=1, d=64, style="gptj", rot=40, order="rope_norm", cs_smem=True),
]


@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: c.id)
def test_matches_reference(case, device):
    run_and_compare(case, device=device,
                    config=RopeConfig(block_t=case.block_t, num_warps=4, block_kv=case.block_kv,
                                      cos_sin_smem=case.cs_smem))


@pytest.mark.parametrize("case", [Case(t=6, hq=8, hkv=2, d=64, kv=FP8, quantize_q=True, block_kv=2),
                                  Case(t=5, style="gptj", rot=48, strided_blocks=True),
                                  Case(t=4, hq=3, hkv=1, order="rope_norm", packed=True)],
                         ids=lambda c: c.id)
def test_int64_index_paths(case, device, monkeypatch):
    """The int64 index arithmetic (tensors spanning ≥ 2^31 elements) computes the same thing."""
    monkeypatch.setattr(prologue, "I32_LIMIT", 0)  # every tensor "too large" for int32 offsets
    run_and_compare(case, device=device,
                    config=RopeConfig(block_t=case.block_t, num_warps=4, block_kv=case.block_kv,
                                      cos_sin_smem=case.cs_smem))


def test_index_width_and_slot_flags():
    """int32 offsets exactly when every offset fits; slot · stride addressing exactly when linear."""
    qkv = torch.empty(0, 1)
    assert prologue._max_offset(torch.empty(3, 5)) == 2 * 5 + 4
    assert prologue._max_offset(torch.empty(3, 5), extra_rows=2) == 14 + 2 * 5
    assert prologue._max_offset(qkv) == 0
    cache = torch.empty(4, 16, 2, 8)
    assert prologue._slot_linear(cache)
    assert prologue._slot_linear(torch.empty(4, 16, 2, 16)[..., :8])  # packed K|V view
    assert not prologue._slot_linear(torch.empty(8, 16, 2, 8)[::2])
    assert prologue._slot_linear(torch.empty(2, 16, 2, 8)[:1])  # one block: any block stride


def test_default_config_and_q_out(device):
    c = Case(t=3, hq=2, hkv=1)
    args, kwargs = make_inputs(c, device)
    ref_args = clone_caches(args)
    q_ref, _ = reference.rope_norm_store_kv(*ref_args, **kwargs)
    q_out = nan_like(torch.empty(c.t, c.hq, 2 * c.d, dtype=c.dtype, device=device))[..., : c.d]  # strided output
    q, _ = prologue.rope_norm_store_kv(*args, **kwargs, q_out=q_out)
    assert q.data_ptr() == q_out.data_ptr()
    assert_close(q_ref, q, name="q")


def test_int32_indices(device):
    c = Case(t=4, hq=2, hkv=1)
    args, kwargs = make_inputs(c, device)
    ref_args = clone_caches(args)
    q_ref, _ = reference.rope_norm_store_kv(*ref_args, **kwargs)
    args = (args[0], args[1].int(), args[2], args[3], args[4], args[5].int())
    q, _ = prologue.rope_norm_store_kv(*args, **kwargs, config=RopeConfig(4, 4))
    assert_close(q_ref, q, name="q")
    assert_close(ref_args[3], args[3], name="k_cache")


def test_zero_tokens(device):
    c = Case(t=0)
    args, kwargs = make_inputs(c, device)
    before = args[3].clone()
    q, qs = prologue.rope_norm_store_kv(*args, **kwargs)
    assert q.shape == (0, c.hq, c.d) and qs is None
    assert torch.equal(args[3], before)
    c = Case(t=0, kv=FP8, quantize_q=True)
    args, kwargs = make_inputs(c, device)
    q, qs = prologue.rope_norm_store_kv(*args, **kwargs)
    assert q.shape == (0, c.hq, c.d) and qs.shape == (0, c.hq)


def test_public_export():
    import hpcops

    assert hpcops.rope_norm_store_kv is prologue.rope_norm_store_kv


def test_default_config_heuristic():
    small = prologue.default_config(1, 8, 1, 128)
    assert small.block_t == 1
    big = prologue.default_config(32768, 64, 8, 128)
    assert big.block_t >= 4 and big.num_warps in (2, 4, 8)


def test_opcheck(device):
    # opcheck compares outputs with torch ops that fp8 lacks, so it runs on a bf16 cache and bf16 q;
    # the fp8 variant of the registered op is checked against its fake below.
    c = Case(t=2, hq=2, hkv=1, skip=False)
    args, kwargs = make_inputs(c, device)
    op_args = (*args, c.hq, c.hkv, c.d, kwargs["q_norm_weight"], kwargs["k_norm_weight"], 1e-5, c.order,
               c.style, None, None, None, False)
    torch.library.opcheck(prologue.rope_norm_store_kv_op, op_args,
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


def test_registered_op_fp8_matches_fake(device):
    from torch._subclasses.fake_tensor import FakeTensorMode

    c = Case(t=3, hq=2, hkv=1, kv=FP8, quantize_q=True)
    args, kwargs = make_inputs(c, device)
    op_args = (*args, c.hq, c.hkv, c.d, kwargs["q_norm_weight"], kwargs["k_norm_weight"], 1e-5, c.order,
               c.style, None, kwargs["k_scale"], kwargs["v_scale"], True)
    q, qs = prologue.rope_norm_store_kv_op(*op_args)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in op_args]
        fq, fqs = prologue.rope_norm_store_kv_op(*fake_args)
    assert (fq.shape, fq.dtype, fqs.shape, fqs.dtype) == (q.shape, q.dtype, qs.shape, qs.dtype)
    ref_args = clone_caches(make_inputs(c, device)[0])
    q_ref, qs_ref = reference.rope_norm_store_kv(*ref_args, **kwargs)
    assert_close(q_ref, q, name="q")
    assert_close(qs_ref, qs, name="q_scale", maxtol=1e-5, rmstol=1e-6)


def _bad(**over):
    c = Case(t=3, hq=2, hkv=1)
    args, kwargs = make_inputs(c)
    args = list(args)
    names = ["qkv", "positions", "cos_sin_cache", "k_cache", "v_cache", "slot_mapping"]
    for k in list(over):
        if k in names:
            args[names.index(k)] = over.pop(k)(args[names.index(k)])
    kwargs.update(over)
    return args, kwargs


BAD = [
    ("qkv-dtype", {"qkv": lambda x: x.float()}, TypeError, "qkv"),
    ("qkv-width", {"qkv": lambda x: x[:, :-64]}, ValueError, "qkv"),
    ("head-dim", {"head_dim": 96}, ValueError, "head_dim"),
    ("gqa", {"num_kv_heads": 3}, ValueError, "num_q_heads"),
    ("positions-len", {"positions": lambda x: x[:-1]}, ValueError, "positions"),
    ("positions-dtype", {"positions": lambda x: x.float()}, TypeError, "positions"),
    ("slots-dtype", {"slot_mapping": lambda x: x.to(torch.int16)}, TypeError, "slot_mapping"),
    ("slots-len", {"slot_mapping": lambda x: x[:1]}, ValueError, "slot_mapping"),
    ("rot-odd", {"rotary_dim": 33}, ValueError, "rotary_dim"),
    ("rot-big", {"rotary_dim": 128}, ValueError, "rotary_dim"),
    ("cs-narrow", {"cos_sin_cache": lambda x: x[:, :32]}, ValueError, "cos_sin_cache"),
    ("cs-dtype", {"cos_sin_cache": lambda x: x.double()}, TypeError, "cos_sin_cache"),
    ("fp8-no-scale", {"k_cache": lambda x: x.to(FP8), "v_cache": lambda x: x.to(FP8)}, ValueError, "k_scale"),
    ("cache-heads", {"k_cache": lambda x: x[:, :, :0]}, ValueError, "k_cache"),
    ("cache-dtype", {"v_cache": lambda x: x.half()}, TypeError, "v_cache"),
    ("order", {"order": "norm"}, ValueError, "order"),
    ("style", {"style": "llama"}, ValueError, "style"),
    ("norm-missing", {"q_norm_weight": None}, ValueError, "q_norm_weight"),
    ("norm-shape", {"k_norm_weight": torch.ones(32)}, ValueError, "k_norm_weight"),
    ("rope-with-weights", {"order": "rope"}, ValueError, "q_norm_weight"),
    ("q-out-dtype", {"q_out": torch.empty(3, 2, 64)}, TypeError, "q_out"),
    ("position-past-cache", {"positions": lambda x: x + 300}, ValueError, "positions"),
    ("position-negative", {"positions": lambda x: x - 1000}, ValueError, "positions"),
    ("slot-past-cache", {"slot_mapping": lambda x: x.clamp(min=0) + 10**6}, ValueError, "slot_mapping"),
    ("slot-below-minus-1", {"slot_mapping": lambda x: x - 10**6}, ValueError, "slot_mapping"),
]


@pytest.mark.parametrize("over,exc,needle", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input(over, exc, needle):
    args, kwargs = _bad(**over)
    with pytest.raises(exc, match=needle):
        prologue.rope_norm_store_kv(*args, **kwargs)


def test_unchecked_bad_indices_stay_inside_the_tensors(device, monkeypatch):
    """Outside checking mode a device call does not look at positions / slot_mapping values: then a slot
    past the cache writes nothing and a position past cos_sin_cache reads row 0, never memory beyond."""
    monkeypatch.setattr(prologue, "values_checkable", lambda t: False)  # as for device tensors
    c = Case(t=6, hq=4, hkv=2, d=64, skip=False, block_size=16)
    (qkv, positions, cs, k_cache, v_cache, slots), kwargs = make_inputs(c, device)
    nb = k_cache.shape[0]
    big_k = torch.full((2 * nb, *k_cache.shape[1:]), SENTINEL, dtype=k_cache.dtype, device=device)
    big_v = big_k.clone()
    big_cs = torch.cat([cs, torch.full_like(cs, float("nan"))])  # rows past cs are NaN
    positions, slots = positions.clone(), slots.clone()
    positions[0] = cs.shape[0] + 7
    slots[1] = nb * c.block_size + 5  # inside big_k, past k_cache
    q, _ = prologue.rope_norm_store_kv(qkv, positions, big_cs[: cs.shape[0]], big_k[:nb], big_v[:nb], slots,
                                       **kwargs)
    assert torch.isfinite(q.float()).all()
    for big in (big_k, big_v):
        assert (big[nb:] == SENTINEL).all(), "a write landed past the cache"
    want_pos = positions.clone()
    want_pos[0] = 0
    ref_k, ref_v = big_k[:nb].clone().fill_(SENTINEL), big_v[:nb].clone().fill_(SENTINEL)
    ref_slots = slots.clone()
    ref_slots[1] = -1
    q_ref, _ = reference.rope_norm_store_kv(qkv, want_pos, cs, ref_k, ref_v, ref_slots, **kwargs)
    assert_close(q_ref, q, name="q")
    assert_close(ref_k, big_k[:nb], name="k_cache")
    assert_close(ref_v, big_v[:nb], name="v_cache")


# ---- GPU tier: real sizes (Hy3: 64/8 and one TP8 rank 8/1, head_dim 128)

GPU_CASES = [
    Case(t=t, hq=hq, hkv=hkv, d=128, kv=kv, quantize_q=kv == FP8, packed=packed, block_size=64, block_t=0,
         pad_cols=0)
    for hq, hkv in ((8, 1), (64, 8))
    for t in (1, 37, 1000, 8192)
    for kv, packed in ((torch.bfloat16, False), (FP8, True))
] + [
    Case(t=513, hq=32, hkv=4, d=d, order=o, style=s, rot=r, block_size=16, block_t=0)
    for d, o, s, r in ((64, "rope", "gptj", None), (256, "rope_norm", "neox", 128),
                       (128, "norm_rope", "gptj", 64))
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.id)
def test_gpu_matches_reference(case, device):
    run_and_compare(case, device=device)


@pytest.mark.gpu
def test_gpu_cuda_graph(device):
    c = Case(t=64, hq=8, hkv=1, d=128, kv=FP8, quantize_q=True, block_size=64, skip=False)
    args, kwargs = make_inputs(c, device)
    ref_args = clone_caches(args)
    q_ref, qs_ref = reference.rope_norm_store_kv(*ref_args, **kwargs)
    graph, (q, qs) = capture_graph(lambda: prologue.rope_norm_store_kv(*args, **kwargs))
    graph.replay()
    torch.cuda.synchronize()
    assert_close(q_ref, q, name="q")
    assert_close(qs_ref, qs, name="q_scale", maxtol=1e-5, rmstol=1e-6)
    assert_close(ref_args[3], args[3], name="k_cache")
