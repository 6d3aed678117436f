"""Triton kernels of the fused MoE (only @triton.jit code; launchers live in routing.py / fused_moe.py).

Conventions: a "pair" is one (token, slot) of topk_ids, flat id p = t·top_k + j. Pairs routed to local
experts are sorted by expert into rows [offsets[e], offsets[e+1]). The task map holds one M tile per
entry: tasks[0, s] = local expert (−1 = sentinel, program exits), tasks[1, s] = first sorted row.
NAIVE (small batches, no index at all): task s is pair s itself, one row, its expert read from topk_ids
(through expert_map); rows are then pair ids, and programs of remote pairs exit.
SWAP_AB: the GEMM kernels compute the transposed tile, weights × activations^T, so that the weight rows
fill the tensor core's M side (64 on Hopper's wgmma) when the token tile is small.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from hpcops.moe.codes import ActMode, QuantCode, XMode

FP8_MAX = tl.constexpr(448.0)
# MoeConfig.pdl: when a kernel releases the next one (launched with programmatic dependent launch)
PDL_AT_START = tl.constexpr(1)
PDL_AT_END = tl.constexpr(2)  # a constexpr global: compiled kernels may read it
# constexpr mirrors of the named codes (codes.py): kernels may read constexpr globals only
Q_NONE = tl.constexpr(int(QuantCode.NONE))
Q_FP8_TENSOR = tl.constexpr(int(QuantCode.FP8_TENSOR))
Q_FP8_BLOCK = tl.constexpr(int(QuantCode.FP8_BLOCK))
A_WIDE = tl.constexpr(int(ActMode.WIDE))
A_FP8_STATIC = tl.constexpr(int(ActMode.FP8_STATIC))
A_WIDE_ROW_AMAX = tl.constexpr(int(ActMode.WIDE_ROW_AMAX))
A_WIDE_GROUP_AMAX = tl.constexpr(int(ActMode.WIDE_GROUP_AMAX))
X_STATIC = tl.constexpr(int(XMode.STATIC))
X_PER_TOKEN_GROUP = tl.constexpr(int(XMode.PER_TOKEN_GROUP))


@triton.jit
def _local_expert(ids_ptr, map_ptr, offs, mask, E_GLOBAL, E_LOCAL, HAS_MAP: tl.constexpr):
    """Local expert of each pair, E_LOCAL (a spare bin) when remote or out of range; and the valid mask."""
    gid = tl.load(ids_ptr + offs, mask=mask, other=-1)
    ok = mask & (gid >= 0) & (gid < E_GLOBAL)
    if HAS_MAP:
        e = tl.load(map_ptr + gid, mask=ok, other=-1)
    else:
        e = gid
    ok = ok & (e >= 0) & (e < E_LOCAL)
    e = tl.where(ok, e, E_LOCAL)
    return e, ok


@triton.jit
def _task_rows(pid, n_tiles, tasks_ptr, offsets_ptr, ids_ptr, map_ptr, CAP, E_GLOBAL, E_LOCAL,
               HAS_MAP: tl.constexpr, NAIVE: tl.constexpr, BLOCK_M: tl.constexpr):
    """Decode a GEMM program id: (local expert, −1 = nothing to do; its rows [BLOCK_M]; row mask; N tile)."""
    task = pid // n_tiles
    pid_n = pid % n_tiles
    if NAIVE:
        e, ok = _local_expert(ids_ptr, map_ptr, task, task >= 0, E_GLOBAL, E_LOCAL, HAS_MAP)
        e = tl.where(ok, e, -1)
        rows = task + tl.arange(0, BLOCK_M)
        rmask = tl.arange(0, BLOCK_M) == 0
    else:
        e = tl.load(tasks_ptr + task)
        row0 = tl.load(tasks_ptr + CAP + task)
        row_end = tl.load(offsets_ptr + e + 1, mask=e >= 0, other=0)
        rows = row0 + tl.arange(0, BLOCK_M)
        rmask = rows < row_end
    return e, rows, rmask, pid_n


@triton.jit
def _write_offsets_and_tasks(counts, offsets_ptr, tasks_ptr, E_LOCAL, CAP,
                             E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, CAP_BLOCK: tl.constexpr):
    """From per-expert counts [E_PAD] (zero past E_LOCAL): row offsets [E_LOCAL+1] and the task map.
    Expert e's tiles take slots [tstart[e], tstart[e] + tiles[e]); slots past the last tile get −1."""
    eidx = tl.arange(0, E_PAD)
    ends = tl.cumsum(counts, 0)
    starts = ends - counts
    tl.store(offsets_ptr + eidx, starts, mask=eidx <= E_LOCAL)
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    tend = tl.cumsum(tiles, 0)
    tstart = tend - tiles
    total = tl.sum(tiles, 0)
    for c in range(0, CAP, CAP_BLOCK):
        s = c + tl.arange(0, CAP_BLOCK)
        smask = (s >= total) & (s < CAP)
        tl.store(tasks_ptr + s, tl.full((CAP_BLOCK,), -1, tl.int32), mask=smask)
        tl.store(tasks_ptr + CAP + s, tl.zeros((CAP_BLOCK,), tl.int32), mask=smask)
    for j in range(0, tl.max(tiles, 0)):
        m = j < tiles
        tl.store(tasks_ptr + tstart + j, eidx, mask=m)
        tl.store(tasks_ptr + CAP + tstart + j, starts + j * BLOCK_M, mask=m)


@triton.jit
def moe_index_small_kernel(ids_ptr, map_ptr, offsets_ptr, sorted_ptr, pos_ptr, tasks_ptr,
                           N, E_GLOBAL, E_LOCAL, CAP,
                           x_ptr, q_ptr, s_ptr, in_scale_ptr, H, stride_x, stride_q, stride_s,
                           HAS_MAP: tl.constexpr, N_PAD: tl.constexpr, E_PAD: tl.constexpr,
                           BLOCK_M: tl.constexpr, CAP_BLOCK: tl.constexpr, QUANT_X: tl.constexpr = False,
                           X_MODE: tl.constexpr = 0, X_BLOCK_H: tl.constexpr = 16):
    """Whole index in one program (small batches): sort pairs by (expert, pair id), deterministic.
    QUANT_X (`MoeConfig.index_quant`): programs 1..T quantize x's rows as `moe_quant_x_kernel` does (X_MODE,
    X_BLOCK_H), beside program 0's sort: one launch for both. It never releases the next launch early: the kernels
    after the gate-up GEMM read the index before their PDL wait, which is safe only while the gate-up grid starts
    after this one has exited (an early release here raced on the H200: the down GEMM, released at the gate-up's
    start, read a part-built index)."""
    pid = tl.program_id(0)
    if pid == 0:
        offs = tl.arange(0, N_PAD)
        mask = offs < N
        e, ok = _local_expert(ids_ptr, map_ptr, offs, mask, E_GLOBAL, E_LOCAL, HAS_MAP)
        key = tl.sort(e * N_PAD + offs)
        s_e = key // N_PAD
        s_pair = key % N_PAD
        s_ok = s_e < E_LOCAL
        tl.store(sorted_ptr + offs, tl.where(s_ok, s_pair, -1), mask=mask)
        tl.store(pos_ptr + s_pair, tl.where(s_ok, offs, -1), mask=s_pair < N)
        counts = tl.histogram(e, E_PAD, mask=ok)
        _write_offsets_and_tasks(counts, offsets_ptr, tasks_ptr, E_LOCAL, CAP, E_PAD, BLOCK_M, CAP_BLOCK)
    elif QUANT_X:
        _quant_x_row(x_ptr, q_ptr, s_ptr, in_scale_ptr, (pid - 1).to(tl.int64), H, stride_x, stride_q, stride_s,
                     X_MODE, X_BLOCK_H)


@triton.jit
def moe_index_hist_kernel(ids_ptr, map_ptr, hist_ptr, N, E_GLOBAL, E_LOCAL,
                          HAS_MAP: tl.constexpr, E_PAD: tl.constexpr, BLOCK: tl.constexpr):
    """Large batches, step 1: the histogram of local experts over this program's BLOCK pairs, hist[b, :]."""
    b = tl.program_id(0)
    offs = b * BLOCK + tl.arange(0, BLOCK)
    e, ok = _local_expert(ids_ptr, map_ptr, offs, offs < N, E_GLOBAL, E_LOCAL, HAS_MAP)
    tl.store(hist_ptr + b * E_PAD + tl.arange(0, E_PAD), tl.histogram(e, E_PAD, mask=ok))


@triton.jit
def moe_index_scan_kernel(hist_ptr, base_ptr, offsets_ptr, tasks_ptr, NB, E_LOCAL, CAP,
                          E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, CAP_BLOCK: tl.constexpr,
                          NB_BLOCK: tl.constexpr):
    """Large batches, step 2 (one program): offsets, the task map, and base[b, e] = the first sorted row of
    block b's pairs of expert e minus the number of block b's pairs of experts below e (its rank offset
    within the block's expert-sorted keys)."""
    eidx = tl.arange(0, E_PAD)
    counts = tl.zeros((E_PAD,), tl.int32)
    for b0 in range(0, NB, NB_BLOCK):
        bidx = b0 + tl.arange(0, NB_BLOCK)
        h = tl.load(hist_ptr + bidx[:, None] * E_PAD + eidx[None, :], mask=bidx[:, None] < NB, other=0)
        counts += tl.sum(h, 0)
    counts = tl.where(eidx < E_LOCAL, counts, 0)
    _write_offsets_and_tasks(counts, offsets_ptr, tasks_ptr, E_LOCAL, CAP, E_PAD, BLOCK_M, CAP_BLOCK)
    running = tl.cumsum(counts, 0) - counts  # the first row of each expert
    for b0 in range(0, NB, NB_BLOCK):
        bidx = b0 + tl.arange(0, NB_BLOCK)
        bmask = bidx[:, None] < NB
        h = tl.load(hist_ptr + bidx[:, None] * E_PAD + eidx[None, :], mask=bmask, other=0)
        first = running[None, :] + tl.cumsum(h, 0) - h  # [NB_BLOCK, E_PAD]: the block's first row per expert
        below = tl.cumsum(h, 1) - h  # the block's pairs of lower experts
        tl.store(base_ptr + bidx[:, None] * E_PAD + eidx[None, :], first - below, mask=bmask)
        running += tl.sum(h, 0)


@triton.jit
def moe_index_scatter_kernel(ids_ptr, map_ptr, base_ptr, sorted_ptr, pos_ptr, N, E_GLOBAL, E_LOCAL,
                             HAS_MAP: tl.constexpr, E_PAD: tl.constexpr, BLOCK: tl.constexpr):
    """Large batches, step 3: sort the block's pairs by (expert, pair id); the j-th sorted pair of expert e
    lands on row base[b, e] + j, so rows are in pair order inside every expert (deterministic)."""
    b = tl.program_id(0)
    i = tl.arange(0, BLOCK)
    offs = b * BLOCK + i
    mask = offs < N
    e, ok = _local_expert(ids_ptr, map_ptr, offs, mask, E_GLOBAL, E_LOCAL, HAS_MAP)
    key = tl.sort(e * BLOCK + i)
    s_e = key // BLOCK
    s_pair = b * BLOCK + key % BLOCK
    s_ok = s_e < E_LOCAL
    row = tl.load(base_ptr + b * E_PAD + s_e, mask=s_ok, other=0) + i
    tl.store(sorted_ptr + row, s_pair, mask=s_ok)
    tl.store(pos_ptr + s_pair, tl.where(s_ok, row, -1), mask=s_pair < N)


@triton.jit
def _quant_x_row(x_ptr, q_ptr, s_ptr, in_scale_ptr, t, H, stride_x, stride_q, stride_s,
                 MODE: tl.constexpr, BLOCK_H: tl.constexpr):
    """Row t of x to fp8. MODE (`XMode`): STATIC, the scale in_scale; PER_TOKEN, s[t] = max|x[t]| / 448;
    PER_TOKEN_GROUP, per token and group of 128, s[t, g], BLOCK_H // 128 groups a step (side by side: at decode
    batches the few programs would otherwise walk H's groups one after another)."""
    if MODE == X_PER_TOKEN_GROUP:
        gi = tl.arange(0, BLOCK_H // 128)
        cols = tl.arange(0, 128)
        n_groups = tl.cdiv(H, 128)
        for g0 in range(0, n_groups, BLOCK_H // 128):
            g = g0 + gi
            c = g[:, None] * 128 + cols[None, :]
            cmask = c < H
            x = tl.load(x_ptr + t * stride_x + c, mask=cmask, other=0.0).to(tl.float32)
            s = tl.maximum(tl.max(tl.abs(x), 1), 1e-12) / FP8_MAX
            q = tl.minimum(tl.maximum(x / s[:, None], -FP8_MAX), FP8_MAX)
            tl.store(q_ptr + t * stride_q + c, q.to(q_ptr.dtype.element_ty), mask=cmask)
            tl.store(s_ptr + t * stride_s + g, s, mask=g < n_groups)
    else:
        cols = tl.arange(0, BLOCK_H)
        cmask = cols < H
        x = tl.load(x_ptr + t * stride_x + cols, mask=cmask, other=0.0).to(tl.float32)
        if MODE == X_STATIC:
            s = tl.load(in_scale_ptr)
        else:
            s = tl.maximum(tl.max(tl.abs(x), 0), 1e-12) / FP8_MAX
            tl.store(s_ptr + t * stride_s, s)
        q = tl.minimum(tl.maximum(x / s, -FP8_MAX), FP8_MAX)
        tl.store(q_ptr + t * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=cmask)


@triton.jit
def moe_quant_x_kernel(x_ptr, q_ptr, s_ptr, in_scale_ptr, H, stride_x, stride_q, stride_s,
                       MODE: tl.constexpr, BLOCK_H: tl.constexpr, PDL_NEXT: tl.constexpr = 0):
    """fp8 x, one program per token (`_quant_x_row`; `XMode`). PDL_NEXT (`MoeConfig.pdl`): the gate-up GEMM is
    launched with programmatic dependent launch; release it at this program's start (it waits for this grid
    before reading x)."""
    if PDL_NEXT != 0:
        gdc_launch_dependents()
    _quant_x_row(x_ptr, q_ptr, s_ptr, in_scale_ptr, tl.program_id(0).to(tl.int64), H, stride_x, stride_q, stride_s,
                 MODE, BLOCK_H)


@triton.jit
def _gate_up_rows(n0, I, BLOCK_N: tl.constexpr):
    """The [2·BLOCK_N] weight rows of a gate-up N tile: gate rows n0 + j, then up rows I + n0 + j; their mask."""
    wr = tl.arange(0, 2 * BLOCK_N)
    wn = n0 + wr % BLOCK_N
    wmask = wn < I
    return wn + (wr // BLOCK_N) * I, wmask


@triton.jit
def _gate_up_halves(acc, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """[BLOCK_M, 2·BLOCK_N] gate-up accumulator → its gate and up halves [BLOCK_M, BLOCK_N]."""
    return tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N)), (0, 2, 1)))


@triton.jit
def _silu_mul(acc_g, acc_u, ACT_DT: tl.constexpr, BF16_MUL: tl.constexpr):
    """silu(gate) · up in fp32, rounded to ACT_DT (BF16_MUL: gate, up and silu(gate) rounded first, as torch)."""
    if BF16_MUL:
        g = acc_g.to(ACT_DT).to(tl.float32)
        u = acc_u.to(ACT_DT).to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(ACT_DT).to(tl.float32)
        return (s * u).to(ACT_DT).to(tl.float32)
    return (acc_g / (1.0 + tl.exp(-acc_g)) * acc_u).to(ACT_DT).to(tl.float32)


@triton.jit
def _mma_zeros(BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr, SWAP_AB: tl.constexpr):
    """A zero fp32 accumulator for [BLOCK_M rows of activations] × [BLOCK_W weight rows], in the MMA's
    orientation (SWAP_AB: [BLOCK_W, BLOCK_M], the weight rows on its M side)."""
    if SWAP_AB:
        acc = tl.zeros((BLOCK_W, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_W), dtype=tl.float32)
    return acc


@triton.jit
def _mma(a, w, acc, SWAP_AB: tl.constexpr, PROMOTE: tl.constexpr = 0):
    """acc + a · wᵀ in the accumulator's orientation (SWAP_AB: acc + w · aᵀ).

    PROMOTE > 0 (fp8 operands): the MMA adds at most PROMOTE products before its sum is added to `acc` in fp32
    (`max_num_imprecise_acc`). Triton's sm_90 default lets an fp8 wgmma accumulate a whole K loop in its own
    reduced-precision accumulator; swap-AB puts the MoE's decode tiles on wgmma (a 16-row tile runs mma.sync,
    which keeps fp32), and on the H200 that tripled the output error with static activation scales and
    multiplied it by 10 with dynamic per-token ones (Hy3 TP8 T 64: max 6.5e-2, rms 2.7e-2 against 5.4e-3 /
    2.6e-3; bench/results/README.md, MoE), and the 64+ row tiles' likewise at T 2048 (`MoeConfig.fp8_promote`)."""
    if SWAP_AB:
        lhs, rhs = w, tl.trans(a)
    else:
        lhs, rhs = a, tl.trans(w)
    return tl.dot(lhs, rhs, acc, max_num_imprecise_acc=PROMOTE if PROMOTE > 0 else None)


@triton.jit
def _tile_offsets(acc):
    """Row-major element offsets of a 2-D accumulator tile (its shape: the MMA's orientation)."""
    return tl.arange(0, acc.shape[0])[:, None] * acc.shape[1] + tl.arange(0, acc.shape[1])[None, :]


@triton.jit
def _mma_result(acc, SWAP_AB: tl.constexpr):
    """The accumulator as [activation rows, weight rows] (transposed back after SWAP_AB)."""
    if SWAP_AB:
        acc = tl.trans(acc)
    return acc


@triton.jit
def _dot_rows(a_rows, rmask, w_rows, wmask, K, SWAP_AB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr,
              BLOCK_K: tl.constexpr):
    """Σ_k a[rows, k] · w[wrows, k] over K, 16-bit operands, fp32 [BLOCK_M, BLOCK_W] (SWAP_AB: computed as
    w · aᵀ, the weight rows on the MMA's M side, and transposed back)."""
    offs_k = tl.arange(0, BLOCK_K)
    acc = _mma_zeros(BLOCK_M, BLOCK_W, SWAP_AB)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        kmask = kk < K
        a = tl.load(a_rows + kk[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        w = tl.load(w_rows + kk[None, :], mask=wmask[:, None] & kmask[None, :], other=0.0)
        acc = _mma(a, w, acc, SWAP_AB)
    return _mma_result(acc, SWAP_AB)


@triton.jit
def _shared_gate_up(sp, x_ptr, w_ptr, act_ptr, T, H, I_S, stride_x, stride_w, stride_act,
                    ACT_DT: tl.constexpr, BF16_MUL: tl.constexpr, SWAP_AB: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The shared expert's gate-up, one (M tile of tokens, N tile) task `sp`, 16-bit:
    act_s[t, n] = silu(x[t]·ws13[n]) · (x[t]·ws13[I_S + n]), every token (no routing)."""
    n_tiles = tl.cdiv(I_S, BLOCK_N)
    rows = (sp // n_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
    n0 = (sp % n_tiles) * BLOCK_N
    rmask = rows < T
    wrow, wmask = _gate_up_rows(n0, I_S, BLOCK_N)
    acc = _dot_rows(x_ptr + rows.to(tl.int64)[:, None] * stride_x, rmask,
                    w_ptr + wrow.to(tl.int64)[:, None] * stride_w, wmask, H, SWAP_AB, BLOCK_M, 2 * BLOCK_N, BLOCK_K)
    acc_g, acc_u = _gate_up_halves(acc, BLOCK_M, BLOCK_N)
    act = _silu_mul(acc_g, acc_u, ACT_DT, BF16_MUL)
    cols = n0 + tl.arange(0, BLOCK_N)
    tl.store(act_ptr + rows.to(tl.int64)[:, None] * stride_act + cols[None, :], act.to(ACT_DT),
             mask=rmask[:, None] & (cols < I_S)[None, :])


@triton.jit
def moe_gate_up_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, a13_ptr, tasks_ptr, offsets_ptr, sorted_ptr, ids_ptr, map_ptr,
                       act_ptr, act_s_ptr, a2_ptr, rowmax_ptr,
                       H, I, CAP, TOP_K, E_GLOBAL, E_LOCAL,
                       stride_xt, stride_xst, stride_xsg,
                       stride_we, stride_wn, stride_wse, stride_wsn, stride_wsk,
                       stride_act, stride_acts,
                       sx_ptr, s13_ptr, sact_ptr, T, I_S, N_SHARED, stride_sx, stride_s13, stride_sact,
                       QUANT: tl.constexpr, X_FP8: tl.constexpr, ACT_OUT: tl.constexpr,
                       ACT_DT: tl.constexpr, BF16_MUL: tl.constexpr,
                       NAIVE: tl.constexpr, HAS_MAP: tl.constexpr, SWAP_AB: tl.constexpr, SHARED: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       SHARED_BLOCK_K: tl.constexpr, FP8_PROMOTE: tl.constexpr = 0,
                       PDL_WAIT: tl.constexpr = False, PDL_NEXT: tl.constexpr = 0,
                       part_ptr=None, cnt_ptr=None, SPLIT_K: tl.constexpr = 1, PDL_WAIT_FIRST: tl.constexpr = False):
    """act[r, n] = silu(x[tok(r)]·w13[e, n]) · (x[tok(r)]·w13[e, I+n]) for one (M tile, N tile) task.

    SHARED: the first N_SHARED programs are the shared expert's gate-up instead (`_shared_gate_up`: the 16-bit
    sx, s13 [2·I_S, H] into sact [T, I_S], K tiles of SHARED_BLOCK_K), the routed tasks after them: one grid,
    so the shared expert's weight read overlaps the routed experts' without a second stream.

    One weight tile of 2·BLOCK_N rows (the gate rows n0.., then the matching up rows I+n0..) and one dot per
    K step; the accumulator is split into gate and up halves in the epilogue.
    QUANT (`QuantCode`): NONE, a 16-bit dot; FP8_TENSOR, fp8 weights with a scale per expert (applied in
    the epilogue); FP8_BLOCK, 128×128 blocks (scales per K tile). X_FP8: x arrives quantized (xs holds
    its scale, per row through strides, or per row and 128-group); otherwise it is quantized while
    loading (FP8_TENSOR: the static a13 scale; FP8_BLOCK: dynamic per row and 128-group). ACT_OUT
    (`ActMode`, see codes.py): WIDE_ROW_AMAX and WIDE_GROUP_AMAX also atomic-max the amax of each row
    (or row and 128-group); FP8_GROUP needs BLOCK_N = 128, WIDE_GROUP_AMAX BLOCK_N < 128.
    PDL_WAIT (`MoeConfig.pdl`; launched with programmatic dependent launch after another kernel of the call): every
    program waits for the previous grid before its first read of what that grid wrote (x, act's buffers) and
    before it exits; before the wait it reads only the call's inputs and the index (PDL_WAIT_FIRST: the previous
    grid writes the index too, `MoeConfig.index_quant`: the wait comes before the task's decode). PDL_NEXT:
    release the down GEMM's launch at this program's start (PDL_AT_START) or once its work is done (PDL_AT_END).
    SPLIT_K > 1 (`MoeConfig.split_k`): SPLIT_K programs (adjacent ids) share a task, each over its own run of K
    steps; each stores its fp32 partial tile to part [tiles, SPLIT_K, tile], and the last of them to count its
    arrival at cnt[task·n_tiles + N tile] (zeroed by the launcher) sums the SPLIT_K partials in split order (the
    result does not depend on which one is last) and runs the epilogue.
    """
    n_tiles = tl.cdiv(I, BLOCK_N)
    pid = tl.program_id(0)
    if PDL_NEXT == PDL_AT_START:
        gdc_launch_dependents()
    if SHARED:
        if pid < N_SHARED:
            if PDL_WAIT:
                gdc_wait()
            _shared_gate_up(pid, sx_ptr, s13_ptr, sact_ptr, T, H, I_S, stride_sx, stride_s13, stride_sact,
                            ACT_DT, BF16_MUL, SWAP_AB, BLOCK_M, BLOCK_N, SHARED_BLOCK_K)
            if PDL_NEXT == PDL_AT_END:
                gdc_launch_dependents()
            return
        pid -= N_SHARED
    k_lo = 0
    k_hi = H
    split = 0
    if SPLIT_K > 1:  # this program's run of K steps
        split = pid % SPLIT_K
        pid = pid // SPLIT_K
        k_run = tl.cdiv(tl.cdiv(H, BLOCK_K), SPLIT_K) * BLOCK_K
        k_lo = split * k_run
        k_hi = tl.minimum(H, k_lo + k_run)
    if PDL_WAIT_FIRST:
        gdc_wait()
    e, rows, rmask, pid_n = _task_rows(pid, n_tiles, tasks_ptr, offsets_ptr, ids_ptr, map_ptr, CAP,
                                       E_GLOBAL, E_LOCAL, HAS_MAP, NAIVE, BLOCK_M)
    if PDL_WAIT and not PDL_WAIT_FIRST:
        gdc_wait()
    if e < 0:
        return
    if NAIVE:
        pair = rows
    else:
        pair = tl.load(sorted_ptr + rows, mask=rmask, other=0)
    tok = (pair // TOP_K).to(tl.int64)
    n0 = pid_n * BLOCK_N
    cols = n0 + tl.arange(0, BLOCK_N)
    cmask = cols < I
    wrow, wmask = _gate_up_rows(n0, I, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    e64 = e.to(tl.int64)
    x_rows = x_ptr + tok[:, None] * stride_xt
    w_rows = w_ptr + e64 * stride_we + wrow.to(tl.int64)[:, None] * stride_wn
    acc = _mma_zeros(BLOCK_M, 2 * BLOCK_N, SWAP_AB)
    if QUANT == Q_FP8_TENSOR:
        if not X_FP8:
            a13 = tl.load(a13_ptr)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + offs_k
        kmask = kk < H
        a = tl.load(x_rows + kk[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        w = tl.load(w_rows + kk[None, :], mask=wmask[:, None] & kmask[None, :], other=0.0)
        if QUANT == Q_NONE:
            acc = _mma(a, w, acc, SWAP_AB)
        elif QUANT == Q_FP8_TENSOR:
            if not X_FP8:
                a = tl.minimum(tl.maximum(a.to(tl.float32) / a13, -FP8_MAX), FP8_MAX).to(tl.float8e4nv)
            acc = _mma(a, w, acc, SWAP_AB, FP8_PROMOTE)
        else:
            if X_FP8:
                a_s = tl.load(xs_ptr + tok * stride_xst + (k0 // 128) * stride_xsg, mask=rmask, other=0.0)
            else:
                af = a.to(tl.float32)
                a_s = tl.maximum(tl.max(tl.abs(af), 1), 1e-12) / FP8_MAX
                a = tl.minimum(tl.maximum(af / a_s[:, None], -FP8_MAX), FP8_MAX).to(tl.float8e4nv)
            # the scale of each weight row's 128-block: the gate rows lie in one block, the up rows in another
            # (block_n divides 128 and I % 128 == 0), so two scalar loads, spread over the rows in registers
            ws_k = ws_ptr + e64 * stride_wse + (k0 // 128) * stride_wsk
            w_s = tl.where(tl.arange(0, 2 * BLOCK_N) < BLOCK_N, tl.load(ws_k + (n0 // 128) * stride_wsn),
                           tl.load(ws_k + ((I + n0) // 128) * stride_wsn))
            if SWAP_AB:
                acc += tl.dot(w, tl.trans(a)) * (w_s[:, None] * a_s[None, :])
            else:
                acc += tl.dot(a, tl.trans(w)) * (a_s[:, None] * w_s[None, :])
    if SPLIT_K > 1:
        part = part_ptr + pid.to(tl.int64) * (SPLIT_K * 2 * BLOCK_N * BLOCK_M) + _tile_offsets(acc)
        tl.store(part + split * (2 * BLOCK_N * BLOCK_M), acc)
        tl.debug_barrier()  # every thread's partial stored before the release below
        arrived = tl.atomic_add(cnt_ptr + pid, 1, sem="acq_rel", scope="gpu")
        if arrived != SPLIT_K - 1:  # not the last: the last one finishes the tile
            if PDL_NEXT == PDL_AT_END:
                gdc_launch_dependents()
            return
        acc = tl.load(part, cache_modifier=".cg")
        for j in tl.static_range(1, SPLIT_K):
            acc += tl.load(part + j * (2 * BLOCK_N * BLOCK_M), cache_modifier=".cg")
    acc_g, acc_u = _gate_up_halves(_mma_result(acc, SWAP_AB), BLOCK_M, BLOCK_N)
    if QUANT == Q_FP8_TENSOR:
        ws = tl.load(ws_ptr + e64 * stride_wse)
        if X_FP8:
            a_s = tl.load(xs_ptr + tok * stride_xst, mask=rmask, other=0.0)
            acc_g = acc_g * (a_s[:, None] * ws)
            acc_u = acc_u * (a_s[:, None] * ws)
        else:
            acc_g = acc_g * (a13 * ws)
            acc_u = acc_u * (a13 * ws)
    act = _silu_mul(acc_g, acc_u, ACT_DT, BF16_MUL)
    # [BLOCK_M, BLOCK_N]
    out_ptrs = act_ptr + rows.to(tl.int64)[:, None] * stride_act + cols[None, :]
    omask = rmask[:, None] & cmask[None, :]
    if ACT_OUT == A_WIDE:
        tl.store(out_ptrs, act.to(ACT_DT), mask=omask)
    elif ACT_OUT == A_FP8_STATIC:
        a2 = tl.load(a2_ptr)
        q = tl.minimum(tl.maximum(act / a2, -FP8_MAX), FP8_MAX)
        tl.store(out_ptrs, q.to(tl.float8e4nv), mask=omask)
    elif ACT_OUT == A_WIDE_ROW_AMAX:
        tl.store(out_ptrs, act.to(ACT_DT), mask=omask)
        amax = tl.max(tl.where(omask, tl.abs(act), 0.0), 1)
        tl.atomic_max(rowmax_ptr + rows, amax, mask=rmask)
    elif ACT_OUT == A_WIDE_GROUP_AMAX:
        tl.store(out_ptrs, act.to(ACT_DT), mask=omask)
        amax = tl.max(tl.where(omask, tl.abs(act), 0.0), 1)
        tl.atomic_max(act_s_ptr + rows.to(tl.int64) * stride_acts + n0 // 128, amax, mask=rmask)
    else:
        amax = tl.max(tl.where(omask, tl.abs(act), 0.0), 1)
        s2 = tl.maximum(amax, 1e-12) / FP8_MAX
        q = tl.minimum(tl.maximum(act / s2[:, None], -FP8_MAX), FP8_MAX)
        tl.store(out_ptrs, q.to(tl.float8e4nv), mask=omask)
        tl.store(act_s_ptr + rows.to(tl.int64) * stride_acts + n0 // 128, s2, mask=rmask)
    if PDL_NEXT == PDL_AT_END:
        gdc_launch_dependents()


@triton.jit
def _shared_down(sp, act_ptr, w_ptr, y_ptr, T, H, I_S, stride_act, stride_w, stride_y, SWAP_AB: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The shared expert's down GEMM, one (M tile of tokens, N tile of H) task `sp`, 16-bit:
    y_s[t, n] = act_s[t]·ws2[n], rounded to y's dtype."""
    n_tiles = tl.cdiv(H, BLOCK_N)
    rows = (sp // n_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (sp % n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask, cmask = rows < T, cols < H
    acc = _dot_rows(act_ptr + rows.to(tl.int64)[:, None] * stride_act, rmask,
                    w_ptr + cols.to(tl.int64)[:, None] * stride_w, cmask, I_S, SWAP_AB, BLOCK_M, BLOCK_N, BLOCK_K)
    tl.store(y_ptr + rows.to(tl.int64)[:, None] * stride_y + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=rmask[:, None] & cmask[None, :])


@triton.jit
def _down_step(a, w, acc, rows64, rmask, r_s, act_s_ptr, ws_ptr, e64, n0, k0, stride_acts, stride_wse, stride_wsn,
               stride_wsk, QUANT: tl.constexpr, ACT_IN: tl.constexpr, SWAP_AB: tl.constexpr,
               FP8_PROMOTE: tl.constexpr):
    """acc + one K step of the down GEMM's tile (a [BLOCK_M, BLOCK_K] act rows, w [BLOCK_N, BLOCK_K] weight rows
    at output column n0, K offset k0), act quantized here where ACT_IN asks (`moe_down_kernel`)."""
    if QUANT == Q_FP8_BLOCK:
        a_s = tl.load(act_s_ptr + rows64 * stride_acts + k0 // 128, mask=rmask, other=0.0)
        if ACT_IN == A_WIDE_GROUP_AMAX:
            a_s = tl.maximum(a_s, 1e-12) / FP8_MAX
            a = tl.minimum(tl.maximum(a.to(tl.float32) / a_s[:, None], -FP8_MAX), FP8_MAX)
            a = a.to(tl.float8e4nv)
        ws = tl.load(ws_ptr + e64 * stride_wse + (n0 // 128) * stride_wsn + (k0 // 128) * stride_wsk)
        if SWAP_AB:
            acc += tl.dot(w, tl.trans(a)) * (ws * a_s[None, :])
        else:
            acc += tl.dot(a, tl.trans(w)) * (a_s[:, None] * ws)
    else:
        if QUANT == Q_FP8_TENSOR:
            if ACT_IN == A_WIDE_ROW_AMAX:
                a = tl.minimum(tl.maximum(a.to(tl.float32) / r_s[:, None], -FP8_MAX), FP8_MAX)
                a = a.to(tl.float8e4nv)
            acc = _mma(a, w, acc, SWAP_AB, FP8_PROMOTE)
        else:
            acc = _mma(a, w, acc, SWAP_AB)
    return acc


@triton.jit
def _down_store(acc, y_ptr, rows64, rmask, cols, cmask, r_s, a2_ptr, ws_ptr, e64, stride_wse, stride_y,
                QUANT: tl.constexpr, ACT_IN: tl.constexpr, SWAP_AB: tl.constexpr):
    """The down GEMM tile's epilogue: the per-tensor fp8 scales, y's dtype, the store."""
    acc = _mma_result(acc, SWAP_AB)
    if QUANT == Q_FP8_TENSOR:
        ws = tl.load(ws_ptr + e64 * stride_wse)
        if ACT_IN == A_FP8_STATIC:
            acc = acc * (tl.load(a2_ptr) * ws)
        else:
            acc = acc * (r_s[:, None] * ws)
    y_ptrs = y_ptr + rows64[:, None] * stride_y + cols[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])


@triton.jit
def moe_down_kernel(act_ptr, act_s_ptr, a2_ptr, rowmax_ptr, w_ptr, ws_ptr, tasks_ptr, offsets_ptr, ids_ptr, map_ptr,
                    y_ptr, H, I, CAP, E_GLOBAL, E_LOCAL,
                    stride_act, stride_acts, stride_we, stride_wn, stride_wse, stride_wsn, stride_wsk,
                    stride_y,
                    sact_ptr, s2_ptr, ysh_ptr, T, I_S, N_SHARED, stride_sact, stride_s2, stride_ysh,
                    QUANT: tl.constexpr, ACT_IN: tl.constexpr,
                    NAIVE: tl.constexpr, HAS_MAP: tl.constexpr, SWAP_AB: tl.constexpr, SHARED: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    SHARED_BLOCK_K: tl.constexpr, FP8_PROMOTE: tl.constexpr = 0,
                    PDL_WAIT: tl.constexpr = False, PDL_NEXT: tl.constexpr = 0, N_PER: tl.constexpr = 1,
                    K_ONE: tl.constexpr = False):
    """y[r, n] = act[r]·w2[e, n] for one (M tile, N tile) task, rows as the gate-up wrote them.

    ACT_IN (`ActMode`, as the gate-up wrote it): the WIDE_*_AMAX modes are quantized here, per row from
    the row amax (FP8_TENSOR) or per row and 128-group from the group amax (FP8_BLOCK).
    SHARED: the first N_SHARED programs are the shared expert's down GEMM (`_shared_down`: sact [T, I_S] ·
    s2 [H, I_S]ᵀ into ysh [T, H]), the routed tasks after them.
    PDL_WAIT, PDL_NEXT (`MoeConfig.pdl`): as the gate-up's (the wait before the first read of act, its scales or
    the shared expert's activation).
    N_PER > 1 (`MoeConfig.down_n_per`): a program computes N_PER consecutive N tiles of its task in one flat loop
    over (N tile, K step), so one software pipeline streams all their weight tiles and a tile's epilogue runs
    under the next tiles' loads (a short K, e.g. Hy3 TP8's I = 192, is 3 steps a tile). With one K step (BLOCK_K
    ≥ I) the activation tile is loaded once and the loop runs over N alone.
    """
    n_tiles = tl.cdiv(H, BLOCK_N)
    if N_PER == 1:
        n_slots = n_tiles
    else:
        n_slots = tl.cdiv(n_tiles, N_PER)
    pid = tl.program_id(0)
    if PDL_NEXT == PDL_AT_START:
        gdc_launch_dependents()
    if SHARED:
        if pid < N_SHARED:
            if PDL_WAIT:
                gdc_wait()
            _shared_down(pid, sact_ptr, s2_ptr, ysh_ptr, T, H, I_S, stride_sact, stride_s2, stride_ysh, SWAP_AB,
                         BLOCK_M, BLOCK_N, SHARED_BLOCK_K)
            if PDL_NEXT == PDL_AT_END:
                gdc_launch_dependents()
            return
        pid -= N_SHARED
    e, rows, rmask, pid_n = _task_rows(pid, n_slots, tasks_ptr, offsets_ptr, ids_ptr, map_ptr, CAP,
                                       E_GLOBAL, E_LOCAL, HAS_MAP, NAIVE, BLOCK_M)
    if e < 0:
        if PDL_WAIT:
            gdc_wait()
        return
    rows64 = rows.to(tl.int64)
    if N_PER == 1:
        n0 = pid_n * BLOCK_N
        cols = n0 + tl.arange(0, BLOCK_N)
        cmask = cols < H
    offs_k = tl.arange(0, BLOCK_K)
    e64 = e.to(tl.int64)
    a_rows = act_ptr + rows64[:, None] * stride_act
    if N_PER == 1:
        w_rows = w_ptr + e64 * stride_we + cols.to(tl.int64)[:, None] * stride_wn
    acc = _mma_zeros(BLOCK_M, BLOCK_N, SWAP_AB)
    if PDL_WAIT:
        gdc_wait()
    r_s = 1.0  # the row scales of A_WIDE_ROW_AMAX (unused otherwise)
    if ACT_IN == A_WIDE_ROW_AMAX:
        r_s = tl.maximum(tl.load(rowmax_ptr + rows, mask=rmask, other=0.0), 1e-12) / FP8_MAX
    if N_PER == 1:
        for k0 in range(0, I, BLOCK_K):
            kk = k0 + offs_k
            kmask = kk < I
            a = tl.load(a_rows + kk[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
            w = tl.load(w_rows + kk[None, :], mask=cmask[:, None] & kmask[None, :], other=0.0)
            acc = _down_step(a, w, acc, rows64, rmask, r_s, act_s_ptr, ws_ptr, e64, n0, k0, stride_acts,
                             stride_wse, stride_wsn, stride_wsk, QUANT, ACT_IN, SWAP_AB, FP8_PROMOTE)
        _down_store(acc, y_ptr, rows64, rmask, cols, cmask, r_s, a2_ptr, ws_ptr, e64, stride_wse, stride_y, QUANT,
                    ACT_IN, SWAP_AB)
    elif K_ONE:
        kmask = offs_k < I
        a = tl.load(a_rows + offs_k[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        nt0 = pid_n * N_PER
        for t in range(0, tl.minimum(N_PER, n_tiles - nt0)):
            n0 = (nt0 + t) * BLOCK_N
            cols = n0 + tl.arange(0, BLOCK_N)
            cmask = cols < H
            w = tl.load(w_ptr + e64 * stride_we + cols.to(tl.int64)[:, None] * stride_wn + offs_k[None, :],
                        mask=cmask[:, None] & kmask[None, :], other=0.0)
            acc = _down_step(a, w, _mma_zeros(BLOCK_M, BLOCK_N, SWAP_AB), rows64, rmask, r_s, act_s_ptr, ws_ptr,
                             e64, n0, 0, stride_acts, stride_wse, stride_wsn, stride_wsk, QUANT, ACT_IN, SWAP_AB,
                             FP8_PROMOTE)
            _down_store(acc, y_ptr, rows64, rmask, cols, cmask, r_s, a2_ptr, ws_ptr, e64, stride_wse, stride_y,
                        QUANT, ACT_IN, SWAP_AB)
    else:
        k_steps = tl.cdiv(I, BLOCK_K)
        nt0 = pid_n * N_PER
        for it in range(0, tl.minimum(N_PER, n_tiles - nt0) * k_steps):
            ks = it % k_steps
            n0 = (nt0 + it // k_steps) * BLOCK_N
            k0 = ks * BLOCK_K
            cols = n0 + tl.arange(0, BLOCK_N)
            cmask = cols < H
            kk = k0 + offs_k
            kmask = kk < I
            a = tl.load(a_rows + kk[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
            w = tl.load(w_ptr + e64 * stride_we + cols.to(tl.int64)[:, None] * stride_wn + kk[None, :],
                        mask=cmask[:, None] & kmask[None, :], other=0.0)
            acc = tl.where(ks == 0, 0.0, acc)  # a new N tile (Hopper: the MMA's use-acc flag)
            acc = _down_step(a, w, acc, rows64, rmask, r_s, act_s_ptr, ws_ptr, e64, n0, k0, stride_acts,
                             stride_wse, stride_wsn, stride_wsk, QUANT, ACT_IN, SWAP_AB, FP8_PROMOTE)
            if ks == k_steps - 1:
                _down_store(acc, y_ptr, rows64, rmask, cols, cmask, r_s, a2_ptr, ws_ptr, e64, stride_wse, stride_y,
                            QUANT, ACT_IN, SWAP_AB)
    if PDL_NEXT == PDL_AT_END:
        gdc_launch_dependents()


@triton.jit
def moe_reduce_kernel(y_ptr, pos_ptr, ids_ptr, map_ptr, tw_ptr, shared_ptr, out_ptr, H, E_GLOBAL, E_LOCAL,
                      stride_y, stride_tw, stride_sh, stride_out,
                      TOP_K: tl.constexpr, HAS_SHARED: tl.constexpr, NAIVE: tl.constexpr, HAS_MAP: tl.constexpr,
                      BLOCK_H: tl.constexpr, PDL_WAIT: tl.constexpr = False):
    """out[t] = Σ_j topk_weights[t, j] · y[pos[t, j]] (+ shared_output[t]), in fp32; pos −1 skipped.
    NAIVE: y rows are pairs (pos = t·k + j), skipped where the pair's expert is remote or out of range.
    PDL_WAIT (`MoeConfig.pdl`): launched with programmatic dependent launch; wait for the down GEMM first."""
    if PDL_WAIT:
        gdc_wait()
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    cmask = cols < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        if NAIVE:
            _, ok = _local_expert(ids_ptr, map_ptr, t * TOP_K + j, t >= 0, E_GLOBAL, E_LOCAL, HAS_MAP)
            p = tl.where(ok, t * TOP_K + j, -1)
        else:
            p = tl.load(pos_ptr + t * TOP_K + j)
        w = tl.load(tw_ptr + t * stride_tw + j)
        v = tl.load(y_ptr + p.to(tl.int64) * stride_y + cols, mask=cmask & (p >= 0), other=0.0)
        acc += w * v.to(tl.float32)
    if HAS_SHARED:
        acc += tl.load(shared_ptr + t * stride_sh + cols, mask=cmask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=cmask)


@triton.jit
def select_experts_kernel(logits_ptr, stride_lt, stride_le, bias_ptr, w_ptr, ids_ptr, T, E, scale, stride_ls,
                          TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
                          SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, RENORM: tl.constexpr,
                          SPLITS: tl.constexpr = 1):
    """Router top-k of BLOCK_T tokens: scores (softmax or sigmoid of the fp32 logits), the TOP_K largest of
    scores + bias (selection only) in descending order, lowest expert id first among equals; weights = the
    chosen scores, renormalized to sum 1 (RENORM), times `scale`. A NaN score is never preferred to a
    number; padding columns are never chosen (top_k ≤ E).
    Each round is one int64 max over (order-preserving bits of the score << 32 | reversed column), which gives
    the winner and its column at once; the weights are gathered after the rounds (one reduction a round: the
    H200's router.md measured 0.94-0.97x the time of a max + min + sum round with sigmoid, 0.55-0.68x with
    softmax). SPLITS > 1: the logits are SPLITS partial sums `stride_ls` apart (`router_gemm_kernel`'s split K),
    added here."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, E_PAD)
    rmask = rows < T
    cmask = cols < E
    x = tl.load(logits_ptr + rows.to(tl.int64)[:, None] * stride_lt + cols[None, :] * stride_le,
                mask=rmask[:, None] & cmask[None, :], other=float("-inf")).to(tl.float32)  # [BLOCK_T, E_PAD]
    for s in tl.static_range(1, SPLITS):
        x += tl.load(logits_ptr + s * stride_ls + rows.to(tl.int64)[:, None] * stride_lt + cols[None, :] * stride_le,
                     mask=rmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)
    if SIGMOID:
        scores = 1.0 / (1.0 + tl.exp(-x))
        choose = scores
        if HAS_BIAS:
            choose = scores + tl.load(bias_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    else:
        m = tl.max(x, axis=1)
        m = tl.where(m == float("-inf"), 0.0, m)  # a row of -inf logits: 0 / 0 = NaN, as torch's softmax
        e = tl.exp(x - m[:, None])
        scores = e / tl.sum(e, axis=1)[:, None]
        choose = scores
    # NaN (e.g. a row of -inf logits under softmax) ranks below every number; only real columns not yet
    # chosen compete (with top_k <= E there is always one), the lowest id among equals
    choose = tl.where(choose == choose, choose, -3.0e38)
    avail = cmask[None, :] & (rows >= 0)[:, None]  # [BLOCK_T, E_PAD]
    kcols = tl.arange(0, K_PAD)
    ids = tl.zeros([BLOCK_T, K_PAD], dtype=tl.int32)
    # float order as int order (negative floats: flip the magnitude bits; -0.0 is made +0.0 first), the
    # reversed column below it: the max is the best score, the lowest column among equals
    bits = (choose + 0.0).to(tl.int32, bitcast=True)
    order = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    key = (order.to(tl.int64) << 32) | (E_PAD - 1 - cols).to(tl.int64)[None, :]
    key = tl.where(avail, key, -9223372036854775807 - 1)
    for j in tl.static_range(TOP_K):
        best = tl.max(key, axis=1)
        ids = tl.where(kcols[None, :] == j, (E_PAD - 1 - (best & 0xFFFFFFFF)).to(tl.int32)[:, None], ids)
        key = tl.where(key == best[:, None], -9223372036854775807 - 1, key)
    w = tl.where(kcols[None, :] < TOP_K, tl.gather(scores, ids, axis=1), 0.0)
    if RENORM:
        w = w / tl.maximum(tl.sum(w, axis=1), 1e-20)[:, None]
    w = w * scale
    out = rows.to(tl.int64)[:, None] * TOP_K + kcols[None, :]
    omask = rmask[:, None] & (kcols[None, :] < TOP_K)
    tl.store(w_ptr + out, w, mask=omask)
    tl.store(ids_ptr + out, ids, mask=omask)


@triton.jit
def router_gemm_kernel(x_ptr, w_ptr, part_ptr, T, E, H, K_SPLIT, stride_xt, stride_we, stride_ps, stride_pt,
                       BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """Partial router logits part[s, t, e] = Σ_{k in split s} x[t, k] · w[e, k] for bf16 x and an fp32 w, with
    fp32 precision on the tensor cores: each fp32 weight tile is split in registers into three bf16 terms
    (hi + mid + lo = w exactly: 8 + 8 + 8 significand bits, fp32's 24), and three bf16 MMAs add x·lo, x·mid, x·hi
    (each product exact, as x is bf16). The tensor core's fp32 accumulation truncates (measured on the H200: a
    bias that grows with the MMA steps, 1.6e-6 of Σ|x·w| at H 4096 with one accumulator, 30× torch's fp32 GEMM,
    `bench/results/probe_route_large_c909b5f.md`), so each K tile's three MMAs start from zero, the small terms
    first, and the FMA units add the tile's sum (rounding to nearest) to the running fp32 sum: the truncations
    are then relative to one K tile's sum. The weight is read once, as fp32; no weight copy. (fp32 `tl.dot` on
    the FMA units, `input_precision="ieee"`, measured 12-68 µs at these sizes, `probe_route_3dff994.md`.)
    Grid (E tiles, splits, T tiles): at decode sizes the splits spread the weight read over the SMs (prefill sizes
    have enough tiles without); `select_experts_kernel` adds them."""
    pid_e, pid_s, pid_t = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    es = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    rmask, emask = rows < T, es < E
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xt
    w_rows = w_ptr + es.to(tl.int64)[:, None] * stride_we
    acc = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    k_begin = pid_s * K_SPLIT
    k_end = tl.minimum(k_begin + K_SPLIT, H)
    for k0 in range(k_begin, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < k_end
        xv = tl.load(x_rows + ks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        wv = tl.load(w_rows + ks[None, :], mask=emask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
        hi = wv.to(tl.bfloat16)
        rest = wv - hi.to(tl.float32)
        mid = rest.to(tl.bfloat16)
        lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)
        tile = tl.dot(xv, tl.trans(lo))
        tile = tl.dot(xv, tl.trans(mid), tile)
        acc += tl.dot(xv, tl.trans(hi), tile)
    out = part_ptr + pid_s.to(tl.int64) * stride_ps + rows.to(tl.int64)[:, None] * stride_pt + es[None, :]
    tl.store(out, acc, mask=rmask[:, None] & emask[None, :])
