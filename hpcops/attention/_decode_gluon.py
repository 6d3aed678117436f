"""Hopper decode attention in Gluon (`triton.experimental.gluon`): the plan's persistent walk with a TMA-fed
swap-AB wgmma tile. Only @gluon.jit code lives here; `decode.py` launches it (`DecodeConfig.gluon`).

Why (bench/results/README.md, "A Hopper (Gluon) decode tile"): the `tl` tile pads the q rows of one kv head to
a 16-row mma.sync tile, widens fp8 K to fp16 and spends ~2 µs a 64-key tile with 2 programs an SM; a split-KV
Gluon probe of this tile streamed 64x4K h8/1 fp8 at 2.96 TB/s (22.6 µs before its combine, against 35.4).

The tile, per 64 keys of one (request, kv head): K and V arrive by TMA (the cache as 2-D [blocks·page, token row]
as `_tma.py` describes, one box a tile, or one a page on pages of 16 or 32 tokens; a bad page id reads past the
cache, where TMA fills zeros), STAGES buffers deep on
mbarriers, issued STAGES − 1 tiles ahead inside a task. Sᵀ [64 keys, NQ rows] = K · qᵀ is one wgmma with the
keys on its 64-row M side and the NQ q rows (q_len·G padded to 8 or 16) as N: fp8 K with the fp8 q of the
prologue, or 16-bit K with a 16-bit q, K never widened. The online softmax runs per column (a q row). Oᵀ [D, NQ]
+= Vᵀ · Pᵀ is a 16-bit wgmma with Vᵀ as the register operand (fp8 V widened there, to fp16 with PV_F16, one
conversion a pair; keys past the sequence or on a bad page zeroed there, so a NaN in the cache never meets a
zero probability: with V_MASK_TAIL only on a request's last, partial tile, since inside the sequence every key
is the request's and a bad page's rows are TMA's zeros) and Pᵀ through shared memory.

The walk is `decode_persistent_kernel`'s with task descriptors (`_decode_kernels.py`): a program starts from
its task_desc row and runs its tasks in order; an unsplit task writes the output, a split one its fp32 partial
and log2-sum-exp into slot 2·pid (first task) or 2·pid + 1, merged by the `tl` combine kernel, or (TAIL_MERGE,
`DecodeConfig.tail_merge`) by the program that writes a pair's last partial (`_tail_merge`). Scores are in
the log2 domain as there: s = q·k · sm_scale · log2(e) (· q_scale · k_scale for fp8).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma


@gluon.jit
def _issue_tile(k_desc, v_desc, k_smem, v_smem, bars, bt_row, bt_width, num_blocks, tile, k_col, v_col, slot,
                ok, PAGE: gl.constexpr, TILE: gl.constexpr, KV_BYTES: gl.constexpr):
    """TMA of K and V tile `tile` of one request into buffer `slot` (nothing when not `ok`): one box of TILE
    rows inside a page, or over pages smaller than a tile one [PAGE, D] box a page (the descriptors' box)."""
    bar = bars.index(slot)
    mbarrier.expect(bar, KV_BYTES, pred=ok)
    if PAGE >= TILE:
        col = tile * TILE // PAGE
        page = gl.load(bt_row + col, mask=ok & (col < bt_width), other=-1)
        good = (page >= 0) & (page < num_blocks)
        row0 = gl.where(good, page, num_blocks) * PAGE + (tile * TILE) % PAGE  # a bad page: past the cache (zeros)
        tma.async_copy_global_to_shared(k_desc, [row0, k_col], bar, k_smem.index(slot), pred=ok)
        tma.async_copy_global_to_shared(v_desc, [row0, v_col], bar, v_smem.index(slot), pred=ok)
    else:
        for sub in gl.static_range(TILE // PAGE):
            col = tile * (TILE // PAGE) + sub
            page = gl.load(bt_row + col, mask=ok & (col < bt_width), other=-1)
            good = (page >= 0) & (page < num_blocks)
            row0 = gl.where(good, page, num_blocks) * PAGE
            tma.async_copy_global_to_shared(k_desc, [row0, k_col], bar, k_smem.index(slot).slice(sub * PAGE, PAGE),
                                            pred=ok)
            tma.async_copy_global_to_shared(v_desc, [row0, v_col], bar, v_smem.index(slot).slice(sub * PAGE, PAGE),
                                            pred=ok)


@gluon.jit
def _page_good(bt_row, bt_width, num_blocks, tile, keys, PAGE: gl.constexpr, TILE: gl.constexpr):
    """Whether each key of tile `tile` (`keys` [TILE], the key offsets in the tile, in some layout) sits on a good
    page id: one page id a tile (pages of TILE tokens or more), else one a key."""
    if PAGE >= TILE:
        col = tile * TILE // PAGE
        page = gl.load(bt_row + col, mask=col < bt_width, other=-1)
        good = (page >= 0) & (page < num_blocks)
        return (keys >= 0) & good
    else:
        col = tile * (TILE // PAGE) + keys // PAGE
        page = gl.load(bt_row + col, mask=col < bt_width, other=-1)
        return (page >= 0) & (page < num_blocks)


@gluon.jit
def _v_masked(vt, tile, kv_len, key_v, bt_row, bt_width, num_blocks, PV: gl.constexpr, PAGE: gl.constexpr,
              TILE: gl.constexpr):
    """Vᵀ [D, TILE] of tile `tile` in P·V's dtype PV, the keys past the sequence or on a bad page zeroed (`key_v`:
    the key offsets in Vᵀ's column layout), so a NaN in the cache never meets a zero probability."""
    v_ok = (tile * TILE + key_v < kv_len) & _page_good(bt_row, bt_width, num_blocks, tile, key_v, PAGE, TILE)
    return gl.where(v_ok[None, :], vt.to(PV), 0.0).to(PV)


@gluon.jit
def _load_round(part_o_ptr, part_lse_ptr, c, first_slot, rest_base, rest_step, n_parts, offs_r, d3,
                ROWS: gl.constexpr, D: gl.constexpr):
    """One round of `_merge_rows`: the lse [TB, R_PAD] and O [TB, R_PAD, D] of partials c (masked past n_parts)."""
    slot = gl.where(c == 0, first_slot, rest_base + c * rest_step).to(gl.int64)
    row = gl.expand_dims(slot, 1) * ROWS + gl.expand_dims(offs_r, 0)  # [TB, R_PAD]
    ok = gl.expand_dims(c < n_parts, 1) & gl.expand_dims(offs_r < ROWS, 0)
    lse = gl.load(part_lse_ptr + row, mask=ok, other=float("-inf"), cache_modifier=".cg")
    o = gl.load(part_o_ptr + gl.expand_dims(row, 2) * D + d3, mask=gl.expand_dims(ok, 2), other=0.0,
                cache_modifier=".cg")
    return lse, o


@gluon.jit
def _merge_round(lse, o, m_run, w, acc, l_r: gl.constexpr):
    """Fold one round of partials (lse [TB, R_PAD], O [TB, R_PAD, D]) into the running maximum, weight and sum."""
    m_new = gl.maximum(m_run, gl.max(lse, axis=0))
    m_ref = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_run - m_ref)
    wc = gl.exp2(lse - gl.expand_dims(m_ref, 0))  # [TB, R_PAD]
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, l_r), 1) + gl.sum(o * gl.expand_dims(wc, 2), axis=0)
    w = w * alpha + gl.sum(wc, axis=0)
    return m_new, w, acc


@gluon.jit
def _merge_rows(part_o_ptr, part_lse_ptr, first_slot, rest_base, rest_step, n_parts, b, h, out_ptr, stride_ot,
                stride_oh, Q_LEN: gl.constexpr, G: gl.constexpr, D: gl.constexpr, R_PAD: gl.constexpr,
                TB: gl.constexpr, num_warps: gl.constexpr, TO_PART: gl.constexpr = False,
                PREFETCH: gl.constexpr = False):
    """`_decode_kernels._merge_rows` in Gluon: every q row of split (b, h) over slots first_slot,
    rest_base + c·rest_step, in rounds of TB partials ([TB, R_PAD, D] tiles, TB in each thread: a running
    maximum a row, no reduction across threads), into the output or (TO_PART) into slot first_slot as a
    partial again. PREFETCH (DecodeConfig.merge_prefetch): the next round's loads are issued before this
    round's math (two rounds in flight: a round is an L2 round trip; the second round's registers)."""
    ROWS: gl.constexpr = Q_LEN * G
    l3: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1, 4], threads_per_warp=[1, 1, 32],
                                        warps_per_cta=[1, num_warps, 1], order=[2, 1, 0])
    l_rd: gl.constexpr = gl.SliceLayout(0, l3)  # [R_PAD, D]
    l_tr: gl.constexpr = gl.SliceLayout(2, l3)  # [TB, R_PAD]
    l_r: gl.constexpr = gl.SliceLayout(1, l_rd)
    offs_c = gl.arange(0, TB, layout=gl.SliceLayout(1, l_tr))
    offs_r = gl.arange(0, R_PAD, layout=gl.SliceLayout(0, l_tr))
    offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, l_rd))
    d3 = gl.expand_dims(gl.expand_dims(offs_d, 0), 0)  # [1, 1, D]
    m_run = gl.full([R_PAD], float("-inf"), gl.float32, layout=gl.SliceLayout(0, l_tr))
    w = gl.zeros([R_PAD], gl.float32, layout=gl.SliceLayout(0, l_tr))
    acc = gl.zeros([R_PAD, D], gl.float32, layout=l_rd)
    if PREFETCH:
        lse_next, o_next = _load_round(part_o_ptr, part_lse_ptr, offs_c, first_slot, rest_base, rest_step,
                                       n_parts, offs_r, d3, ROWS, D)
        for c0 in range(0, n_parts, TB):
            lse = lse_next
            o = o_next
            lse_next, o_next = _load_round(part_o_ptr, part_lse_ptr, c0 + TB + offs_c, first_slot, rest_base,
                                           rest_step, n_parts, offs_r, d3, ROWS, D)
            m_run, w, acc = _merge_round(lse, o, m_run, w, acc, l_r)
    else:
        for c0 in range(0, n_parts, TB):
            lse, o = _load_round(part_o_ptr, part_lse_ptr, c0 + offs_c, first_slot, rest_base, rest_step, n_parts,
                                 offs_r, d3, ROWS, D)
            m_run, w, acc = _merge_round(lse, o, m_run, w, acc, l_r)
    w_r = gl.convert_layout(w, l_r)
    res = acc / gl.expand_dims(gl.where(w_r == 0.0, 1.0, w_r), 1)
    r = gl.arange(0, R_PAD, layout=l_r)
    if TO_PART:
        dst = first_slot.to(gl.int64) * ROWS + r
        gl.store(part_o_ptr + gl.expand_dims(dst, 1) * D + gl.expand_dims(offs_d, 0), res,
                 mask=gl.expand_dims(r < ROWS, 1))
        m_r = gl.convert_layout(m_run, l_r)
        gl.store(part_lse_ptr + dst, gl.where(w_r == 0.0, float("-inf"), m_r + gl.log2(w_r)), mask=r < ROWS)
    else:
        tok = (b * Q_LEN + r // G).to(gl.int64)
        ptrs = out_ptr + gl.expand_dims(tok * stride_ot + (h * G + r % G) * stride_oh, 1) + gl.expand_dims(offs_d, 0)
        gl.store(ptrs, res.to(out_ptr.dtype.element_ty), mask=gl.expand_dims(r < ROWS, 1))


@gluon.jit
def _tail_merge(part_o_ptr, part_lse_ptr, pair_desc_ptr, merge_sem_ptr, pid, b, h, B, out_ptr, stride_ot, stride_oh,
                Q_LEN: gl.constexpr, G: gl.constexpr, D: gl.constexpr, R_PAD: gl.constexpr, TB: gl.constexpr,
                GROUP: gl.constexpr, num_warps: gl.constexpr, PREFETCH: gl.constexpr = False):
    """`_decode_kernels._tail_merge` in Gluon (DecodeConfig.tail_merge): count this program's partial of split
    (b, h) in (CTA barrier, one acq_rel atomic); the program that writes the last merges every q row of the pair
    and resets the count. GROUP > 0 and more partials than GROUP: in two levels (groups of GROUP partials merged
    into their first slot by the program that completes them, then the groups)."""
    idx = (h * B + b).to(gl.int64)
    owner = gl.load(pair_desc_ptr + idx * 4)
    parts = gl.load(pair_desc_ptr + idx * 4 + 1)
    first_slot = gl.load(pair_desc_ptr + idx * 4 + 2)
    pair_sem = merge_sem_ptr + 2 * gl.num_programs(0) + idx
    n_top = parts
    step = parts * 0 + 2
    ready = parts > 0
    gl.thread_barrier()
    if GROUP > 0:
        if parts > GROUP:
            g_lo = (pid - owner) // GROUP * GROUP
            g_n = gl.minimum(parts - g_lo, GROUP)
            g_first = gl.where(g_lo == 0, first_slot, 2 * (owner + g_lo))
            arrived = gl.atomic_add(merge_sem_ptr + g_first, 1, sem="acq_rel", scope="gpu")
            ready = arrived == g_n - 1
            if ready:
                gl.store(merge_sem_ptr + g_first, 0)
                _merge_rows(part_o_ptr, part_lse_ptr, g_first, 2 * (owner + g_lo), 2, g_n, b, h, out_ptr,
                            stride_ot, stride_oh, Q_LEN, G, D, R_PAD, TB, num_warps, True, PREFETCH)
                gl.thread_barrier()
            n_top = (parts + GROUP - 1) // GROUP
            step = parts * 0 + 2 * GROUP
    if ready:
        arrived = gl.atomic_add(pair_sem, 1, sem="acq_rel", scope="gpu")
        if arrived == n_top - 1:
            gl.store(pair_sem, 0)
            _merge_rows(part_o_ptr, part_lse_ptr, first_slot, 2 * owner, step, n_top, b, h, out_ptr, stride_ot,
                        stride_oh, Q_LEN, G, D, R_PAD, TB, num_warps, False, PREFETCH)


@gluon.jit
def _pdl_wait():
    """Programmatic dependent launch: griddepcontrol.wait (the previous kernel's writes are visible after it)."""
    gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _pdl_release():
    """griddepcontrol.launch_dependents: the next kernel may launch once every program ran this (or exited)."""
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32, is_pure=False,
                              pack=1)


@gluon.jit
def decode_gluon_kernel(
    q_ptr, k_desc, v_desc, bt_ptr, seq_lens_ptr, out_ptr, part_o_ptr, part_lse_ptr, task_desc_ptr,
    pair_desc_ptr, merge_sem_ptr,
    q_scale_ptr, k_scale_ptr, v_scale_ptr, sm_scale_log2, B, num_q_heads, bt_width, num_blocks,
    stride_qt, stride_qh, stride_kh, stride_vh, stride_bt, stride_ot, stride_oh,
    Q_LEN: gl.constexpr, G: gl.constexpr, NQ: gl.constexpr, D: gl.constexpr, PAGE: gl.constexpr,
    TILE: gl.constexpr, STAGES: gl.constexpr, KV_FP8: gl.constexpr, Q_FP8: gl.constexpr, num_warps: gl.constexpr,
    TAIL_MERGE: gl.constexpr = False, R_PAD: gl.constexpr = 1, TAIL_PARTS: gl.constexpr = 1,
    TAIL_GROUP: gl.constexpr = 0, MERGE_PREFETCH: gl.constexpr = False, PDL_WAIT: gl.constexpr = False,
    PV_F16: gl.constexpr = False, V_MASK_TAIL: gl.constexpr = False,
):
    ROWS: gl.constexpr = Q_LEN * G
    KV_BYTES: gl.constexpr = 2 * TILE * D * k_desc.dtype.primitive_bitwidth // 8
    K_STEP: gl.constexpr = 256 // k_desc.dtype.primitive_bitwidth
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, NQ, K_STEP])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, NQ, 16])
    vt_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    q_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8],
                                              warps_per_cta=[num_warps, 1], order=[1, 0])
    q_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([NQ, D], k_desc.dtype)
    # P·V in fp16 (PV_F16) or bf16 over fp8 V (widened in registers), else in V's own 16-bit dtype
    PV: gl.constexpr = (gl.float16 if PV_F16 else gl.bfloat16) if KV_FP8 else v_desc.dtype
    p_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([NQ, TILE], PV)
    cols_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    rows_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    cols_o: gl.constexpr = gl.SliceLayout(0, o_layout)
    rows_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    keys_v: gl.constexpr = gl.SliceLayout(0, vt_layout)

    q_smem = gl.allocate_shared_memory(k_desc.dtype, [NQ, D], q_smem_layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, TILE, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, TILE, D], v_desc.layout)
    p_smem = gl.allocate_shared_memory(PV, [NQ, TILE], p_smem_layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for ib in gl.static_range(STAGES):
        mbarrier.init(bars.index(ib), count=1)
    q_t = q_smem.permute((1, 0))  # [D, NQ], K-major: B of Sᵀ = K·qᵀ
    p_t = p_smem.permute((1, 0))  # [TILE, NQ], K-major: B of Oᵀ = Vᵀ·Pᵀ

    pid = gl.program_id(0)
    if PDL_WAIT:  # DecodeConfig.pdl_wait: nothing is read before the previous kernel's writes are visible
        _pdl_wait()
    kv_scale = 1.0
    v_scale = 1.0
    if KV_FP8:
        kv_scale = gl.load(k_scale_ptr)
        v_scale = gl.load(v_scale_ptr)
    td = task_desc_ptr + pid * 8
    b = gl.load(td)
    h = gl.load(td + 1)
    lo = gl.load(td + 2)
    left = gl.load(td + 3)
    kv_len = gl.load(td + 4, mask=b >= 0, other=0)  # the first request's length (0 idle)
    later = pid * 0
    used = pid * 0  # tiles through the buffers so far: buffer used % STAGES, mbarrier phase (used // STAGES) & 1

    r_s = gl.arange(0, NQ, layout=cols_s)  # the q row of a column: r = j·G + g
    r_o = gl.arange(0, NQ, layout=cols_o)
    d_o = gl.arange(0, D, layout=rows_o)
    key_s = gl.arange(0, TILE, layout=rows_s)
    key_v = gl.arange(0, TILE, layout=keys_v)
    rq = gl.arange(0, NQ, layout=gl.SliceLayout(1, q_layout))
    dq = gl.arange(0, D, layout=gl.SliceLayout(0, q_layout))
    while left > 0:
        b_next = gl.where(b + 1 == B, 0, b + 1)
        kv_next = gl.load(seq_lens_ptr + b_next)
        t_b = gl.maximum((kv_len + TILE - 1) // TILE, 1)
        n = gl.minimum(left, t_b - lo)
        bt_row = bt_ptr + b.to(gl.int64) * stride_bt
        k_col = h * stride_kh
        v_col = h * stride_vh
        for i0 in gl.static_range(STAGES - 1):  # the task's first tiles in flight
            _issue_tile(k_desc, v_desc, k_smem, v_smem, bars, bt_row, bt_width, num_blocks, lo + i0, k_col, v_col,
                        (used + i0) % STAGES, i0 < n, PAGE, TILE, KV_BYTES)

        # q rows of (b, h) into shared memory; padded rows are 0
        jq = rq // G
        tok = (b * Q_LEN + jq).to(gl.int64)
        head = h * G + rq % G
        q_ok = (rq < ROWS)[:, None] & (dq < D)[None, :]
        q = gl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + dq[None, :], mask=q_ok, other=0.0)
        q_smem.store(q.to(k_desc.dtype))
        fence_async_shared()
        if Q_FP8:
            qs = gl.load(q_scale_ptr + (b * Q_LEN + r_s // G) * num_q_heads + h * G + r_s % G, mask=r_s < ROWS,
                         other=0.0)
        else:
            qs = gl.full([NQ], 1.0, gl.float32, layout=cols_s)
        s_scale = qs * (sm_scale_log2 * kv_scale)
        last_s = kv_len - Q_LEN + r_s // G  # the last key row r may see (causal among the new tokens)
        m_i = gl.full([NQ], float("-inf"), gl.float32, layout=cols_s)
        l_i = gl.zeros([NQ], gl.float32, layout=cols_s)
        o = gl.zeros([D, NQ], gl.float32, layout=o_layout)

        for i in range(n):
            # refill the buffer the previous tile left (its wgmmas were waited for)
            j = i + STAGES - 1
            _issue_tile(k_desc, v_desc, k_smem, v_smem, bars, bt_row, bt_width, num_blocks, lo + j, k_col, v_col,
                        (used + j) % STAGES, j < n, PAGE, TILE, KV_BYTES)
            tile = lo + i
            # the tile's page ids, read before the wait so their latency hides behind it
            good_s = _page_good(bt_row, bt_width, num_blocks, tile, key_s, PAGE, TILE)
            s = (used + i) % STAGES
            mbarrier.wait(bars.index(s), phase=((used + i) // STAGES) & 1)
            st = warpgroup_mma(k_smem.index(s), q_t, gl.zeros([TILE, NQ], gl.float32, layout=s_layout), use_acc=False)
            key = tile * TILE + key_s
            seen = (key[:, None] <= last_s[None, :]) & good_s[:, None]
            st = gl.where(seen, st * s_scale[None, :], float("-inf"))
            m_new = gl.maximum(m_i, gl.max(st, axis=0))
            m_ref = gl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = gl.exp2(m_i - m_ref)
            p = gl.exp2(st - m_ref[None, :])
            l_i = l_i * alpha + gl.sum(p, axis=0)
            m_i = m_new
            p_smem.store(gl.permute(p.to(PV), (1, 0)))
            fence_async_shared()
            vt = v_smem.index(s).permute((1, 0)).load(vt_layout)  # [D, TILE]
            if V_MASK_TAIL:
                if (tile + 1) * TILE <= kv_len:
                    # a tile inside the sequence: every key is the request's (a bad page's keys are TMA's zeros)
                    v_pv = vt.to(PV)
                else:
                    v_pv = _v_masked(vt, tile, kv_len, key_v, bt_row, bt_width, num_blocks, PV, PAGE, TILE)
            else:
                v_pv = _v_masked(vt, tile, kv_len, key_v, bt_row, bt_width, num_blocks, PV, PAGE, TILE)
            o = o * gl.convert_layout(alpha, cols_o)[None, :]
            o = warpgroup_mma(v_pv, p_t, o)
        used += n

        # finish the task: the output (unsplit) or the fp32 partial and its log2-sum-exp (split)
        l_o = gl.convert_layout(l_i, cols_o)
        m_o = gl.convert_layout(m_i, cols_o)
        l_safe = gl.where(l_o == 0.0, 1.0, l_o)
        o = o / l_safe[None, :] * v_scale
        row_ok = r_o < ROWS
        split = (lo > 0) | (lo + n < t_b)
        if split:
            base = (2 * pid + later).to(gl.int64) * ROWS
            lse = gl.where(l_o == 0.0, float("-inf"), m_o + gl.log2(l_safe))
            gl.store(part_o_ptr + (base + r_o)[None, :] * D + d_o[:, None], o, mask=row_ok[None, :])
            gl.store(part_lse_ptr + base + r_o, lse, mask=row_ok)
            if TAIL_MERGE:
                _tail_merge(part_o_ptr, part_lse_ptr, pair_desc_ptr, merge_sem_ptr, pid, b, h, B, out_ptr,
                            stride_ot, stride_oh, Q_LEN, G, D, R_PAD, TAIL_PARTS, TAIL_GROUP, num_warps,
                            MERGE_PREFETCH)
        else:
            tok_o = (b * Q_LEN + r_o // G).to(gl.int64)
            head_o = h * G + r_o % G
            ptrs = out_ptr + tok_o[None, :] * stride_ot + head_o[None, :] * stride_oh + d_o[:, None]
            gl.store(ptrs, o.to(out_ptr.dtype.element_ty), mask=row_ok[None, :])
        left -= n
        h = gl.where(b_next == 0, h + 1, h)
        b = b_next
        kv_len = kv_next
        lo = 0
        later = 1
    if PDL_WAIT:  # the next kernel launches once every program is done (at the start, its programs would take the
        _pdl_release()  # slots this grid frees, unevenly: measured 15 % slower at h64/8, decode_tune_pdl_0268b5e.md)
    for ib in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(ib))
