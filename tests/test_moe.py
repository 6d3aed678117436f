"""Fused MoE: index build, fused_moe vs the torch reference, bad input, torch.library, GPU tier.

CPU tier shapes are small (E 6, H 256, I 128/192) so the interpreter stays fast; the GPU tier runs
Hy3 shapes (E 192, k 8, H 4096, I 192; EP8: 24 local of 192 experts, I 1536) and CUDA-graph replay.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

import pytest
import torch

import hpcops
from hpcops.moe import reference as R
from hpcops.moe.configs import MoeConfig, gate_up_split, get_config
from hpcops.moe.fused_moe import device_name, fused_moe
from hpcops.moe.routing import build_moe_index, select_experts, task_capacity
from hpcops.quant import (
    FP8,
    Fp8Block128,
    Fp8PerTensor,
    quantize_block128,
    quantize_per_tensor,
    quantize_per_token,
    quantize_per_token_group,
)
from hpcops.testing import assert_close, capture_graph, nan_like, recorded_launches, relative_errors

# ---------------------------------------------------------------------------------------------------
# factories


@dataclass
class Weights:
    w13: torch.Tensor
    w2: torch.Tensor
    quant: object


def make_weights(E: int, H: int, inter: int, kind: str, dtype=torch.bfloat16, device="cpu",
                 static: bool = True, seed: int = 0) -> Weights:
    """Random expert weights (std ≈ 1/sqrt(K), so activations stay O(1)), generated on `device`;
    fp8 kinds quantize them (per expert, or 128×128 blocks)."""
    g = torch.Generator(device=device).manual_seed(seed)
    w13 = torch.randn(E, 2 * inter, H, generator=g, device=device) / H ** 0.5
    w2 = torch.randn(E, H, inter, generator=g, device=device) / inter ** 0.5
    if kind == "none":
        return Weights(w13.to(dtype), w2.to(dtype), None)
    if kind == "fp8_tensor":
        s13 = w13.abs().amax(dim=(1, 2)) / 448.0
        s2 = w2.abs().amax(dim=(1, 2)) / 448.0
        q13 = (w13 / s13[:, None, None]).clamp(-448, 448).to(FP8)
        q2 = (w2 / s2[:, None, None]).clamp(-448, 448).to(FP8)
        # x ~ N(0,1): a13 saturates past |x| = 4; a2 covers the intermediate's range
        a13 = torch.tensor([4.0 / 448], device=device) if static else None
        a2 = torch.tensor([1.0 / 448], device=device) if static else None
        return Weights(q13, q2, Fp8PerTensor(s13, s2, a13, a2))
    q13, s13 = quantize_block128(w13)
    q2, s2 = quantize_block128(w2)
    return Weights(q13, q2, Fp8Block128(s13, s2))


def make_routing(T: int, k: int, E_global: int, device="cpu", seed: int = 1):
    """Distinct experts per token, random fp32 weights."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E_global, generator=g)[:k] for _ in range(T)]) if T else \
        torch.empty(0, k, dtype=torch.long)
    w = torch.rand(T, k, generator=g) + 0.1
    return w.to(device), ids.to(torch.int32).to(device)


def make_expert_map(E_global: int, local: list[int], device="cpu") -> torch.Tensor:
    m = torch.full((E_global,), -1, dtype=torch.int32)
    for i, e in enumerate(local):
        m[e] = i
    return m.to(device)


# ---------------------------------------------------------------------------------------------------
# index build


@pytest.mark.parametrize("small", [True, False], ids=["one-program", "hist-scan-scatter"])
@pytest.mark.parametrize("T,k,E,ep", [(1, 1, 6, False), (7, 3, 6, False), (64, 5, 6, False),
                                      (37, 3, 8, True), (5, 2, 8, True)])
def test_index_build(small, T, k, E, ep, device):
    _, ids = make_routing(T, k, E, device=device)
    emap = make_expert_map(E, [6, 0, 3, 5], device) if ep else None
    n_local = 4 if ep else E
    bm = 16
    # blocks of 32 pairs: several programs per step of the multi-program build
    idx = build_moe_index(ids, n_local, bm, expert_map=emap, small_max=10**6 if small else 0, block=32)
    counts, offsets, tasks = R.moe_index(ids, n_local, bm, emap)
    assert idx.offsets.cpu().tolist() == offsets.tolist()
    assert idx.counts.cpu().tolist() == counts.tolist()
    cap = task_capacity(T * k, n_local, bm)
    got = idx.tasks.cpu()
    assert got.shape == (2, cap)
    n_tasks = len(tasks)
    assert n_tasks <= cap
    assert list(zip(got[0, :n_tasks].tolist(), got[1, :n_tasks].tolist())) == tasks
    assert (got[0, n_tasks:] == -1).all(), "sentinel after the last task"
    # every locally routed (token, slot) exactly once, in its expert's range; remote pairs dropped
    loc = R.local_expert_ids(ids, n_local, emap).flatten().cpu()
    pos = idx.pair_pos.cpu()[: T * k]
    srt = idx.sorted_pair.cpu()
    assert ((pos < 0) == (loc < 0)).all()
    valid = (loc >= 0).nonzero().flatten()
    assert sorted(srt[: int(offsets[-1])].tolist()) == valid.tolist()
    for p in valid.tolist():
        r = int(pos[p])
        assert int(srt[r]) == p
        e = int(loc[p])
        assert offsets[e] <= r < offsets[e + 1]
    for e in range(n_local):  # deterministic: pair order inside every expert
        rows = srt[int(offsets[e]):int(offsets[e + 1])].tolist()
        assert rows == sorted(rows)


def test_index_all_remote(device):
    _, ids = make_routing(9, 2, 8, device=device)
    emap = torch.full((8,), -1, dtype=torch.int32, device=device)
    idx = build_moe_index(ids, 3, 16, expert_map=emap)
    assert idx.offsets.cpu().tolist() == [0, 0, 0, 0]
    assert (idx.tasks.cpu()[0] == -1).all()
    assert (idx.pair_pos.cpu() == -1).all()


# ---------------------------------------------------------------------------------------------------
# fused_moe vs reference


@dataclass(frozen=True)
class Case:
    T: int
    k: int = 3
    E: int = 6
    H: int = 256
    inter: int = 128
    quant: str = "none"  # none | fp8_tensor | fp8_block
    static: bool = True  # fp8_tensor: static a13/a2 scales, else dynamic per token
    dtype: torch.dtype = torch.bfloat16
    shared: bool = False
    ep: bool = False  # 4 local experts of E global through expert_map
    use_out: bool = False
    act_mul: str = "fp32"
    small_max: int | None = None  # force the multi-program index build with 0
    prequant: bool | None = None  # force config.prequant_x
    block_n: int | None = None  # force the gate-up N tile (fp8_block: 128 quantizes in the epilogue)
    swap: bool | None = None  # force config.swap_ab
    naive: bool | None = None  # force one task per pair (True) or the index (False)
    fused_shared: int = 0  # I_s of a shared expert fused into the GEMM kernels (shared_w13 / shared_w2)
    promote: int | None = None  # force config.fp8_promote (None: the default)
    n_per: int = 1  # config.down_n_per
    down_bk: int | None = None  # force config.down_block_k (≥ inter with n_per > 1: one K step, act loaded once)
    split: int = 1  # config.split_k
    index_quant: bool = True  # config.index_quant

    @property
    def id(self) -> str:
        q = self.quant + ("" if self.quant != "fp8_tensor" else ("-static" if self.static else "-dyn"))
        s = f"T{self.T}-k{self.k}-E{self.E}-H{self.H}-I{self.inter}-{q}-{str(self.dtype)[6:]}"
        for flag in ("shared", "ep", "use_out"):
            if getattr(self, flag):
                s += "-" + flag
        if self.fused_shared:
            s += f"-fshared{self.fused_shared}"
        if self.act_mul != "fp32":
            s += "-mul" + self.act_mul
        if self.small_max is not None:
            s += f"-small{self.small_max}"
        if self.prequant is not None:
            s += f"-prequant{int(self.prequant)}"
        if self.block_n is not None:
            s += f"-bn{self.block_n}"
        if self.swap is not None:
            s += f"-swap{int(self.swap)}"
        if self.naive is not None:
            s += "-naive" if self.naive else "-indexed"
        if self.promote is not None:
            s += f"-promote{self.promote}"
        if self.n_per != 1:
            s += f"-nper{self.n_per}"
        if self.down_bk is not None:
            s += f"-dbk{self.down_bk}"
        if self.split != 1:
            s += f"-split{self.split}"
        if not self.index_quant:
            s += "-iq0"
        return s


CASES = [
    Case(1, k=1),
    Case(7, dtype=torch.float16, inter=192),
    Case(7, shared=True, use_out=True),
    Case(64, k=5, inter=192, shared=True, use_out=True, ep=True, E=8),
    Case(1, quant="fp8_tensor"),
    Case(7, quant="fp8_tensor", inter=192, use_out=True),
    Case(7, quant="fp8_tensor", static=False),
    Case(64, quant="fp8_tensor", static=False, ep=True, E=8, shared=True, use_out=True),
    Case(7, quant="fp8_block", shared=True),
    Case(64, k=3, quant="fp8_block", inter=256, H=200, ep=True, E=8, use_out=True),
    Case(7, quant="fp8_tensor", act_mul="bf16"),
    Case(7, act_mul="bf16", dtype=torch.float16),
    Case(20, quant="fp8_tensor", small_max=0, ep=True, E=8),
    Case(7, quant="fp8_tensor", prequant=True, shared=True),
    Case(7, quant="fp8_block", prequant=True, H=200, block_n=128, shared=True),
    Case(0, quant="fp8_tensor", shared=True, use_out=True),
    Case(0, use_out=True),
    Case(5, k=4, inter=192, dtype=torch.float16),
    Case(9, k=2, small_max=0),
    Case(3, quant="fp8_block", shared=True, block_n=64),  # 16-bit act + group amax, quantized by the down GEMM
    Case(6, k=3, quant="fp8_block", inter=256, H=200, ep=True, E=8, block_n=32),
]


# Every case of both GEMM forms (swap_ab) and both task forms (one task per pair, or the index)
PATH_BASES = [
    Case(5, k=2, shared=True, use_out=True, ep=True, E=8),
    Case(7, dtype=torch.float16, inter=192),
    Case(6, quant="fp8_tensor", shared=True, ep=True, E=8),
    Case(7, quant="fp8_tensor", static=False),
    Case(6, k=2, quant="fp8_block", inter=256, H=200, ep=True, E=8),
    Case(3, quant="fp8_block", shared=True, block_n=64),
    Case(4, quant="fp8_tensor", act_mul="bf16", k=4),
    Case(19, k=2, fused_shared=48, ep=True, E=8),  # 19 tokens: two M tiles of 16, the second ragged
    Case(5, quant="fp8_tensor", fused_shared=40, act_mul="bf16"),
    Case(6, quant="fp8_block", inter=256, fused_shared=64, ep=True, E=8),
]
PATH_CASES = [replace(c, swap=swap, naive=naive) for c in PATH_BASES for swap in (False, True)
              for naive in (False, True)]
# fp8 per-tensor MMA sums promoted every 64 products, or never (MoeConfig.fp8_promote; default: by tile and scales)
PATH_CASES += [Case(6, quant="fp8_tensor", shared=True, ep=True, E=8, swap=False, promote=64),
               Case(7, quant="fp8_tensor", static=False, swap=True, naive=False, promote=0, H=384),
               Case(7, quant="fp8_tensor", static=False, swap=False, naive=False, promote=128, H=384)]

# a down GEMM program over several N tiles in one flat (N tile, K step) loop (MoeConfig.down_n_per): a count that
# does not divide the N tiles (the last program's fewer), K of several steps and of one, every quantization, both
# GEMM and task forms, expert parallelism, the fused shared expert, NaN-filled out
NPER_CASES = [replace(c, n_per=n_per, swap=swap, naive=naive)
              for c in (Case(5, k=3, shared=True, use_out=True, ep=True, E=8, H=320),
                        Case(7, quant="fp8_tensor", static=False, H=384),
                        Case(6, k=2, quant="fp8_block", inter=256, H=384, ep=True, E=8, use_out=True),
                        Case(9, k=2, quant="fp8_tensor", H=448, inter=64, fused_shared=48))
              for n_per in (3,) for swap in (False, True) for naive in (False, True)]
NPER_CASES += [Case(40, k=5, inter=192, H=320, ep=True, E=16, use_out=True, n_per=2, small_max=0),
               Case(3, k=2, H=200, use_out=True, n_per=64)]
# one K step over a masked I (act loaded once, the loop over N alone): 16-bit, fp8 static and dynamic, the GEMM form
NPER_CASES += [Case(9, k=2, inter=96, H=320, use_out=True, n_per=3, down_bk=128, swap=False, naive=False),
               Case(9, k=2, inter=96, H=320, quant="fp8_tensor", n_per=2, down_bk=128, swap=False, naive=False),
               Case(8, k=2, inter=96, H=384, quant="fp8_tensor", static=False, n_per=4, down_bk=128, swap=True,
                    naive=True, ep=True, E=8)]

# the gate-up K loop split over programs (MoeConfig.split_k): runs of K steps that divide H's steps and that do not
# (H 384 = 3 steps of 128: runs of 2 and 1; split 4: a program with no step), every quantization, both GEMM and task
# forms, expert parallelism, the fused shared expert, the multi-program index, NaN-filled out
SPLIT_CASES = [replace(c, split=split, swap=swap, naive=naive)
               for c in (Case(5, k=3, shared=True, use_out=True, ep=True, E=8, H=384),
                         Case(7, quant="fp8_tensor", static=False, H=384, use_out=True),
                         Case(6, k=2, quant="fp8_block", inter=256, H=384, ep=True, E=8, use_out=True),
                         Case(9, k=2, quant="fp8_tensor", H=448, inter=64, fused_shared=48))
               for split in (2,) for swap in (False, True) for naive in (False, True)]
SPLIT_CASES += [Case(40, k=5, inter=192, H=384, ep=True, E=16, use_out=True, split=4, small_max=0),
                Case(3, k=2, quant="fp8_block", H=384, use_out=True, split=4, block_n=64),
                Case(7, quant="fp8_tensor", prequant=True, H=512, use_out=True, split=3, n_per=2)]


def _tolerance(case: Case) -> dict:
    if case.quant == "none":
        return {}
    # fp8: the kernel and the reference quantize the same values, but the gate-up accumulations differ in
    # fp32 rounding order, which now and then flips the fp8 rounding of an activation by one ulp (6 %);
    # that and the bf16 rounding of each expert's output give a few 1e-2 of max error.
    return {"maxtol": 4e-2, "rmstol": 1.5e-2}


def run_case(case: Case, device: str):
    E_local = 4 if case.ep else case.E
    wts = make_weights(E_local, case.H, case.inter, case.quant, case.dtype, device, static=case.static)
    tw, ids = make_routing(case.T, case.k, case.E, device)
    emap = make_expert_map(case.E, [case.E - 1, 0, 2, 3], device) if case.ep else None
    g = torch.Generator().manual_seed(2)
    x = torch.randn(case.T, case.H, generator=g).to(case.dtype).to(device)
    shared = torch.randn(case.T, case.H, generator=g).to(case.dtype).to(device) if case.shared else None
    s13 = s2 = None
    if case.fused_shared:
        s13 = (torch.randn(2 * case.fused_shared, case.H, generator=g) / case.H ** 0.5).to(case.dtype).to(device)
        s2 = (torch.randn(case.H, case.fused_shared, generator=g) / case.fused_shared ** 0.5).to(case.dtype).to(device)
    n_global = case.E
    cfg = get_config(num_tokens=case.T, top_k=case.k, num_experts=n_global, hidden=case.H, inter=case.inter,
                     quant=case.quant, interpreter=device == "cpu")
    cfg = cfg.with_(act_mul=case.act_mul)
    if case.small_max is not None:
        cfg = cfg.with_(index_small_max=case.small_max)
    if case.prequant is not None:
        cfg = cfg.with_(prequant_x=case.prequant)
    if case.block_n is not None:
        cfg = cfg.with_(block_n=case.block_n)
    if case.swap is not None:
        cfg = cfg.with_(swap_ab=case.swap)
    if case.naive is not None:
        cfg = cfg.with_(naive_max_pairs=1 << 30 if case.naive else 0)
    if case.promote is not None:
        cfg = cfg.with_(fp8_promote=case.promote)
    if case.n_per != 1:
        cfg = cfg.with_(down_n_per=case.n_per)
    if case.down_bk is not None:
        cfg = cfg.with_(down_block_k=case.down_bk)
    if case.split != 1:
        cfg = cfg.with_(split_k=case.split)
    cfg = cfg.with_(index_quant=case.index_quant)
    out = nan_like(torch.empty(case.T, case.H, dtype=case.dtype, device=device)) if case.use_out else None
    got = fused_moe(x, wts.w13, wts.w2, tw, ids, quant=wts.quant, expert_map=emap, shared_output=shared,
                    out=out, config=cfg, shared_w13=s13, shared_w2=s2)
    if out is not None:
        assert got.data_ptr() == out.data_ptr()
    ref = R.fused_moe(x, wts.w13, wts.w2, tw, ids, quant=wts.quant, expert_map=emap, shared_output=shared,
                      config=cfg, shared_w13=s13, shared_w2=s2)
    return got, ref


@pytest.mark.parametrize("case", CASES + PATH_CASES + NPER_CASES + SPLIT_CASES, ids=lambda c: c.id)
def test_fused_moe(case, device):
    got, ref = run_case(case, device)
    assert got.dtype == case.dtype and got.shape == (case.T, case.H)
    assert_close(ref, got, **_tolerance(case))


# x's fp8 quantization pass inside the index build's launch (MoeConfig.index_quant): static per tensor, dynamic per
# token, per token and 128-group, the one-program index and the three-kernel one (the pass then alone after it),
# expert parallelism, a tuned-size batch (64 tokens: 64 quantizing programs beside the sort), NaN-filled out
INDEX_QUANT_CASES = [Case(6, quant="fp8_tensor", prequant=True, ep=True, E=8, naive=False, use_out=True),
                     Case(7, quant="fp8_tensor", static=False, naive=False, H=384),
                     Case(6, k=2, quant="fp8_block", inter=256, H=200, prequant=True, block_n=128, ep=True, E=8,
                          naive=False, use_out=True),
                     Case(20, quant="fp8_tensor", static=False, small_max=0, ep=True, E=8, use_out=True),
                     Case(64, k=2, quant="fp8_tensor", prequant=True, naive=False)]


@pytest.mark.parametrize("case", INDEX_QUANT_CASES, ids=lambda c: c.id)
def test_index_quant(case, device):
    """`MoeConfig.index_quant`: the output is the same bit for bit whether x's quantization runs alone after the
    index or in the index build's launch (which releases the gate-up's, waiting before it reads the index), and the
    reference's within the fp8 tolerance."""
    outs = []
    for iq in (False, True):
        got, ref = run_case(replace(case, index_quant=iq), device)
        assert_close(ref, got, name=f"index_quant={iq}", **_tolerance(case))
        outs.append(got)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("mode", ["tensor-static", "tensor-per-token", "block"])
def test_fused_moe_fp8_input(mode, device):
    """x arrives already quantized (x_scale); the output is bf16."""
    T, k, E, H, inter = 7, 3, 6, 256, 128
    kind = "fp8_block" if mode == "block" else "fp8_tensor"
    wts = make_weights(E, H, inter, kind, device=device, static=mode == "tensor-static")
    tw, ids = make_routing(T, k, E, device)
    x16 = torch.randn(T, H).bfloat16()
    if mode == "tensor-static":
        xq, xs = quantize_per_tensor(x16, wts.quant.a13_scale.cpu())
        x_scale = None  # defaults to quant.a13_scale
    elif mode == "tensor-per-token":
        xq, xs = quantize_per_token(x16)
        x_scale = xs.to(device)
    else:
        xq, xs = quantize_per_token_group(x16, 128)
        x_scale = xs.to(device)
    xq = xq.to(device)
    cfg = get_config(num_tokens=T, top_k=k, num_experts=E, hidden=H, inter=inter, quant=kind,
                     interpreter=device == "cpu")
    got = fused_moe(xq, wts.w13, wts.w2, tw, ids, quant=wts.quant, x_scale=x_scale, config=cfg)
    ref = R.fused_moe(xq, wts.w13, wts.w2, tw, ids, quant=wts.quant, x_scale=x_scale)
    assert got.dtype == torch.bfloat16
    assert_close(ref, got, maxtol=4e-2, rmstol=1.5e-2)  # fp8 tolerance, see _tolerance


def test_all_experts_remote_gives_shared_output(device):
    """EP: tokens whose experts all live on other ranks → exactly shared_output (zeros without it)."""
    T, H, inter = 5, 256, 128
    wts = make_weights(3, H, inter, "none", device=device)
    tw, ids = make_routing(T, 2, 8, device)
    emap = make_expert_map(8, [], device)
    shared = torch.randn(T, H).bfloat16().to(device)
    x = torch.randn(T, H).bfloat16().to(device)
    cfg = get_config(num_tokens=T, top_k=2, num_experts=8, hidden=H, inter=inter,
                     interpreter=device == "cpu")
    out = fused_moe(x, wts.w13, wts.w2, tw, ids, expert_map=emap, shared_output=shared,
                    out=nan_like(shared), config=cfg)
    assert torch.equal(out.cpu(), shared.cpu())
    out = fused_moe(x, wts.w13, wts.w2, tw, ids, expert_map=emap, out=nan_like(shared), config=cfg)
    assert (out.cpu() == 0).all()


def test_ep_ranks_sum_to_full(device):
    """Two simulated EP ranks (half the experts each) sum to the single-rank result."""
    T, k, E, H, inter = 6, 3, 6, 256, 128
    full = make_weights(E, H, inter, "none", dtype=torch.float16, device=device)
    tw, ids = make_routing(T, k, E, device)
    x = torch.randn(T, H).half().to(device)
    whole = fused_moe(x, full.w13, full.w2, tw, ids)
    parts = []
    for local in ([0, 2, 4], [1, 3, 5]):
        emap = make_expert_map(E, local, device)
        sel = torch.tensor(local, device=device)
        parts.append(fused_moe(x, full.w13[sel].contiguous(), full.w2[sel].contiguous(), tw, ids,
                               expert_map=emap).float())
    assert_close(whole.float(), parts[0] + parts[1], maxtol=5e-3, rmstol=2e-3)


# ---------------------------------------------------------------------------------------------------
# bad input


def _bad_inputs(device):
    T, k, E, H, inter = 3, 2, 4, 256, 128
    w = make_weights(E, H, inter, "none", device=device)
    f = make_weights(E, H, inter, "fp8_tensor", device=device)
    b = make_weights(E, H, inter, "fp8_block", device=device)
    tw, ids = make_routing(T, k, E, device)
    x = torch.randn(T, H).bfloat16().to(device)
    base = dict(x=x, w13=w.w13, w2=w.w2, topk_weights=tw, topk_ids=ids)
    f8 = dict(base, w13=f.w13, w2=f.w2, quant=f.quant)
    bk = dict(base, w13=b.w13, w2=b.w2, quant=b.quant)
    s = f.quant
    b192 = make_weights(E, H, 192, "fp8_tensor", device=device)
    return [
        ("x", TypeError, dict(base, x=x.float())),
        ("w13", ValueError, dict(base, w13=w.w13[:, :, :128])),
        ("w2", ValueError, dict(base, w2=w.w2[:, :, :64])),
        ("w2", ValueError, dict(base, w2=w.w2[:3])),
        ("w13", ValueError, dict(base, w13=w.w13.transpose(1, 2).contiguous().transpose(1, 2))),
        ("w13", TypeError, dict(base, w13=w.w13.half())),
        ("topk_ids", TypeError, dict(base, topk_ids=ids.long())),
        ("topk_ids", ValueError, dict(base, topk_ids=ids[:2])),
        ("topk_ids", ValueError, dict(base, topk_ids=ids + E)),
        ("topk_ids", ValueError, dict(base, topk_ids=ids - E)),
        ("topk_weights", ValueError, dict(base, topk_weights=tw[:, :1])),
        ("topk_weights", TypeError, dict(base, topk_weights=tw.half())),
        ("expert_map", TypeError, dict(base, expert_map=torch.zeros(8, dtype=torch.int64, device=device))),
        ("expert_map", ValueError, dict(base, expert_map=torch.full((8,), E, dtype=torch.int32, device=device))),
        ("expert_map", ValueError, dict(base, expert_map=torch.full((8,), -2, dtype=torch.int32, device=device))),
        ("shared_output", ValueError, dict(base, shared_output=x[:, :128])),
        ("shared_ready", ValueError, dict(base, shared_ready=object())),
        ("shared_ready", TypeError, dict(base, shared_output=x, shared_ready=object())),
        ("out", TypeError, dict(base, out=torch.empty(T, H, device=device))),
        ("quant", TypeError, dict(base, quant="fp8")),
        ("w13", TypeError, dict(f8, w13=w.w13)),
        ("w13_scale", ValueError, dict(f8, quant=Fp8PerTensor(s.w13_scale[:2], s.w2_scale, s.a13_scale,
                                                              s.a2_scale))),
        ("a13_scale", ValueError, dict(f8, quant=Fp8PerTensor(s.w13_scale, s.w2_scale,
                                                              s.w13_scale, s.a2_scale))),
        ("x_scale", ValueError, dict(f8, x=x.to(FP8), quant=Fp8PerTensor(s.w13_scale, s.w2_scale))),
        ("x_scale", ValueError, dict(f8, x_scale=s.a13_scale)),
        ("w2_scale", ValueError, dict(bk, quant=Fp8Block128(b.quant.w13_scale, b.quant.w2_scale[:, :1]))),
        ("I % 128", ValueError, dict(bk, w13=b192.w13, w2=b192.w2,
                                     quant=Fp8Block128(torch.ones(E, 3, 2, device=device),
                                                       torch.ones(E, 2, 2, device=device)))),
        ("x_scale", ValueError, dict(bk, x=x.to(FP8))),
        ("x", TypeError, dict(base, x=x.to(FP8))),
        ("config", ValueError, dict(bk, config=MoeConfig(block_k=64))),
        ("config.act_mul", ValueError, dict(base, config=MoeConfig(act_mul="fp16"))),
        ("config.fp8_promote", ValueError, dict(f8, config=MoeConfig(fp8_promote=48))),
        ("config.fp8_promote", ValueError, dict(f8, config=MoeConfig(fp8_promote=-32))),
        ("config.fp8_promote", ValueError, dict(f8, config=MoeConfig(fp8_promote=64.0))),
        ("config.down_n_per", ValueError, dict(base, config=MoeConfig(down_n_per=0))),
        ("config.down_n_per", ValueError, dict(base, config=MoeConfig(down_n_per=2.0))),
        *_bad_shared_weights(base, f8, x, H, device),
    ]


def _bad_shared_weights(base, f8, x, H, device):
    """The fused shared expert's weights: both or none, [2·I_s, H] and [H, I_s] in x's 16-bit dtype, a 16-bit x,
    not with shared_output."""
    s13 = torch.randn(64, H).bfloat16().to(device)
    s2 = torch.randn(H, 32).bfloat16().to(device)
    both = dict(base, shared_w13=s13, shared_w2=s2)
    return [
        ("shared_w13", ValueError, dict(base, shared_w13=s13)),
        ("shared_w13", ValueError, dict(base, shared_w2=s2)),
        ("shared_w13", ValueError, dict(both, shared_w13=s13[:, :128])),
        ("shared_w13", ValueError, dict(both, shared_w13=s13[:63])),
        ("shared_w13", TypeError, dict(both, shared_w13=s13.half())),
        ("shared_w13", ValueError, dict(both, shared_w13=s13.t().contiguous().t())),
        ("shared_w2", ValueError, dict(both, shared_w2=s2[:, :16])),
        ("shared_w2", TypeError, dict(both, shared_w2=s2.float())),
        ("shared_output", ValueError, dict(both, shared_output=x)),
        ("shared_w13", TypeError, dict(f8, x=x.to(FP8), shared_w13=s13, shared_w2=s2)),
    ]


def test_bad_inputs(device, monkeypatch):
    monkeypatch.setenv("HPCOPS_CHECK", "1")  # topk_ids values on a GPU are checked in checking mode only
    for name, exc, kw in _bad_inputs(device):
        with pytest.raises(exc) as info:
            fused_moe(**kw)
        assert name in str(info.value), (name, str(info.value))


def test_public_exports():
    assert hpcops.fused_moe is fused_moe
    assert hpcops.select_experts is select_experts


# ---------------------------------------------------------------------------------------------------
# torch.library


def test_opcheck(device):
    """Schema, fake and autograd registration of the out= op (bf16: opcheck's schema check compares
    inputs with arithmetic that CPU torch lacks for fp8); the fp8 path through the op is called directly."""
    from hpcops.moe.fused_moe import fused_moe_out_op

    T, k, E, H, inter = 3, 2, 4, 128, 128
    tw, ids = make_routing(T, k, E, device)
    x = torch.randn(T, H).bfloat16().to(device)
    w = make_weights(E, H, inter, "none", device=device)
    out = torch.empty(T, H, dtype=torch.bfloat16, device=device)
    args = (x, w.w13, w.w2, tw, ids, out, "none", None, None, None, None, None, None, x, "fp32")
    torch.library.opcheck(fused_moe_out_op, args,
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    f = make_weights(E, H, inter, "fp8_tensor", device=device)
    q = f.quant
    out8 = nan_like(out)
    fused_moe_out_op(x, f.w13, f.w2, tw, ids, out8, "fp8_tensor", q.w13_scale, q.w2_scale, q.a13_scale,
                     q.a2_scale, None, None, None, "fp32")
    ref = R.fused_moe(x, f.w13, f.w2, tw, ids, quant=q)
    assert_close(ref, out8, maxtol=4e-2, rmstol=1.5e-2)  # fp8 tolerance, see _tolerance


# ---------------------------------------------------------------------------------------------------
# GPU tier (H200): Hy3 shapes, EP ranks, CUDA graphs


HY3 = dict(E=192, k=8, H=4096)


def _hy3_inputs(T, inter, kind, n_local=None, seed=0, device="cuda"):
    E, k, H = HY3["E"], HY3["k"], HY3["H"]
    local = list(range(n_local)) if n_local else list(range(E))
    wts = make_weights(len(local), H, inter, kind, device=device, seed=seed)
    tw, ids = make_routing(T, k, E, device, seed=seed + 1)
    emap = make_expert_map(E, local, device) if n_local else None
    x = torch.randn(T, H, device=device).bfloat16()
    return wts, tw, ids, emap, x


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["none", "fp8_tensor", "fp8_block"])
@pytest.mark.parametrize("T", [1, 4, 64, 512, 4096])
@pytest.mark.parametrize("shape", ["tp8", "ep8"])
def test_gpu_hy3(shape, T, kind):
    inter, n_local = (192, None) if shape == "tp8" else (1536, 24)
    if kind == "fp8_block" and inter % 128:
        pytest.skip("Fp8Block128 needs I % 128 == 0 (Hy3 TP8 has I = 192)")
    wts, tw, ids, emap, x = _hy3_inputs(T, inter, kind, n_local)
    shared = torch.randn_like(x)
    got = fused_moe(x, wts.w13, wts.w2, tw, ids, quant=wts.quant, expert_map=emap, shared_output=shared,
                    out=nan_like(x))
    ref = R.fused_moe(x, wts.w13, wts.w2, tw, ids, quant=wts.quant, expert_map=emap, shared_output=shared)
    tol = {} if kind == "none" else {"maxtol": 4e-2, "rmstol": 1.5e-2}  # fp8 tolerance, see _tolerance
    assert_close(ref, got, **tol)


@pytest.mark.gpu
@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("naive", [False, True])
@pytest.mark.parametrize("kind", ["none", "fp8_tensor", "fp8_tensor_dyn", "fp8_block"])
@pytest.mark.parametrize("T", [4, 64])
def test_gpu_hy3_paths(T, kind, naive, swap):
    """Both GEMM forms (swap_ab) × both task forms (one task per pair / the index) at Hy3 sizes on the GPU
    (TP8; EP8 for the 128-block scheme, which needs I % 128 == 0); fp8_tensor_dyn: per-tensor fp8 weights with
    dynamic per-token activation scales (no a13/a2)."""
    quant_kind = kind.replace("_dyn", "")
    inter, n_local = (192, None) if kind != "fp8_block" else (1536, 24)
    wts, tw, ids, emap, x = _hy3_inputs(T, inter, quant_kind, n_local)
    quant = Fp8PerTensor(wts.quant.w13_scale, wts.quant.w2_scale) if kind == "fp8_tensor_dyn" else wts.quant
    shared = torch.randn_like(x)
    cfg = get_config(num_tokens=T, inter=inter, quant=quant_kind, num_local_experts=n_local, **HY3_CFG)
    cfg = cfg.with_(swap_ab=swap, naive_max_pairs=1 << 30 if naive else 0)
    got = fused_moe(x, wts.w13, wts.w2, tw, ids, quant=quant, expert_map=emap, shared_output=shared,
                    out=nan_like(x), config=cfg)
    ref = R.fused_moe(x, wts.w13, wts.w2, tw, ids, quant=quant, expert_map=emap, shared_output=shared)
    tol = {} if kind == "none" else {"maxtol": 4e-2, "rmstol": 1.5e-2}  # fp8 tolerance, see _tolerance
    assert_close(ref, got, **tol)


@pytest.mark.gpu
@pytest.mark.parametrize("dyn", [False, True])
@pytest.mark.parametrize("T, shape", [(2048, "tp8"), (4096, "tp8"), (2048, "ep8")])
def test_gpu_fp8_wide_tiles_promote(T, shape, dyn):
    """fp8 per-tensor at batches whose tiles are 64+ rows without swap-AB (wgmma). `fp8_promote=128` (the MMA's
    reduced-precision sum joins fp32 every 128 products): within the fp8 tolerance with at most half its rms, and
    more accurate than 0 (Triton's default, one reduced-precision sum over the whole K loop: max 6.9e-2 / rms 2.8e-2
    with dynamic scales on the H200). The default (None) is the former with dynamic activation scales and the latter
    with static ones, bit for bit, and within the fp8 tolerance either way."""
    inter, n_local = (192, None) if shape == "tp8" else (1536, 24)
    wts, tw, ids, emap, x = _hy3_inputs(T, inter, "fp8_tensor", n_local)
    quant = Fp8PerTensor(wts.quant.w13_scale, wts.quant.w2_scale) if dyn else wts.quant
    cfg = get_config(num_tokens=T, inter=inter, quant="fp8_tensor", num_local_experts=n_local, **HY3_CFG)
    assert cfg.block_m >= 64 and not cfg.swap_ab and cfg.fp8_promote is None, cfg  # the wide tiles, the default
    ref = R.fused_moe(x, wts.w13, wts.w2, tw, ids, quant=quant, expert_map=emap)
    outs, errs = {}, {}
    for promote in (0, 128, None):
        outs[promote] = fused_moe(x, wts.w13, wts.w2, tw, ids, quant=quant, expert_map=emap, out=nan_like(x),
                                  config=cfg.with_(fp8_promote=promote))
        errs[promote] = relative_errors(ref, outs[promote])
    assert_close(ref, outs[128], maxtol=4e-2, rmstol=7.5e-3)
    assert_close(ref, outs[None], maxtol=4e-2, rmstol=1.5e-2)
    assert errs[128][1] < errs[0][1], errs
    assert torch.equal(outs[None], outs[128 if dyn else 0]), errs


class _Hy3Knob:
    """A Hy3 layer (`shape` tp8 / ep8, `kind` of quantization, T tokens) under its GPU config with one MoeConfig
    field (`knob`) set per call: `run(value, out)` (out NaN-filled when not given)."""

    def __init__(self, shape: str, T: int, kind: str, knob: str):
        if shape == "tp8" and kind == "fp8_block":
            pytest.skip("Fp8Block128 needs I % 128 == 0 (Hy3 TP8 has I = 192)")
        inter, n_local = (192, None) if shape == "tp8" else (1536, 24)
        self.T, self.knob = T, knob
        self.wts, self.tw, self.ids, self.emap, self.x = _hy3_inputs(T, inter, kind, n_local)
        self.cfg = get_config(num_tokens=T, inter=inter, quant=kind, num_local_experts=n_local, **HY3_CFG)

    def run(self, value, out=None):
        return fused_moe(self.x, self.wts.w13, self.wts.w2, self.tw, self.ids, quant=self.wts.quant,
                         expert_map=self.emap, out=nan_like(self.x) if out is None else out,
                         config=self.cfg.with_(**{self.knob: value}))

    def replay_with_new_routing(self, value):
        """A CUDA graph of `run(value)` replayed after the routing changed in place: (its output, the eager call's
        output on the new routing)."""
        out = nan_like(self.x)
        graph, _ = capture_graph(lambda: self.run(value, out))
        tw2, ids2 = make_routing(self.T, HY3["k"], HY3["E"], "cuda", seed=7)
        self.tw.copy_(tw2)
        self.ids.copy_(ids2)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        return out, self.run(value)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["fp8_tensor", "none", "fp8_block"])
@pytest.mark.parametrize("T", [1, 4, 16, 64, 512, 2048, 4096])
@pytest.mark.parametrize("shape", ["tp8", "ep8"])
def test_gpu_down_n_per_bit_equal(shape, T, kind):
    """`MoeConfig.down_n_per` (a down program over several N tiles in one flat loop, the MMA's accumulator restarted
    at each tile) sums each tile in the order of one program a tile: bit-equal at Hy3 sizes (a count dividing the N
    tiles and one that does not), NaN-filled out, eagerly and in a CUDA-graph replay with new routing."""
    h = _Hy3Knob(shape, T, kind, "down_n_per")
    want = h.run(1)
    assert not want.isnan().any()
    for n_per in (4, 5, 32):
        out = nan_like(h.x)
        h.run(n_per, out)
        torch.cuda.synchronize()
        assert torch.equal(out, want), n_per
    replayed, _ = h.replay_with_new_routing(4)
    assert torch.equal(replayed, h.run(1))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["fp8_tensor", "none", "fp8_block"])
@pytest.mark.parametrize("T", [1, 4, 16, 64, 512])
@pytest.mark.parametrize("shape", ["tp8", "ep8"])
def test_gpu_split_k(shape, T, kind):
    """`MoeConfig.split_k` (the gate-up K loop over 2-4 programs, the last to arrive sums the fp32 partials in split
    order): within the reference's tolerance and as close to it as one program a task, NaN-filled out;
    deterministic (two runs bit-equal, whichever program arrives last); a CUDA-graph replay with new routing
    equals the eager call."""
    h = _Hy3Knob(shape, T, kind, "split_k")
    ref = R.fused_moe(h.x, h.wts.w13, h.wts.w2, h.tw, h.ids, quant=h.wts.quant, expert_map=h.emap)
    want = h.run(1)
    tol = {} if kind == "none" else {"maxtol": 4e-2, "rmstol": 1.5e-2}  # fp8 tolerance, see _tolerance
    for split in (2, 3, 4):
        got = h.run(split)
        assert_close(ref, got, **tol)
        assert relative_errors(ref, got)[1] <= 1.25 * relative_errors(ref, want)[1] + 1e-4, split
        assert torch.equal(h.run(split), got), split
    replayed, eager = h.replay_with_new_routing(4)
    assert torch.equal(replayed, eager)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["fp8_tensor", "fp8_tensor_dyn", "none"])
@pytest.mark.parametrize("T", [64, 2048, 4096])
def test_gpu_down_n_per_one_k_step(T, kind):
    """`down_n_per` with one K step over Hy3 TP8's I = 192 (down_block_k 256, masked): the activation tile is loaded
    once and the program walks all of H's N tiles; within the reference's tolerance, NaN-filled out, and as close
    to the reference as the default kernels (its K sum runs in another order, so not bit-equal)."""
    quant_kind = kind.replace("_dyn", "")
    wts, tw, ids, emap, x = _hy3_inputs(T, 192, quant_kind)
    quant = Fp8PerTensor(wts.quant.w13_scale, wts.quant.w2_scale) if kind == "fp8_tensor_dyn" else wts.quant
    cfg = get_config(num_tokens=T, inter=192, quant=quant_kind, **HY3_CFG)
    ref = R.fused_moe(x, wts.w13, wts.w2, tw, ids, quant=quant)
    want = fused_moe(x, wts.w13, wts.w2, tw, ids, quant=quant, out=nan_like(x), config=cfg)
    got = fused_moe(x, wts.w13, wts.w2, tw, ids, quant=quant, out=nan_like(x),
                    config=cfg.with_(down_n_per=32, down_block_k=256,  # 16-bit: 2 stages fit shared memory
                                     **({"down_num_stages": 2} if kind == "none" else {})))
    tol = {} if kind == "none" else {"maxtol": 4e-2, "rmstol": 1.5e-2}  # fp8 tolerance, see _tolerance
    assert_close(ref, got, **tol)
    assert relative_errors(ref, got)[1] <= 1.25 * relative_errors(ref, want)[1] + 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["fp8_tensor", "none"])
def test_gpu_ep8_ranks_sum_to_full(kind):
    """Eight simulated EP ranks (24 local experts each, I 1536) sum to the single-rank computation."""
    E, k, H, inter, T = 192, 8, 4096, 1536, 64
    full = make_weights(E, H, inter, kind, device="cuda")
    tw, ids = make_routing(T, k, E, "cuda")
    x = torch.randn(T, H, device="cuda").bfloat16()
    whole = fused_moe(x, full.w13, full.w2, tw, ids, quant=full.quant).float()
    acc = torch.zeros_like(whole)
    for r in range(8):
        local = list(range(24 * r, 24 * (r + 1)))
        q = full.quant
        if q is not None:
            q = Fp8PerTensor(q.w13_scale[24 * r:24 * (r + 1)], q.w2_scale[24 * r:24 * (r + 1)], q.a13_scale,
                             q.a2_scale)
        acc += fused_moe(x, full.w13[local[0]:local[-1] + 1], full.w2[local[0]:local[-1] + 1], tw, ids,
                         quant=q, expert_map=make_expert_map(E, local, "cuda")).float()
    # each rank rounds its partial sum to bf16 once
    assert_close(whole, acc, maxtol=2e-2, rmstol=8e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["fp8_tensor", "none", "fp8_block"])
@pytest.mark.parametrize("T", [4, 64, 2048])
def test_gpu_cuda_graph_replay(kind, T):
    """Capture once, replay with new routing written into the same buffers: equals eager."""
    inter, n_local = (192, None) if kind != "fp8_block" else (1536, 24)
    wts, tw, ids, emap, x = _hy3_inputs(T, inter, kind, n_local)
    out = torch.empty_like(x)

    def step():
        fused_moe(x, wts.w13, wts.w2, tw, ids, quant=wts.quant, expert_map=emap, out=out)

    graph, _ = capture_graph(step)
    for seed in (5, 6, 7):
        tw2, ids2 = make_routing(T, HY3["k"], HY3["E"], "cuda", seed=seed)
        tw.copy_(tw2)
        ids.copy_(ids2)
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        eager = fused_moe(x, wts.w13, wts.w2, tw, ids, quant=wts.quant, expert_map=emap)
        assert torch.equal(out, eager) or assert_close(eager, out) is None


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["none", "fp8_tensor", "fp8_block"])
@pytest.mark.parametrize("T", [1, 4, 16, 64, 256, 2048])
@pytest.mark.parametrize("shape", ["tp8", "ep8"])
def test_gpu_hy3_fused_shared_expert(shape, T, kind):
    """Hy3's shared expert (I_s = 192, bf16) fused into the routed GEMM kernels, in a CUDA graph, at the tuned
    configs of every batch regime; the output buffer starts NaN."""
    inter, n_local = (192, None) if shape == "tp8" else (1536, 24)
    if kind == "fp8_block" and inter % 128:
        pytest.skip("Fp8Block128 needs I % 128 == 0 (Hy3 TP8 has I = 192)")
    wts, tw, ids, emap, x = _hy3_inputs(T, inter, kind, n_local)
    g = torch.Generator(device="cuda").manual_seed(3)
    s13 = (torch.randn(384, 4096, generator=g, device="cuda") / 64).bfloat16()
    s2 = (torch.randn(4096, 192, generator=g, device="cuda") / 192 ** 0.5).bfloat16()
    out = nan_like(x)
    graph, _ = capture_graph(lambda: fused_moe(x, wts.w13, wts.w2, tw, ids, quant=wts.quant, expert_map=emap,
                                                out=out, shared_w13=s13, shared_w2=s2))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ref = R.fused_moe(x, wts.w13, wts.w2, tw, ids, quant=wts.quant, expert_map=emap, shared_w13=s13, shared_w2=s2)
    tol = {} if kind == "none" else {"maxtol": 4e-2, "rmstol": 1.5e-2}  # fp8 tolerance, see _tolerance
    assert_close(ref, out, **tol)


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", [0, 1])
@pytest.mark.parametrize("graph", [False, True])
def test_gpu_shared_output_from_another_stream(graph, pdl):
    """The shared expert's output written late on an auxiliary stream (as vLLM runs it at decode sizes): the
    reduction waits for `shared_ready`, eagerly and in a captured graph. The aux stream sleeps first, so
    the routed GEMMs finish long before it writes; a reduction that did not wait would read the NaNs."""
    T = 4
    wts, tw, ids, emap, x = _hy3_inputs(T, 192, "fp8_tensor")
    want_shared = torch.randn_like(x)
    shared, out = torch.empty_like(x), torch.empty_like(x)
    aux, ready = torch.cuda.Stream(), torch.cuda.Event()

    def step():
        shared.fill_(float("nan"))
        aux.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(aux):
            torch.cuda._sleep(20_000_000)  # ~10 ms of spinning on the aux stream
            shared.copy_(want_shared)
            ready.record(aux)
        fused_moe(x, wts.w13, wts.w2, tw, ids, quant=wts.quant, shared_output=shared, shared_ready=ready, out=out,
                  config=cfg)
        torch.cuda.current_stream().wait_stream(aux)

    cfg = get_config(num_tokens=T, inter=192, quant="fp8_tensor", **HY3_CFG).with_(pdl=pdl)

    ref = R.fused_moe(x, wts.w13, wts.w2, tw, ids, quant=wts.quant, shared_output=want_shared)
    if graph:
        g, _ = capture_graph(step)
        out.fill_(float("nan"))
        g.replay()
    else:
        out.fill_(float("nan"))
        step()
    torch.cuda.synchronize()
    assert_close(ref, out, maxtol=4e-2, rmstol=1.5e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", [1, 2])
@pytest.mark.parametrize("kind", ["none", "fp8_tensor", "fp8_tensor_dyn", "fp8_block"])
@pytest.mark.parametrize("T", [4, 16, 64, 2048])
def test_gpu_pdl(T, kind, pdl):
    """`MoeConfig.pdl` (the gate-up, down and reduce kernels launched with programmatic dependent launch, each
    waiting for the previous one's writes) at the tuned config of each batch regime (one task a pair at T 4, the
    index above), eagerly and replayed in a CUDA graph, with the shared expert fused into the GEMMs (T <= 64) or
    added from `shared_output`: bit-equal to the same config launched without PDL, and within the tolerance of the
    reference. Output buffers start NaN."""
    quant_kind = kind.replace("_dyn", "")
    inter, n_local = (192, None) if kind != "fp8_block" else (1536, 24)
    wts, tw, ids, emap, x = _hy3_inputs(T, inter, quant_kind, n_local)
    quant = Fp8PerTensor(wts.quant.w13_scale, wts.quant.w2_scale) if kind == "fp8_tensor_dyn" else wts.quant
    cfg = get_config(num_tokens=T, inter=inter, quant=quant_kind, num_local_experts=n_local,
                     device_name=device_name(x.device), **HY3_CFG).with_(pdl=0)
    extra = {}
    if T <= 64:
        g = torch.Generator(device="cuda").manual_seed(3)
        extra = dict(shared_w13=(torch.randn(384, 4096, generator=g, device="cuda") / 64).bfloat16(),
                     shared_w2=(torch.randn(4096, 192, generator=g, device="cuda") / 192 ** 0.5).bfloat16())
    else:
        extra = dict(shared_output=torch.randn_like(x))

    def run(c, out):
        return fused_moe(x, wts.w13, wts.w2, tw, ids, quant=quant, expert_map=emap, out=out, config=c, **extra)

    base = run(cfg, nan_like(x))
    eager = run(cfg.with_(pdl=pdl), nan_like(x))
    out = nan_like(x)
    graph, _ = capture_graph(lambda: run(cfg.with_(pdl=pdl), out))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(eager, base) and torch.equal(out, base)
    ref = R.fused_moe(x, wts.w13, wts.w2, tw, ids, quant=quant, expert_map=emap, **extra)
    tol = {} if kind == "none" else {"maxtol": 4e-2, "rmstol": 1.5e-2}  # fp8 tolerance, see _tolerance
    assert_close(ref, eager, **tol)


def test_pdl_config_is_checked():
    """`MoeConfig.pdl` takes 0, 1 or 2, `split_k` an int in 1..16 (ValueError naming them otherwise)."""
    T, k, E, H, inter = 2, 2, 4, 64, 64
    tw, ids = make_routing(T, k, E, "cpu")
    w = make_weights(E, H, inter, "none", device="cpu")
    x = torch.randn(T, H).bfloat16()
    cfg = get_config(num_tokens=T, top_k=k, num_experts=E, hidden=H, inter=inter, interpreter=True)
    with pytest.raises(ValueError, match="config.pdl"):
        fused_moe(x, w.w13, w.w2, tw, ids, config=cfg.with_(pdl=3))
    for bad in (0, 17, 2.0, True):
        with pytest.raises(ValueError, match="config.split_k"):
            fused_moe(x, w.w13, w.w2, tw, ids, config=cfg.with_(split_k=bad))


def test_gluon_config_is_checked():
    """`MoeConfig.gluon` names what it lacks (ValueError): a bool, the 128-block scheme, the decode tile, no fused
    shared expert, x quantized up front, an sm_90 GPU."""
    T, k, E, H, inter = 3, 2, 4, 256, 128
    tw, ids = make_routing(T, k, E, "cpu")
    x = torch.randn(T, H).bfloat16()
    blk = make_weights(E, H, inter, "fp8_block", device="cpu")
    cfg = get_config(num_tokens=T, top_k=k, num_experts=E, hidden=H, inter=inter, quant="fp8_block",
                     interpreter=True).with_(swap_ab=True, block_m=16, block_n=128, block_k=128, prequant_x=True)
    cases = [(dict(gluon=1), "must be a bool"), (dict(gluon=True, block_m=32), "takes swap_ab, block_m 16"),
             (dict(gluon=True, prequant_x=False), "needs x quantized up front"),
             (dict(gluon=True), "needs an sm_90 GPU")]
    for over, msg in cases:
        with pytest.raises(ValueError, match="config.gluon " + msg):
            fused_moe(x, blk.w13, blk.w2, tw, ids, quant=blk.quant, config=cfg.with_(**over))
    t = make_weights(E, H, inter, "fp8_tensor", device="cpu")
    with pytest.raises(ValueError, match="config.gluon takes the fp8 128-block scheme"):
        fused_moe(x, t.w13, t.w2, tw, ids, quant=t.quant, config=cfg.with_(gluon=True))
    # a fused shared expert: refused before anything is launched
    with pytest.raises(ValueError, match="config.gluon does not take a fused shared expert"):
        fused_moe(x, blk.w13, blk.w2, tw, ids, quant=blk.quant, config=cfg.with_(gluon=True),
                  shared_w13=torch.zeros(2 * 64, H).bfloat16(), shared_w2=torch.zeros(H, 64).bfloat16())


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 4, 16, 64])
@pytest.mark.parametrize("shape", ["ep8", "dsv3"])
def test_gpu_gluon_gate_up(shape, T):
    """`MoeConfig.gluon` (the 128-block gate-up as a Gluon kernel, x quantized up front) at Hy3 EP8 and DeepSeek-V3
    TP8 sizes, over the heuristic's split, one program a task and 3: within the reference's tolerance and as close
    to it as the `tl` kernel, NaN-filled out; a CUDA-graph replay with new routing equals the eager call."""
    if shape == "ep8":
        h = _Hy3Knob("ep8", T, "fp8_block", "gluon")
    else:  # DeepSeek-V3 TP8: E 256, k 8, H 7168, I 256
        h = _Hy3Knob.__new__(_Hy3Knob)
        h.T, h.knob = T, "gluon"
        E, k, H, inter = 256, 8, 7168, 256
        h.wts = make_weights(E, H, inter, "fp8_block", device="cuda")
        h.tw, h.ids = make_routing(T, k, E, "cuda")
        h.emap = None
        h.x = torch.randn(T, H, device="cuda").bfloat16()
        h.cfg = get_config(num_tokens=T, top_k=k, num_experts=E, hidden=H, inter=inter, quant="fp8_block")
    h.cfg = h.cfg.with_(prequant_x=True, swap_ab=True, block_m=16, block_n=128, block_k=128, act_mul="fp32")
    ref = R.fused_moe(h.x, h.wts.w13, h.wts.w2, h.tw, h.ids, quant=h.wts.quant, expert_map=h.emap)
    want = h.run(False)
    for split in sorted({1, h.cfg.split_k, 3}):
        h.cfg = h.cfg.with_(split_k=split)
        got = h.run(True)
        assert_close(ref, got, maxtol=4e-2, rmstol=1.5e-2)  # fp8 tolerance, see _tolerance
        assert relative_errors(ref, got)[1] <= 1.25 * relative_errors(ref, want)[1] + 1e-4, split
    replayed, eager = h.replay_with_new_routing(True)
    assert torch.equal(replayed, eager)


# ---------------------------------------------------------------------------------------------------
# configs: launch counts, the tuned table

HY3_CFG = dict(top_k=8, num_experts=192, hidden=4096)


def test_get_config_fp8_block_tiles():
    """fp8 block: whole 128-groups per gate-up program (epilogue quantization), its 256-row gate+up tile on
    8 warps, at every batch (narrower tiles measured slower at B 4 and 16); the index under EP."""
    cfg = get_config(num_tokens=4, inter=1536, quant="fp8_block", **HY3_CFG)
    assert cfg.block_n == 128 and cfg.num_warps == 8 and cfg.block_k == cfg.down_block_k == 128
    ep8 = get_config(num_tokens=4, inter=1536, quant="fp8_block", num_local_experts=24, **HY3_CFG)
    assert ep8.block_n == 128 and ep8.naive_max_pairs == 0 and cfg.naive_max_pairs == 48


def test_reduce_block_h_heuristic():
    """The reduction takes 256 columns a program up to 64 tokens and 1024 above, tuned entry or not (the tuner does
    not sweep it, so `TUNABLE` leaves it to the heuristic)."""
    from hpcops.moe.configs import TUNABLE

    assert "reduce_block_h" not in TUNABLE
    for dev in (None, "NVIDIA H200"):
        for T, want in ((1, 256), (4, 256), (64, 256), (65, 1024), (512, 1024), (4096, 1024)):
            for n_local, quant in ((None, "fp8_tensor"), (24, "fp8_block"), (None, "none")):
                cfg = get_config(num_tokens=T, inter=192 if n_local is None else 1536, quant=quant,
                                 num_local_experts=n_local, device_name=dev, **HY3_CFG)
                assert cfg.reduce_block_h == want, (dev, T, n_local, quant)


def test_gate_up_split_heuristic():
    """fp8 128-block gate-up K loops go over several programs where the batch's tiles leave most of the 132 SMs
    idle (`gate_up_split`): Hy3 EP8 T 4 (~3.8 touched experts × 12 N tiles) over 2, DeepSeek-V3 TP8 T 1 (8 × 2 tiles,
    56 K steps) over 8; one program a task from a few dozen tokens on, and for the other schemes."""
    ep8 = dict(inter=1536, quant="fp8_block", num_local_experts=24, **HY3_CFG)
    assert get_config(num_tokens=4, **ep8).split_k == 2
    assert get_config(num_tokens=64, **ep8).split_k == 1
    dsv3 = dict(top_k=8, num_experts=256, hidden=7168, inter=256, quant="fp8_block")
    assert get_config(num_tokens=1, **dsv3).split_k == 8 and get_config(num_tokens=16, **dsv3).split_k == 1
    assert get_config(num_tokens=1, top_k=8, num_experts=128, hidden=2048, inter=768, quant="fp8_block").split_k == 2
    for quant in ("none", "fp8_tensor"):
        assert get_config(num_tokens=1, top_k=8, num_experts=256, hidden=7168, inter=256, quant=quant).split_k == 1
    assert gate_up_split(4, 8, 192, 24, 512, 1536, 128, 128) == 1  # 4 K steps: no split
    dsv3 = get_config(num_tokens=1, top_k=8, num_experts=256, hidden=7168, inter=256, quant="fp8_block")
    assert dsv3.block_n == 128 and dsv3.naive_max_pairs == 64


@pytest.mark.parametrize("kind,want", [
    ("fp8_tensor", ["moe_quant_x_kernel", "moe_gate_up_kernel", "moe_down_kernel", "moe_reduce_kernel"]),
    ("fp8_tensor_dyn", ["aten.zeros.default", "moe_quant_x_kernel", "moe_gate_up_kernel",
                        "moe_down_kernel", "moe_reduce_kernel"]),  # dynamic a2: a zeroed row-amax buffer, first
    # (x's quantization then comes right before the gate-up GEMM, whose launch it releases: MoeConfig.pdl)
])
def test_decode_batch_launches(kind, want):
    """Everything a decode-size call puts on the stream (Triton launches and torch ops that run kernels):
    B=4 Hy3 with static fp8 scales is four launches: x quantized once, then one task per pair (32 pairs over
    192 experts: no index), the two GEMMs and the reduction."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from hpcops.moe import _moe_kernels as K

    class TorchOps(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "empty" not in str(func):  # allocations launch nothing
                calls.append((str(func), args, kwargs))
            return func(*args, **(kwargs or {}))

    E, H, inter, T, k = 4, 256, 128, 4, 8
    base = kind.replace("_dyn", "")
    wts = make_weights(E, H, inter, base, static=kind == "fp8_tensor")
    x = torch.zeros(T, H, dtype=torch.bfloat16)
    ids = torch.zeros(T, k, dtype=torch.int32)
    tw = torch.zeros(T, k)
    cfg = get_config(num_tokens=T, inter=192, quant=base, **HY3_CFG).with_(validate_ids=False)  # the GPU heuristic
    with recorded_launches(K) as calls, TorchOps():
        fused_moe(x, wts.w13, wts.w2, tw, ids, quant=wts.quant, shared_output=x, out=torch.empty_like(x),
                  config=cfg)
    assert [name for name, _, _ in calls] == want


@pytest.mark.parametrize("index_quant,want", [
    (True, ["moe_index_small_kernel", "moe_gate_up_kernel", "moe_down_kernel", "moe_reduce_kernel"]),
    (False, ["moe_index_small_kernel", "moe_quant_x_kernel", "moe_gate_up_kernel", "moe_down_kernel",
             "moe_reduce_kernel"]),
])
def test_index_batch_launches(index_quant, want):
    """Under expert parallelism a decode batch builds the index (B=4 Hy3 EP8, static fp8 scales): x's quantization is
    T more programs of the index build's one-program launch (`MoeConfig.index_quant`), four launches in all, or
    its own launch after the index without."""
    from hpcops.moe import _moe_kernels as K

    E, H, inter, T, k = 24, 256, 128, 4, 8
    wts = make_weights(E, H, inter, "fp8_tensor", static=True)
    emap = make_expert_map(192, list(range(24)))
    cfg = get_config(num_tokens=T, inter=192, quant="fp8_tensor", num_local_experts=24, **HY3_CFG)
    cfg = cfg.with_(validate_ids=False, index_quant=index_quant)  # the GPU heuristic
    x = torch.zeros(T, H, dtype=torch.bfloat16)
    with recorded_launches(K) as calls:
        fused_moe(x, wts.w13, wts.w2, torch.zeros(T, k), torch.zeros(T, k, dtype=torch.int32), quant=wts.quant,
                  expert_map=emap, out=torch.empty_like(x), config=cfg)
    assert [name for name, _, _ in calls] == want
    assert calls[0][2].get("QUANT_X", False) == index_quant


def _entry(T, **cfg):
    return {"E": 192, "E_local": 192, "H": 4096, "I": 192, "quant": "fp8_tensor", "T": T, "config": cfg}


def test_tuned_table(monkeypatch, tmp_path):
    from hpcops.moe import configs as C
    from hpcops.moe import tuned

    monkeypatch.delenv("HPCOPS_MOE_TUNED", raising=False)
    monkeypatch.setattr(tuned, "TUNED", {"GPU-A": [_entry(4, block_n=16), _entry(64, block_n=64, block_m=32)]})
    kw = dict(top_k=8, num_experts=192, hidden=4096, inter=192, quant="fp8_tensor", num_local_experts=192)
    heur = get_config(num_tokens=4, **kw)
    assert get_config(num_tokens=4, device_name="GPU-A", **kw) == heur.with_(block_n=16)
    assert get_config(num_tokens=2, device_name="GPU-A", **kw).block_n == 16
    assert get_config(num_tokens=16, device_name="GPU-A", **kw).block_n == 16  # log2: 16 is as near 4 as 64
    assert get_config(num_tokens=17, device_name="GPU-A", **kw).block_m == 32
    assert get_config(num_tokens=129, device_name="GPU-A", **kw) == get_config(num_tokens=129, **kw)  # > 2·64
    assert get_config(num_tokens=4, device_name="GPU-B", **kw) == heur  # another device
    assert get_config(num_tokens=4, device_name="GPU-A", interpreter=True, **kw) == \
        get_config(num_tokens=4, interpreter=True, **kw)  # the interpreter keeps its own tiles
    ep = dict(kw, num_local_experts=24)
    assert get_config(num_tokens=4, device_name="GPU-A", **ep) == get_config(num_tokens=4, **ep)  # EP shape
    # a sweep output named by HPCOPS_MOE_TUNED comes first
    f = tmp_path / "moe_sweep.json"
    f.write_text(json.dumps({"device": "GPU-A", "entries": [_entry(4, block_n=64, prequant_x=False)]}))
    monkeypatch.setenv("HPCOPS_MOE_TUNED", str(f))
    got = get_config(num_tokens=4, device_name="GPU-A", **kw)
    assert got.block_n == 64 and not got.prequant_x and heur.prequant_x
    C._env_entries.cache_clear()
    f.write_text(json.dumps({"device": "GPU-A", "entries": [_entry(4, blocc_n=64)]}))
    with pytest.raises(ValueError, match="blocc_n"):
        get_config(num_tokens=4, device_name="GPU-A", **kw)
    C._env_entries.cache_clear()


@pytest.mark.gpu
def test_gpu_out_of_range_ids_are_dropped_without_checking(monkeypatch):
    """Without HPCOPS_CHECK, device topk_ids are not synced to the host: out-of-range ids are dropped
    like remote experts (no out-of-bounds access), so the result is the reference without them."""
    monkeypatch.delenv("HPCOPS_CHECK", raising=False)
    t, k, e, h, inter = 9, 2, 4, 256, 128
    w = make_weights(e, h, inter, "none", device="cuda")
    tw0, ids0 = make_routing(t, k, e, "cuda")
    base = dict(x=torch.randn(t, h, device="cuda").bfloat16(), w13=w.w13, w2=w.w2, topk_weights=tw0,
                topk_ids=ids0)
    ids = base["topk_ids"].clone()
    ids[::2, 0] += 5 * e  # out of range
    got = fused_moe(**dict(base, topk_ids=ids))
    tw = base["topk_weights"].clone()
    tw[::2, 0] = 0.0
    from hpcops.moe.reference import fused_moe as ref_moe

    want = ref_moe(**dict(base, topk_weights=tw))
    torch.cuda.synchronize()
    assert_close(want, got)


# ---------------------------------------------------------------------------------------------------
# quantization schemes: one class each, named codes


def test_schemes_are_one_class_each():
    """Every quant type maps to one scheme with its own name (the config/tuned-table key) and kernel code;
    the torch.library op rebuilds the quant object from its flat scale arguments."""
    from hpcops.moe import schemes as S
    from hpcops.moe.codes import QuantCode

    classes = list(S.SCHEMES.values())
    assert sorted(c.code for c in classes) == sorted(QuantCode)
    assert len({c.name for c in classes}) == len(classes)
    w = make_weights(2, 128, 128, "fp8_tensor")
    assert isinstance(S.scheme_for(None), S.Wide16) and isinstance(S.scheme_for(w.quant), S.Fp8Tensor)
    q = S.scheme_named("fp8_tensor").from_op_args(w.quant.w13_scale, w.quant.w2_scale, w.quant.a13_scale,
                                                  w.quant.a2_scale)
    assert isinstance(q, Fp8PerTensor) and q.a2_scale is w.quant.a2_scale
    assert S.scheme_named("none").from_op_args(None, None, None, None) is None
    with pytest.raises(TypeError, match="quant must be None, Fp8PerTensor or Fp8Block128, got str"):
        S.scheme_for("fp8")
    with pytest.raises(ValueError, match="quant_kind must be one of"):
        S.scheme_named("int4")


def test_kernels_compare_named_codes_only():
    """The kernels read the mode constexprs through the named mirrors of codes.py, never bare numbers."""
    import inspect
    import re

    from hpcops.moe import _moe_kernels as K

    src = inspect.getsource(K)
    assert not re.findall(r"\b(QUANT|ACT_OUT|ACT_IN|MODE) == \d", src)
    from hpcops.moe.codes import ActMode, QuantCode, XMode

    mirrors = {"Q_NONE": QuantCode.NONE, "Q_FP8_TENSOR": QuantCode.FP8_TENSOR, "A_WIDE": ActMode.WIDE,
               "A_FP8_STATIC": ActMode.FP8_STATIC, "A_WIDE_ROW_AMAX": ActMode.WIDE_ROW_AMAX,
               "A_WIDE_GROUP_AMAX": ActMode.WIDE_GROUP_AMAX, "X_STATIC": XMode.STATIC,
               "X_PER_TOKEN_GROUP": XMode.PER_TOKEN_GROUP}
    assert {k: int(getattr(K, k)) for k in mirrors} == {k: int(v) for k, v in mirrors.items()}


def test_fp8_promote_rule():
    """`MoeConfig.fp8_promote` None: 128 products on swap-AB tiles and on a GEMM whose fp8 input has per-token
    scales, no promotion on the static-scale wide tiles; an int applies to every fp8 GEMM (0: none), capped by the K
    tile; 16-bit weights never."""
    from hpcops.moe.fused_moe import _fp8_promote

    c = MoeConfig()
    assert _fp8_promote(c, True, False, 128) == {}
    assert _fp8_promote(c, True, True, 64) == {"FP8_PROMOTE": 64}
    assert _fp8_promote(c.with_(swap_ab=True), True, False, 256) == {"FP8_PROMOTE": 128}
    assert _fp8_promote(c.with_(swap_ab=True, fp8_promote=0), True, True, 128) == {}
    assert _fp8_promote(c.with_(fp8_promote=256), True, False, 128) == {"FP8_PROMOTE": 128}
    assert _fp8_promote(c.with_(fp8_promote=128), False, True, 128) == {}


@pytest.mark.parametrize("H", [200, 2600])
def test_quant_x_per_token_group(H, device):
    """`moe_quant_x_kernel` per token and 128-group (`prequant_x` for the 128-block scheme, an fp8 x's scales): the
    scales and the fp8 values of `quantize_per_token_group`, with a partial last group and, at H 2600 (21 groups,
    16 a step), a second step of groups that runs past H."""
    from hpcops.moe.codes import XMode
    from hpcops.moe.schemes import _quantize_x
    from hpcops.quant import quantize_per_token_group

    x = (torch.randn(5, H, generator=torch.Generator().manual_seed(3)) * 3).bfloat16().to(device)
    got = _quantize_x(x, XMode.PER_TOKEN_GROUP, None, x)
    got.scale.fill_(float("nan"))
    got.pending.launch()
    want_q, want_s = quantize_per_token_group(x)
    assert torch.equal(got.scale, want_s.float())
    assert torch.equal(got.x.float(), want_q.float())


@pytest.mark.parametrize("mode", ["static", "per-token", "per-token-group"])
@pytest.mark.parametrize("small", [True, False], ids=["one-program", "hist-scan-scatter"])
def test_index_build_quantizes_x(mode, small, device):
    """`build_moe_index(x_quant=)`: x's quantization as T more programs of the one-program index build's launch (or
    alone after the three-kernel build): the fp8 rows and scales of `moe_quant_x_kernel` run alone, bit for bit, and
    of the torch quantizers; the index the same as without it."""
    from hpcops.moe.codes import XMode
    from hpcops.moe.schemes import _quantize_x
    from hpcops.quant import quantize_per_tensor, quantize_per_token, quantize_per_token_group

    T, k, E, H = 9, 3, 8, 300
    _, ids = make_routing(T, k, E, device=device)
    emap = make_expert_map(E, [6, 0, 3, 5], device)
    x = (torch.randn(T, H, generator=torch.Generator().manual_seed(5)) * 2).bfloat16().to(device)
    xmode = {"static": XMode.STATIC, "per-token": XMode.PER_TOKEN, "per-token-group": XMode.PER_TOKEN_GROUP}[mode]
    a13 = torch.tensor([0.02], device=device)
    alone, fused = (_quantize_x(x, xmode, a13 if mode == "static" else None, x) for _ in range(2))
    for a in (alone, fused):
        if mode != "static":
            a.scale.fill_(float("nan"))
    alone.pending.launch()
    small_max = 10**6 if small else 0
    idx = build_moe_index(ids, 4, 16, expert_map=emap, small_max=small_max, block=16, x_quant=fused.pending)
    plain = build_moe_index(ids, 4, 16, expert_map=emap, small_max=small_max, block=16)
    for f in ("offsets", "tasks", "pair_pos"):
        assert torch.equal(getattr(idx, f), getattr(plain, f)), f
    used = int(plain.offsets[-1])  # (rows past the routed pairs are unused: not written by the three-kernel build)
    assert torch.equal(idx.sorted_pair[:used], plain.sorted_pair[:used])
    assert torch.equal(fused.x.view(torch.uint8), alone.x.view(torch.uint8))
    if mode == "static":
        want_q, _ = quantize_per_tensor(x, a13)
    else:
        assert torch.equal(fused.scale, alone.scale)
        want_q, want_s = quantize_per_token(x) if mode == "per-token" else quantize_per_token_group(x)
        assert torch.equal(fused.scale, want_s.float().reshape(fused.scale.shape))
    assert torch.equal(fused.x.float(), want_q.float())
