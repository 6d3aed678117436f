"""Decode attention's other kernels: the GQA-1 row path (DecodeConfig.row_path) and the Hopper Gluon kernel
(DecodeConfig.gluon), against the torch reference. Split from test_decode.py so the GPU tier (one process a
file) runs them beside the rest.
"""

from __future__ import annotations

import pytest
import torch
from test_decode import CASES, Case, _gpu_real_sizes, _inputs, _vid, _with_config
from test_decode import test_decode_matches_reference as _decode_matches_reference
from test_decode_paths import _bad_page_ids, _nan_past_the_end

import hpcops
from hpcops.attention import reference as ref
from hpcops.testing import assert_close, capture_graph, make_paged_kv, nan_like

# ---------------------------------------------------------------- GQA 1: the row path (DecodeConfig.row_path)
ROW = dict(row_path=True)
# one query row a (request, kv head): q_len 1, as many q heads as kv heads
ROW_CASES = [
    Case((1, 63, 65, 200), 4, 4, 64, 16),                                 # page 16 ±1, a 1-token request
    Case((129, 1, 0, 64), 2, 2, 64, 64, kv="fp16"),                       # empty + 1-token requests, page 64
    Case((300, 17, 0), 2, 2, 128, 64, kv="fp8"),                          # fp8 KV, head_dim 128
    Case((127, 128, 129), 3, 3, 64, 16, kv="fp8q"),                       # fp8 query, page 16
    Case((1000, 70), 2, 2, 128, 64, kv="fp8q", programs=7, min_tiles=1),  # a long request split 7 ways
    Case((1000,), 1, 1, 64, 64, programs=5, min_tiles=1),                 # one request split 5 ways, bf16
    Case((90, 33), 3, 3, 96, 32, packed=False),                           # head_dim 96 (padded), page 32
    Case((257, 5), 2, 2, 256, 256, kv="fp16"),                            # head_dim 256, page 256
    Case((300, 40), 1, 1, 256, 16, kv="fp8", programs=4, min_tiles=1),    # head_dim 256 on 16-token pages
]
# the lean loop on (the row path's default: offsets rebuilt each step) and off (the masked loop alone), held
# offsets, the old tile walk, 128-key steps (the masked loop; use_tma is ignored by the row path)
ROW_VARIANTS = [ROW, dict(ROW, lean_loop=False), dict(ROW, lean_mode="hold"), dict(ROW, task_desc=False),
                dict(ROW, block_n=128, use_tma=True)]


@pytest.mark.parametrize("variant", ROW_VARIANTS, ids=_vid)
@pytest.mark.parametrize("case", ROW_CASES, ids=lambda c: c.id)
def test_row_path_matches_reference(case, variant, device):
    with _with_config(variant):
        for schedule in ("dynamic", "static"):
            _decode_matches_reference(case, schedule, device)


@pytest.mark.parametrize("variant", ROW_VARIANTS[:2], ids=_vid)
@pytest.mark.parametrize("bs", [64, 16])
def test_row_path_nan_past_the_end_never_reaches_output(variant, bs, device):
    _nan_past_the_end(variant, 1, bs, 1, device)


@pytest.mark.parametrize("variant", ROW_VARIANTS[:2], ids=_vid)
@pytest.mark.parametrize("bs", [64, 16])
def test_row_path_bad_page_ids_are_not_read(variant, bs, device, monkeypatch):
    _bad_page_ids(variant, bs, 1, device, monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", [ROW, dict(ROW, num_warps=8), dict(ROW, max_regs=168)], ids=_vid)
@pytest.mark.parametrize("spec, fp8", [("2x32K+30x4K", True), ("64x4K", False), ("32x0.125K+32x4K", True)],
                         ids=lambda v: str(v))
def test_gpu_row_path_real_sizes(spec, fp8, variant):
    """The row path at h8/8 (GQA 1) at real sizes, as the tune moves it (alone, 8 warps, 168 registers)."""
    with _with_config(variant):
        _gpu_real_sizes(spec, 8, 8, fp8)


def test_row_path_is_taken(device, monkeypatch):
    """With row_path on, a GQA-1 batch goes through the row path (its per-slot merge runs once a task);
    by default (None) over fp8 KV only; off, or at GQA 2 or q_len 2, never. CPU tier only: an interpreted
    kernel reads its helpers from the module when it runs, so a counting wrapper sees the calls."""
    if device != "cpu":
        pytest.skip("counts helper calls of interpreted kernels")
    from hpcops.attention import _decode_kernels as kernels

    calls = []
    merge = kernels._merge_slots
    monkeypatch.setattr(kernels, "_merge_slots", lambda *a: calls.append(1) or merge(*a))
    for variant, case, taken in ((ROW, ROW_CASES[2], True), (dict(row_path=False), ROW_CASES[2], False),
                                 ({}, ROW_CASES[2], True), ({}, ROW_CASES[1], False), (ROW, ROW_CASES[1], True),
                                 (ROW, Case((300, 17), 4, 2, 64, 64), False),
                                 (ROW, Case((300, 17), 2, 2, 64, 64, q_len=2), False)):
        for schedule in ("dynamic", "static"):
            calls.clear()
            with _with_config(variant):
                _decode_matches_reference(case, schedule, device)
            assert bool(calls) == taken, (variant, case.id, schedule, len(calls))


def test_tune_plan_scenarios_gate_their_candidates(device):
    """`hpcops tune decode --only plan`: every plan-launch candidate builds the reference's tables (CPU
    tier: interpreted; GPU tier: natively), inside its context, and leaves the process-wide config as it was."""
    from hpcops.attention import decode as dec
    from hpcops.bench.tune import get_op
    from hpcops.bench.tune.decode import PlanScenario
    from hpcops.bench.tune.engine import Limits, phase_a
    from hpcops.bench.tune.space import label

    op = get_op("decode")
    assert any(isinstance(s, PlanScenario) for s in op.scenarios(True))
    s = PlanScenario("40x100+3x0", 2)
    x = op.make_inputs(s, 0, device)
    cands = [c for _, c in phase_a(op, s, Limits.of(False, False))]
    moved = {k for c in cands[1:] for k, v in c.items() if cands[0][k] != v}
    assert moved == {"plan_block_c", "plan_warps", "plan_block_b", "plan_one_pass", "task_desc"}
    before = dec.decode_config()
    for c in cands:
        with op.context(c):
            op.gate(s, x, c, label(c, cands[0]))
            assert op.prepare(s, c)(x)().has_desc == c["task_desc"]
    assert dec.decode_config() == before


# the Gluon kernel's cases (DecodeConfig.gluon): Hy3's TP8 rank with the prologue's fp8 q (one long request split
# over programs, a short one, an empty one), 16-bit KV with q_len 8 (causal edges, 16 q rows), GQA 16 with fp8 q,
# fp16 at head_dim 256 on 256-token pages
GLUON_CASES = [Case((3000, 70, 0, 1), 8, 1, 128, 64, kv="fp8q", programs=9, min_tiles=2),
               Case((65, 0, 130, 64, 8), 2, 1, 64, 64, q_len=8, programs=5, min_tiles=1),
               CASES[3], CASES[5], Case((500, 129), 8, 1, 128, 128, kv="bf16", programs=7, min_tiles=1),
               # pages under a tile: one TMA box a page
               Case((700, 33, 0), 8, 1, 128, 16, kv="fp8q", programs=6, min_tiles=1),
               Case((260, 64, 1), 4, 2, 64, 32, q_len=2, kv="bf16", programs=5, min_tiles=1)]


@pytest.mark.gpu
@pytest.mark.parametrize("tail", [{}, dict(tail_merge=True), dict(tail_merge=True, tail_group=2),
                                  dict(tail_merge=True, merge_prefetch=False),
                                  dict(tail_merge=True, tail_group=2, merge_prefetch=False),
                                  dict(tail_merge=True, pdl_wait=False), dict(pdl_wait=False),
                                  dict(tail_merge=True, merge_round=8192, merge_prefetch=False),
                                  dict(tail_merge=True, merge_round=8192, merge_prefetch=False, tail_group=2),
                                  dict(tail_merge=True, pv_fp16=True), dict(tail_merge=True, v_mask_tail=True),
                                  dict(tail_merge=True, pv_fp16=True, v_mask_tail=True),
                                  dict(pv_fp16=True, v_mask_tail=True)],
                         ids=["combine", "tail_merge", "tail_group2", "no-prefetch", "tail_group2-no-prefetch",
                              "tail_merge-no-pdl_wait", "combine-no-pdl_wait", "round8", "round8-tail_group2",
                              "pv_fp16", "v_mask_tail", "pv_fp16-v_mask_tail", "combine-pv_fp16-v_mask_tail"])
@pytest.mark.parametrize("case", GLUON_CASES, ids=lambda c: c.id)
def test_gpu_gluon_kernel_matches_reference(case, tail):
    """On an sm_90 GPU these cases take the Gluon kernel (no silent fallback) and match the torch reference, its
    splits merged by the combine kernel or in its own tail (DecodeConfig.tail_merge), in one level or two
    (tail_group 2: the 3000-token request's ~8 partials in groups of 2), with one round of partial loads in flight
    or two (merge_prefetch, the default), 4 or 8 partials a round (merge_round 8192), P·V in fp16 over fp8 V
    (pv_fp16), V masked on a request's last tile only (v_mask_tail)."""
    from hpcops.attention.decode import gluon_unsupported_reason

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon decode kernel is sm_90 only (wgmma)")
    q, _, kv = _inputs(case, "cuda")
    assert gluon_unsupported_reason(q, kv.k_cache, kv.v_cache, case.q_len * case.hq // case.hkv) is None
    with _with_config(dict(gluon=True, **tail)):
        _decode_matches_reference(case, "dynamic", "cuda")


def test_gluon_reasons_name_what_does_not_fit(device):
    """Where the Gluon kernel does not apply, the launcher says why (and runs the tl kernel)."""
    from hpcops.attention.decode import gluon_unsupported_reason

    kv = make_paged_kv([100], num_kv_heads=1, head_dim=96, block_size=16, device=device)
    q = torch.randn(1, 8, 96, device=device).bfloat16()
    why = gluon_unsupported_reason(q, kv.k_cache, kv.v_cache, 8)
    assert why is not None
    if device == "cuda" and torch.cuda.get_device_capability()[0] == 9:
        assert "head_dim 96" in why


def test_bench_gluon_row_is_unavailable_where_the_kernel_does_not_apply():
    """The decode bench's `hpcops-gluon` row says why it cannot run (here: no CUDA device) instead of timing the
    tl kernel under the Gluon name; the config is left as it was."""
    from hpcops.attention import decode as dec
    from hpcops.bench.registry import PeerUnavailable
    from hpcops.bench.suites import decode as suite

    before = dec.decode_config()
    x = suite.make_decode_inputs([100, 30], 8, 1, True, seed=0, device="cpu")
    with pytest.raises(PeerUnavailable, match="the Gluon kernel does not apply here: not a CUDA device"):
        suite._gluon()(x)
    assert dec.decode_config() == before


def test_bench_has_the_blog_table4_decode_rows():
    """The decode bench times the blog's table-4 decode rows (vLLM's 8q1s1k, 16q1s2k, 32q1s1k, 64q1s4k) at h64/8 bf16
    beside its six scenarios at both head shapes and KV dtypes, each case once; --quick keeps its two scenarios."""
    from hpcops.bench.suites import decode as suite

    names = [s.name for s in suite.scenarios()]
    assert len(names) == len(set(names)) == 24 + 3
    for spec in ("8x1K", "16x2K", "32x1K", "64x4K"):
        assert f"{spec} h64/8 bf16" in names
        count, k = spec.split("x")
        assert suite.Scenario(spec, 64, 8, False).lens == [int(k[:-1]) * 1024] * int(count)
    assert not any(n.startswith(("8x1K", "16x2K", "32x1K")) for n in (s.name for s in suite.scenarios(quick=True)))


# ---------------------------------------------------------------- the plan's kernel choice (plan_kernel)
def test_plan_kernel_takes_gluon_only_where_it_applies(monkeypatch):
    """`plan_decode`'s hints pick the Gluon kernel only for an fp8 q over fp8 KV at 2-16 q rows a kv head (2-8 at
    head_dim 64), head_dim 64/128/256, pages it reads, on sm_90, with DecodeConfig.gluon None; the tl kernel
    everywhere else (here the device checks are stubbed to an H200's)."""
    from hpcops.attention import decode as dec

    monkeypatch.setattr(dec._platform, "is_interpreter", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    fp8, bf16 = torch.float8_e4m3fn, torch.bfloat16
    hints = dict(num_q_heads=8, head_dim=128, q_dtype=fp8, kv_dtype=fp8)
    assert dec.plan_kernel(1, 1, 64, "cuda", **hints) == "gluon"
    assert dec.plan_kernel(8, 2, 16, "cuda", **{**hints, "num_q_heads": 64}) == "gluon"  # q_len 2, G 8, pages of 16
    assert dec.plan_kernel(1, 1, 256, "cuda", **{**hints, "head_dim": 64}) == "gluon"
    for change, why in ((dict(q_dtype=bf16), "16-bit q"), (dict(kv_dtype=bf16, q_dtype=bf16), "16-bit KV"),
                        (dict(num_q_heads=1), "one q row: the row path"), (dict(num_q_heads=32), "32 q rows"),
                        (dict(head_dim=96), "head_dim 96"), (dict(head_dim=None), "a hint missing"),
                        (dict(head_dim=64, num_q_heads=16), "16 rows at head_dim 64")):
        assert dec.plan_kernel(1, 1, 64, "cuda", **{**hints, **change}) == "tl", why
    assert dec.plan_kernel(1, 1, 4, "cuda", **hints) == "tl", "pages of 4 tokens"
    assert dec.plan_kernel(1, 1, 64, "cpu", **hints) == "tl", "not a CUDA device"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    assert dec.plan_kernel(1, 1, 64, "cuda", **hints) == "tl", "not sm_90"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    for forced in (True, False):
        with _with_config(dict(gluon=forced)):
            assert dec.plan_kernel(1, 1, 64, "cuda", **hints) == "tl", f"gluon={forced}: the plan is not built for it"


def test_plan_programs_per_sm_follow_the_kernels_registers():
    """Programs an SM a plan is built for: the Gluon kernel's 3; one for the tl kernel's MMA tile above head_dim
    128 (8 warps of 172-190 registers: two programs do not fit an SM's registers); the default (None: 2) for the
    row path, at head_dim <= 128, without hints, or with num_warps forced below 8."""
    from hpcops._platform import num_sms
    from hpcops.attention import decode as dec
    from hpcops.attention.plan import GLUON_PROGRAMS_PER_SM

    fp8, bf16 = torch.float8_e4m3fn, torch.bfloat16
    hints = dict(num_q_heads=8, head_dim=256, kv_dtype=bf16)
    assert dec.plan_programs_per_sm("gluon", 1, 1, **{**hints, "head_dim": 128}) == GLUON_PROGRAMS_PER_SM
    assert dec.plan_programs_per_sm("gluon", 1, 1, **hints) == 2  # head_dim 256: 180 registers, 99 KB shared
    # the combine kernel merging the splits (no tail): 2 an SM, 3 at head_dim 64 (the H100 grid tune)
    assert dec.plan_programs_per_sm("gluon", 1, 1, **{**hints, "head_dim": 128}, tail=False) == 2
    assert dec.plan_programs_per_sm("gluon", 1, 1, **hints, tail=False) == 2
    assert dec.plan_programs_per_sm("gluon", 1, 1, **{**hints, "head_dim": 64}, tail=False) == GLUON_PROGRAMS_PER_SM
    assert dec.plan_programs_per_sm("tl", 1, 1, **hints) == 1
    assert dec.plan_programs_per_sm("tl", 1, 1, **{**hints, "kv_dtype": fp8}) == 1  # the MMA tile over fp8 KV
    assert dec.plan_programs_per_sm("tl", 8, 1, **hints) == 1  # one q row a kv head over bf16 KV: the MMA tile
    assert dec.plan_programs_per_sm("tl", 8, 1, **{**hints, "kv_dtype": fp8}) is None  # the row path
    assert dec.plan_programs_per_sm("tl", 1, 1, **{**hints, "head_dim": 128}) is None
    assert dec.plan_programs_per_sm("tl", 1, 1, **{**hints, "head_dim": None}) is None
    with _with_config(dict(num_warps=4)):
        assert dec.plan_programs_per_sm("tl", 1, 1, **hints) is None
    with _with_config(dict(row_path=True)):
        assert dec.plan_programs_per_sm("tl", 8, 1, **hints) is None
    seq_lens = torch.tensor([3000, 70], dtype=torch.int32)
    for kw, per_sm in ((hints, 1), ({**hints, "head_dim": 128}, 2)):
        plan = ref.plan_decode(seq_lens, num_kv_heads=1, block_size=64, q_dtype=bf16, **kw)
        assert plan.num_programs == per_sm * num_sms("cpu"), kw


def test_plan_with_hints_off_hopper_is_the_tl_plan(device):
    """Off an H200 (here: the CPU tier) the hints change nothing: the tl plan, 2 programs an SM, no pair table;
    the reference planner, given the same device's lengths, makes the same choice (on an H200: both the Gluon
    plan)."""
    seq_lens = torch.tensor([300, 70], dtype=torch.int32, device=device)
    hints = dict(num_q_heads=8, head_dim=128, q_dtype=torch.float8_e4m3fn, kv_dtype=torch.float8_e4m3fn)
    plan = hpcops.plan_decode(seq_lens, num_kv_heads=1, block_size=64, **hints)
    want = ref.plan_decode(seq_lens, num_kv_heads=1, block_size=64, **hints)
    if device == "cuda" and torch.cuda.get_device_capability()[0] == 9:
        assert plan.kernel == want.kernel == "gluon"
    else:
        assert (plan.kernel, want.kernel, plan.has_pairs) == ("tl", "tl", False)
    assert plan.num_programs == want.num_programs


@pytest.mark.gpu
@pytest.mark.parametrize("max_seq_len", [None, 512], ids=["untold", "told-short"])
def test_gpu_default_plan_takes_gluon_for_fp8_q(max_seq_len):
    """On an H200 a plan told fp8 q over fp8 KV (h8/1) is the Gluon kernel's: with its lengths untold, the combine
    kernel at 2 programs an SM (no pair table); told a short step (`max_seq_len` 512, here a wrong hint: the
    lengths reach 6000), the tail merge at 3 an SM, the pair table written. decode_attention then runs the Gluon
    kernel so by default, and one captured step (plan + 2 layers) replayed with new lengths matches the reference
    either way (a wrong hint costs speed, not correctness); told a bf16 q, the plan stays the tl kernel's."""
    from hpcops._platform import num_sms
    from hpcops.bench.suites.decode import make_decode_inputs

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon decode kernel is sm_90 only (wgmma)")
    lens = [6000] + [300] * 7 + [4096] * 8
    layers = [make_decode_inputs(lens, 8, 1, True, seed=s) for s in (4, 5)]
    x = layers[0]
    seq_lens = x["seq_lens"].clone()
    kw = dict(num_kv_heads=1, block_size=64)
    hints = dict(num_q_heads=8, head_dim=128, kv_dtype=x["k_cache"].dtype)
    assert hpcops.plan_decode(seq_lens, q_dtype=torch.bfloat16, **kw, **hints).kernel == "tl"
    plan = hpcops.plan_decode(seq_lens, q_dtype=x["q8"].dtype, **kw, **hints, max_seq_len=max_seq_len)
    tail = max_seq_len is not None
    assert (plan.kernel, plan.num_programs, plan.has_pairs) == ("gluon", (3 if tail else 2) * num_sms(), tail)
    outs = [nan_like(y["out"]) for y in layers]

    def step():
        hpcops.plan_decode(seq_lens, out=plan, **kw)
        for y, o in zip(layers, outs):
            hpcops.decode_attention(y["q8"], y["k_cache"], y["v_cache"], y["block_table"], seq_lens, plan=plan,
                                    k_scale=y["k_scale"], v_scale=y["v_scale"], q_scale=y["q_scale"], out=o)

    graph, _ = capture_graph(step)
    for new in (lens, [6000 - 37 * i for i in range(16)], [1] * 15 + [6000]):
        seq_lens.copy_(torch.tensor(new, dtype=torch.int32))
        for o in outs:
            o.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for y, o in zip(layers, outs):
            want = ref.decode_attention(y["q8"], y["k_cache"], y["v_cache"], y["block_table"], seq_lens,
                                        k_scale=y["k_scale"], v_scale=y["v_scale"], q_scale=y["q_scale"])
            assert_close(want, o, name=f"gluon plan, graph replay, lens {new[:3]}...")
        assert int(plan.merge_sem.abs().sum()) == 0
