"""Decode attention and its plan: kernels (interpreted on the CPU tier) vs torch references."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

import hpcops
from hpcops import _platform
from hpcops.attention import plan as plan_mod
from hpcops.attention import reference as ref
from hpcops.quant import quantize_per_token_head
from hpcops.testing import assert_close, capture_graph, make_paged_kv, nan_like

FP8 = torch.float8_e4m3fn


# ---------------------------------------------------------------- plan
def _tables(plan):
    t = plan.host_tables()
    return t["header"], t["cum"], t["first_b"], t["last_b"]


def _desc(plan):
    """The descriptor tables (the reference fills them always, the kernel under task_desc)."""
    return plan.task_desc[:, :5].tolist(), plan.merge_desc.tolist()


@pytest.mark.parametrize("seed", range(12))
def test_plan_matches_reference(seed, device):
    rng = random.Random(seed)
    b = rng.choice([1, 2, 5, 17, 64, 300])
    lens = [rng.choice([0, 1, 63, 64, 65, rng.randint(1, 5000)]) for _ in range(b)]
    hkv = rng.choice([1, 2, 8])
    c = rng.choice([1, 7, 132, 528])
    mt = rng.choice([1, 2, 8])
    cost = rng.choice([0, 1, 3, 4, 9])
    snap = rng.choice([0, 4, 16, 64])
    split_cost = rng.choice([0, 16, 64, 256])
    slices = rng.choice([1, 2, 4, 8])
    kw = dict(num_kv_heads=hkv, num_programs=c, min_tiles=mt, task_cost=cost, snap=snap,
              num_sms=rng.choice([None, 1, 66, 132]))
    sl = torch.tensor(lens, dtype=torch.int32, device=device)
    with _with_config(dict(task_desc=False)):
        got = hpcops.plan_decode(sl, **kw)
        want = ref.plan_decode(sl.cpu(), **kw)
    assert _tables(got) == _tables(want) and not got.has_desc and got.cut_task_cost == got.cut_snap == 0
    _check_tasks(want, c, hkv, lens)
    with _with_config(dict(task_desc=True, plan_one_pass=bool(seed % 2), split_cost=split_cost, merge_slices=slices)):
        got = hpcops.plan_decode(sl, **kw)
        want = ref.plan_decode(sl.cpu(), **kw)
    assert got.has_desc and got.cut_task_cost == cost and got.cut_snap == (snap if cost else 0)
    assert _tables(got) == _tables(want) and _desc(got) == _desc(want)
    _check_tasks(want, c, hkv, lens)


def _check_tasks(plan, c, hkv, lens):
    """Every tile of every (head, request) is covered exactly once, by contiguous tasks; only programs
    below `active` hold tiles (a snap may close some), at most a bucket's worth + two snaps; the task and
    merge descriptors say the same (a merge for each split pair, in the program of its first piece,
    over all its pieces)."""
    bucket, s, total, active = plan.host_tables()["header"]
    used_snap = plan.host_tables()["used_snap"]
    unit = plan_mod.cost_unit(plan.cut_task_cost)
    tasks = plan.tasks()
    tiles = {}
    for prog, h, req, t0, n, _ in tasks:
        assert n >= 1 and prog < c
        for t in range(t0, t0 + n):
            assert (h, req, t) not in tiles
            tiles[(h, req, t)] = prog
    assert len(tiles) == hkv * s == hkv * sum(max(1, -(-n // 64)) for n in lens)
    busy = sorted({p for p, *_ in tasks})
    assert busy[-1] < active <= c and (used_snap or busy == list(range(active)))
    load = max(sum(n for p, *_, n, _ in tasks if p == i) for i in busy)
    if used_snap == plan_mod.WHOLE_SNAP:  # no request split; each end of a bucket moved by at most half a pair
        c_max = unit * max(max(1, -(-n // 64)) for n in lens) + plan.cut_task_cost
        assert not any(t[5] for t in tasks) and load <= -(-(bucket + c_max) // unit)
    else:
        assert used_snap == min(plan.cut_snap, bucket // 4) and load <= -(-(bucket + 2 * used_snap) // unit)
    desc, merge = _desc(plan)
    for i in range(c):
        mine = [t for t in tasks if t[0] == i]
        assert desc[i] == ([mine[0][2], mine[0][1], mine[0][3], sum(t[4] for t in mine), lens[mine[0][2]]] if mine
                           else [-1, 0, 0, 0, 0])
    pieces = {}
    for prog, h, req, *_rest, split in tasks:
        if split:
            pieces.setdefault((h, req), []).append(prog)
    want = {progs[0]: (req, h, len(progs)) for (h, req), progs in pieces.items()}
    got = {k: (m[0], m[1], m[3]) for k, m in enumerate(merge) if m[0] >= 0}
    assert got == want


def test_plan_task_cost_evens_out_short_requests():
    """32 two-tile requests then 32 of 64 tiles, 8 kv heads, 264 programs; a task costing 2 tiles: the
    equal-tile cut gives one program a head all 32 short requests (64 tiles + 32 tasks = 128 tiles of
    cost); the cut in cost keeps every program within ~70, and every program still holds a tile."""
    lens = torch.tensor([128] * 32 + [4096] * 32, dtype=torch.int32)

    def worst(plan):
        per = {}
        for prog, *_, n, _split in plan.tasks():
            t, k = per.get(prog, (0, 0))
            per[prog] = (t + n, k + 1)
        return max(t + 2 * k for t, k in per.values())

    with _with_config(dict(task_desc=True)):
        flat = ref.plan_decode(lens, num_kv_heads=8, num_programs=264, min_tiles=4, task_cost=0)
        costed = ref.plan_decode(lens, num_kv_heads=8, num_programs=264, min_tiles=4, task_cost=8, snap=0)
        snapped = ref.plan_decode(lens, num_kv_heads=8, num_programs=264, min_tiles=4, task_cost=8, snap=16)
    assert worst(flat) == 64 + 2 * 32
    assert worst(costed) <= 70 and costed.host_tables()["header"][3] == 264
    # a snap trades a little balance for fewer split pairs
    assert worst(snapped) <= 74
    assert sum(t[5] for t in snapped.tasks()) < sum(t[5] for t in costed.tasks())


def test_plan_snap_keeps_aligned_requests_whole():
    """64 requests of 8 tiles, 8 kv heads: the equal-tile cut is aligned (2 requests a program); the cut
    in cost drifts off the request boundaries and splits most of them; a snap of 4 tiles (capped at a
    quarter bucket) brings the cuts back to the boundaries: no split at all."""
    lens = torch.tensor([512] * 64, dtype=torch.int32)
    with _with_config(dict(task_desc=True, split_cost=0)):  # the whole cut would keep them whole too
        kw = dict(num_kv_heads=8, num_programs=264, min_tiles=4, task_cost=8)
        drift = ref.plan_decode(lens, snap=0, **kw)
        snapped = ref.plan_decode(lens, snap=16, **kw)
    assert sum(t[5] for t in drift.tasks()) > 300
    assert sum(t[5] for t in snapped.tasks()) == 0 and not (snapped.merge_desc[:, 0] >= 0).any()


@pytest.mark.parametrize("hkv, programs, snap, whole", [(1, 396, 0, 40), (8, 396, 0, 80), (8, 264, 0, 80)])
def test_plan_split_cost_cuts_short_uniform_batches_whole(hkv, programs, snap, whole, device):
    """64 requests of 8 tiles (64x0.5K): the equal cut in cost splits most of them (a bucket of 16 units at
    h8/1, 52 at h64/8 on 396 programs); with DecodeConfig.split_cost 32 the plan cuts whole pairs (a bucket of 1
    or 2 pairs of 40 units): no split, no merge, the kernel's tables the reference's. A batch of 64 tiles a
    request (64x4K h8/1) keeps the equal cut: whole pairs (264 units) would cost far more than the split (43)."""
    from hpcops.attention import decode as dec

    kw = dict(num_kv_heads=hkv, num_programs=programs, min_tiles=4, task_cost=8, snap=snap)
    short = torch.tensor([512] * 64, dtype=torch.int32, device=device)
    long = torch.tensor([4096] * 64, dtype=torch.int32, device=device)
    kw_long = dict(kw, num_kv_heads=1)
    with dec.decode_config_changed(task_desc=True, split_cost=0):
        split = ref.plan_decode(short.cpu(), **kw)
        equal_long = ref.plan_decode(long.cpu(), **kw_long)
    with dec.decode_config_changed(task_desc=True, split_cost=32):
        got = hpcops.plan_decode(short, **kw)
        want = ref.plan_decode(short.cpu(), **kw)
        got_long = hpcops.plan_decode(long, **kw_long)
    assert sum(t[5] for t in split.tasks()) > 40
    assert _tables(got) == _tables(want) and _desc(got) == _desc(want)
    assert got.host_tables()["used_snap"] == plan_mod.WHOLE_SNAP and got.host_tables()["header"][0] == whole
    tasks = got.tasks()
    assert not any(t[5] for t in tasks) and not (got.merge_desc[:, 0] >= 0).any()
    assert sorted((h, b) for _, h, b, *_ in tasks) == [(h, b) for h in range(hkv) for b in range(64)]
    assert _tables(got_long) == _tables(equal_long) and _desc(got_long) == _desc(equal_long)


@pytest.mark.parametrize("spec, hkv, sms, whole", [
    ("16x2K", 8, 132, True),  # 128 whole pairs of 136 units, one an SM, against max(66, 17408 / 132) + 40
    ("8x1K", 8, 132, True),  # 64 of 72 against 35 + 40
    ("16x2K", 8, 264, False),  # 136 against 66 + 40
    ("128x4K", 1, 132, True),  # 128 of 264 against 256 + 40
    ("64x4K", 1, 132, False),  # 64 of 264 against 128 + 40
    ("64x0.5K", 1, 132, True),  # 40 against 20 + 40
    ("32x1K", 1, 132, False),  # 32 of 72 against 18 + 40: 100 SMs idle (H100: 16.3 µs whole, 12.7 equal)
    ("48x1K", 1, 132, False),  # 72 against 27 + 40 (H100: 16.7 µs whole, 16.1 equal)
    ("16x1K", 1, 132, False),  # 72 against max(16, 9) + 40
])
def test_plan_whole_cut_by_busiest_sm(spec, hkv, sms, whole, device):
    """The whole cut is weighed on the busiest SM (`plan.whole_pays`): its whole buckets × the whole programs an SM
    runs, against the equal cut's share (a bucket or total / SMs) + the split cost (40 for the tl kernel). The
    device's plan kernel and the reference agree."""
    from hpcops.attention import decode as dec
    from hpcops.bench.scenarios import parse_lengths

    lens = torch.tensor(parse_lengths(spec), dtype=torch.int32, device=device)
    kw = dict(num_kv_heads=hkv, num_programs=264, min_tiles=4, task_cost=8, snap=0, num_sms=sms)
    with dec.decode_config_changed(task_desc=True, split_cost=None):
        got = hpcops.plan_decode(lens, **kw)
        want = ref.plan_decode(lens.cpu(), **kw)
    assert got.num_sms == want.num_sms == sms
    assert _tables(got) == _tables(want) and _desc(got) == _desc(want)
    assert (got.host_tables()["used_snap"] == plan_mod.WHOLE_SNAP) is whole
    assert any(t[5] for t in got.tasks()) is not whole


def test_whole_cut_cases_of_the_decode_bench():
    """Which of the decode bench's cases the tl kernel's plan cuts whole on 264 programs over 132 SMs (the H200 and
    H100 bench grid): the short uniform batches and the h64/8 ones whose pairs fill the SMs about once, measured
    faster whole (bench/results/probe_whole_cut_h100.md, decode_h100_042c88d.md); every mix with a long request
    keeps the equal cut. A change of the cost model that moves a case shows here."""
    from hpcops.bench.scenarios import parse_lengths
    from hpcops.bench.suites import decode as suite

    whole = set()
    for sc in suite.scenarios():
        cum = [0]
        for n in parse_lengths(sc.spec):
            cum.append(cum[-1] + max(1, -(-n // plan_mod.TILE)))
        cs = plan_mod.CostStream.cut(cum, sc.hkv, plan_mod.DEFAULT_TASK_COST, 264, plan_mod.DEFAULT_MIN_TILES, 0,
                                     plan_mod.SPLIT_COST_TL, num_sms=132)
        if cs.snap == plan_mod.WHOLE_SNAP:
            whole.add(f"{sc.spec} h{sc.hq}/{sc.hkv}")
    assert whole == {"64x0.5K h8/1", "64x0.5K h64/8", "64x4K h64/8", "8x1K h64/8", "16x2K h64/8", "32x1K h64/8"}


def test_check_plan_matches_takes_the_plans_kernel(device):
    """A Gluon plan (split cost 0: the equal cut) of a short uniform batch, where the tl kernel's plan would keep
    every request whole, is checked against the reference cut for its own kernel: no false "stale" error; other
    lengths still raise."""
    from hpcops.attention import decode as dec

    lens = torch.tensor([512] * 64, dtype=torch.int32, device=device)
    with dec.decode_config_changed(task_desc=True, split_cost=None):
        plan = hpcops.plan_decode(lens, num_kv_heads=1, num_programs=264)
        assert plan.host_tables()["used_snap"] == plan_mod.WHOLE_SNAP  # the tl kernel's: whole
        plan.kernel = "gluon"  # as plan_kernel picks on sm_90 for an fp8 q over fp8 KV
        hpcops.plan_decode(lens, num_kv_heads=1, out=plan)
        assert plan.host_tables()["used_snap"] != plan_mod.WHOLE_SNAP and any(t[5] for t in plan.tasks())
        plan_mod.check_plan_matches(plan, lens.cpu())
        with pytest.raises(ValueError, match="stale"):
            plan_mod.check_plan_matches(plan, (lens + 64).cpu())


def test_plan_num_sms_errors(device):
    lens = torch.tensor([100, 200], dtype=torch.int32, device=device)
    for bad in (0, -1, 1.5, "132"):
        with pytest.raises(ValueError, match="num_sms"):
            hpcops.plan_decode(lens, num_kv_heads=1, num_sms=bad)
        with pytest.raises(ValueError, match="num_sms"):
            ref.plan_decode(lens.cpu(), num_kv_heads=1, num_sms=bad)
    assert hpcops.plan_decode(lens, num_kv_heads=1).num_sms == _platform.num_sms(lens.device)


def test_split_cost_errors():
    from hpcops.attention.decode import DecodeConfig

    for bad in (-1, plan_mod.MAX_SPLIT_COST + 1, 1.5, "32"):
        with pytest.raises(ValueError, match="split_cost"):
            DecodeConfig(split_cost=bad)
    assert DecodeConfig().split_cost is None and DecodeConfig(split_cost=0).split_cost == 0


@pytest.mark.parametrize("launch", [dict(plan_block_c=16, plan_warps=1), dict(plan_block_c=0, plan_one_pass=True),
                                    dict(plan_block_c=32, plan_warps=2, plan_block_b=16, plan_one_pass=True),
                                    dict(plan_block_c=64, plan_block_b=1024, plan_one_pass=True),
                                    dict(plan_block_c=256, plan_warps=8, plan_block_b=64)],
                         ids=lambda d: "-".join(f"{k}{v}" for k, v in d.items()))
@pytest.mark.parametrize("b", [1, 17, 64, 300])
def test_plan_launch_knobs_same_tables(launch, b, device):
    """Every plan launch choice (one pass or looped blocks, any programs per plan program) builds the
    reference's tables, descriptors included."""
    from hpcops.attention import decode as dec

    rng = random.Random(b)
    lens = [rng.choice([0, 1, 64, 65, rng.randint(1, 3000)]) for _ in range(b)]
    sl = torch.tensor(lens, dtype=torch.int32, device=device)
    for hkv, c, mt in ((1, 132, 2), (8, 37, 1)):
        for desc in (False, True):  # without descriptors the cut is in tiles, with them in cost
            with dec.decode_config_changed(**launch, task_desc=desc):
                want = ref.plan_decode(sl.cpu(), num_kv_heads=hkv, num_programs=c, min_tiles=mt)
                got = hpcops.plan_decode(sl, num_kv_heads=hkv, num_programs=c, min_tiles=mt)
            assert got.has_desc == desc and _tables(got) == _tables(want)
            assert not desc or _desc(got) == _desc(want)


def test_plan_without_descriptors_is_refused_by_task_desc(device):
    kv = make_paged_kv([100, 7], num_kv_heads=1, head_dim=64, block_size=16, device=device)
    q = torch.randn(2, 2, 64, device=device).bfloat16()
    with _with_config(dict(task_desc=False)):
        plan = hpcops.plan_decode(kv.seq_lens, num_kv_heads=1, block_size=16)
    with pytest.raises(ValueError, match="task descriptors"):  # the default config reads them
        hpcops.decode_attention(q, kv.k_cache, kv.v_cache, kv.block_table, kv.seq_lens, plan=plan)


def test_plan_launch_knob_errors(device):
    from hpcops.attention import decode as dec

    with dec.decode_config_changed(plan_block_c=48), pytest.raises(ValueError, match="plan_block_c"):
        hpcops.plan_decode(torch.ones(3, dtype=torch.int32, device=device), num_kv_heads=1)


def test_plan_replan_into_same_buffers(device):
    sl = torch.tensor([5000, 10, 300], dtype=torch.int32, device=device)
    plan = hpcops.plan_decode(sl, num_kv_heads=2, max_batch=8, num_programs=16)
    bufs = (plan.header.data_ptr(), plan.cum.data_ptr(), plan.first_b.data_ptr())
    sl2 = torch.tensor([7, 7, 9000, 1, 64], dtype=torch.int32, device=device)
    again = hpcops.plan_decode(sl2, num_kv_heads=2, out=plan)
    assert again is plan and (plan.header.data_ptr(), plan.cum.data_ptr(), plan.first_b.data_ptr()) == bufs
    want = ref.plan_decode(sl2.cpu(), num_kv_heads=2, num_programs=16, max_batch=8)
    assert _tables(plan) == _tables(want)
    with pytest.raises(ValueError, match="max_batch"):
        hpcops.plan_decode(torch.ones(9, dtype=torch.int32, device=device), num_kv_heads=2, out=plan)


def test_plan_min_tiles_floor_prevents_oversplitting(device):
    sl = torch.tensor([256] * 4, dtype=torch.int32, device=device)  # 16 tiles in all
    plan = ref.plan_decode(sl, num_kv_heads=1, num_programs=528, min_tiles=8, task_cost=0)
    assert plan.host_tables()["header"] == [8, 16, 16, 2]
    with _with_config(dict(split_cost=0)):  # the floor alone (the tl kernel's split cost would keep them whole)
        plan = ref.plan_decode(sl, num_kv_heads=1, num_programs=528, min_tiles=8, task_cost=3)
    assert plan.host_tables()["header"] == [32, 16, 76, 3]  # units of 1/4 tile: 4·16 + 3·4
    plan = ref.plan_decode(sl, num_kv_heads=1, num_programs=528, min_tiles=8, task_cost=3)
    assert plan.host_tables()["header"] == [38, 16, 76, 2]  # 2 requests of 4 tiles + 3/4 a bucket: none split


def test_plan_errors(device):
    with pytest.raises(TypeError, match="seq_lens"):
        hpcops.plan_decode(torch.ones(3, dtype=torch.int64), num_kv_heads=1)
    with pytest.raises(ValueError, match="q_len"):
        hpcops.plan_decode(torch.ones(3, dtype=torch.int32), num_kv_heads=1, q_len=9)
    with pytest.raises(ValueError, match="block_size"):
        hpcops.plan_decode(torch.ones(3, dtype=torch.int32), num_kv_heads=1, block_size=48)


# ---------------------------------------------------------------- decode
@dataclass(frozen=True)
class Case:
    lens: tuple[int, ...]
    hq: int
    hkv: int
    d: int
    bs: int
    q_len: int = 1
    kv: str = "bf16"  # bf16 | fp16 | fp8 | fp8q (fp8 KV and fp8 query)
    packed: bool = True
    programs: int = 6
    min_tiles: int = 1
    q_mag: float = 1.0  # q ~ N(0, q_mag²): past fp16's 65504 for a bf16 q (scripts/fuzz_cpu.py draws it)

    @property
    def id(self):
        lens = "+".join(map(str, self.lens)) if len(self.lens) < 5 else f"{len(self.lens)}seqs"
        packed = "-packed" if self.packed else ""
        mag = f"-q{self.q_mag:g}" if self.q_mag != 1.0 else ""
        return f"{lens}-h{self.hq}/{self.hkv}-d{self.d}-bs{self.bs}-q{self.q_len}-{self.kv}{packed}{mag}"


CASES = [
    Case((1, 63, 65, 200), 8, 2, 64, 16),                       # GQA 4, page ±1
    Case((129, 1, 0, 64), 8, 8, 64, 32, kv="fp16"),             # MHA, empty + 1-token sequences
    Case((300, 17), 6, 2, 128, 64, q_len=3, kv="fp8"),          # odd GQA 3, speculative decode
    Case((127, 128, 129), 16, 1, 64, 64, q_len=1, kv="fp8q"),   # GQA 16, fp8 query
    Case((90, 33), 4, 1, 96, 16, q_len=8, packed=False),        # head_dim 96, q_len 8
    Case((257, 5), 2, 2, 256, 256, q_len=2, kv="fp16"),         # head_dim 256, page 256
    Case((70, 1, 2, 3, 4, 140), 4, 4, 64, 16, programs=4, min_tiles=2),  # many tasks per program
    Case((1000,), 8, 1, 64, 64, programs=5, min_tiles=1, kv="fp8"),       # one long sequence split 5 ways
]


def _inputs(case: Case, device):
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": FP8, "fp8q": FP8}[case.kv]
    kv = make_paged_kv(list(case.lens), num_kv_heads=case.hkv, head_dim=case.d, block_size=case.bs,
                       dtype=dtype, device=device, packed=case.packed, extra_cols=1)
    qdt = torch.bfloat16 if case.kv in ("bf16", "fp8", "fp8q") else torch.float16
    q = (torch.randn(len(case.lens) * case.q_len, case.hq, case.d, device=device) * case.q_mag).to(qdt)
    q_scale = None
    if case.kv == "fp8q":
        q, q_scale = quantize_per_token_head(q)
    return q, q_scale, kv


@pytest.mark.parametrize("schedule", ["dynamic", "static"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_decode_matches_reference(case, schedule, device):
    q, q_scale, kv = _inputs(case, device)
    plan = None
    if schedule == "dynamic":
        plan = hpcops.plan_decode(kv.seq_lens, num_kv_heads=case.hkv, q_len=case.q_len, block_size=case.bs,
                                  num_programs=case.programs, min_tiles=case.min_tiles)
    out_dtype = torch.bfloat16 if q.dtype == FP8 else q.dtype
    out = nan_like(torch.empty(q.shape, dtype=out_dtype, device=device))
    got = hpcops.decode_attention(q, kv.k_cache, kv.v_cache, kv.block_table, kv.seq_lens, plan=plan,
                                  schedule=schedule, k_scale=kv.k_scale, v_scale=kv.v_scale, q_scale=q_scale,
                                  out=out)
    assert got is out
    want = ref.decode_attention(q, kv.k_cache, kv.v_cache, kv.block_table, kv.seq_lens, k_scale=kv.k_scale,
                                v_scale=kv.v_scale, q_scale=q_scale)
    assert_close(want, got)
    if 0 in case.lens:
        empty = [i for i, n in enumerate(case.lens) if n == 0]
        for i in empty:
            assert torch.all(got[i * case.q_len:(i + 1) * case.q_len] == 0)


@pytest.mark.parametrize("schedule", ["dynamic", "static"])
def test_decode_bf16_q_past_fp16_range_over_fp8_kv(schedule, device):
    """Over fp8 KV the MMA path takes a 16-bit q in fp16 (K's one conversion): a bf16 q past fp16's 65504 is
    scaled by a power of two a row, not turned into inf (NaN out, before the fix). Rows from 1 to 1e6."""
    case = Case((300, 17, 64), 8, 1, 128, 64, q_len=1, kv="fp8")
    q, _, kv = _inputs(case, device)
    mult = torch.tensor([1.0, 3.0e4, 6.0e4, 7.0e4, 1.0e5, 1.0e6, 0.5, 2.0e5], device=device)
    q = (q.float() * mult[None, :, None]).to(torch.bfloat16)
    plan = None
    if schedule == "dynamic":
        plan = hpcops.plan_decode(kv.seq_lens, num_kv_heads=1, block_size=64, num_programs=4, min_tiles=1)
    got = hpcops.decode_attention(q, kv.k_cache, kv.v_cache, kv.block_table, kv.seq_lens, plan=plan,
                                  schedule=schedule, k_scale=kv.k_scale, v_scale=kv.v_scale, out=nan_like(q))
    want = ref.decode_attention(q, kv.k_cache, kv.v_cache, kv.block_table, kv.seq_lens, k_scale=kv.k_scale,
                                v_scale=kv.v_scale)
    assert torch.isfinite(want).all()
    assert_close(want, got)


def test_plan_tail_default_is_few_programs_a_kv_head_or_a_short_step_on_the_gluon_kernel():
    """`decode.plan_tail`: the Gluon kernel where a pair gathers at most TAIL_ONE_LEVEL_MAX partials (h64/8) or the
    step's requests are told short (max_seq_len <= GLUON_TAIL_MAX_SEQ); the tl kernel only on a 16-bit q over fp8
    KV with 2 or more q rows a kv head, head_dim up to 128 and at most TAIL_ONE_LEVEL_MAX programs a kv head (h64/8
    at 264 programs, not h8/1), whatever max_seq_len says; never without the hints."""
    from hpcops.attention import decode as dec

    h64 = dict(num_q_heads=64, head_dim=128, q_dtype=torch.bfloat16, kv_dtype=FP8)
    assert dec.plan_tail("tl", 8, 1, 264, **h64)
    assert dec.plan_tail("tl", 8, 1, 264, **{**h64, "q_dtype": torch.float16})
    assert dec.plan_tail("tl", 8, 1, 8 * dec.TAIL_ONE_LEVEL_MAX, **h64)
    assert not dec.plan_tail("tl", 8, 1, 8 * dec.TAIL_ONE_LEVEL_MAX + 1, **h64)
    assert not dec.plan_tail("tl", 1, 1, 264, **{**h64, "num_q_heads": 8})  # h8/1: a pair can gather 264
    assert not dec.plan_tail("tl", 8, 1, 264, **{**h64, "kv_dtype": torch.bfloat16})
    assert not dec.plan_tail("tl", 8, 1, 264, **{**h64, "q_dtype": FP8})
    assert not dec.plan_tail("tl", 8, 1, 264, **{**h64, "head_dim": 256})
    assert not dec.plan_tail("tl", 8, 1, 264, **{**h64, "num_q_heads": 8})  # one q row a kv head: the row path
    assert dec.plan_tail("tl", 8, 2, 264, **{**h64, "num_q_heads": 8})  # ... unless q_len makes it 2
    assert not dec.plan_tail("tl", 8, 1, 264)
    assert not dec.plan_tail("tl", 1, 1, 264, **{**h64, "num_q_heads": 8}, max_seq_len=512)
    assert dec.plan_tail("gluon", 8, 1, 396)  # h64/8: 49.5 partials a pair at most
    assert not dec.plan_tail("gluon", 1, 1, 396)  # h8/1, lengths untold: the combine
    assert dec.plan_tail("gluon", 1, 1, 396, max_seq_len=512)  # a short step: the tail
    assert dec.plan_tail("gluon", 1, 1, 396, max_seq_len=dec.GLUON_TAIL_MAX_SEQ)
    assert not dec.plan_tail("gluon", 1, 1, 396, max_seq_len=dec.GLUON_TAIL_MAX_SEQ + 1)
    assert not dec.plan_tail("gluon", 1, 1, 264, max_seq_len=4096)


@pytest.mark.parametrize("max_seq_len, tail, per_sm", [(None, False, 2), (512, True, 3), (4096, False, 2)])
def test_gluon_plan_merges_in_its_tail_only_for_a_short_step_at_h8(monkeypatch, max_seq_len, tail, per_sm, device):
    """An h8/1 plan for the Gluon kernel (its choice stubbed to an H200's): the tail merge at 3 programs an SM where
    max_seq_len tells a short step, else no pair table (the combine kernel) at 2 an SM; the torch reference plan
    makes the same choice and the same tables, and `out=` keeps the plan's own."""
    from hpcops._platform import num_sms
    from hpcops.attention import decode as dec

    monkeypatch.setattr(dec, "_hopper", lambda device: None)
    seq_lens = torch.tensor([512, 300, 64, 511, 129], dtype=torch.int32, device=device)
    kw = dict(num_kv_heads=1, block_size=64, num_q_heads=8, head_dim=128, q_dtype=FP8, kv_dtype=FP8,
              max_seq_len=max_seq_len)
    want = ref.plan_decode(seq_lens, **kw)
    got = hpcops.plan_decode(seq_lens, **kw)
    for plan in (want, got):
        assert (plan.kernel, plan.tail) == ("gluon", tail)
        assert plan.num_programs == per_sm * num_sms(seq_lens.device)
    assert got.has_pairs == tail  # the pair table written for the tail merge only (the reference writes it always)
    want.has_pairs = got.has_pairs
    assert got.host_tables() == want.host_tables()
    again = hpcops.plan_decode(seq_lens, num_kv_heads=1, block_size=64, out=got, max_seq_len=1)
    assert (again.tail, again.num_programs) == (tail, per_sm * num_sms(seq_lens.device))


@pytest.mark.parametrize("kv_kind", ["fp8", "bf16"])
def test_decode_default_tail_merge_over_fp8_kv_matches_reference(kv_kind, monkeypatch, device):
    """A plan told a bf16 q over fp8 KV with few programs a kv head (`plan_tail`) writes the pair table, and
    decode_attention then merges in the attention kernel (no combine launch: the combine kernel here raises); over
    bf16 KV the same plan keeps the combine. Both equal the reference, through a second step on the same plan."""
    from hpcops.attention import _decode_kernels

    case = Case((300, 17, 64, 1000, 129), 16, 8, 64, 16, kv=kv_kind)
    q, _, kv = _inputs(case, device)
    hints = dict(num_q_heads=16, head_dim=64, q_dtype=q.dtype, kv_dtype=kv.k_cache.dtype)
    kw = dict(num_kv_heads=8, block_size=16, num_programs=16, min_tiles=1, task_cost=0)  # the equal cut: splits
    plan = hpcops.plan_decode(kv.seq_lens, **kw, **hints)
    tail = kv_kind == "fp8"
    assert (plan.kernel, plan.tail, plan.has_pairs) == ("tl", tail, tail)
    assert any(t[5] for t in plan.tasks())  # some pair is split: a merge runs
    if tail:
        class _NoCombine:
            def __getitem__(self, grid):
                raise AssertionError("the combine kernel was launched under the default tail merge")

        monkeypatch.setattr(_decode_kernels, "decode_combine_kernel", _NoCombine())
    for lens in (case.lens, (1000, 1, 300, 64, 17)):
        seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
        hpcops.plan_decode(seq_lens, out=plan, **{k: kw[k] for k in ("num_kv_heads", "block_size")})
        got = hpcops.decode_attention(q, kv.k_cache, kv.v_cache, kv.block_table, seq_lens, plan=plan,
                                      k_scale=kv.k_scale, v_scale=kv.v_scale, out=nan_like(q))
        want = ref.decode_attention(q, kv.k_cache, kv.v_cache, kv.block_table, seq_lens, k_scale=kv.k_scale,
                                    v_scale=kv.v_scale)
        assert_close(want, got)
    if tail:
        assert int(plan.merge_sem.count_nonzero()) == 0  # every count set back for the next step


def test_plan_costs_scale_the_cut_for_the_converting_tile_without_the_tail_merge():
    """`decode.plan_costs`: CONVERT_TILE_COSTS for the tl kernel's tile over fp8 KV under a 16-bit q (2 or more q rows
    a kv head, head_dim up to 128) on a plan without the tail merge, TAIL_TILE_COSTS on a tail plan; None (the
    defaults) elsewhere or without hints."""
    from hpcops.attention import decode as dec
    from hpcops.attention.plan import CONVERT_TILE_COSTS, TAIL_TILE_COSTS

    h8 = dict(num_q_heads=8, head_dim=128, q_dtype=torch.bfloat16, kv_dtype=FP8)
    assert dec.plan_costs("tl", False, 1, 1, **h8) == CONVERT_TILE_COSTS
    assert dec.plan_costs("tl", False, 1, 1, **{**h8, "q_dtype": torch.float16}) == CONVERT_TILE_COSTS
    assert dec.plan_costs("tl", True, 1, 1, **h8) == TAIL_TILE_COSTS  # a tail-merged split is a dearer task
    assert dec.plan_costs("gluon", False, 1, 1, **h8) is None
    assert dec.plan_costs("tl", False, 1, 1, **{**h8, "q_dtype": FP8}) is None  # fp8 q: no conversion
    assert dec.plan_costs("tl", False, 1, 1, **{**h8, "kv_dtype": torch.bfloat16}) is None
    assert dec.plan_costs("tl", False, 1, 1, **{**h8, "head_dim": 256}) is None
    assert dec.plan_costs("tl", False, 8, 1, **h8) is None  # one q row a kv head: the row path
    assert dec.plan_costs("tl", False, 1, 1) is None


def test_tail_plan_of_a_16bit_q_over_fp8_kv_charges_a_dearer_task(device):
    """A plan told a bf16 q over fp8 KV at h64/8 (264 programs: 33 a kv head, a tail plan) cuts with TAIL_TILE_COSTS
    (task cost 12, the default tile floor and split cost), the same tables as the reference's told the same."""
    from hpcops.attention.plan import DEFAULT_MIN_TILES

    seq_lens = torch.tensor([128] * 16 + [4096] * 16, dtype=torch.int32, device=device)
    hints = dict(num_q_heads=64, head_dim=128, q_dtype=torch.bfloat16, kv_dtype=FP8)
    kw = dict(num_kv_heads=8, block_size=64, num_programs=264, num_sms=132)
    plan = hpcops.plan_decode(seq_lens, **kw, **hints)
    assert (plan.kernel, plan.tail) == ("tl", True)
    assert (plan.min_tiles, plan.task_cost, plan.split_cost) == (DEFAULT_MIN_TILES, 12, None)
    assert plan.host_tables() == ref.plan_decode(seq_lens.cpu(), **kw, **hints).host_tables()


def test_plan_of_a_16bit_q_over_fp8_kv_splits_short_requests_in_equal_pieces(device):
    """A plan told a bf16 q over fp8 KV at h8/1 takes the converting tile's costs (min_tiles 2, task cost 4, split
    cost 16): 24 requests of 8 tiles on 96 programs (more than TAIL_ONE_LEVEL_MAX: no tail merge) and 48 SMs go in
    four 2-tile pieces each (the default costs keep every request whole: 40 units a request against 20 + 40 split),
    the same tables as the reference's; the attention on it equals the reference over two steps."""
    from hpcops.attention.plan import CONVERT_TILE_COSTS

    case = Case((512,) * 24, 8, 1, 64, 16, kv="fp8")
    q, _, kv = _inputs(case, device)
    hints = dict(num_q_heads=8, head_dim=64, q_dtype=q.dtype, kv_dtype=kv.k_cache.dtype)
    kw = dict(num_kv_heads=1, block_size=16, num_programs=96, num_sms=48)
    plan = hpcops.plan_decode(kv.seq_lens, **kw, **hints)
    assert (plan.kernel, plan.tail) == ("tl", False)
    assert (plan.min_tiles, plan.task_cost, plan.split_cost) == CONVERT_TILE_COSTS
    pieces = [(t[2], t[4]) for t in plan.tasks()]  # (request, tiles) of every task
    assert sorted(pieces) == [(b, 2) for b in range(24) for _ in range(4)], pieces
    want_plan = ref.plan_decode(kv.seq_lens.cpu(), **kw, **hints)
    assert plan.host_tables() == want_plan.host_tables()
    whole = hpcops.plan_decode(kv.seq_lens, **kw)  # no hints: the default costs, a whole cut
    assert sorted((t[2], t[4]) for t in whole.tasks()) == [(b, 8) for b in range(24)]
    for lens in (case.lens, (512, 17, 300, 64, 511, 1, 129, 200) * 3):
        seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
        hpcops.plan_decode(seq_lens, out=plan, num_kv_heads=1, block_size=16)
        got = hpcops.decode_attention(q, kv.k_cache, kv.v_cache, kv.block_table, seq_lens, plan=plan,
                                      k_scale=kv.k_scale, v_scale=kv.v_scale, out=nan_like(q))
        want = ref.decode_attention(q, kv.k_cache, kv.v_cache, kv.block_table, seq_lens, k_scale=kv.k_scale,
                                    v_scale=kv.v_scale)
        assert_close(want, got)


@pytest.mark.parametrize("tail", [False, True])
def test_decode_whole_cut_matches_reference(tail, device):
    """With DecodeConfig.split_cost the plan of a short uniform batch splits no request (checked on the
    plan's tasks): the attention, with the combine or the tail merge, still equals the reference."""
    from hpcops.attention import decode as dec

    case = Case((150,) * 6, 4, 2, 64, 16, programs=8)
    q, q_scale, kv = _inputs(case, device)
    with dec.decode_config_changed(split_cost=32, tail_merge=tail):
        plan = hpcops.plan_decode(kv.seq_lens, num_kv_heads=2, block_size=16, num_programs=8, min_tiles=1)
        assert plan.host_tables()["used_snap"] == plan_mod.WHOLE_SNAP and not any(t[5] for t in plan.tasks())
        got = hpcops.decode_attention(q, kv.k_cache, kv.v_cache, kv.block_table, kv.seq_lens, plan=plan,
                                      out=nan_like(q))
    assert_close(ref.decode_attention(q, kv.k_cache, kv.v_cache, kv.block_table, kv.seq_lens), got)


@pytest.mark.parametrize("slices, warps", [(2, 4), (4, 4), (8, 4), (4, 2), (1, 2)])
@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_decode_merge_slices_match_reference(slices, warps, kv, device):
    """DecodeConfig.merge_slices: a request of 80 tiles split over ~27 programs (more than 16 partials) beside
    short ones, each pair's merge split into column slices over its owner and the programs after it (the plan's
    helper rows, the kernel's the reference's); the output equals the reference's, and a split of at most 16
    partials keeps its one merging program."""
    from hpcops.attention import decode as dec

    case = Case((64 * 80, 70, 300, 1, 64 * 20), 8, 1, 64, 64, kv=kv, programs=40, min_tiles=1)
    q, q_scale, kv_ = _inputs(case, device)
    kw = dict(num_kv_heads=1, block_size=64, num_programs=40, min_tiles=1)
    with dec.decode_config_changed(merge_slices=slices, split_cost=0, combine_warps=warps):
        plan = hpcops.plan_decode(kv_.seq_lens, **kw)
        want_plan = ref.plan_decode(kv_.seq_lens.cpu(), **kw)
        assert plan.merge_slices == want_plan.merge_slices == slices
        assert _tables(plan) == _tables(want_plan) and _desc(plan) == _desc(want_plan)
        md = plan.merge_desc.tolist()
        owners = [k for k, (b, _, slot, n) in enumerate(md) if b >= 0 and slot // 2 == k]
        helpers = [k for k, (b, _, slot, n) in enumerate(md) if b >= 0 and slot // 2 != k]
        long_owner = [k for k in owners if md[k][3] > 16]
        assert len(long_owner) == 1 and md[long_owner[0]][0] == 0  # request 0 (80 tiles)
        assert helpers == list(range(long_owner[0] + 1, long_owner[0] + slices))  # none with 1 slice
        assert all(md[k][3] <= 16 for k in owners if k not in long_owner) and len(owners) >= 2
        got = hpcops.decode_attention(q, kv_.k_cache, kv_.v_cache, kv_.block_table, kv_.seq_lens, plan=plan,
                                      k_scale=kv_.k_scale, v_scale=kv_.v_scale, out=nan_like(q))
    want = ref.decode_attention(q, kv_.k_cache, kv_.v_cache, kv_.block_table, kv_.seq_lens, k_scale=kv_.k_scale,
                                v_scale=kv_.v_scale)
    assert_close(want, got)


def test_merge_slices_errors(device):
    from hpcops.attention import decode as dec
    from hpcops.attention.decode import DecodeConfig

    for bad in (0, 3, 16, 2.0, True):
        with pytest.raises(ValueError, match="merge_slices"):
            DecodeConfig(merge_slices=bad)
    for bad in (1, 3, 8, 4.0):
        with pytest.raises(ValueError, match="combine_warps"):
            DecodeConfig(combine_warps=bad)
    with pytest.raises(ValueError, match="merge_slices needs task_desc"):
        DecodeConfig(merge_slices=4, task_desc=False)
    # the default (None): 4 slices with task descriptors, none without (no error)
    assert DecodeConfig().merge_slices_used() == 4 and DecodeConfig(task_desc=False).merge_slices_used() == 1
    assert DecodeConfig(merge_slices=2).merge_slices_used() == 2
    case = Case((64 * 40,), 8, 1, 64, 64)
    q, _, kv = _inputs(case, device)
    kw = dict(num_kv_heads=1, block_size=64, num_programs=32, min_tiles=1)
    with dec.decode_config_changed(merge_slices=1):
        plain = hpcops.plan_decode(kv.seq_lens, **kw)
    # under the default: a plan without helper rows, the combine would leave columns
    with pytest.raises(ValueError, match="merge_slices=1"):
        hpcops.decode_attention(q, kv.k_cache, kv.v_cache, kv.block_table, kv.seq_lens, plan=plain)
    sliced = hpcops.plan_decode(kv.seq_lens, **kw)
    # helper rows read as owners would merge wrong slots
    with dec.decode_config_changed(merge_slices=1), pytest.raises(ValueError, match="merge_slices=4"):
        hpcops.decode_attention(q, kv.k_cache, kv.v_cache, kv.block_table, kv.seq_lens, plan=sliced)


def test_decode_default_plan_and_scale(device):
    kv = make_paged_kv([40, 100], num_kv_heads=1, head_dim=64, block_size=16, device=device)
    q = torch.randn(2, 4, 64, device=device).bfloat16()
    got = hpcops.decode_attention(q, kv.k_cache, kv.v_cache, kv.block_table, kv.seq_lens, scale=0.3)
    want = ref.decode_attention(q, kv.k_cache, kv.v_cache, kv.block_table, kv.seq_lens, scale=0.3)
    assert_close(want, got)


def test_empty_batch(device):
    kv = make_paged_kv([], num_kv_heads=1, head_dim=64, block_size=16, device=device)
    q = torch.empty(0, 4, 64, device=device, dtype=torch.bfloat16)
    out = hpcops.decode_attention(q, kv.k_cache, kv.v_cache, kv.block_table[:0], kv.seq_lens)
    assert out.shape == (0, 4, 64)


def test_opcheck(device):
    kv = make_paged_kv([20, 70], num_kv_heads=1, head_dim=64, block_size=16, device=device)
    q = torch.randn(2, 2, 64, device=device).half()
    kv.k_cache, kv.v_cache = kv.k_cache.half(), kv.v_cache.half()
    out = torch.empty_like(q)
    from hpcops.attention.decode import decode_attention_out

    torch.library.opcheck(decode_attention_out, (q, kv.k_cache, kv.v_cache, kv.block_table, kv.seq_lens, out,
                                                 0.125, None, None, None, False),
                          test_utils=("test_schema", "test_faketensor"))
    decode_attention_out(q, kv.k_cache, kv.v_cache, kv.block_table, kv.seq_lens, out, 0.125, None, None, None,
                         True)
    want = ref.decode_attention(q, kv.k_cache, kv.v_cache, kv.block_table, kv.seq_lens, scale=0.125)
    assert_close(want, out)


# ---------------------------------------------------------------- errors
def _good(device):
    kv = make_paged_kv([30, 50], num_kv_heads=2, head_dim=64, block_size=16, device=device)
    q = torch.randn(2, 4, 64, device=device).bfloat16()
    return q, kv


@pytest.mark.parametrize("mutate, exc, match", [
    (lambda a: a.update(q=a["q"].float()), TypeError, "q must have dtype"),
    (lambda a: a.update(k_cache=a["k_cache"][..., :48].contiguous(), v_cache=a["v_cache"][..., :48].contiguous(),
                        q=a["q"][..., :48].contiguous()), ValueError, "head_dim 48"),
    (lambda a: a.update(k_cache=a["k_cache"].to(FP8), v_cache=a["v_cache"].to(FP8)), ValueError, "k_scale"),
    (lambda a: a.update(block_table=a["block_table"].long()), TypeError, "block_table"),
    (lambda a: a.update(seq_lens=a["seq_lens"].long()), TypeError, "seq_lens"),
    (lambda a: a.update(q=torch.randn(3, 4, 64, device=a["q"].device).bfloat16()), ValueError,
     "multiple of the batch"),
    (lambda a: a.update(block_table=a["block_table"][:, :2]), ValueError, "block_table has 2 columns"),
    (lambda a: a.update(q=torch.randn(2, 3, 64, device=a["q"].device).bfloat16()), ValueError,
     "multiple of kv heads"),
    (lambda a: a.update(v_cache=a["v_cache"].half()), TypeError, "v_cache"),
    (lambda a: a.update(schedule="greedy"), ValueError, "schedule"),
    (lambda a: a.update(q_scale=torch.ones(2, 4, device=a["q"].device)), ValueError, "q_scale is for an fp8 q"),
    (lambda a: a.update(q=torch.randn(4, 4, 64, device=a["q"].device).bfloat16(),
                        seq_lens=torch.tensor([1, 50], dtype=torch.int32, device=a["seq_lens"].device)),
     ValueError, r"seq_lens\[0\] = 1 < q_len 2"),
    (lambda a: a["block_table"].__setitem__((1, 2), 10**6), ValueError, r"block_table\[1, 2\] = 1000000"),
    (lambda a: a["block_table"].__setitem__((0, 0), -1), ValueError, r"block_table\[0, 0\] = -1"),
])
def test_bad_input(mutate, exc, match, device, monkeypatch):
    """Each bad argument raises, naming it. Values of device tensors are checked in checking mode."""
    monkeypatch.setenv("HPCOPS_CHECK", "1")  # the block-table width check syncs on a GPU: opt in
    q, kv = _good(device)
    args = dict(q=q, k_cache=kv.k_cache, v_cache=kv.v_cache, block_table=kv.block_table, seq_lens=kv.seq_lens,
                schedule="dynamic")
    mutate(args)
    with pytest.raises(exc, match=match):
        hpcops.decode_attention(args.pop("q"), args.pop("k_cache"), args.pop("v_cache"),
                                args.pop("block_table"), args.pop("seq_lens"), **args)


@pytest.mark.parametrize("block_n", [128])
def test_decode_block_n_config(block_n, device):
    from hpcops.attention import decode as dec

    # page 128 with tasks starting on odd tiles: a 128-key step straddles two pages
    straddle = Case((300, 129), 4, 2, 64, 128, kv="fp16", programs=6, min_tiles=1)
    with dec.decode_config_changed(block_n=block_n):
        for case in (CASES[0], CASES[7], CASES[6], straddle):
            test_decode_matches_reference(case, "dynamic", device)


@pytest.mark.parametrize("case", [CASES[2], CASES[3], CASES[5], CASES[7]], ids=lambda c: c.id)
def test_decode_tma_config(case, device):
    """TMA descriptor loads (pages ≥ 64 tokens; other cases fall back to pointer loads)."""
    from hpcops.attention import decode as dec

    with dec.decode_config_changed(use_tma=True):
        for schedule in ("dynamic", "static"):
            test_decode_matches_reference(case, schedule, device)


def _with_config(changes):
    from hpcops.attention.decode import decode_config_changed

    return decode_config_changed(**changes)


def _vid(d):
    return "legacy" if d == LEGACY else "+".join(f"{k}={v if isinstance(v, str) else int(v)}" for k, v in d.items())


# ---------------------------------------------------------------- GPU tier
# the kernels and plan as measured before the H200 sweep that turned task_desc, lean_loop (fp8 KV), pdl and
# the one-pass 16-entry plan on: still a supported configuration, kept under test
LEGACY = dict(task_desc=False, lean_loop=False, pdl=False, pdl_wait=False, plan_block_c=128, plan_warps=4,
              plan_one_pass=False, use_tma=False)
# the defaults before the TMA lean loop (pointer loads, held offsets on fp8 KV): the pointer path at real sizes
POINTER = dict(use_tma=False, lean_mode="hold")
GPU_SCENARIOS = [("2x32K+30x4K", 8, 1, True), ("1x128K+31x4K", 8, 1, False), ("64x4K", 64, 8, True),
                 ("32x0.125K+32x4K", 64, 8, False)]


@pytest.mark.gpu
@pytest.mark.parametrize("variant", [{}, LEGACY, POINTER, dict(use_tma=False, lean_mode="recompute", lean_loop=True),
                                     dict(tail_merge=True), dict(tail_merge=True, gluon=True), dict(split_cost=256),
                                     dict(pdl_wait=False), dict(merge_slices=1, combine_warps=4),
                                     dict(merge_slices=8, gluon=True), dict(merge_slices=2, combine_warps=4)],
                         ids=lambda d: _vid(d) or "default")
@pytest.mark.parametrize("spec, hq, hkv, fp8", GPU_SCENARIOS, ids=lambda v: str(v))
def test_gpu_real_sizes(spec, hq, hkv, fp8, variant):
    with _with_config(variant):
        _gpu_real_sizes(spec, hq, hkv, fp8)


def _gpu_real_sizes(spec, hq, hkv, fp8):
    from hpcops.bench.scenarios import parse_lengths
    from hpcops.bench.suites.decode import make_decode_inputs

    x = make_decode_inputs(parse_lengths(spec), hq, hkv, fp8, seed=3)
    want = ref.decode_attention(x["q"], x["k_cache"], x["v_cache"], x["block_table"], x["seq_lens"],
                                k_scale=x["k_scale"], v_scale=x["v_scale"])
    for schedule in ("dynamic", "static"):
        out = nan_like(x["out"])
        hpcops.decode_attention(x["q"], x["k_cache"], x["v_cache"], x["block_table"], x["seq_lens"],
                                schedule=schedule, k_scale=x["k_scale"], v_scale=x["v_scale"], out=out)
        assert_close(want, out, name=f"{spec} {schedule}")
    if fp8:  # fp8 query, as the fused prologue emits it
        out = nan_like(x["out"])
        hpcops.decode_attention(x["q8"], x["k_cache"], x["v_cache"], x["block_table"], x["seq_lens"],
                                k_scale=x["k_scale"], v_scale=x["v_scale"], q_scale=x["q_scale"], out=out)
        want8 = ref.decode_attention(x["q8"], x["k_cache"], x["v_cache"], x["block_table"], x["seq_lens"],
                                     k_scale=x["k_scale"], v_scale=x["v_scale"], q_scale=x["q_scale"])
        assert_close(want8, out, name=f"{spec} fp8 q")


@pytest.mark.gpu
@pytest.mark.parametrize("variant", [{}, LEGACY, dict(lean_loop=True, plan_block_c=32, plan_warps=2),
                                     dict(tail_merge=True), dict(tail_merge=True, tail_group=2),
                                     dict(split_cost=64, tail_merge=True), dict(pdl_wait=False),
                                     dict(pdl_wait=True, tail_merge=True, tail_group=2),
                                     dict(merge_slices=1, combine_warps=4)],
                         ids=lambda d: _vid(d) or "default")
@pytest.mark.parametrize("q_len", [1, 3])
def test_gpu_cuda_graph_replay_with_new_lengths(q_len, variant):
    """One captured decode step (plan + 3 layers) replayed with new lengths equals eager runs."""
    with _with_config(variant):
        _gpu_graph_replay(q_len)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", [{}, dict(pdl_wait=False), dict(tail_group=2)],
                         ids=lambda d: _vid(d) or "default")
def test_gpu_cuda_graph_replay_fp8q(variant):
    """The pipeline's form (an fp8 q from the prologue over fp8 KV, a plan told so: the Gluon kernel with its tail
    merge on sm_90), plan + 3 layers captured and replayed with new lengths; with pdl_wait (the default) each layer's
    kernel launches while the previous one finishes, over the plan's shared partials and counts."""
    with _with_config(variant):
        _gpu_graph_replay(1, fp8=True)


def _gpu_graph_replay(q_len, fp8=False):
    torch.manual_seed(5)
    b, hq, hkv, d, bs, max_len = 12, 16, 2, 128, 64, 6000
    kv_dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    layers = [make_paged_kv([max_len] * b, num_kv_heads=hkv, head_dim=d, block_size=bs, device="cuda",
                            packed=not fp8, dtype=kv_dtype) for _ in range(3)]
    seq_lens = torch.full((b,), 100, dtype=torch.int32, device="cuda")
    q = [torch.randn(b * q_len, hq, d, device="cuda").bfloat16() for _ in layers]
    q_scale = None
    if fp8:
        q_scale = [qi.float().abs().amax(-1).clamp_min(1e-6) / 448 for qi in q]
        q = [(qi.float() / s[..., None]).to(torch.float8_e4m3fn) for qi, s in zip(q, q_scale)]
    scales = dict(k_scale=torch.tensor([0.02], device="cuda"), v_scale=torch.tensor([0.03], device="cuda")) \
        if fp8 else {}
    outs = [torch.empty(b * q_len, hq, d, device="cuda", dtype=torch.bfloat16) for _ in q]
    hints = dict(num_q_heads=hq, head_dim=d, q_dtype=q[0].dtype, kv_dtype=kv_dtype) if fp8 else {}
    plan = hpcops.plan_decode(seq_lens, num_kv_heads=hkv, q_len=q_len, block_size=bs, max_batch=b, **hints)

    def call(i, kv, **kw):
        qs = dict(q_scale=q_scale[i]) if fp8 else {}
        return hpcops.decode_attention(q[i], kv.k_cache, kv.v_cache, kv.block_table, seq_lens, **scales, **qs, **kw)

    def step():
        hpcops.plan_decode(seq_lens, num_kv_heads=hkv, q_len=q_len, block_size=bs, out=plan)
        for i, (kv, oi) in enumerate(zip(layers, outs)):
            call(i, kv, plan=plan, out=oi)

    graph, _ = capture_graph(step)
    for lens in ([max_len] + [q_len] * (b - 1), [q_len + i * 499 for i in range(b)], [64 * (i + 1) for i in range(b)]):
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        for o in outs:
            o.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for i, (kv, oi) in enumerate(zip(layers, outs)):
            assert_close(call(i, kv), oi, name=f"graph replay lens={lens[:3]}...")
            qs = dict(q_scale=q_scale[i]) if fp8 else {}
            want = ref.decode_attention(q[i], kv.k_cache, kv.v_cache, kv.block_table, seq_lens, **scales, **qs)
            assert_close(want, oi)


@triton.jit
def _pdl_copy(src, dst, n, BLOCK: tl.constexpr):
    """A consumer launched with PDL: waits for the previous grid (griddepcontrol.wait), then copies src to dst."""
    gdc_wait()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst + offs, tl.load(src + offs, mask=offs < n), mask=offs < n)


@pytest.mark.gpu
@pytest.mark.parametrize("split_cost", [256, 0], ids=["whole", "equal"])
def test_gpu_pdl_consumer_sees_the_output(split_cost):
    """A kernel launched with PDL right after decode_attention (griddepcontrol.wait, then it reads `out`) sees the
    finished output: the combine grid completes only after the attention grid, also when the plan splits nothing
    (a whole cut, where no combine program has a merge to wait for). Repeated, each time from a NaN-filled out."""
    from hpcops.attention import decode as dec

    case = Case((512,) * 64, 8, 1, 128, 64)
    q, _, kv = _inputs(case, "cuda")
    want = ref.decode_attention(q, kv.k_cache, kv.v_cache, kv.block_table, kv.seq_lens)
    with dec.decode_config_changed(split_cost=split_cost):
        plan = hpcops.plan_decode(kv.seq_lens, num_kv_heads=1, block_size=64)
        assert any(t[5] for t in plan.tasks()) == (split_cost == 0)  # split tasks only under the equal cut
        out, seen = nan_like(q), nan_like(q)
        for _ in range(20):
            out.fill_(float("nan"))
            seen.fill_(float("nan"))
            hpcops.decode_attention(q, kv.k_cache, kv.v_cache, kv.block_table, kv.seq_lens, plan=plan, out=out)
            _pdl_copy[(triton.cdiv(out.numel(), 1024),)](out, seen, out.numel(), BLOCK=1024, launch_pdl=True)
            torch.cuda.synchronize()
            assert_close(want, seen, name=f"what a PDL consumer read (split_cost {split_cost})")


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", ["dynamic", "static", "dynamic-tail_merge", "dynamic-tail_group"])
def test_gpu_compute_sanitizer(schedule):
    """memcheck over a small mixed batch (page-boundary lengths, splits) finds no error (the tail merge too, in
    one level and in two: groups of 2 partials)."""
    import os
    import shutil
    import subprocess
    import sys

    tool = shutil.which("compute-sanitizer")
    if tool is None:
        pytest.skip("compute-sanitizer not on PATH")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [tool, "--tool", "memcheck", "--error-exitcode", "3", sys.executable,
           os.path.join(root, "scripts", "profile_decode.py"), "--spec", "3x63+1x65+1x700+2x4K", "--kv", "fp8",
           "--schedule", schedule.split("-")[0]]
    cmd += {"dynamic-tail_merge": ["--config", "tail_merge=1"],
            "dynamic-tail_group": ["--config", "tail_merge=1,tail_group=2"]}.get(schedule, [])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": root})
    if "Device not supported" in proc.stdout + proc.stderr:
        pytest.skip("compute-sanitizer does not support this device/runtime (gVisor)")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "ERROR SUMMARY: 0 errors" in proc.stdout + proc.stderr


def test_decode_min_rows_config(device):
    """A 64-row score tile (rows padded past q_len·G): same results."""
    from hpcops.attention import decode as dec

    with dec.decode_config_changed(min_rows=64):
        for case in (CASES[2], CASES[7]):
            for schedule in ("dynamic", "static"):
                test_decode_matches_reference(case, schedule, device)


def test_decode_tma_falls_back_on_head_major_pages(device):
    """HND pages (a token row does not hold all kv heads) cannot use the 2-D TMA view: decode falls
    back to pointer loads and stays correct with use_tma on."""
    from hpcops.attention import decode as dec
    from hpcops.attention._tma import tma_unsupported_reason

    kv = make_paged_kv([130, 64, 65], num_kv_heads=2, head_dim=64, block_size=64, device=device)
    hnd_k = kv.k_cache.transpose(1, 2).contiguous().transpose(1, 2)  # [N, bs, H, D] view of HND storage
    hnd_v = kv.v_cache.transpose(1, 2).contiguous().transpose(1, 2)
    assert tma_unsupported_reason(hnd_k, 64) is not None
    q = torch.randn(3, 8, 64, device=device).bfloat16()
    with dec.decode_config_changed(use_tma=True):
        got = hpcops.decode_attention(q, hnd_k, hnd_v, kv.block_table, kv.seq_lens, out=nan_like(q))
    assert_close(ref.decode_attention(q, hnd_k, hnd_v, kv.block_table, kv.seq_lens), got)


# ---------------------------------------------------------------- the plan's contract (issue 8)
def _stale_setup(device):
    """A plan built for one step's seq_lens, and the next step's seq_lens (same batch size)."""
    kv = make_paged_kv([30, 200, 70], num_kv_heads=2, head_dim=64, block_size=16, device=device)
    q = torch.randn(3, 4, 64, device=device).bfloat16()
    plan = hpcops.plan_decode(kv.seq_lens, num_kv_heads=2, block_size=16, num_programs=4, min_tiles=1)
    new_lens = torch.tensor([200, 30, 130], dtype=torch.int32, device=device)
    return q, kv, plan, new_lens


def test_stale_plan_raises(device, monkeypatch):
    """A plan from another step (same batch, other lengths) would give a wrong result: where seq_lens'
    values are checkable (host tensors; a GPU in checking mode) decode_attention raises."""
    if device != "cpu":
        monkeypatch.setenv("HPCOPS_CHECK", "1")
    q, kv, plan, new_lens = _stale_setup(device)
    with pytest.raises(ValueError, match=r"plan is stale.*request 0 has 1 64-token tiles in the plan but 4.*"
                                         r"plan_decode\(seq_lens, \.\.\., out=plan\)"):
        hpcops.decode_attention(q, kv.k_cache, kv.v_cache, kv.block_table, new_lens, plan=plan)
    # re-planned for the new lengths into the same buffers: accepted, and right
    hpcops.plan_decode(new_lens, num_kv_heads=2, block_size=16, out=plan)
    got = hpcops.decode_attention(q, kv.k_cache, kv.v_cache, kv.block_table, new_lens, plan=plan, out=nan_like(q))
    assert_close(ref.decode_attention(q, kv.k_cache, kv.v_cache, kv.block_table, new_lens), got)


def test_plan_with_the_same_tiles_but_other_lengths_is_stale(device, monkeypatch):
    """Lengths with the same 64-token tile counts cut the same, but each program's first request's length is
    in the plan's task descriptors (its first tiles need no load of seq_lens): another step's lengths are
    refused where checkable, and the plan re-planned for them is right."""
    if device != "cpu":
        monkeypatch.setenv("HPCOPS_CHECK", "1")
    q, kv, plan, _ = _stale_setup(device)
    same_tiles = torch.tensor([1, 193, 65], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="plan is stale.*its tables differ from those of these seq_lens"):
        hpcops.decode_attention(q, kv.k_cache, kv.v_cache, kv.block_table, same_tiles, plan=plan)
    hpcops.plan_decode(same_tiles, num_kv_heads=2, block_size=16, out=plan)
    got = hpcops.decode_attention(q, kv.k_cache, kv.v_cache, kv.block_table, same_tiles, plan=plan,
                                  out=nan_like(q))
    assert_close(ref.decode_attention(q, kv.k_cache, kv.v_cache, kv.block_table, same_tiles), got)


def test_stale_plan_check_needs_checkable_values(device, monkeypatch):
    """On a GPU outside checking mode (or while capturing) the tables are not compared: no host sync per
    layer. Emulated here: seq_lens' values reported uncheckable, as for a CUDA tensor without HPCOPS_CHECK."""
    from hpcops.attention import decode as dec

    q, kv, plan, new_lens = _stale_setup(device)
    calls = []
    monkeypatch.setattr(dec, "values_checkable", lambda t: False)
    monkeypatch.setattr(dec, "check_plan_matches", lambda *a: calls.append(a))
    hpcops.decode_attention(q, kv.k_cache, kv.v_cache, kv.block_table, new_lens, plan=plan)
    assert calls == []
    monkeypatch.setattr(dec, "values_checkable", lambda t: True)
    hpcops.decode_attention(q, kv.k_cache, kv.v_cache, kv.block_table, new_lens, plan=plan)
    assert len(calls) == 1


def test_values_checkable_gating(monkeypatch):
    """Host tensors are always checked; device tensors (a meta tensor stands in) only with HPCOPS_CHECK=1."""
    from hpcops._checks import values_checkable

    dev_tensor = torch.zeros(3, dtype=torch.int32, device="meta")
    monkeypatch.delenv("HPCOPS_CHECK", raising=False)
    assert values_checkable(torch.zeros(3, dtype=torch.int32)) and not values_checkable(dev_tensor)
    monkeypatch.setenv("HPCOPS_CHECK", "1")
    assert values_checkable(dev_tensor)


def test_plan_for_another_block_size_raises(device):
    q, kv, _, _ = _stale_setup(device)
    plan = hpcops.plan_decode(kv.seq_lens, num_kv_heads=2, block_size=64)
    with pytest.raises(ValueError, match=r"plan was built for \(num_kv_heads, q_len, block_size, batch\) = "
                                         r"\(2, 1, 64, 3\), got \(2, 1, 16, 3\)"):
        hpcops.decode_attention(q, kv.k_cache, kv.v_cache, kv.block_table, kv.seq_lens, plan=plan)
