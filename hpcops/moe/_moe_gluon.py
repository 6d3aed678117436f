"""The fp8 128-block gate-up GEMM at decode batches in Gluon (sm_90): `MoeConfig.gluon`.

Why: the 128-block scheme scales every K step's MMA result (a weight scale per 128-row block, an activation scale
per token and 128-group), so in Triton's `tl` each step waits for its MMA before the next is issued
(`warp_group_dot_wait {pendings = 0}` after every dot; unrolling two steps or widening the weight tile to bf16 in
registers gives the same wait). Here the wait is explicit: step k's two MMAs (gate rows, up rows: one weight
scale each) are issued, then step k−1's results are waited for (`warpgroup_mma_wait(num_outstanding=2)`),
scaled and added while step k's run.

Layout (swap-AB, as the `tl` kernel's decode tiles): the weight rows on wgmma's M side (a 128-row gate tile and
its 128-row up tile, TMA boxes of `w13` seen as [E·2I, H]), the task's ≤ BLOCK_M tokens on N. x arrives quantized
(`prequant_x`, or an fp8 x): a program loads its tokens' rows for its whole K run into shared memory once, then
streams the weight tiles through a `STAGES`-deep TMA ring. The epilogue is the `tl` kernel's for this scheme:
split-K partials (`split_k`, the last program to arrive sums them in split order), silu(gate)·up, fp8 per
(row, 128-group) with its scale.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from hpcops.attention._decode_gluon import _pdl_release as _gdc_release  # programmatic dependent launch
from hpcops.attention._decode_gluon import _pdl_wait as _gdc_wait

FP8_MAX = gl.constexpr(448.0)
BN = gl.constexpr(128)  # gate (and up) rows of a tile: one weight-scale block
BK = gl.constexpr(128)  # K step: one 128-group


@gluon.jit
def _issue_w(w_desc, wg_smem, wu_smem, bars, slot, row_g, row_u, kstep, ok):
    """Both weight tiles of one K step into ring slot `slot`, on its mbarrier (nothing where not `ok`)."""
    bar = bars.index(slot)
    mbarrier.expect(bar, 2 * BN * BK, pred=ok)
    tma.async_copy_global_to_shared(w_desc, [row_g, kstep * BK], bar, wg_smem.index(slot), pred=ok)
    tma.async_copy_global_to_shared(w_desc, [row_u, kstep * BK], bar, wu_smem.index(slot), pred=ok)


@gluon.jit
def moe_gate_up_block_gluon_kernel(
    x_ptr, xs_ptr, w_desc, ws_ptr, tasks_ptr, offsets_ptr, sorted_ptr, ids_ptr, map_ptr, act_ptr, act_s_ptr,
    part_ptr, cnt_ptr,
    H, I, CAP, TOP_K, E_GLOBAL, E_LOCAL,
    stride_xt, stride_xst, stride_xsg, stride_wse, stride_wsn, stride_wsk, stride_act, stride_acts,
    ACT_DT: gl.constexpr, NAIVE: gl.constexpr, HAS_MAP: gl.constexpr, BLOCK_M: gl.constexpr, STEPS: gl.constexpr,
    STAGES: gl.constexpr, SPLIT_K: gl.constexpr, PDL_WAIT: gl.constexpr, PDL_NEXT: gl.constexpr,
    num_warps: gl.constexpr,
):
    """act[r, n] (fp8, scale per row and 128-group) = silu(x[tok(r)]·w13[e, n]) · (x[tok(r)]·w13[e, I+n]) for one
    (task, N tile of 128, K run) program, as `moe_gate_up_kernel` with QUANT FP8_BLOCK, X_FP8, SWAP_AB,
    ACT_OUT FP8_GROUP and no fused shared expert. STEPS: the most K steps a program runs (its x rows' buffer).
    PDL_NEXT: 1 releases the next launch at the start, 2 at the end (`PDL_AT_START` / `PDL_AT_END`)."""
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                    instr_shape=[16, BLOCK_M, 32])
    cols_l: gl.constexpr = gl.SliceLayout(0, acc_l)  # a token (row of act) per column
    rows_l: gl.constexpr = gl.SliceLayout(1, acc_l)  # an N (I) index per row
    X_VEC: gl.constexpr = 16 if num_warps == 4 else 8  # bytes a thread's cp.async: the warps cover 16 rows
    x_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, X_VEC], threads_per_warp=[32 * X_VEC // BK, BK // X_VEC],
                                         warps_per_cta=[num_warps, 1], order=[1, 0])
    x_smem_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BK], gl.float8e4nv)

    pid = gl.program_id(0)
    if PDL_NEXT == 1:
        _gdc_release()
    n_tiles = I // BN
    split = pid % SPLIT_K
    pid = pid // SPLIT_K
    n_k = (H + BK - 1) // BK
    k_run = (n_k + SPLIT_K - 1) // SPLIT_K
    s_lo = split * k_run
    n = gl.minimum(n_k - s_lo, k_run)  # this program's K steps (≤ 0: none)
    task = pid // n_tiles
    n0 = (pid % n_tiles) * BN
    rm = gl.arange(0, BLOCK_M, layout=cols_l)
    if NAIVE:  # one task per (token, slot) pair
        gid = gl.load(ids_ptr + task)
        ok = (gid >= 0) & (gid < E_GLOBAL)
        if HAS_MAP:
            e = gl.load(map_ptr + gid, mask=ok, other=-1)
        else:
            e = gid
        e = gl.where(ok & (e >= 0) & (e < E_LOCAL), e, -1)
        row0 = task
        row_end = task + 1
    else:
        e = gl.load(tasks_ptr + task)
        row0 = gl.load(tasks_ptr + CAP + task)
        row_end = gl.load(offsets_ptr + e + 1, mask=e >= 0, other=0)
    if PDL_WAIT:
        _gdc_wait()
    if e < 0:
        return
    rows = row0 + rm
    rmask = rows < row_end
    if NAIVE:
        pair = rows
    else:
        pair = gl.load(sorted_ptr + rows, mask=rmask, other=0)
    tok = (pair // TOP_K).to(gl.int64)

    wg_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BN, BK], w_desc.layout)
    wu_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BN, BK], w_desc.layout)
    x_smem = gl.allocate_shared_memory(gl.float8e4nv, [STEPS, BLOCK_M, BK], x_smem_l)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for ib in gl.static_range(STAGES):
        mbarrier.init(bars.index(ib), count=1)
    row_g = e * (2 * I) + n0  # the gate tile's first row in w13 as [E·2I, H]; the up tile's is I rows further
    for i0 in gl.static_range(STAGES):  # the run's first weight tiles in flight
        _issue_w(w_desc, wg_smem, wu_smem, bars, i0, row_g, row_g + I, s_lo + i0, i0 < n)

    # the tokens' x rows over this program's K run, once (zeros past H and past the task's rows)
    tok_x = gl.convert_layout(tok, gl.SliceLayout(1, x_l))
    rmask_x = gl.convert_layout(rmask, gl.SliceLayout(1, x_l))
    offs_k = gl.arange(0, BK, layout=gl.SliceLayout(0, x_l))
    for js in gl.static_range(STEPS):  # (cp.async: every step's copy in flight at once)
        kk = (s_lo + js) * BK + offs_k
        m = rmask_x[:, None] & ((kk < H) & (js < n))[None, :]
        async_copy.async_copy_global_to_shared(x_smem.index(js), x_ptr + tok_x[:, None] * stride_xt + kk[None, :],
                                               mask=m)
    async_copy.commit_group()
    async_copy.wait_group(0)
    fence_async_shared()

    ws_e = ws_ptr + e.to(gl.int64) * stride_wse
    ws_g = ws_e + (n0 // 128) * stride_wsn
    ws_u = ws_e + ((I + n0) // 128) * stride_wsn
    xs_rows = xs_ptr + tok * stride_xst
    zero = gl.zeros([BN, BLOCK_M], gl.float32, layout=acc_l)
    acc_g = zero
    acc_u = zero
    if n > 0:
        # step 0 issued; in the loop step i is issued, then step i−1's results are waited for and scaled while
        # step i's MMAs run
        mbarrier.wait(bars.index(0), 0)
        xt0 = x_smem.index(0).permute((1, 0))
        tg = warpgroup_mma(wg_smem.index(0), xt0, zero, use_acc=False, is_async=True)
        tu = warpgroup_mma(wu_smem.index(0), xt0, zero, use_acc=False, is_async=True)
        a_s = gl.load(xs_rows + s_lo * stride_xsg, mask=rmask, other=0.0)
        sc_g = a_s * gl.load(ws_g + s_lo * stride_wsk)
        sc_u = a_s * gl.load(ws_u + s_lo * stride_wsk)
        for i in range(1, n):
            slot = i % STAGES
            a_s = gl.load(xs_rows + (s_lo + i) * stride_xsg, mask=rmask, other=0.0)  # step i's scales
            g_s = gl.load(ws_g + (s_lo + i) * stride_wsk)
            u_s = gl.load(ws_u + (s_lo + i) * stride_wsk)
            mbarrier.wait(bars.index(slot), (i // STAGES) & 1)
            xti = x_smem.index(i).permute((1, 0))
            ng = warpgroup_mma(wg_smem.index(slot), xti, zero, use_acc=False, is_async=True)
            nu = warpgroup_mma(wu_smem.index(slot), xti, zero, use_acc=False, is_async=True)
            dg, du = warpgroup_mma_wait(num_outstanding=2, deps=[tg, tu])
            acc_g += dg * sc_g[None, :]
            acc_u += du * sc_u[None, :]
            # step i−1's slot is free: its refill, STAGES steps on
            nxt = i - 1 + STAGES
            _issue_w(w_desc, wg_smem, wu_smem, bars, (i - 1) % STAGES, row_g, row_g + I, s_lo + nxt, nxt < n)
            tg = ng
            tu = nu
            sc_g = a_s * g_s
            sc_u = a_s * u_s
        dg, du = warpgroup_mma_wait(num_outstanding=0, deps=[tg, tu])
        acc_g += dg * sc_g[None, :]
        acc_u += du * sc_u[None, :]
    for ib in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(ib))

    ni = gl.arange(0, BN, layout=rows_l)
    if SPLIT_K > 1:  # fp32 partials; the last of the task's programs to arrive sums them in split order
        tile = ni[:, None] * BLOCK_M + rm[None, :]
        part = part_ptr + pid.to(gl.int64) * (SPLIT_K * 2 * BN * BLOCK_M) + tile
        gl.store(part + split * (2 * BN * BLOCK_M), acc_g)
        gl.store(part + split * (2 * BN * BLOCK_M) + BN * BLOCK_M, acc_u)
        gl.thread_barrier()  # every thread's partial stored before the release below
        arrived = gl.atomic_add(cnt_ptr + pid, 1, sem="acq_rel", scope="gpu")
        if arrived != SPLIT_K - 1:
            if PDL_NEXT == 2:
                _gdc_release()
            return
        acc_g = gl.load(part, cache_modifier=".cg")
        acc_u = gl.load(part + BN * BLOCK_M, cache_modifier=".cg")
        for sj in gl.static_range(1, SPLIT_K):
            acc_g += gl.load(part + sj * (2 * BN * BLOCK_M), cache_modifier=".cg")
            acc_u += gl.load(part + sj * (2 * BN * BLOCK_M) + BN * BLOCK_M, cache_modifier=".cg")
    # silu(gate)·up in fp32, rounded to ACT_DT (x's 16-bit dtype, as the `tl` kernel), then fp8 per (row, 128-group)
    act = (acc_g / (1.0 + gl.exp(-acc_g)) * acc_u).to(ACT_DT).to(gl.float32)
    amax = gl.max(gl.where(rmask[None, :], gl.abs(act), 0.0), axis=0)
    s2 = gl.maximum(amax, 1e-12) / FP8_MAX
    q = gl.minimum(gl.maximum(act / s2[None, :], -FP8_MAX), FP8_MAX)
    rows64 = rows.to(gl.int64)
    gl.store(act_ptr + rows64[None, :] * stride_act + (n0 + ni)[:, None], q.to(gl.float8e4nv), mask=rmask[None, :])
    gl.store(act_s_ptr + rows64 * stride_acts + n0 // 128, s2, mask=rmask)
    if PDL_NEXT == 2:
        _gdc_release()
