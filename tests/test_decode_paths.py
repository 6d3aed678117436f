"""Decode attention's launch paths beside the default one: the knob variants (old kernels, lean loop modes,
register caps), NaN and bad page ids per path, the GQA-1 row path and the Gluon kernel. Split from
test_decode.py so the GPU tier (one process a file) runs them side by side.
"""

from __future__ import annotations

import pytest
import torch
from test_decode import CASES, FP8, LEGACY, Case, _inputs, _vid, _with_config
from test_decode import test_decode_matches_reference as _decode_matches_reference

import hpcops
from hpcops.attention import reference as ref
from hpcops.testing import assert_close, make_paged_kv, nan_like, recorded_launches

# ---------------------------------------------------------------- knob variants (task_desc, lean_loop)
# the defaults run in every test above (task_desc, lean loop on fp8 KV, one-pass 16-entry plan); here the
# old kernels and plan, the lean loop on 16-bit KV too, and the old tile walk with the auto-launch plan;
# the lean loop's other addressing modes (offsets rebuilt each step; whole tiles through TMA)
VARIANTS = [LEGACY, dict(lean_loop=True), dict(task_desc=False, lean_loop=False, plan_block_c=0),
            dict(lean_loop=True, lean_mode="recompute"), dict(lean_loop=True, lean_mode="tma", use_tma=True),
            # the combine's merge in rounds of 2 partials (the default merges up to 64 in one round)
            dict(combine_chunks=2),
            # split requests merged by the attention program that writes their last partial (no combine kernel)
            dict(tail_merge=True),
            # ... in two levels: groups of 2 partials merged into their first slot, then the groups
            dict(tail_merge=True, tail_group=2),
            # the Gluon kernel where it applies (GPU tier, sm_90; elsewhere, the CPU tier included, the tl kernel),
            # V masked on a request's last tile only (v_mask_tail, by default: bad pages inside a sequence are TMA's
            # zeros)
            dict(gluon=True)]
# cases where the lean loop applies (pages >= 64 tokens, and smaller ones with lean_pages): causal edges
# across a tile boundary (q_len 8 at 65 tokens), empty and exactly-one-tile requests, odd GQA, head_dim 96,
# long splits
VARIANT_CASES = [CASES[2], CASES[3], CASES[5], CASES[7], CASES[6],
                 Case((65, 0, 130, 64, 8), 8, 1, 64, 64, q_len=8, programs=5, min_tiles=1),
                 Case((200, 3, 0, 127), 6, 2, 64, 128, q_len=2, kv="fp8", programs=7, min_tiles=1),
                 Case((1000, 70), 8, 1, 96, 64, kv="fp8q", programs=7, min_tiles=2),
                 # pages smaller than a step (DecodeConfig.lean_pages): a step spans 4 / 2 pages
                 Case((65, 0, 130, 64, 8, 300), 8, 1, 64, 16, q_len=8, kv="fp8", programs=5, min_tiles=1),
                 Case((200, 3, 0, 127), 6, 2, 64, 32, q_len=2, kv="fp8q", programs=7, min_tiles=1)]



@pytest.mark.parametrize("variant", VARIANTS, ids=_vid)
@pytest.mark.parametrize("case", VARIANT_CASES, ids=lambda c: c.id)
def test_decode_variants_match_reference(case, variant, device):
    with _with_config(variant):
        _decode_matches_reference(case, "dynamic", device)
        if variant.get("lean_loop"):
            _decode_matches_reference(case, "static", device)


@pytest.mark.parametrize("variant", [{}, dict(combine_chunks=32), dict(combine_chunks=16)], ids=_vid)
def test_combine_merges_many_partials(variant, device):
    """A request split over more partials than the combine's 16-partial tile: the default merges them in one
    64-partial round, combine_chunks 32 in rounds of 32, 16 in rounds of 16 (a running maximum across rounds);
    a 2-partial request beside it takes the small tile. Both schedules."""
    case = Case((2000, 70), 2, 1, 64, 64, kv="fp8q", programs=40, min_tiles=1)
    for schedule in ("dynamic", "static"):
        with _with_config(variant):
            _decode_matches_reference(case, schedule, device)


@pytest.mark.parametrize("case", [Case((2000, 70), 2, 1, 64, 64, kv="fp8q", programs=40, min_tiles=1),
                                  Case((700, 64, 3, 129), 12, 4, 128, 64, q_len=3, programs=9, min_tiles=1)],
                         ids=lambda c: c.id)
@pytest.mark.parametrize("group", [None, 4, 3], ids=lambda g: f"group{g}")
def test_tail_merge_replans_into_the_same_buffers(case, group, device):
    """DecodeConfig.tail_merge: the plan's pair table matches its merge table, every count (the groups' and the
    pairs') is back at 0 after a call, and a re-plan of other lengths into the same buffers (as each decode
    step) merges right again; a request split over more partials than a round (16) merges in rounds; with
    tail_group 4 or 3 the long split of the first case merges in two levels (the last group shorter)."""
    with _with_config(dict(tail_merge=True, tail_group=group, split_cost=0)):  # splits, never the whole cut
        q, q_scale, kv = _inputs(case, device)
        plan = hpcops.plan_decode(kv.seq_lens, num_kv_heads=case.hkv, q_len=case.q_len, block_size=case.bs,
                                  num_programs=case.programs, min_tiles=case.min_tiles)
        for step, lens in enumerate((list(case.lens), [n // 3 + 5 for n in case.lens])):
            seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
            plan.merge_sem.fill_(7)  # as an aborted step would leave them: the plan zeroes the counts
            hpcops.plan_decode(seq_lens, num_kv_heads=case.hkv, q_len=case.q_len, block_size=case.bs, out=plan)
            assert plan.merge_sem.numel() == 2 * case.programs + plan.max_batch * case.hkv
            assert int(plan.merge_sem[: 2 * case.programs + len(lens) * case.hkv].abs().sum()) == 0
            md = plan.merge_desc.tolist()
            assert any(r[0] >= 0 for r in md), "the case must split a request"
            if group and case.lens[0] == 2000 and step == 0:
                assert max(r[3] for r in md) > 2 * group, "the case must merge in two levels, several groups"
            for k, (b, h, slot, parts) in enumerate(md):
                if b >= 0:
                    assert plan.pair_desc[h * len(lens) + b, :3].tolist() == [k, parts, slot], (step, k)
            out = nan_like(torch.empty(q.shape, dtype=torch.bfloat16 if q.dtype == FP8 else q.dtype, device=device))
            hpcops.decode_attention(q, kv.k_cache, kv.v_cache, kv.block_table, seq_lens, plan=plan,
                                    k_scale=kv.k_scale, v_scale=kv.v_scale, q_scale=q_scale, out=out)
            want = ref.decode_attention(q, kv.k_cache, kv.v_cache, kv.block_table, seq_lens, k_scale=kv.k_scale,
                                        v_scale=kv.v_scale, q_scale=q_scale)
            assert_close(want, out, name=f"tail merge, step {step}")
            assert int(plan.merge_sem.abs().sum()) == 0, plan.merge_sem.tolist()
        # the reference plan builds the same pair rows
        want_plan = ref.plan_decode(seq_lens, num_kv_heads=case.hkv, q_len=case.q_len, block_size=case.bs,
                                    num_programs=case.programs, min_tiles=case.min_tiles)
        for b, h, _slot, _parts in want_plan.merge_desc.tolist():
            if b >= 0:
                idx = h * len(lens) + b
                assert want_plan.pair_desc[idx].tolist() == plan.pair_desc[idx].tolist()


def test_tail_group_default_is_one_level_where_few_partials_can_meet():
    """The Gluon kernel merges in one level where a pair can gather at most TAIL_ONE_LEVEL_MAX partials (programs
    per kv head: h64/8 at 3 programs an SM of 132) and in groups of 4 rounds above (h8/1); either kernel in one
    level where the block table holds no request of more tiles (a piece holds one at least) than a group; an
    explicit tail_group wins."""
    from hpcops.attention import decode as dec

    wide = 1 << 20  # tiles: a table as wide as vLLM's (max_model_len / page)
    assert dec._tail_group(4, wide, -(-396 // 8)) == 0 and dec._tail_group(4, wide, dec.TAIL_ONE_LEVEL_MAX) == 0
    assert dec._tail_group(4, wide, 396) == 16 and dec._tail_group(4, wide, dec.TAIL_ONE_LEVEL_MAX + 1) == 16
    assert dec._tail_group(4, wide) == 16 and dec._tail_group(4, 17) == 16 and dec._tail_group(4, 17, 396) == 16
    assert dec._tail_group(4, 16) == 0 and dec._tail_group(4, 8, 396) == 0  # 64x0.5K: 8 tiles a request at most
    with dec.decode_config_changed(tail_group=8):
        assert dec._tail_group(4, wide, 50) == 8 and dec._tail_group(4, wide, 396) == 8 and dec._tail_group(4, 2) == 8


def test_tail_group_from_the_block_tables_width(device):
    """The tail merge's launch takes one level where the block table is too narrow for a request of more tiles
    than a group, groups where it is wide enough; the same merge (the split here has no more partials than a
    group), bit for bit, and the reference's result. The plan is told the call's dtypes: on an sm_90 GPU the Gluon
    kernel (groups of 16 partials), elsewhere the tl kernel (32); 132 programs, over 64 a kv head."""
    from hpcops.attention import _decode_gluon as G
    from hpcops.attention import _decode_kernels as K

    case = Case((1000, 70), 8, 1, 64, 64, kv="fp8q", programs=132, min_tiles=1)
    q, q_scale, kv = _inputs(case, device)
    narrow = kv.block_table[:, :16].contiguous()  # 16 pages of 64: the 1000-token request's 16 tiles
    wide = torch.cat([narrow, narrow[:, :1].expand(-1, 40)], dim=1).contiguous()  # 56 tiles
    outs = []
    with _with_config(dict(tail_merge=True, split_cost=0)):
        plan = hpcops.plan_decode(kv.seq_lens, num_kv_heads=case.hkv, block_size=case.bs,
                                  num_programs=case.programs, min_tiles=case.min_tiles, num_q_heads=case.hq,
                                  head_dim=case.d, q_dtype=q.dtype, kv_dtype=kv.k_cache.dtype)
        for table, wide_table in ((narrow, False), (wide, True)):
            args = (q, kv.k_cache, kv.v_cache, table, kv.seq_lens)
            kw = dict(plan=plan, k_scale=kv.k_scale, v_scale=kv.v_scale, q_scale=q_scale)
            with recorded_launches(K, G) as calls:
                hpcops.decode_attention(*args, **kw)
            (name, group), = [(c[0], c[2]["TAIL_GROUP"]) for c in calls if "TAIL_GROUP" in c[2]]
            assert group == ((16 if name == "decode_gluon_kernel" else 32) if wide_table else 0), (name, group)
            out = nan_like(torch.empty(q.shape, dtype=torch.bfloat16, device=device))
            outs.append(hpcops.decode_attention(*args, **kw, out=out))
    assert torch.equal(outs[0], outs[1])
    want = ref.decode_attention(q, kv.k_cache, kv.v_cache, narrow, kv.seq_lens, k_scale=kv.k_scale,
                                v_scale=kv.v_scale, q_scale=q_scale)
    assert_close(want, outs[0], maxtol=3e-2, rmstol=1e-2)


def test_tail_merge_errors(device):
    from hpcops.attention import decode as dec

    with pytest.raises(ValueError, match="tail_merge needs task_desc"):
        dec.set_decode_config(tail_merge=True, task_desc=False)
    for bad in (1, -2, 5000, 2.0, "4"):
        with pytest.raises(ValueError, match="tail_group"):
            dec.set_decode_config(tail_group=bad)
    with pytest.raises(TypeError, match="merge_prefetch"):
        dec.set_decode_config(merge_prefetch=1)
    for bad in (512, 3000, 32768, 4096.0, True):
        with pytest.raises(ValueError, match="DecodeConfig.merge_round"):
            dec.set_decode_config(merge_round=bad)
    # the Gluon merge's round at h8/1 d128: 4 partials by default, 8 with merge_round 8192, never over 16
    assert dec._tail_parts(8, 128, True) == 4 and dec._tail_parts(8, 128, False, 8192) == 8
    assert dec._tail_parts(1, 64, False, 16384) == 16
    with pytest.raises(TypeError, match="pdl_wait"):
        dec.set_decode_config(pdl_wait="yes")
    for name in ("pv_fp16", "v_mask_tail"):
        with pytest.raises(TypeError, match=name):
            dec.set_decode_config(**{name: 1})
    case = Case((300, 200), 4, 1, 64, 64, programs=6, min_tiles=1)
    q, _, kv = _inputs(case, device)
    plan = hpcops.plan_decode(kv.seq_lens, num_kv_heads=1, block_size=64, num_programs=6, min_tiles=1)
    with _with_config(dict(tail_merge=True)), pytest.raises(ValueError, match="plan was built without"):
        hpcops.decode_attention(q, kv.k_cache, kv.v_cache, kv.block_table, kv.seq_lens, plan=plan)


def test_lean_mode_and_max_regs_errors():
    from hpcops.attention import decode as dec

    with pytest.raises(ValueError, match="DecodeConfig.lean_mode"):
        dec.set_decode_config(lean_mode="shared")
    for bad in (16, 256, True, 168.0):
        with pytest.raises(ValueError, match="DecodeConfig.max_regs"):
            dec.set_decode_config(max_regs=bad)
    for bad in (0, 1, 24, 512, 16.0, True):
        with pytest.raises(ValueError, match="DecodeConfig.combine_chunks"):
            dec.set_decode_config(combine_chunks=bad)
    assert dec.decode_config() == dec.DecodeConfig()  # a rejected change leaves the config as it was


def test_max_regs_launches(device):
    """A register cap is a launch option (ptxas .maxnreg; the interpreter drops it): the result is the same."""
    with _with_config(dict(lean_loop=True, lean_mode="recompute", max_regs=168)):
        for schedule in ("dynamic", "static"):
            _decode_matches_reference(CASES[2], schedule, device)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("mode", ["recompute", "tma"])
def test_lean_mode_unequal_kv_strides(mode, kv_dtype, device):
    """K and V caches with different strides (V a column slice of a wider buffer): the recompute mode's
    offsets are built for each (no shared tile), TMA falls back to pointer loads or reads each view."""
    kv = make_paged_kv([200, 65], num_kv_heads=2, head_dim=64, block_size=64, dtype=kv_dtype, device=device)
    wide = torch.zeros(*kv.v_cache.shape[:-1], 128, dtype=kv_dtype, device=device)
    wide[..., 32:96] = kv.v_cache
    v_view = wide[..., 32:96]
    assert v_view.stride() != kv.k_cache.stride()
    q = torch.randn(2, 8, 64, device=device).bfloat16()
    want = ref.decode_attention(q, kv.k_cache, kv.v_cache, kv.block_table, kv.seq_lens, k_scale=kv.k_scale,
                                v_scale=kv.v_scale)
    with _with_config(dict(lean_loop=True, lean_mode=mode, use_tma=mode == "tma")):
        for schedule in ("dynamic", "static"):
            got = hpcops.decode_attention(q, kv.k_cache, v_view, kv.block_table, kv.seq_lens, schedule=schedule,
                                          k_scale=kv.k_scale, v_scale=kv.v_scale, out=nan_like(q))
            assert_close(want, got, name=f"{schedule} {mode}")


def _poisoned(device, kv_dtype=torch.bfloat16, bs=64):
    """Two requests on `bs`-token pages whose cache holds NaN past each sequence's end (last page's
    tail and the spare block); the block table's spare column points out of range."""
    lens = [130, 70]
    kv = make_paged_kv(lens, num_kv_heads=1, head_dim=64, block_size=bs, dtype=kv_dtype, device=device,
                       packed=True, extra_cols=1)
    for b, n in enumerate(lens):
        last = int(kv.block_table[b, (n - 1) // bs])
        kv.k_cache[last, n % bs:] = float("nan")
        kv.v_cache[last, n % bs:] = float("nan")
        kv.block_table[b, -1] = kv.k_cache.shape[0] + 5
    used = set(kv.block_table[:, :-1].flatten().tolist())
    spare = next(i for i in range(kv.k_cache.shape[0]) if i not in used)
    kv.k_cache[spare] = float("nan")
    kv.v_cache[spare] = float("nan")
    return lens, kv


@pytest.mark.parametrize("variant", [{}] + VARIANTS, ids=lambda d: _vid(d) or "default")
@pytest.mark.parametrize("q_len, bs", [(1, 64), (3, 64), (3, 16)])
def test_decode_nan_past_the_end_never_reaches_output(variant, q_len, bs, device):
    _nan_past_the_end(variant, q_len, bs, 4, device)


def _nan_past_the_end(variant, q_len, bs, hq, device):
    lens, kv = _poisoned(device, bs=bs)
    q = torch.randn(len(lens) * q_len, hq, 64, device=device).bfloat16()
    want = ref.decode_attention(q, kv.k_cache, kv.v_cache, kv.block_table, kv.seq_lens)
    assert torch.isfinite(want).all()
    with _with_config(variant):
        for schedule in ("dynamic", "static"):
            plan = hpcops.plan_decode(kv.seq_lens, num_kv_heads=1, q_len=q_len, block_size=bs, num_programs=3,
                                      min_tiles=1)
            got = hpcops.decode_attention(q, kv.k_cache, kv.v_cache, kv.block_table, kv.seq_lens, schedule=schedule,
                                          plan=plan if schedule == "dynamic" else None, out=nan_like(q))
            assert_close(want, got, name=f"{schedule} {variant}")


@pytest.mark.parametrize("variant", [{}] + VARIANTS, ids=lambda d: _vid(d) or "default")
@pytest.mark.parametrize("bs", [64, 16])
def test_decode_bad_page_ids_are_not_read(variant, bs, device, monkeypatch):
    """A page id < 0 or >= num_blocks inside a sequence (unchecked: device values outside checking
    mode) is never read: its keys drop out of the softmax, its V rows contribute nothing."""
    _bad_page_ids(variant, bs, 4, device, monkeypatch)


def _bad_page_ids(variant, bs, hq, device, monkeypatch):
    from hpcops.attention import decode as dec

    monkeypatch.setattr(dec, "values_checkable", lambda t: False)
    lens = [300, 200]
    kv = make_paged_kv(lens, num_kv_heads=1, head_dim=64, block_size=bs, device=device, packed=True)
    q = torch.randn(2, hq, 64, device=device).bfloat16()
    # (request, column) -> bad id; on 16-token pages the bad ones sit inside a 64-token step
    bad = {(0, 2): -1, (1, 1): kv.k_cache.shape[0]} if bs == 64 else {(0, 9): -1, (1, 4): kv.k_cache.shape[0]}
    table = kv.block_table.clone()
    for (b, col), pid in bad.items():
        table[b, col] = pid
    want = torch.empty(2, hq, 64)
    for b, n in enumerate(lens):
        keep = [t for t in range(n) if (b, t // bs) not in bad]
        pages = kv.block_table[b, torch.tensor(keep) // bs].long()
        k = kv.k_cache[pages, torch.tensor(keep) % bs, 0].float()  # [L', D]
        v = kv.v_cache[pages, torch.tensor(keep) % bs, 0].float()
        p = torch.softmax(q[b].float() @ k.T / 8.0, dim=-1)
        want[b] = p @ v
    with _with_config(variant):
        for schedule in ("dynamic", "static"):
            got = hpcops.decode_attention(q, kv.k_cache, kv.v_cache, table, kv.seq_lens, schedule=schedule,
                                          out=nan_like(q))
            assert_close(want.bfloat16(), got, name=f"{schedule} {variant}")
