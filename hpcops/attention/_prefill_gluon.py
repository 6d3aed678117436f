"""Hopper prefill attention in Gluon (`triton.experimental.gluon`): the `tl` kernel's flat tile list and GQA
packing, with K/V tiles by TMA on mbarriers and both GEMMs as asynchronous wgmma so that one tile's softmax runs
while the tensor cores work on the neighbouring tile's P·V. Two kernels share that loop (`_attend`):
`prefill_gluon_kernel` (one program refills its own ring) and `prefill_gluon_ws_kernel` (warp-specialized: a TMA
producer warp and two consumer warpgroups, below). Only @gluon.jit code lives here; `prefill.py` launches them
(`PrefillConfig.gluon`, `gluon_ws`). 16-bit q and KV only (the fp8 paths stay on the `tl` kernel).

Why (PREFILL.md, "Register use"): the `tl` kernel is held to 64×64 tiles on one warpgroup by its registers,
and Triton 3.6's `tl.range(warp_specialize=True)` does nothing on sm_90, so its softmax never overlaps its own
MMAs. Here a program owns a BLOCK_M-row q tile (16 rows a warp, BLOCK_M / 64 warpgroups) and walks its KV tiles
in this order, per tile j (FA3's intra-warpgroup overlap):

    issue S_{j+1} = Q·K_{j+1}ᵀ          (async wgmma, q and K from shared memory)
    issue O += P_j·V_j                  (async wgmma, P_j from registers, V from shared memory)
    wait for S_{j+1}; softmax of S_{j+1} → P_{j+1}, α_{j+1}   (while P_j·V_j runs)
    wait for O; refill tile j's buffer (TMA of tile j + STAGES); O ·= α_{j+1}

The online softmax is the `tl` kernel's with FMA_SCALE (max on the raw dot, exp2(s·c − m)); keys past a row's
causal limit are −inf in the tiles that reach the diagonal. V rows past seq_len (the last page's unused slots:
anything, NaN included) are zeroed in shared memory before their P·V, since a zero probability times NaN is NaN.
A bad page id reads past the cache (TMA fills zeros): a wrong answer, never an illegal address, as the `tl` path.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from hpcops.attention._decode_gluon import _issue_tile  # K/V TMA of one tile into a ring buffer (decode's)


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _add2(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


@gluon.jit
def _add4(a0, a1, a2, a3, b0, b1, b2, b3):
    return a0 + b0, a1 + b1, a2 + b2, a3 + b3


# ---- opt-in trace (`scripts/probe_prefill_trace.py`): the SM clock where a program's partitions pass their waits ----
# `TRACE` (a constexpr of the warp-specialized kernels, False by default: no code) and `trace_ptr`, an int32 buffer
# [programs, 3 roles, TRACE_KINDS, TRACE_STEPS]: role 0 / 1 the consumer warpgroups, 2 the producer; a kind below
# 8 is a q tile's event (index: the program's tile ordinal), 8 and up a K/V step's (index: the program's ring step).
# Consumers: 0 tile start, 1 first P stored, 2 loop done, 3 last P·V done, 4 output stored, 5 the SM's id (not a
# clock), 6 / 7 the global timer (ns, low 32 bits) at the tile's start / end; 8 step top, 9 K_{j+1} landed, 10 Vᵀ_j
# ready (fp8), 11 turn taken, 12 S_{j+1} done, 13 softmax done, 14 P·V_j done. Producer: 0 tile start, 1 next tile
# published (prefetch); fp8 steps 8 top, 9 V_j landed, 10 Vᵀ buffer free, 11 Vᵀ_j published; 16-bit steps 8 before
# the buffer's release, 9 after it (loads issued).
TRACE_KINDS = gl.constexpr(16)
TRACE_STEPS = gl.constexpr(512)


@gluon.jit
def _stamp(trace, role: gl.constexpr, kind: gl.constexpr, step, TRACE: gl.constexpr):
    """TRACE: record event `kind` of partition `role`, trace = (trace_ptr, program, tile ordinal): the SM clock
    (kind 5: the SM's id, 6 and 7: the global ns timer), indexed by the tile ordinal (kinds below 8) or by `step`
    (the others)."""
    if TRACE:
        if kind == 5:
            t = gl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
        elif kind == 6 or kind == 7:
            t = gl.inline_asm_elementwise("mov.u32 $0, %globaltimer_lo;", "=r", [], dtype=gl.int32, is_pure=False,
                                          pack=1)
        else:
            t = gl.inline_asm_elementwise("mov.u32 $0, %clock;", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
        idx = trace[2] if kind < 8 else step
        gl.store(trace[0] + ((trace[1] * 3 + role) * TRACE_KINDS + kind) * TRACE_STEPS + idx, t,
                 mask=idx < TRACE_STEPS)


@gluon.jit
def _tile_of(cu_seqlens_q_ptr, seq_lens_ptr, num_reqs, tiles_per_head, num_kv_heads, TOKENS: gl.constexpr,
             TILE: gl.constexpr, BLOCK_B: gl.constexpr, HEADS_INNER: gl.constexpr, WARPS: gl.constexpr):
    """This program's q tile from the flat tile list: request b owns tiles [cum[b] − n[b], cum[b]) with
    n[b] = cdiv(q_len[b], TOKENS), its heaviest (last) tile first; see `_tile_at`."""
    return _tile_at(gl.program_id(0), cu_seqlens_q_ptr, seq_lens_ptr, num_reqs, tiles_per_head, num_kv_heads, TOKENS,
                    TILE, BLOCK_B, HEADS_INNER, WARPS)


@gluon.jit
def _tile_at(pid, cu_seqlens_q_ptr, seq_lens_ptr, num_reqs, tiles_per_head, num_kv_heads, TOKENS: gl.constexpr,
             TILE: gl.constexpr, BLOCK_B: gl.constexpr, HEADS_INNER: gl.constexpr, WARPS: gl.constexpr):
    """Flat tile `pid`: (kv_head, req, ok, q_start, q_len, seq_len, ctx_len, first_tok, n), ok False past Σ n[b]
    (the grid is a bound from host shapes), n the K/V tiles up to the tile's last row's diagonal. `seq_lens` is
    read with `cu_seqlens_q`, in one round trip: a tile's start is a chain of dependent global loads (this, then
    the block table and the first K/V tile, or q), each a DRAM latency when the metadata is cold."""
    b_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1], threads_per_warp=[32], warps_per_cta=[WARPS],
                                              order=[0])
    if HEADS_INNER:
        kv_head = pid % num_kv_heads
        tile = pid // num_kv_heads
    else:
        kv_head = pid // tiles_per_head
        tile = pid % tiles_per_head
    offs_b = gl.arange(0, BLOCK_B, layout=b_layout)
    b_ok = offs_b < num_reqs
    q_lo = gl.load(cu_seqlens_q_ptr + offs_b, mask=b_ok, other=0)
    q_hi = gl.load(cu_seqlens_q_ptr + offs_b + 1, mask=b_ok, other=0)
    s_len = gl.load(seq_lens_ptr + offs_b, mask=b_ok, other=0)
    n_tiles = (q_hi - q_lo + TOKENS - 1) // TOKENS
    cum = gl.associative_scan(n_tiles, 0, _add)
    # two reductions (each a barrier across the warps): the request and the tile count, then the request's fields
    req, total = gl.reduce(((cum <= tile).to(gl.int32), n_tiles), 0, _add2)
    sel = offs_b == req
    req_end, q_start, q_len, seq_len = gl.reduce((gl.where(sel, cum, 0), gl.where(sel, q_lo, 0),
                                                  gl.where(sel, q_hi - q_lo, 0), gl.where(sel, s_len, 0)), 0, _add4)
    req_tiles = (q_len + TOKENS - 1) // TOKENS
    m_blk = req_tiles - 1 - (tile - (req_end - req_tiles))
    ctx_len = seq_len - q_len
    first_tok = m_blk * TOKENS
    last_tok = gl.minimum(first_tok + TOKENS, q_len) - 1
    ok = tile < total
    return kv_head, req, ok, q_start, q_len, seq_len, ctx_len, first_tok, (ctx_len + last_tok + TILE) // TILE


@gluon.jit
def _fold_top(x, MAX: gl.constexpr):
    """x [R, n] → [R, n / 2]: max (MAX) or sum of its two column halves, elementwise. In a wgmma accumulator's
    layout the top column bit of what `_row_reduce` leaves is a register bit: no data moves."""
    R: gl.constexpr = x.shape[0]
    N: gl.constexpr = x.shape[1]
    a, b = gl.split(gl.permute(gl.reshape(x, [R, 2, N // 2]), (0, 2, 1)))
    if MAX:
        return gl.maximum(a, b)
    return a + b


@gluon.jit
def _row_reduce(x, MAX: gl.constexpr, TREE: gl.constexpr):
    """The max (MAX) or sum of each row of x [R, N] (a wgmma accumulator's layout). TREE: first fold the columns a
    thread holds pairwise (column bit 0, then the top bits down to the 4 columns of a lane quad: log2 depth)
    instead of Triton's in-thread loop, a chain of N / 4 dependent instructions a row."""
    if TREE:
        R: gl.constexpr = x.shape[0]
        N: gl.constexpr = x.shape[1]
        rows: gl.constexpr = gl.SliceLayout(1, x.type.layout)
        a, b = gl.split(gl.reshape(x, [R, N // 2, 2]))
        if MAX:
            y = gl.maximum(a, b)
        else:
            y = a + b
        for _ in gl.static_range(N.bit_length() - 4):  # N / 2 columns down to 4
            y = _fold_top(y, MAX)
        if MAX:  # the same rows on the same threads: a change of name, no data moves
            return gl.convert_layout(gl.max(y, axis=1), rows)
        return gl.convert_layout(gl.sum(y, axis=1), rows)
    if MAX:
        return gl.max(x, axis=1)
    return gl.sum(x, axis=1)


@gluon.jit
def _softmax_tile(s, m_i, l_i, c, key0, kv_limit, keys, MASKED, ROW_SCALE: gl.constexpr = False,
                  P_EXP: gl.constexpr = 0, TREE: gl.constexpr = False, SUM: gl.constexpr = True):
    """One online-softmax step on the raw scores s [BLOCK_M, TILE] (exp2 domain, logit scale c > 0, one for the
    tile or, ROW_SCALE, one a row [BLOCK_M]): (p, α, m, l). MASKED (the tile reaches a row's causal limit): keys
    past kv_limit [BLOCK_M] are −inf. P_EXP: p and l come scaled by 2^P_EXP, inside exp2's argument (the fp8
    kernel's e4m3 range: no multiply an element); α and m are not scaled. TREE: the row max and sum by
    `_row_reduce`'s tree. SUM False: l_i comes back as it came (the caller sums P elsewhere). (An fp16 exp2,
    `ex2.approx.f16x2`, would not halve the MUFU work on sm_90: ptxas splits it into two MUFU.EX2.F16 and adds the
    conversions.)"""
    if MASKED:
        s = gl.where((key0 + keys)[None, :] <= kv_limit[:, None], s, float("-inf"))
    m_new = gl.maximum(m_i, _row_reduce(s, True, TREE) * c)
    m_ref = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_ref)
    if P_EXP != 0:
        m_ref = m_ref - P_EXP
    if ROW_SCALE:
        p = gl.exp2(s * c[:, None] - m_ref[:, None])
    else:
        p = gl.exp2(s * c - m_ref[:, None])
    if SUM:
        l_i = l_i * alpha + _row_reduce(p, False, TREE)
    return p, alpha, m_new, l_i


@gluon.jit
def _zero_v_tail(v_buf, tile, seq_len, TILE: gl.constexpr, ld_layout: gl.constexpr):
    """Zero the rows of V tile `tile` (buffer `v_buf` [TILE, D]) past seq_len: the last page's unused slots hold
    anything, NaN included, and a zero probability times NaN is NaN. Nothing for the tiles inside the sequence."""
    if (tile + 1) * TILE > seq_len:
        v = v_buf.load(ld_layout)
        key = tile * TILE + gl.arange(0, TILE, layout=gl.SliceLayout(1, ld_layout))
        v_buf.store(gl.where((key < seq_len)[:, None], v, 0.0).to(v.dtype))
        fence_async_shared()


@gluon.jit
def _p_operand(p, DT: gl.constexpr, FP8: gl.constexpr):
    """The probabilities as P·V's A operand: DT (16-bit), or with FP8 e4m3 (p comes as P·256, `_softmax_tile`'s
    P_EXP = 8: P in [0, 1] scaled into e4m3's normal range; l carries the same 256, so O / l needs no more)."""
    if FP8:
        return p.to(gl.float8e4nv)
    return p.to(DT)


# Vᵀ in the keys' natural order (`_transpose_v`, on one warpgroup: the fp8 kernel's producer; every tile but
# 128 keys at D 64 or 128, and the P-in-registers mode). A thread holds 16 contiguous d bytes of 2^r consecutive keys
# (r = log2(TILE·D) − 11): one 16-byte load a key, one 2^r-byte store a d. The lanes take d 16, the next 3 key
# bits and d 32; the warps what is left (at 128×128: the key's 64 and d's 64). Shared memory serves a 16-byte
# access a quarter-warp (8 lanes) at a time, an 8-byte one a half-warp at a time: under the 128-byte swizzle (a
# row's 16-byte chunk c at chunk c ^ (row % 8)) a quarter-warp of loads spans 2 chunks × 4 keys 2^r apart (one
# swizzle row), 4 wavefronts where 1 is the minimum; with the key bits first among the lanes it was 8 (H200 ncu
# at 128×128: 1109 load wavefronts a tile, 897 of them bank conflicts). A blocked layout with 8 d bytes a thread
# stored Vᵀ a byte at a time (the fp8 kernel ran at a third of the bf16 one's speed). Each base moves one
# coordinate: a Gluon distributed layout cannot mix them.
@gluon.constexpr_function
def _vt_bases(TILE, D):
    """[key, d] bases (registers, lanes, warps) of V's [TILE, D] tile on 4 warps, for D 64–256 and TILE·D ≥ 2048."""
    t, dd = TILE.bit_length() - 1, D.bit_length() - 1
    r = t + dd - 11  # key bits in the registers, beside d's 4
    regs = [[0, 1], [0, 2], [0, 4], [0, 8]] + [[1 << i, 0] for i in range(r)]
    lanes = [[0, 16]] + [[1 << (r + i), 0] for i in range(3)] + [[0, 32]]
    warps = [[1 << i, 0] for i in range(r + 3, t)] + [[0, 1 << i] for i in range(6, dd)]
    return regs, lanes, warps


@gluon.constexpr_function
def _vt_load_layout(TILE, D):
    """V [TILE keys, D]: registers d0–d3 then the keys."""
    regs, lanes, warps = _vt_bases(TILE, D)
    return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=lanes, warp_bases=warps, block_bases=[],
                                      shape=[TILE, D])


@gluon.constexpr_function
def _vt_store_layout(TILE, D):
    """Vᵀ [D, TILE keys]: the same threads, the keys first among the registers (2^r contiguous bytes a store)."""
    regs, lanes, warps = _vt_bases(TILE, D)
    regs = regs[4:] + regs[:4]
    return gl.DistributedLinearLayout(reg_bases=[[d, k] for k, d in regs], lane_bases=[[d, k] for k, d in lanes],
                                      warp_bases=[[d, k] for k, d in warps], block_bases=[], shape=[D, TILE])


# A layout cannot serve both sides at the minimum with the keys in their natural order: a quarter-warp of V loads
# wants 8 distinct (key % 8), a half-warp of Vᵀ stores 16 distinct 8-byte slots of one Vᵀ row, i.e. distinct
# key / 8, while a thread stores the 8 consecutive keys it loaded. So on tiles of 128 keys at D 128 and 64
# (`_vt_perm`) P·V runs over a permuted key order j = π(key) inside the tile, key bits (k0 k1 k2 k3 k4 k5 k6) at
# j bits (3 4 5 0 1 2 6): Σ_key P[m, key] V[key, d] does not depend on the order. A thread loads keys 8 apart
# (k3–k5 in registers: j contiguous) while a quarter-warp's lanes take k0–k2 (8 distinct swizzle rows): both sides
# at the minimum: 256 wavefronts a tile (loads and stores, 4 warps) instead of 1280 at D 128, 128 instead of 384
# at D 64 (a model of the banks, tests/test_prefill_banks.py; ncu measured 1689 with P's at D 128). The
# consumers store P in the same order j: 16-byte stores (j's bits 0–3 are k3–k5 and k0, all in a thread's
# registers), 8 times fewer instructions than the 2-byte ones, as many wavefronts.
@gluon.constexpr_function
def _vt_perm(TILE, D):
    """Whether the fp8 transpose runs in the permuted key order (TILE 128, D 64 or 128, 4 producer warps)."""
    return TILE == 128 and D in (64, 128)


@gluon.constexpr_function
def _vt_perm_bases(D):
    """[key, d] bases of the permuted transpose's V tile [128, D]. D = 128: registers d0–d3 and k3–k5, lanes
    k0–k2, k6, d4, warps d5, d6. D = 64 (64-byte rows, the 64-byte swizzle: chunk c of row r at c ^ (r / 2 % 4),
    so k0–k2 in a quarter-warp still reach 8 bank groups): registers d0–d3, k3, k4 (4-byte Vᵀ stores, a whole
    warp's 32 words in one Vᵀ row), lanes k0–k2, k5, k6, warps d4, d5."""
    if D == 128:
        return ([[0, 1], [0, 2], [0, 4], [0, 8], [8, 0], [16, 0], [32, 0]],
                [[1, 0], [2, 0], [4, 0], [64, 0], [0, 16]], [[0, 32], [0, 64]])
    return ([[0, 1], [0, 2], [0, 4], [0, 8], [8, 0], [16, 0]],
            [[1, 0], [2, 0], [4, 0], [32, 0], [64, 0]], [[0, 16], [0, 32]])


@gluon.constexpr_function
def _vt_perm_load_layout(TILE, D):
    """V [key, d] for the permuted transpose (`_vt_perm_bases`)."""
    regs, lanes, warps = _vt_perm_bases(D)
    return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=lanes, warp_bases=warps, block_bases=[],
                                      shape=[TILE, D])


@gluon.constexpr_function
def _vt_perm_store_layout(TILE, D):
    """Vᵀ [d, j] in the permuted order: the load layout's threads (each V[key, d] at Vᵀ[d, π(key)]), the
    registers that hold contiguous j (k3 and up) first."""
    regs, lanes, warps = _vt_perm_bases(D)
    # [key, d] -> [d, π(key)], π: key bits (k0 k1 k2 k3 k4 k5 k6) at (3 4 5 0 1 2 6), linear on the bases
    move = lambda b: [b[1], (b[0] >> 3 & 7) | (b[0] & 7) << 3 | (b[0] & 64)]  # noqa: E731
    key_regs = [move(b) for b in regs if b[0]]
    return gl.DistributedLinearLayout(reg_bases=key_regs + [move(b) for b in regs if not b[0]],
                                      lane_bases=[move(b) for b in lanes], warp_bases=[move(b) for b in warps],
                                      block_bases=[], shape=[D, TILE])


@gluon.constexpr_function
def _p_perm_store_layout(ROWS, TILE):
    """P [m, j] of a consumer warpgroup (an m64n128 wgmma accumulator: lanes k1, k2 and rows 1–4, registers k0,
    row 8, k3–k6; warps rows 16, 32) in the permuted key order, j0–j3 (k3–k5, k0) first: 16-byte stores."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [8, 0], [0, 64]],
        lane_bases=[[0, 16], [0, 32], [1, 0], [2, 0], [4, 0]], warp_bases=[[16, 0], [32, 0]], block_bases=[],
        shape=[ROWS, TILE])


@gluon.jit
def _permute_keys(x, ROWS: gl.constexpr):
    """x [ROWS, 128] with its columns in the permuted order j = π(key) (the key bits k0–k2 and k3–k5 swapped): a
    relabelling of registers, no data moves."""
    x = gl.reshape(x, [ROWS, 2, 2, 2, 2, 2, 2, 2])  # dims 1..7: k6 k5 k4 k3 k2 k1 k0
    x = gl.permute(x, (0, 1, 5, 6, 7, 2, 3, 4))  # j's bits from the top: k6 k2 k1 k0 k5 k4 k3
    return gl.reshape(x, [ROWS, 128])


@gluon.jit
def _transpose_v(v_buf, vt_buf, tile, seq_len, TILE: gl.constexpr, D: gl.constexpr, PERM: gl.constexpr = False):
    """V tile `tile` ([TILE, D], as the cache holds it) into `vt_buf` as Vᵀ [D, TILE], on 4 warps: an fp8 wgmma's B
    operand must be K-major (keys contiguous) for P·V. Rows past seq_len become 0 on the way (see
    `_zero_v_tail`). PERM (`_vt_perm`): the keys of Vᵀ in the permuted order j = π(key)."""
    if PERM:
        ld_layout: gl.constexpr = _vt_perm_load_layout(TILE, D)
    else:
        ld_layout: gl.constexpr = _vt_load_layout(TILE, D)
    v = v_buf.load(ld_layout)
    key = tile * TILE + gl.arange(0, TILE, layout=gl.SliceLayout(1, ld_layout))
    if (tile + 1) * TILE > seq_len:
        v = gl.where((key < seq_len)[:, None], v, gl.zeros_like(v))
    if PERM:
        vt_buf.store(gl.convert_layout(_permute_keys(gl.permute(v, (1, 0)), D), _vt_perm_store_layout(TILE, D)))
    else:
        vt_buf.store(gl.convert_layout(gl.permute(v, (1, 0)), _vt_store_layout(TILE, D)))
    fence_async_shared()


# The permuted transpose in 4×4 byte blocks (`PrefillConfig.gluon_vt_prmt`): V read as int32 words (4 d bytes of a
# key) in `_vt_perm_load_layout`'s threads; a thread's keys k3 and k4 at one word column give 4 words that become
# Vᵀ's 4 words of those d (4 bytes j0 j1 = k3 k4 each): two rounds of byte permutes, 8 PRMT for 16 bytes, 64 a thread
# and tile at D 128, where `gl.convert_layout` of the fp8 tile takes 119 (sm_90 SASS, session 67's ncu: the
# producer, busy 83 % of its samples, pacing the h8/1 step). Rows of D bytes keep their 16-byte chunks and swizzle
# under the int32 view.
_PRMT_4X4 = gl.constexpr("""{
.reg .b32 t0, t1, t2, t3;
prmt.b32 t0, $4, $5, 0x5140;
prmt.b32 t1, $4, $5, 0x7362;
prmt.b32 t2, $6, $7, 0x5140;
prmt.b32 t3, $6, $7, 0x7362;
prmt.b32 $0, t0, t2, 0x5410;
prmt.b32 $1, t0, t2, 0x7632;
prmt.b32 $2, t1, t3, 0x5410;
prmt.b32 $3, t1, t3, 0x7632;
}""")


@gluon.constexpr_function
def _words_layout(ROWS, D):
    """The int32 view [ROWS, D / 4] of an fp8 [ROWS, D] tile in shared memory: the same bytes and swizzle."""
    return gl.NVMMASharedLayout.get_default_for([ROWS, D // 4], gl.int32)


@gluon.constexpr_function
def _vt_words_load_layout(D):
    """`_vt_perm_load_layout`'s threads over V's int32 words [128 keys, D / 4]: d2, d3 of the fp8 registers are
    the word column's first two bits (d0, d1 are inside a word)."""
    regs, lanes, warps = _vt_perm_bases(D)
    word = lambda b: [b[0], b[1] >> 2]  # noqa: E731
    return gl.DistributedLinearLayout(reg_bases=[word(b) for b in regs[2:]], lane_bases=[word(b) for b in lanes],
                                      warp_bases=[word(b) for b in warps], block_bases=[], shape=[128, D // 4])


@gluon.jit
def _transpose_v_prmt(v_buf, vt_buf, tile, seq_len, D: gl.constexpr):
    """`_transpose_v`'s permuted transpose (TILE 128, `_vt_perm`) by byte permutes (`_PRMT_4X4`): V [key, d] as
    words X[key, w] (w = d / 4), the keys' bits (k6 k5 k4 k3, k2 k1 k0) as dims; the 4 words of keys k3 k4 at each
    (k6, k5, k2..k0, w) go in, the 4 words of d = 4w + b come out (bytes j0 j1 = k3 k4). Vᵀ's word column is
    j / 4 = (k6, k2..k0, k5) and its row d = (w, b)."""
    W: gl.constexpr = D // 4
    ld_layout: gl.constexpr = _vt_words_load_layout(D)
    x = v_buf._reinterpret(gl.int32, [128, W], _words_layout(128, D)).load(ld_layout)
    key = tile * 128 + gl.arange(0, 128, layout=gl.SliceLayout(1, ld_layout))
    if (tile + 1) * 128 > seq_len:
        x = gl.where((key < seq_len)[:, None], x, gl.zeros_like(x))
    x = gl.permute(gl.reshape(x, [2, 2, 2, 2, 8, W]), (0, 1, 4, 5, 3, 2))  # [k6, k5, k2..k0, w, k3, k4]
    x_k4_0, x_k4_1 = gl.split(x)
    a0, a1 = gl.split(x_k4_0)  # keys +0, +8 (k3)
    a2, a3 = gl.split(x_k4_1)  # keys +16, +24
    b0, b1, b2, b3 = gl.inline_asm_elementwise(_PRMT_4X4, "=r,=r,=r,=r,r,r,r,r", [a0, a1, a2, a3],
                                               dtype=(gl.int32, gl.int32, gl.int32, gl.int32), is_pure=True, pack=1)
    y = gl.join(gl.join(b0, b2), gl.join(b1, b3))  # [k6, k5, k2..k0, w, d1, d0] (a join's new dim is the last)
    y = gl.reshape(gl.permute(y, (3, 4, 5, 0, 2, 1)), [D, 32])  # [d, (k6, k2..k0, k5)]
    vt_buf._reinterpret(gl.int32, [D, 32], _words_layout(D, 128)).store(y)
    fence_async_shared()


@gluon.jit
def _p_e4m3(p, ROWS: gl.constexpr, PERM: gl.constexpr):
    """A consumer's P·256 (fp32, the accumulator's layout) as the e4m3 tile its `p_buf` takes, PERM in the permuted
    key order of the producer's Vᵀ (`_p_perm_store_layout`). The order is moved while P is fp32, where it is a
    renaming of whole registers, and cast after: each F2FP packs two keys that share a 16-bit half of a stored
    word. Cast first, the same move shuffled bytes (sm_90 SASS: 64 PRMT, 56 LOP3 and 24 SHF a warp and tile)."""
    if PERM:
        p = gl.convert_layout(_permute_keys(p, ROWS), _p_perm_store_layout(ROWS, 128))
    return p.to(gl.float8e4nv)


@gluon.jit
def _ring(j, g0, PERSIST: gl.constexpr):
    """K/V step j of a q tile as a step of the program's ring: j itself, or (PERSIST, a program that walks several
    q tiles) g0 + j, g0 the steps of its earlier tiles, so that slots, phases and turns go on across its tiles."""
    if PERSIST:
        return g0 + j
    else:
        return j


@gluon.jit
def _attend(q_ptr, out_ptr, k_desc, v_desc, q_buf, k_smem, v_smem, full, empty, turn, bt_row, bt_width, num_blocks,
            k_col, v_col, n, q_start, q_len, first_tok, ctx_len, seq_len, kv_head, c, stride_qt, stride_qh,
            stride_ot, stride_oh, fp8_args, ROW0: gl.constexpr, ROWS: gl.constexpr, WARPS: gl.constexpr,
            D: gl.constexpr, G: gl.constexpr, TILE: gl.constexpr, PAGE: gl.constexpr, STAGES: gl.constexpr,
            WS: gl.constexpr, WG: gl.constexpr, FP8: gl.constexpr = False, SOFTMAX: gl.constexpr = 0,
            G0=0, T0=0, PERSIST: gl.constexpr = False, PRE: gl.constexpr = False, pre=None,
            TRACE: gl.constexpr = False, trace=None):
    """Rows [ROW0, ROW0 + ROWS) of the q tile (row r: token first_tok + r // G, head kv_head·G + r % G) over the
    request's first n K/V tiles, on WARPS warps (16 rows a warp), into `out`. The tiles arrive in the STAGES-deep
    ring on `full`. Not WS: this routine refills the ring (tile j + STAGES once tile j is done). WS (consumer
    warpgroup WG of the specialized kernel): it releases buffers on `empty` for the producer, and issues its
    wgmmas in its turn (`turn[WG]`, then passes the turn on).

    FP8 (fp8 q over fp8 KV, warp-specialized; `fp8_args` = (q_scale_ptr, stride_qst, stride_qsh, k_scale_ptr,
    v_scale_ptr, vt_buf, p_buf, vt_full, vt_empty)): S = q8·K8ᵀ as an fp8 wgmma with a logit scale a row
    (q_scale[token, head]·k_scale·c); P is quantized as e4m3(P·256) into this warpgroup's `p_buf` [ROWS, TILE] and
    O += P8·V8 is an fp8 wgmma over Vᵀ from `vt_buf` [2, D, TILE], which the producer warpgroup fills
    (`_ws_producer_fp8`: tile j in buffer j % VT, VT 2 or 3, announced on `vt_full`, given back on `vt_empty` by both
    consumers once their P·V_j is done). A consumer releases a K/V buffer (`empty`) as soon as its S is done: the
    producer has read V by then. The epilogue multiplies by v_scale / l (P and l both carry the 256, which the
    softmax puts in exp2's argument; the `tl` kernel's `pv_fp8` numerics: e4m3 probabilities, ~2 % RMS error on
    random data). FP8 == 2 (`PrefillConfig.gluon_p_regs`): P stays in
    registers as P·V's A operand and P·V runs synchronously after the next S is issued (an 8-bit register operand
    cannot wait in `warpgroup_mma_wait`'s deps in Triton 3.6): no P round trip through shared memory, but P·V no
    longer runs under this warpgroup's own softmax, only under the other's. FP8 == 3 (`PrefillConfig.gluon_p_dbuf`):
    two P buffers a consumer (`p_buf` all four, 2·WG + tile % 2): P_{j+1} is stored before P_j·V_j is waited for,
    which keeps ptxas from placing that wait ahead of the softmax as it does with one buffer. SOFTMAX & 1
    (`PrefillConfig.gluon_tree`): the softmax's row max and sum as trees (`_row_reduce`). SOFTMAX & 2
    (`PrefillConfig.gluon_pv_overlap`, 16-bit, warp-specialized; `p_buf` a [64] fp32 scratch): the row sums are
    stored before the P·V wait, the same fix for the 16-bit loop, whose P stays in registers. SOFTMAX & 4
    (`PrefillConfig.gluon_mma_sum`, fp8 with P in shared memory; `fp8_args[9]` the [8, TILE] e4m3 ones that the
    producer writes before its first `vt_full`): the row sums by the tensor cores, l += P8·1 as an N = 8 wgmma
    beside P·V (the same e4m3 P that P·V weighs V by), instead of 64 FADD a thread and tile and a quad shuffle a
    row; each tile's wgmma starts from zero and its sums join l in fp32 (4 FADD a thread), as the fp8 wgmma keeps
    only ~14 bits where it adds to a large accumulator. SOFTMAX & 32 (`PrefillConfig.gluon_q_regs`, fp8):
    q in registers as S's A operand (loaded once; fp8: 16 registers a thread) instead of read from shared memory by
    every S wgmma. SOFTMAX & 64 (`PrefillConfig.gluon_vt3`, fp8): three Vᵀ buffers (`_fp8_buffers`; VT here, their
    count). PERSIST (`PrefillConfig.gluon_persist`, fp8 with P in shared
    memory: a program walking several q tiles): this q tile's K/V steps are steps G0.. of the program's ring (slots,
    phases, Vᵀ buffers) and its turns T0..; the last Vᵀ buffer is given back too (the producer refills it for the
    next q tile). PRE (`PrefillConfig.gluon_prefetch`, persistent fp8 with q in registers): `pre` = (q's A
    operand, the rows' q scales, k_scale, v_scale), read by the caller from the shared memory the producer's TMA
    filled ahead of the tile (`_ws_prefetch`): no global load before the first S. SOFTMAX & 512
    (`PrefillConfig.gluon_wide_store`): the output stored in 16-byte pieces, whole rows a warp, after a
    `convert_layout` through shared memory, instead of 4-byte pieces from the accumulator's layout (a store
    instruction there touches 8 rows: 8 lines). TRACE (warp-specialized):
    `_stamp`s at the tile's and each step's waits, `trace` = (trace_ptr, program, tile ordinal)."""
    P_REGS: gl.constexpr = FP8 == 2
    P_DBUF: gl.constexpr = FP8 == 3  # two P buffers a consumer: P_{j+1} is stored before P_j·V_j is waited for
    P_EXP: gl.constexpr = 8 if FP8 else 0  # fp8: P as e4m3(P·256)
    TREE: gl.constexpr = (SOFTMAX & 1) != 0  # the row max and sum as trees (`_row_reduce`)
    # 16-bit WS: the row sums into `p_buf` (a scratch) before the P·V wait, so the softmax runs under P·V
    PV_OVERLAP: gl.constexpr = (SOFTMAX & 2) != 0 and WS and not FP8
    MSUM: gl.constexpr = (SOFTMAX & 4) != 0 and FP8 != 0 and FP8 != 2  # the row sums as l += P8·1 (wgmma N = 8)
    Q_REGS: gl.constexpr = (SOFTMAX & 32) != 0  # q as S's register operand
    VT_PERM: gl.constexpr = FP8 != 2 and _vt_perm(TILE, D)  # P and Vᵀ in the permuted key order
    WIDE_STORE: gl.constexpr = (SOFTMAX & 512) != 0  # the output in 16-byte pieces (`PrefillConfig.gluon_wide_store`)
    gl.static_assert(WS or not FP8, "the fp8 loop runs on the warp-specialized kernel only")
    gl.static_assert(not PERSIST or (WS and FP8 != 2), "the persistent loop: warp-specialized, P not in fp8 registers")
    DT: gl.constexpr = k_desc.dtype
    KV_BYTES: gl.constexpr = 2 * TILE * D * DT.primitive_bitwidth // 8
    K_STEP: gl.constexpr = 32 if FP8 else 16
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                       instr_shape=[16, TILE, K_STEP])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                       instr_shape=[16, D, K_STEP])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4 if FP8 else 2)
    l_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                       instr_shape=[16, 8, K_STEP])  # MSUM's [ROWS, 8] sums
    ld_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8],
                                               warps_per_cta=[WARPS, 1], order=[1, 0])
    rows_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    rows_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    _stamp(trace, WG, 0, 0, TRACE)
    _stamp(trace, WG, 5, 0, TRACE)
    _stamp(trace, WG, 6, 0, TRACE)
    r_s = ROW0 + gl.arange(0, ROWS, layout=rows_s)
    if PRE:  # q, its scales and the KV scales from the caller (the producer's prefetch)
        gl.static_assert(FP8 != 0 and Q_REGS, "the prefetch: fp8 with q in registers")
        q_scale_ptr, stride_qst, stride_qsh, k_scale_ptr, v_scale_ptr, vt_buf, p_buf, vt_full, vt_empty = fp8_args[:9]
        VT: gl.constexpr = vt_buf.shape[0]  # Vᵀ buffers in the ring (`_fp8_buffers`)
        q_op, qs, k_scale, out_scale = pre
    else:
        if FP8:  # the scales first: their loads then share q's round trip (after q's conversion they were another)
            q_scale_ptr, stride_qst, stride_qsh, k_scale_ptr, v_scale_ptr, vt_buf, p_buf, vt_full, vt_empty = \
                fp8_args[:9]
            VT: gl.constexpr = vt_buf.shape[0]  # Vᵀ buffers in the ring (`_fp8_buffers`)
            tok_s = first_tok + r_s // G
            qs = gl.load(q_scale_ptr + (q_start + tok_s).to(gl.int64) * stride_qst + (kv_head * G + r_s % G)
                         * stride_qsh, mask=tok_s < q_len, other=0.0)
            k_scale = gl.load(k_scale_ptr)
            out_scale = gl.load(v_scale_ptr)  # P and l both carry 2^P_EXP: it cancels in O / l
        # the q rows into shared memory; rows past q_len are 0
        rq = ROW0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, ld_layout))
        dq = gl.arange(0, D, layout=gl.SliceLayout(0, ld_layout))
        tok_q = first_tok + rq // G
        q_rows = (q_start + tok_q).to(gl.int64) * stride_qt + (kv_head * G + rq % G).to(gl.int64) * stride_qh
        q_val = gl.load(q_ptr + q_rows[:, None] + dq[None, :], mask=(tok_q < q_len)[:, None] & (dq < D)[None, :],
                        other=0.0)
        if Q_REGS:  # S's A operand for the whole loop
            q_op = gl.convert_layout(q_val, gl.DotOperandLayout(operand_index=0, parent=s_layout,
                                                                k_width=4 if FP8 else 2))
        else:
            q_buf.store(q_val)
            q_op = q_buf
    if MSUM:  # P is summed against the producer's ones (all 8 columns: each is the row sum)
        ones_buf = fp8_args[9]
        l_zero = gl.zeros([ROWS, 8], gl.float32, layout=l_layout)  # each tile's sums start from 0 (see below)
        l_acc = l_zero
    fence_async_shared()

    keys = gl.arange(0, TILE, layout=gl.SliceLayout(0, s_layout))
    kv_limit = ctx_len + gl.minimum(first_tok + r_s // G, q_len - 1)  # the last key row r sees
    if FP8:  # one logit scale a row; > 0 so that −inf · c never makes a NaN (a zero q scale only zeroes the logits)
        c = gl.maximum(qs * (k_scale * c), 1e-30)
    if PV_OVERLAP:
        p_buf = fp8_args[6]
    full_end = (ctx_len + first_tok + ROW0 // G + 1) // TILE  # tiles all these rows see entirely: no mask
    m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=rows_s)
    l_i = gl.zeros([ROWS], gl.float32, layout=rows_s)
    o = gl.zeros([ROWS, D], gl.float32, layout=o_layout)

    # tile 0: its scores and probabilities before the loop
    r0 = _ring(0, G0, PERSIST)
    mbarrier.wait(full.index(r0 % STAGES), (r0 // STAGES) & 1)
    s = warpgroup_mma(q_op, k_smem.index(r0 % STAGES).permute((1, 0)),
                      gl.zeros([ROWS, TILE], gl.float32, layout=s_layout), use_acc=False)
    p, alpha, m_i, l_i = _softmax_tile(s, m_i, l_i, c, 0, kv_limit, keys, full_end == 0, FP8, P_EXP, TREE, not MSUM)
    if P_REGS:
        p = gl.convert_layout(_p_operand(p, DT, True), p_layout)
        mbarrier.arrive(empty.index(r0 % STAGES), count=1)  # K_0 is read (and the producer transposes V_0 itself)
    elif FP8:  # P·V's A operand from shared memory (an 8-bit register operand cannot be kept alive across the wait)
        (p_buf.index(2 * WG) if P_DBUF else p_buf).store(_p_e4m3(p, ROWS, VT_PERM))
        fence_async_shared()
        mbarrier.arrive(empty.index(r0 % STAGES), count=1)
    else:
        p = gl.convert_layout(_p_operand(p, DT, False), p_layout)
    _stamp(trace, WG, 1, 0, TRACE)
    for j in range(n - 1):
        rj = _ring(j, G0, PERSIST)  # this step's place in the program's ring (j itself unless PERSIST)
        slot = rj % STAGES
        nxt = (rj + 1) % STAGES
        _stamp(trace, WG, 8, rj, TRACE)
        if not FP8:
            _zero_v_tail(v_smem.index(slot), j, seq_len, TILE, ld_layout)
        mbarrier.wait(full.index(nxt), ((rj + 1) // STAGES) & 1)
        _stamp(trace, WG, 9, rj, TRACE)
        if FP8:  # Vᵀ_j from the producer
            mbarrier.wait(vt_full.index(rj % VT), (rj // VT) & 1)
            _stamp(trace, WG, 10, rj, TRACE)
        if WS:  # my turn at the tensor cores: warpgroup 0 first (its first wait passes on the initial phase)
            mbarrier.wait(turn.index(WG), (_ring(j, T0, PERSIST) & 1) ^ (1 - WG))
            _stamp(trace, WG, 11, rj, TRACE)
        s_tok = warpgroup_mma(q_op, k_smem.index(nxt).permute((1, 0)),
                              gl.zeros([ROWS, TILE], gl.float32, layout=s_layout), use_acc=False, is_async=True)
        if P_REGS:  # synchronous: waits for S_{j+1} too
            o = warpgroup_mma(p, vt_buf.index(rj % VT).permute((1, 0)), o)
            o_tok = o
        elif P_DBUF:
            o_tok = warpgroup_mma(p_buf.index(2 * WG + j % 2), vt_buf.index(rj % VT).permute((1, 0)), o,
                                  is_async=True)
        elif FP8:
            o_tok = warpgroup_mma(p_buf, vt_buf.index(rj % VT).permute((1, 0)), o, is_async=True)
        else:
            o_tok = warpgroup_mma(p, v_smem.index(slot), o, is_async=True)
        if MSUM:  # P_j's row sums (P_DBUF: the buffer P·V reads)
            # a fresh accumulator a tile, added to l_acc in fp32 below: Hopper's fp8 wgmma keeps ~14 bits where it
            # adds its products to a large accumulator, so summing into l_acc itself cut off late small P
            l_tok = warpgroup_mma(p_buf.index(2 * WG + j % 2) if P_DBUF else p_buf, ones_buf.permute((1, 0)), l_zero,
                                  use_acc=False, is_async=True)
        if WS:
            mbarrier.arrive(turn.index(1 - WG), count=1)
        s = warpgroup_mma_wait(2 if MSUM else 1, deps=[s_tok])  # S_{j+1} done, P_j·V_j may still run
        _stamp(trace, WG, 12, rj, TRACE)
        p_next, alpha, m_i, l_i = _softmax_tile(s, m_i, l_i, c, (j + 1) * TILE, kv_limit, keys, j + 1 >= full_end,
                                                FP8, P_EXP, TREE, not MSUM)
        _stamp(trace, WG, 13, rj, TRACE)
        if P_REGS:
            mbarrier.arrive(empty.index(nxt), count=1)  # K_{j+1} is read
            mbarrier.arrive(vt_empty.index(rj % VT), count=1)  # P_j·V_j is done
            p = gl.convert_layout(_p_operand(p_next, DT, True), p_layout)
        elif P_DBUF:  # P_{j+1} into the buffer P_{j-1}·V_{j-1} read (waited for a step ago), then P_j·V_j
            mbarrier.arrive(empty.index(nxt), count=1)  # K_{j+1} is read
            p_buf.index(2 * WG + (j + 1) % 2).store(_p_e4m3(p_next, ROWS, VT_PERM))
            fence_async_shared()
            if MSUM:
                o, l_t = warpgroup_mma_wait(0, deps=[o_tok, l_tok])
                l_acc = l_acc + l_t
            else:
                o = warpgroup_mma_wait(0, deps=[o_tok])
            mbarrier.arrive(vt_empty.index(rj % VT), count=1)  # P_j·V_j is done with Vᵀ_j
        elif FP8:
            mbarrier.arrive(empty.index(nxt), count=1)  # K_{j+1} is read
            p8 = _p_e4m3(p_next, ROWS, VT_PERM)
            if MSUM:
                o, l_t = warpgroup_mma_wait(0, deps=[o_tok, l_tok])
                l_acc = l_acc + l_t
            else:
                o = warpgroup_mma_wait(0, deps=[o_tok])
            mbarrier.arrive(vt_empty.index(rj % VT), count=1)  # P_j·V_j is done with Vᵀ_j and with p_buf
            p_buf.store(p8)
            fence_async_shared()
        else:
            p_next = gl.convert_layout(_p_operand(p_next, DT, False), p_layout)
            if PV_OVERLAP:  # a store that needs every exp2: ptxas cannot sink the softmax below the wait
                p_buf.store(l_i)
            o, p = warpgroup_mma_wait(0, deps=[o_tok, p])
        # tile j's buffers are free (fp8: K released above, V the producer's)
        if not WS:
            _issue_tile(k_desc, v_desc, k_smem, v_smem, full, bt_row, bt_width, num_blocks, j + STAGES, k_col, v_col,
                        slot, j + STAGES < n, PAGE, TILE, KV_BYTES)
        elif not FP8:
            mbarrier.arrive(empty.index(slot), count=1)
        o = o * gl.convert_layout(alpha, rows_o)[:, None]
        if MSUM:
            l_acc = l_acc * gl.convert_layout(alpha, gl.SliceLayout(1, l_layout))[:, None]
        if not FP8:
            p = p_next
        _stamp(trace, WG, 14, rj, TRACE)
    _stamp(trace, WG, 2, 0, TRACE)
    rl = _ring(n - 1, G0, PERSIST)
    last = rl % STAGES
    if FP8:
        mbarrier.wait(vt_full.index(rl % VT), (rl // VT) & 1)
        if P_DBUF:
            o = warpgroup_mma(p_buf.index(2 * WG + (n - 1) % 2), vt_buf.index(rl % VT).permute((1, 0)), o)
        elif MSUM:  # the last P·V and P·1 issued together, one wait for both
            o_tok = warpgroup_mma(p_buf, vt_buf.index(rl % VT).permute((1, 0)), o, is_async=True)
            l_tok = warpgroup_mma(p_buf, ones_buf.permute((1, 0)), l_zero, use_acc=False, is_async=True)
            o, l_t = warpgroup_mma_wait(0, deps=[o_tok, l_tok])
            l_acc = l_acc + l_t
        else:
            o = warpgroup_mma(p if P_REGS else p_buf, vt_buf.index(rl % VT).permute((1, 0)), o)
        if MSUM:
            if P_DBUF:
                l_acc = l_acc + warpgroup_mma(p_buf.index(2 * WG + (n - 1) % 2), ones_buf.permute((1, 0)), l_zero,
                                              use_acc=False)
            l_i = gl.convert_layout(gl.max(l_acc, axis=1), rows_s)
        if PERSIST:  # the last Vᵀ buffer back to the producer too: it fills it again for the next q tile
            mbarrier.arrive(vt_empty.index(rl % VT), count=1)
    else:
        _zero_v_tail(v_smem.index(last), n - 1, seq_len, TILE, ld_layout)
        o = warpgroup_mma(p, v_smem.index(last), o)
        if PERSIST:  # the last K/V buffer back to the producer too (16-bit: released after P·V)
            mbarrier.arrive(empty.index(last), count=1)

    _stamp(trace, WG, 3, 0, TRACE)
    l_o = gl.convert_layout(l_i, rows_o)
    if FP8:
        o = o * (out_scale / gl.where(l_o > 0.0, l_o, 1.0))[:, None]
    else:
        o = o / gl.where(l_o > 0.0, l_o, 1.0)[:, None]
    if WIDE_STORE:  # 16 bytes a thread, whole rows a warp: through shared memory, 4 lines a store instruction
        CHUNKS: gl.constexpr = D * out_ptr.dtype.element_ty.primitive_bitwidth // 128  # 16-byte pieces a row
        TPR: gl.constexpr = CHUNKS if CHUNKS < 32 else 32
        st_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, D // TPR], threads_per_warp=[32 // TPR, TPR],
                                                   warps_per_cta=[WARPS, 1], order=[1, 0])
        o_out = o.to(out_ptr.dtype.element_ty)
        if FP8:  # the compiler's shared scratch (the fp8 q buffer is too small for a 16-bit output)
            o_out = gl.convert_layout(o_out, st_layout)
        else:  # through q's buffer, free since the last S was waited for (3 K/V buffers leave no room for scratch)
            q_buf.store(o_out)
            gl.thread_barrier()  # this warpgroup's stores before its loads
            o_out = q_buf.load(st_layout)
            gl.thread_barrier()  # and its loads before q's buffer is written again (a persistent kernel's next tile)
        r_o = ROW0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, st_layout))
        d_o = gl.arange(0, D, layout=gl.SliceLayout(0, st_layout))
    else:  # from the wgmma accumulator's layout: 4 bytes a thread, 8 rows (8 lines) a store instruction
        o_out = o
        r_o = ROW0 + gl.arange(0, ROWS, layout=rows_o)
        d_o = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    tok_o = first_tok + r_o // G
    o_rows = (q_start + tok_o).to(gl.int64) * stride_ot + (kv_head * G + r_o % G).to(gl.int64) * stride_oh
    gl.store(out_ptr + o_rows[:, None] + d_o[None, :], o_out.to(out_ptr.dtype.element_ty),
             mask=(tok_o < q_len)[:, None] & (d_o < D)[None, :])
    _stamp(trace, WG, 4, 0, TRACE)
    _stamp(trace, WG, 7, 0, TRACE)


@gluon.jit
def prefill_gluon_kernel(
    q_ptr, k_desc, v_desc, bt_ptr, seq_lens_ptr, cu_seqlens_q_ptr, out_ptr, sm_scale_log2,
    num_reqs, tiles_per_head, num_kv_heads, bt_width, num_blocks,
    stride_qt, stride_qh, stride_kh, stride_vh, stride_bt, stride_ot, stride_oh,
    D: gl.constexpr, G: gl.constexpr, BLOCK_M: gl.constexpr, TILE: gl.constexpr, PAGE: gl.constexpr,
    BLOCK_B: gl.constexpr, STAGES: gl.constexpr, HEADS_INNER: gl.constexpr, num_warps: gl.constexpr,
    SOFTMAX: gl.constexpr = 0,
):
    gl.static_assert(num_warps == BLOCK_M // 16, "a warp owns 16 rows of the q tile")
    gl.static_assert(STAGES >= 2, "the refill of tile j + STAGES needs two buffers at least")
    TOKENS: gl.constexpr = BLOCK_M // G
    DT: gl.constexpr = k_desc.dtype
    KV_BYTES: gl.constexpr = 2 * TILE * D * DT.primitive_bitwidth // 8
    kv_head, req, ok, q_start, q_len, seq_len, ctx_len, first_tok, n = _tile_of(
        cu_seqlens_q_ptr, seq_lens_ptr, num_reqs, tiles_per_head, num_kv_heads, TOKENS, TILE, BLOCK_B, HEADS_INNER,
        num_warps)
    if not ok:
        return

    q_smem = gl.allocate_shared_memory(DT, [BLOCK_M, D], gl.NVMMASharedLayout.get_default_for([BLOCK_M, D], DT))
    k_smem = gl.allocate_shared_memory(DT, [STAGES, TILE, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(DT, [STAGES, TILE, D], v_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for ib in gl.static_range(STAGES):
        mbarrier.init(bars.index(ib), count=1)
    bt_row = bt_ptr + req.to(gl.int64) * stride_bt
    k_col = kv_head * stride_kh
    v_col = kv_head * stride_vh
    for i0 in gl.static_range(STAGES):
        _issue_tile(k_desc, v_desc, k_smem, v_smem, bars, bt_row, bt_width, num_blocks, i0, k_col, v_col, i0,
                    i0 < n, PAGE, TILE, KV_BYTES)
    _attend(q_ptr, out_ptr, k_desc, v_desc, q_smem, k_smem, v_smem, bars, bars, bars, bt_row, bt_width, num_blocks,
            k_col, v_col, n, q_start, q_len, first_tok, ctx_len, seq_len, kv_head, sm_scale_log2, stride_qt,
            stride_qh, stride_ot, stride_oh, (), 0, BLOCK_M, num_warps, D, G, TILE, PAGE, STAGES, False, 0,
            SOFTMAX=SOFTMAX)
    for ib in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(ib))


# ---- warp-specialized variant (PrefillConfig.gluon_ws): a TMA producer warp and two consumer warpgroups ----------
# FA3's structure: one producer warp fills the K/V ring (`full` barriers, expect-tx) and waits until both consumers
# have released a buffer (`empty`, two arrivals); each consumer warpgroup owns 64 rows of the 128-row q tile and runs
# `_attend` on its own registers, and the two take turns issuing their wgmmas (`turn` barriers, ping-pong), so
# that one's softmax runs while the other's GEMMs hold the tensor cores. Partitions synchronize only through
# mbarriers: no CTA-wide bar.sync in the loop (the non-specialized kernel has one before every mbarrier wait, which
# keeps its two warpgroups in lock step, softmax against softmax).


@gluon.jit
def _ws_producer(args, D: gl.constexpr, G: gl.constexpr, TILE: gl.constexpr, PAGE: gl.constexpr,
                 STAGES: gl.constexpr, FP8: gl.constexpr, TRACE: gl.constexpr = False, trace_ptr=None):
    (q_ptr, out_ptr, k_desc, v_desc, q_smem, k_smem, v_smem, full, empty, turn, bt_row, bt_width, num_blocks, k_col,
     v_col, n, q_start, q_len, first_tok, ctx_len, seq_len, kv_head, c, stride_qt, stride_qh, stride_ot,
     stride_oh, q_scale_ptr, stride_qst, stride_qsh, k_scale_ptr, v_scale_ptr, vt_smem, p_smem, vt_full,
     vt_empty, ones_smem) = args
    _produce_tiles(k_desc, v_desc, k_smem, v_smem, full, empty, bt_row, bt_width, num_blocks, k_col, v_col, n, 0, D,
                   TILE, PAGE, STAGES, False, TRACE, (trace_ptr, gl.program_id(0), 0))


@gluon.jit
def _produce_tiles(k_desc, v_desc, k_smem, v_smem, full, empty, bt_row, bt_width, num_blocks, k_col, v_col, n, g0,
                   D: gl.constexpr, TILE: gl.constexpr, PAGE: gl.constexpr, STAGES: gl.constexpr,
                   PERSIST: gl.constexpr = False, TRACE: gl.constexpr = False, trace=None):
    """The 16-bit producer warp's K/V loads of a q tile, each once both consumers released its buffer (after their
    P·V of the tile it held). PERSIST: ring steps g0.. (`_ring`). TRACE: `_stamp`s around each release wait."""
    KV_BYTES: gl.constexpr = 2 * TILE * D * k_desc.dtype.primitive_bitwidth // 8
    for j in range(n):
        rj = _ring(j, g0, PERSIST)
        slot = rj % STAGES
        _stamp(trace, 2, 8, rj, TRACE)
        # a buffer is free once both consumers released it (mbarriers start with phase 1 complete)
        mbarrier.wait(empty.index(slot), ((rj // STAGES) & 1) ^ 1)
        _stamp(trace, 2, 9, rj, TRACE)
        _issue_tile(k_desc, v_desc, k_smem, v_smem, full, bt_row, bt_width, num_blocks, j, k_col, v_col, slot, True,
                    PAGE, TILE, KV_BYTES)


@gluon.jit
def _ws_producer_fp8(args, D: gl.constexpr, G: gl.constexpr, TILE: gl.constexpr, PAGE: gl.constexpr,
                     STAGES: gl.constexpr, FP8: gl.constexpr, SOFTMAX: gl.constexpr = 0, TRACE: gl.constexpr = False,
                     trace_ptr=None):
    """The fp8 kernel's producer warpgroup: the K/V ring as `_ws_producer` fills it, and V_j transposed into
    Vᵀ buffer j % VT (FA3 does the same in its producer): once V_j has landed and both consumers gave the buffer
    back (`vt_empty`), `_transpose_v`, a barrier of the 4 warps, then `vt_full` and this warpgroup's release of
    the K/V buffer (`empty` takes 3 arrivals here: the consumers release K when their S is done). A buffer is
    refilled one tile late (tile j-1+STAGES at step j), when the consumers have long released it. SOFTMAX & 4
    (`gluon_mma_sum`): first the [8, TILE] ones the consumers sum P against, published by the first `vt_full`."""
    (q_ptr, out_ptr, k_desc, v_desc, q_smem, k_smem, v_smem, full, empty, turn, bt_row, bt_width, num_blocks, k_col,
     v_col, n, q_start, q_len, first_tok, ctx_len, seq_len, kv_head, c, stride_qt, stride_qh, stride_ot,
     stride_oh, q_scale_ptr, stride_qst, stride_qsh, k_scale_ptr, v_scale_ptr, vt_smem, p_smem, vt_full,
     vt_empty, ones_smem) = args
    _produce_fp8_first(k_desc, v_desc, k_smem, v_smem, full, empty, bt_row, bt_width, num_blocks, k_col, v_col, n, 0,
                       D, TILE, PAGE, STAGES)
    if (SOFTMAX & 4) != 0 and FP8 != 2:
        _store_ones(ones_smem, k_desc.dtype, TILE)
    _produce_fp8_steps(k_desc, v_desc, k_smem, v_smem, full, empty, vt_smem, vt_full, vt_empty, bt_row, bt_width,
                       num_blocks, k_col, v_col, n, seq_len, 0, D, TILE, PAGE, STAGES, FP8, False, 0,
                       (SOFTMAX & 128) != 0, TRACE, (trace_ptr, gl.program_id(0), 0))


@gluon.jit
def _store_ones(ones_smem, DT: gl.constexpr, TILE: gl.constexpr):
    """`gluon_mma_sum`'s [8, TILE] e4m3 ones (P·1's B operand), by the 4-warp producer."""
    ones_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, TILE // 16], threads_per_warp=[2, 16],
                                                 warps_per_cta=[4, 1], order=[1, 0])  # 8 rows on 4 warps
    # e4m3 1.0 as its bits (0x38): the fp32 constant 1.0 cast to e4m3 comes out wrong on sm_90 (Triton 3.6: a
    # mix of 0x38, 0x60 and 0xFC bytes in shared memory, measured on the H200)
    ones_smem.store(gl.full([8, TILE], 0x38, gl.uint8, layout=ones_layout).to(DT, bitcast=True))
    fence_async_shared()  # for the wgmma (async proxy); the loop's barrier and vt_full arrival publish it


@gluon.jit
def _produce_fp8_first(k_desc, v_desc, k_smem, v_smem, full, empty, bt_row, bt_width, num_blocks, k_col, v_col, n,
                       g0, D: gl.constexpr, TILE: gl.constexpr, PAGE: gl.constexpr, STAGES: gl.constexpr,
                       PERSIST: gl.constexpr = False):
    """A q tile's first STAGES K/V tiles into the ring. PERSIST: they are ring steps g0.., and each waits until its
    buffer's previous load (an earlier q tile's) is released by both consumers and the transpose."""
    KV_BYTES: gl.constexpr = 2 * TILE * D * k_desc.dtype.primitive_bitwidth // 8
    for i0 in gl.static_range(STAGES):
        r = _ring(i0, g0, PERSIST)
        if PERSIST:
            mbarrier.wait(empty.index(r % STAGES), ((r // STAGES) & 1) ^ 1, pred=i0 < n)
        _issue_tile(k_desc, v_desc, k_smem, v_smem, full, bt_row, bt_width, num_blocks, i0, k_col, v_col,
                    r % STAGES, i0 < n, PAGE, TILE, KV_BYTES)


@gluon.jit
def _produce_fp8_steps(k_desc, v_desc, k_smem, v_smem, full, empty, vt_smem, vt_full, vt_empty, bt_row, bt_width,
                       num_blocks, k_col, v_col, n, seq_len, g0, D: gl.constexpr, TILE: gl.constexpr,
                       PAGE: gl.constexpr, STAGES: gl.constexpr, FP8: gl.constexpr, PERSIST: gl.constexpr = False,
                       PART: gl.constexpr = 0, PRMT: gl.constexpr = False, TRACE: gl.constexpr = False,
                       trace=None):
    """A q tile's K/V steps in the producer: the refills (tile j-1+STAGES at step j) and each V_j transposed into
    Vᵀ buffer (ring step) % VT (2, or 3 with SOFTMAX & 64: `_fp8_buffers`). PERSIST: ring steps g0.. (`_ring`).
    PART 1: step 0 alone, PART 2: the steps after it (`gluon_prefetch` publishes the next tile between them), 0: all.
    PRMT (SOFTMAX & 128, `PrefillConfig.gluon_vt_prmt`): the permuted transpose by byte permutes. TRACE: `_stamp`s
    at each step's waits."""
    PERM: gl.constexpr = FP8 != 2 and _vt_perm(TILE, D)
    KV_BYTES: gl.constexpr = 2 * TILE * D * k_desc.dtype.primitive_bitwidth // 8
    VT: gl.constexpr = vt_smem.shape[0]  # Vᵀ buffers (`_fp8_buffers`)
    j_lo = 1 if PART == 2 else 0
    j_hi = gl.minimum(n, 1) if PART == 1 else n
    for j in range(j_lo, j_hi):
        rj = _ring(j, g0, PERSIST)
        slot = rj % STAGES
        _stamp(trace, 2, 8, rj, TRACE)
        if j >= 1:  # refill the previous tile's buffer with tile j-1+STAGES
            prev = (rj - 1) % STAGES
            if j - 1 + STAGES < n:
                mbarrier.wait(empty.index(prev), ((rj - 1) // STAGES) & 1)
                _issue_tile(k_desc, v_desc, k_smem, v_smem, full, bt_row, bt_width, num_blocks, j - 1 + STAGES,
                            k_col, v_col, prev, True, PAGE, TILE, KV_BYTES)
        mbarrier.wait(full.index(slot), (rj // STAGES) & 1)
        _stamp(trace, 2, 9, rj, TRACE)
        mbarrier.wait(vt_empty.index(rj % VT), ((rj // VT) & 1) ^ 1)  # P·V_{j-VT} is done in both consumers
        _stamp(trace, 2, 10, rj, TRACE)
        if PRMT and PERM:
            _transpose_v_prmt(v_smem.index(slot), vt_smem.index(rj % VT), j, seq_len, D)
        else:
            _transpose_v(v_smem.index(slot), vt_smem.index(rj % VT), j, seq_len, TILE, D, PERM)
        gl.thread_barrier()  # all 4 warps' Vᵀ stores (each fenced for the async proxy) before the arrivals
        mbarrier.arrive(vt_full.index(rj % VT), count=1)
        mbarrier.arrive(empty.index(slot), count=1)
        _stamp(trace, 2, 11, rj, TRACE)


@gluon.jit
def _ws_consume(args, D: gl.constexpr, G: gl.constexpr, TILE: gl.constexpr, PAGE: gl.constexpr,
                STAGES: gl.constexpr, FP8: gl.constexpr, SOFTMAX: gl.constexpr, WG: gl.constexpr,
                TRACE: gl.constexpr = False, trace_ptr=None):
    (q_ptr, out_ptr, k_desc, v_desc, q_smem, k_smem, v_smem, full, empty, turn, bt_row, bt_width, num_blocks, k_col,
     v_col, n, q_start, q_len, first_tok, ctx_len, seq_len, kv_head, c, stride_qt, stride_qh, stride_ot,
     stride_oh, q_scale_ptr, stride_qst, stride_qsh, k_scale_ptr, v_scale_ptr, vt_smem, p_smem, vt_full,
     vt_empty, ones_smem) = args
    if FP8 == 3:  # all four P buffers, two a consumer: `_attend` picks 2·WG + tile % 2
        p_bufs = p_smem
    else:
        p_bufs = p_smem.index(WG)
    _attend(q_ptr, out_ptr, k_desc, v_desc, q_smem.index(WG), k_smem, v_smem, full, empty, turn, bt_row, bt_width,
            num_blocks, k_col, v_col, n, q_start, q_len, first_tok, ctx_len, seq_len, kv_head, c, stride_qt,
            stride_qh, stride_ot, stride_oh,
            (q_scale_ptr, stride_qst, stride_qsh, k_scale_ptr, v_scale_ptr, vt_smem, p_bufs, vt_full, vt_empty,
             ones_smem),
            WG * 64, 64, 4, D, G, TILE, PAGE, STAGES, True, WG, FP8, SOFTMAX,
            TRACE=TRACE, trace=(trace_ptr, gl.program_id(0), 0))


@gluon.jit
def _ws_consumer0(args, D: gl.constexpr, G: gl.constexpr, TILE: gl.constexpr, PAGE: gl.constexpr,
                  STAGES: gl.constexpr, FP8: gl.constexpr, SOFTMAX: gl.constexpr, TRACE: gl.constexpr = False,
                  trace_ptr=None):
    _ws_consume(args, D, G, TILE, PAGE, STAGES, FP8, SOFTMAX, 0, TRACE, trace_ptr)


@gluon.jit
def _ws_consumer1(args, D: gl.constexpr, G: gl.constexpr, TILE: gl.constexpr, PAGE: gl.constexpr,
                  STAGES: gl.constexpr, FP8: gl.constexpr, SOFTMAX: gl.constexpr, TRACE: gl.constexpr = False,
                  trace_ptr=None):
    _ws_consume(args, D, G, TILE, PAGE, STAGES, FP8, SOFTMAX, 1, TRACE, trace_ptr)


@gluon.jit
def _fp8_buffers(DT: gl.constexpr, D: gl.constexpr, TILE: gl.constexpr, FP8: gl.constexpr, SOFTMAX: gl.constexpr):
    """The fp8 kernel's shared memory beside q and the K/V ring: two Vᵀ buffers (the fp8 P·V's B operand, keys
    contiguous; three with SOFTMAX & 64, `PrefillConfig.gluon_vt3`: the producer may transpose V_j as soon as P·V_{j-3}
    is done instead of P·V_{j-2}), each consumer's e4m3 P (the A operand; two each with FP8 3, none with P in
    registers), their mbarriers (initialized), and gluon_mma_sum's [8, TILE] ones: (vt, p, vt_full, vt_empty, ones)."""
    VT: gl.constexpr = 3 if (SOFTMAX & 64) != 0 else 2
    vt_smem = gl.allocate_shared_memory(DT, [VT, D, TILE], gl.NVMMASharedLayout.get_default_for([D, TILE], DT))
    if FP8 == 2:
        p_smem = vt_smem  # P stays in registers: not read
    elif FP8 == 3:  # two P buffers a consumer
        p_smem = gl.allocate_shared_memory(DT, [4, 64, TILE], gl.NVMMASharedLayout.get_default_for([64, TILE], DT))
    else:
        p_smem = gl.allocate_shared_memory(DT, [2, 64, TILE], gl.NVMMASharedLayout.get_default_for([64, TILE], DT))
    vt_full = gl.allocate_shared_memory(gl.int64, [VT, 1], mbarrier.MBarrierLayout())
    vt_empty = gl.allocate_shared_memory(gl.int64, [VT, 1], mbarrier.MBarrierLayout())
    if SOFTMAX & 4:  # gluon_mma_sum: [8, TILE] e4m3 ones, P·1's B operand (N = 8, keys contiguous)
        ones_smem = gl.allocate_shared_memory(DT, [8, TILE], gl.NVMMASharedLayout.get_default_for([8, TILE], DT))
    else:
        ones_smem = vt_smem  # not read
    for ib in gl.static_range(VT):
        mbarrier.init(vt_full.index(ib), count=1)
        mbarrier.init(vt_empty.index(ib), count=2)  # both consumers' P·V
    return vt_smem, p_smem, vt_full, vt_empty, ones_smem


@gluon.jit
def _ws_buffers(k_desc, v_desc, D: gl.constexpr, TILE: gl.constexpr, STAGES: gl.constexpr, FP8: gl.constexpr,
                SOFTMAX: gl.constexpr):
    """The warp-specialized kernels' shared memory (both consumers' q tiles, the K/V ring) and mbarriers (`full`,
    `empty` a ring slot, the consumers' `turn`s), initialized; fp8 (`_fp8_buffers`): the Vᵀ buffers, the P buffers,
    their mbarriers and the ones; 16-bit: the row-sum scratch (SOFTMAX & 2, `_attend`'s PV_OVERLAP) and stand-ins
    for the fp8 buffers, never read."""
    DT: gl.constexpr = k_desc.dtype
    q_smem = gl.allocate_shared_memory(DT, [2, 64, D], gl.NVMMASharedLayout.get_default_for([64, D], DT))
    k_smem = gl.allocate_shared_memory(DT, [STAGES, TILE, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(DT, [STAGES, TILE, D], v_desc.layout)
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    if FP8:
        vt_smem, p_smem, vt_full, vt_empty, ones_smem = _fp8_buffers(DT, D, TILE, FP8, SOFTMAX)
    else:
        vt_smem = q_smem  # not read
        if SOFTMAX & 2:  # each consumer's row sums, written before its P·V wait (`_attend`'s PV_OVERLAP)
            p_smem = gl.allocate_shared_memory(gl.float32, [2, 64], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        else:
            p_smem = q_smem
        vt_full = turn
        vt_empty = turn
        ones_smem = q_smem  # not read
    for ib in gl.static_range(STAGES):
        mbarrier.init(full.index(ib), count=1)
        mbarrier.init(empty.index(ib), count=3 if FP8 else 2)  # both consumers (fp8: and the producer's transpose)
    for ib in gl.static_range(2):
        mbarrier.init(turn.index(ib), count=1)
    return q_smem, k_smem, v_smem, full, empty, turn, vt_smem, p_smem, vt_full, vt_empty, ones_smem


@gluon.jit
def prefill_gluon_ws_kernel(
    q_ptr, k_desc, v_desc, bt_ptr, seq_lens_ptr, cu_seqlens_q_ptr, out_ptr, sm_scale_log2,
    num_reqs, tiles_per_head, num_kv_heads, bt_width, num_blocks,
    stride_qt, stride_qh, stride_kh, stride_vh, stride_bt, stride_ot, stride_oh,
    q_scale_ptr, stride_qst, stride_qsh, k_scale_ptr, v_scale_ptr,
    D: gl.constexpr, G: gl.constexpr, TILE: gl.constexpr, PAGE: gl.constexpr, BLOCK_B: gl.constexpr,
    STAGES: gl.constexpr, HEADS_INNER: gl.constexpr, CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr,
    FP8: gl.constexpr = 0, FP8_CONSUMER_REGS: gl.constexpr = 224, FP8_PRODUCER_REGS: gl.constexpr = 56,
    SOFTMAX: gl.constexpr = 0, TRACE: gl.constexpr = False, trace_ptr=None,
):
    """`prefill_gluon_kernel`'s maths on a 128-row q tile, warp-specialized: launched with num_warps = 4 (the
    default partition, consumer 0) plus a 4-warp worker (consumer 1, CONSUMER_REGS registers) and a 1-warp TMA
    producer (24 registers). FP8 (1; 2 with P in registers, 3 with two P buffers a consumer: `_attend`): an fp8 q
    (per token-head scales) over
    fp8 KV, both GEMMs in fp8, with a 4-warp producer that also transposes V (`_ws_producer_fp8`;
    FP8_CONSUMER_REGS / FP8_PRODUCER_REGS). TRACE: the partitions' `_stamp`s into `trace_ptr` (program = the tile)."""
    gl.static_assert(num_warps == 4, "the default partition is consumer warpgroup 0")
    gl.static_assert(STAGES >= 2, "two K/V buffers at least")
    BLOCK_M: gl.constexpr = 128  # two consumer warpgroups of 64 rows
    TOKENS: gl.constexpr = BLOCK_M // G
    kv_head, req, ok, q_start, q_len, seq_len, ctx_len, first_tok, n = _tile_of(
        cu_seqlens_q_ptr, seq_lens_ptr, num_reqs, tiles_per_head, num_kv_heads, TOKENS, TILE, BLOCK_B, HEADS_INNER,
        num_warps)
    if not ok:
        return

    q_smem, k_smem, v_smem, full, empty, turn, vt_smem, p_smem, vt_full, vt_empty, ones_smem = _ws_buffers(
        k_desc, v_desc, D, TILE, STAGES, FP8, SOFTMAX)
    bt_row = bt_ptr + req.to(gl.int64) * stride_bt
    args = (q_ptr, out_ptr, k_desc, v_desc, q_smem, k_smem, v_smem, full, empty, turn, bt_row, bt_width, num_blocks,
            kv_head * stride_kh, kv_head * stride_vh, n, q_start, q_len, first_tok, ctx_len, seq_len, kv_head,
            sm_scale_log2, stride_qt, stride_qh, stride_ot, stride_oh, q_scale_ptr, stride_qst, stride_qsh,
            k_scale_ptr, v_scale_ptr, vt_smem, p_smem, vt_full, vt_empty, ones_smem)
    if FP8:
        gl.warp_specialize([(_ws_consumer0, (args, D, G, TILE, PAGE, STAGES, FP8, SOFTMAX, TRACE, trace_ptr)),
                            (_ws_consumer1, (args, D, G, TILE, PAGE, STAGES, FP8, SOFTMAX, TRACE, trace_ptr)),
                            (_ws_producer_fp8, (args, D, G, TILE, PAGE, STAGES, FP8, SOFTMAX, TRACE, trace_ptr))],
                           [4, 4], [FP8_CONSUMER_REGS, FP8_PRODUCER_REGS])
    else:
        gl.warp_specialize([(_ws_consumer0, (args, D, G, TILE, PAGE, STAGES, FP8, SOFTMAX, TRACE, trace_ptr)),
                            (_ws_consumer1, (args, D, G, TILE, PAGE, STAGES, FP8, SOFTMAX, TRACE, trace_ptr)),
                            (_ws_producer, (args, D, G, TILE, PAGE, STAGES, FP8, TRACE, trace_ptr))], [4, 1],
                           [CONSUMER_REGS, 24])


# ---- persistent fp8 variant (PrefillConfig.gluon_persist): one program an SM walks q tiles -----------------------
# The warp-specialized fp8 kernel launches a program a q tile; one fits an SM (~165 KB of shared memory), so each
# tile's pipeline fill (q load, the first K/V TMA, the first transpose) and drain (the last P·V, the epilogue) leave
# the SM's tensor cores idle. Here a program an SM walks the flat tile list in snake order (wave i forward when even,
# backward when odd: the heaviest-first list then pairs heavy with light tiles); every partition walks the same
# tiles, and the ring, the Vᵀ buffers and the consumers' turns go on across them (`_ring`), so the producer fills the
# next tile's K/V while the consumers finish this one.


@gluon.jit
def _snake(i, pid, nprog):
    """The flat tile of a persistent program's i-th step: wave i, forward on even waves, backward on odd ones."""
    return i * nprog + pid + (i % 2) * (nprog - 1 - 2 * pid)


@gluon.jit
def _ws_persist(args, D: gl.constexpr, G: gl.constexpr, TILE: gl.constexpr, PAGE: gl.constexpr, STAGES: gl.constexpr,
                FP8: gl.constexpr, SOFTMAX: gl.constexpr, BLOCK_B: gl.constexpr, HEADS_INNER: gl.constexpr,
                ROLE: gl.constexpr):
    """A partition of the persistent kernel over the program's q tiles, which every partition walks in the same
    sequence (`_snake`): ROLE 0 / 1 consumer warpgroup ROLE (`_attend`); 2 the fp8 producer warpgroup
    (`_ws_producer_fp8`'s loads and transposes: a tile's first K/V loads go out as soon as the buffers they take are
    released, while the consumers still work on the tile before); 3 the 16-bit producer warp (`_ws_producer`'s)."""
    (q_ptr, out_ptr, k_desc, v_desc, q_smem, k_smem, v_smem, full, empty, turn, bt_ptr, stride_bt, bt_width,
     num_blocks, stride_kh, stride_vh, cu_seqlens_q_ptr, seq_lens_ptr, num_reqs, tiles_per_head, num_kv_heads, c,
     stride_qt, stride_qh, stride_ot, stride_oh, q_scale_ptr, stride_qst, stride_qsh, k_scale_ptr, v_scale_ptr,
     vt_smem, p_smem, vt_full, vt_empty, ones_smem) = args
    if ROLE < 2:
        if FP8 == 3:  # all four P buffers, two a consumer: `_attend` picks 2·WG + tile % 2
            p_bufs = p_smem
        else:
            p_bufs = p_smem.index(ROLE)
    if ROLE == 2:
        if (SOFTMAX & 4) != 0:
            _store_ones(ones_smem, k_desc.dtype, TILE)  # published by the first vt_full
    TOKENS: gl.constexpr = 128 // G
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    bound = tiles_per_head * num_kv_heads
    g0 = pid * 0  # ring steps of this program's earlier tiles
    t0 = pid * 0  # turns of its earlier tiles (a tile of n K/V tiles takes n - 1)
    for i in range(gl.cdiv(bound, nprog)):
        t = _snake(i, pid, nprog)
        kv_head, req, ok, q_start, q_len, seq_len, ctx_len, first_tok, n = _tile_at(
            t, cu_seqlens_q_ptr, seq_lens_ptr, num_reqs, tiles_per_head, num_kv_heads, TOKENS, TILE, BLOCK_B,
            HEADS_INNER, 1 if ROLE == 3 else 4)
        if ok & (t < bound):
            bt_row = bt_ptr + req.to(gl.int64) * stride_bt
            k_col = kv_head * stride_kh
            v_col = kv_head * stride_vh
            if ROLE < 2:
                _attend(q_ptr, out_ptr, k_desc, v_desc, q_smem.index(ROLE), k_smem, v_smem, full, empty, turn, bt_row,
                        bt_width, num_blocks, k_col, v_col, n, q_start, q_len, first_tok, ctx_len, seq_len, kv_head, c,
                        stride_qt, stride_qh, stride_ot, stride_oh,
                        (q_scale_ptr, stride_qst, stride_qsh, k_scale_ptr, v_scale_ptr, vt_smem, p_bufs, vt_full,
                         vt_empty, ones_smem),
                        ROLE * 64, 64, 4, D, G, TILE, PAGE, STAGES, True, ROLE, FP8, SOFTMAX, g0, t0, True)
            elif ROLE == 2:
                _produce_fp8_first(k_desc, v_desc, k_smem, v_smem, full, empty, bt_row, bt_width, num_blocks, k_col,
                                   v_col, n, g0, D, TILE, PAGE, STAGES, True)
                _produce_fp8_steps(k_desc, v_desc, k_smem, v_smem, full, empty, vt_smem, vt_full, vt_empty, bt_row,
                                   bt_width, num_blocks, k_col, v_col, n, seq_len, g0, D, TILE, PAGE, STAGES, FP8,
                                   True, 0, (SOFTMAX & 128) != 0)
            else:
                _produce_tiles(k_desc, v_desc, k_smem, v_smem, full, empty, bt_row, bt_width, num_blocks, k_col,
                               v_col, n, g0, D, TILE, PAGE, STAGES, True)
            g0 += n
            if ROLE < 2:
                t0 += n - 1


@gluon.jit
def _ws_consumer0_persist(args, D: gl.constexpr, G: gl.constexpr, TILE: gl.constexpr, PAGE: gl.constexpr,
                          STAGES: gl.constexpr, FP8: gl.constexpr, SOFTMAX: gl.constexpr, BLOCK_B: gl.constexpr,
                          HEADS_INNER: gl.constexpr):
    _ws_persist(args, D, G, TILE, PAGE, STAGES, FP8, SOFTMAX, BLOCK_B, HEADS_INNER, 0)


@gluon.jit
def _ws_consumer1_persist(args, D: gl.constexpr, G: gl.constexpr, TILE: gl.constexpr, PAGE: gl.constexpr,
                          STAGES: gl.constexpr, FP8: gl.constexpr, SOFTMAX: gl.constexpr, BLOCK_B: gl.constexpr,
                          HEADS_INNER: gl.constexpr):
    _ws_persist(args, D, G, TILE, PAGE, STAGES, FP8, SOFTMAX, BLOCK_B, HEADS_INNER, 1)


@gluon.jit
def _ws_producer_fp8_persist(args, D: gl.constexpr, G: gl.constexpr, TILE: gl.constexpr, PAGE: gl.constexpr,
                             STAGES: gl.constexpr, FP8: gl.constexpr, SOFTMAX: gl.constexpr, BLOCK_B: gl.constexpr,
                             HEADS_INNER: gl.constexpr):
    _ws_persist(args, D, G, TILE, PAGE, STAGES, FP8, SOFTMAX, BLOCK_B, HEADS_INNER, 2)


@gluon.jit
def _ws_producer_persist(args, D: gl.constexpr, G: gl.constexpr, TILE: gl.constexpr, PAGE: gl.constexpr,
                         STAGES: gl.constexpr, FP8: gl.constexpr, SOFTMAX: gl.constexpr, BLOCK_B: gl.constexpr,
                         HEADS_INNER: gl.constexpr):
    _ws_persist(args, D, G, TILE, PAGE, STAGES, FP8, SOFTMAX, BLOCK_B, HEADS_INNER, 3)


@gluon.jit
def prefill_gluon_ws_persist_kernel(
    q_ptr, k_desc, v_desc, bt_ptr, seq_lens_ptr, cu_seqlens_q_ptr, out_ptr, sm_scale_log2,
    num_reqs, tiles_per_head, num_kv_heads, bt_width, num_blocks,
    stride_qt, stride_qh, stride_kh, stride_vh, stride_bt, stride_ot, stride_oh,
    q_scale_ptr, stride_qst, stride_qsh, k_scale_ptr, v_scale_ptr,
    D: gl.constexpr, G: gl.constexpr, TILE: gl.constexpr, PAGE: gl.constexpr, BLOCK_B: gl.constexpr,
    STAGES: gl.constexpr, HEADS_INNER: gl.constexpr, num_warps: gl.constexpr, FP8: gl.constexpr = 1,
    FP8_CONSUMER_REGS: gl.constexpr = 224, FP8_PRODUCER_REGS: gl.constexpr = 56, SOFTMAX: gl.constexpr = 0,
    CONSUMER_REGS: gl.constexpr = 240, PRODUCER_REGS: gl.constexpr = 24,
):
    """`prefill_gluon_ws_kernel` as a persistent grid (a program an SM, each walking q tiles `_snake`'s way): its
    16-bit mode (FP8 0: the 1-warp producer, CONSUMER_REGS / PRODUCER_REGS) or its fp8 mode with P in shared memory
    (FP8 1 or 3); same partitions and shared memory."""
    gl.static_assert(num_warps == 4, "the default partition is consumer warpgroup 0")
    gl.static_assert(STAGES >= 2, "two K/V buffers at least")
    gl.static_assert(FP8 != 2, "P in fp8 registers has no persistent form")
    q_smem, k_smem, v_smem, full, empty, turn, vt_smem, p_smem, vt_full, vt_empty, ones_smem = _ws_buffers(
        k_desc, v_desc, D, TILE, STAGES, FP8, SOFTMAX)
    args = (q_ptr, out_ptr, k_desc, v_desc, q_smem, k_smem, v_smem, full, empty, turn, bt_ptr, stride_bt, bt_width,
            num_blocks, stride_kh, stride_vh, cu_seqlens_q_ptr, seq_lens_ptr, num_reqs, tiles_per_head, num_kv_heads,
            sm_scale_log2, stride_qt, stride_qh, stride_ot, stride_oh, q_scale_ptr, stride_qst, stride_qsh,
            k_scale_ptr, v_scale_ptr, vt_smem, p_smem, vt_full, vt_empty, ones_smem)
    if FP8:
        gl.warp_specialize([(_ws_consumer0_persist, (args, D, G, TILE, PAGE, STAGES, FP8, SOFTMAX, BLOCK_B,
                                                     HEADS_INNER)),
                            (_ws_consumer1_persist, (args, D, G, TILE, PAGE, STAGES, FP8, SOFTMAX, BLOCK_B,
                                                     HEADS_INNER)),
                            (_ws_producer_fp8_persist, (args, D, G, TILE, PAGE, STAGES, FP8, SOFTMAX, BLOCK_B,
                                                        HEADS_INNER))],
                           [4, 4], [FP8_CONSUMER_REGS, FP8_PRODUCER_REGS])
    else:
        gl.warp_specialize([(_ws_consumer0_persist, (args, D, G, TILE, PAGE, STAGES, FP8, SOFTMAX, BLOCK_B,
                                                     HEADS_INNER)),
                            (_ws_consumer1_persist, (args, D, G, TILE, PAGE, STAGES, FP8, SOFTMAX, BLOCK_B,
                                                     HEADS_INNER)),
                            (_ws_producer_persist, (args, D, G, TILE, PAGE, STAGES, FP8, SOFTMAX, BLOCK_B,
                                                    HEADS_INNER))],
                           [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# ---- persistent fp8 variant with a prefetched tile start (PrefillConfig.gluon_prefetch) ------------------------------
# `prefill_gluon_ws_persist_kernel`'s consumers still begin every q tile with a chain of global round trips (the tile's
# metadata, then q and its scales) before their first S, with the tensor cores idle (bench/results
# probe_prefill_tile_cost_*: ~10 µs a q tile for both dtypes at one tile a wave). Here the producer walks the tiles one
# ahead: while the consumers work on tile i it reads tile i+1's metadata, publishes it in shared memory and TMAs its q
# (fp8 rows, G a box: one token's heads) and q scales into a ring of two slots; a consumer starts a tile from shared
# memory alone (`_attend`'s PRE).


@gluon.jit
def _pack8(a0, a1, a2, a3, a4, a5, a6, a7, layout: gl.constexpr):
    """Eight int32 scalars as an [8] vector (a tile's metadata in the prefetch's shared ring)."""
    k = gl.arange(0, 8, layout=layout)
    return (gl.where(k == 0, a0, 0) + gl.where(k == 1, a1, 0) + gl.where(k == 2, a2, 0) + gl.where(k == 3, a3, 0)
            + gl.where(k == 4, a4, 0) + gl.where(k == 5, a5, 0) + gl.where(k == 6, a6, 0) + gl.where(k == 7, a7, 0))


@gluon.jit
def _field(v, K: gl.constexpr, layout: gl.constexpr):
    """Element K of `_pack8`'s vector (every thread holds all eight: no shuffle)."""
    return gl.sum(gl.where(gl.arange(0, 8, layout=layout) == K, v, 0), axis=0)


@gluon.jit
def _take_tile(queue_ptr, bound, nprog):
    """`PrefillConfig.gluon_queue`: the next flat tile from the launch's counter (one relaxed atomic add; Triton
    issues a scalar atomic from one thread and hands its result to the others through shared memory). Every program
    takes tiles until its first take at or past `bound`, so a launch makes exactly bound + nprog takes and the
    last one returns bound + nprog - 1: the program that gets it puts the counter back to 0 for the next launch
    (every other take is already done: no memset, graph-safe)."""
    t = gl.atomic_add(queue_ptr, 1, sem="relaxed")
    if t == bound + nprog - 1:
        gl.atomic_xchg(queue_ptr, 0, sem="relaxed")
    return t


@gluon.jit
def _publish_tile(q_desc, qs_desc, q_ring, qs_ring, info_smem, q_full, q_empty, i, t, bound, cu_seqlens_q_ptr,
                  seq_lens_ptr, num_reqs, tiles_per_head, num_kv_heads, G: gl.constexpr, TILE: gl.constexpr,
                  BLOCK_B: gl.constexpr, HEADS_INNER: gl.constexpr, QUEUE: gl.constexpr = False):
    """The producer's prefetch of the program's i-th tile (flat tile t) into ring slot i % 2: once both consumers
    have read the slot's previous tile (`q_empty`), its metadata into `info_smem[slot]` and, for a real tile, q's
    128 rows (one [G, D] box a token, consumer w's 64 rows into `q_ring[2·slot + w]`) and their scales (one
    [TOKENS / 2, G] box a consumer into `qs_ring`) by TMA on `q_full[slot]`. Rows past the request's q_len read the
    next request's (finite; never stored), rows past the last token zeros. The metadata's first field is the
    slot's state: 1 a tile, 0 none (a hole in the flat list, or past the program's last tile), 2 (QUEUE: t at or
    past `bound`) the end of the program's walk. Returns what the producer needs of the tile: (kv_head, req, ok,
    seq_len, n)."""
    TOKENS: gl.constexpr = 128 // G
    HALF: gl.constexpr = TOKENS // 2
    info_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[8], threads_per_warp=[32], warps_per_cta=[4],
                                                 order=[0])
    kv_head, req, ok, q_start, q_len, seq_len, ctx_len, first_tok, n = _tile_at(
        t, cu_seqlens_q_ptr, seq_lens_ptr, num_reqs, tiles_per_head, num_kv_heads, TOKENS, TILE, BLOCK_B,
        HEADS_INNER, 4)
    ok = ok & (t < bound)
    slot = i % 2
    mbarrier.wait(q_empty.index(slot), ((i // 2) & 1) ^ 1)  # the slot's tile before (i - 2) is read
    state = ok.to(gl.int32)
    if QUEUE:
        state = gl.where(t < bound, state, 2)
    info_smem.index(slot).store(_pack8(state, kv_head, req, q_start, q_len, seq_len, first_tok, n, info_layout))
    gl.thread_barrier()  # the 4 warps' stores before the arrival that publishes them
    Q_BYTES: gl.constexpr = 128 * q_desc.block_type.shape[1] * q_desc.dtype.primitive_bitwidth // 8 + 128 * 4
    bar = q_full.index(slot)
    mbarrier.expect(bar, Q_BYTES, pred=ok)
    mbarrier.arrive(bar, count=1, pred=ok == 0)  # no tile: the metadata alone (ok = 0 ends nothing early)
    tok0 = q_start + first_tok
    head0 = kv_head * G
    hq = num_kv_heads * G
    for tok in gl.static_range(TOKENS):
        tma.async_copy_global_to_shared(q_desc, [(tok0 + tok) * hq + head0, 0], bar,
                                        q_ring.index(2 * slot + tok // HALF).slice((tok % HALF) * G, G), pred=ok)
    for w in gl.static_range(2):
        tma.async_copy_global_to_shared(qs_desc, [tok0 + w * HALF, head0], bar, qs_ring.index(2 * slot + w),
                                        pred=ok)
    return kv_head, req, ok, seq_len, n


@gluon.jit
def _prefetch_produce(args, i, cur, g0, pid, nprog, bound, D: gl.constexpr, G: gl.constexpr, TILE: gl.constexpr,
                      PAGE: gl.constexpr, STAGES: gl.constexpr, FP8: gl.constexpr, BLOCK_B: gl.constexpr,
                      HEADS_INNER: gl.constexpr, QUEUE: gl.constexpr, PRMT: gl.constexpr, TRACE: gl.constexpr = False,
                      trace_ptr=None):
    """The producer's step i of `_ws_prefetch`: tile `cur` = (kv_head, req, ok, seq_len, n), already published.
    Its first K/V loads and first Vᵀ (what the consumers need first), then the next tile (the snake's next, or
    QUEUE the counter's) published into the other slot, then the tile's other steps. Returns (the next tile's
    flat index, the next tile's `cur`, g0 past this tile)."""
    (q_ptr, out_ptr, k_desc, v_desc, q_desc, qs_desc, q_ring, qs_ring, info_smem, q_full, q_empty, k_smem, v_smem,
     full, empty, turn, bt_ptr, stride_bt, bt_width, num_blocks, stride_kh, stride_vh, cu_seqlens_q_ptr,
     seq_lens_ptr, num_reqs, tiles_per_head, num_kv_heads, c, stride_qt, stride_qh, stride_ot, stride_oh,
     q_scale_ptr, stride_qst, stride_qsh, k_scale_ptr, v_scale_ptr, vt_smem, p_smem, vt_full, vt_empty,
     ones_smem, queue_ptr) = args
    kv_head, req, ok, seq_len, n = cur
    trace = (trace_ptr, pid, i)
    _stamp(trace, 2, 0, 0, TRACE)
    bt_row = bt_ptr + req.to(gl.int64) * stride_bt
    k_col = kv_head * stride_kh
    v_col = kv_head * stride_vh
    if ok:
        _produce_fp8_first(k_desc, v_desc, k_smem, v_smem, full, empty, bt_row, bt_width, num_blocks, k_col, v_col,
                           n, g0, D, TILE, PAGE, STAGES, True)
        _produce_fp8_steps(k_desc, v_desc, k_smem, v_smem, full, empty, vt_smem, vt_full, vt_empty, bt_row,
                           bt_width, num_blocks, k_col, v_col, n, seq_len, g0, D, TILE, PAGE, STAGES, FP8, True, 1,
                           PRMT, TRACE, trace)
    # the snake: a tile past the program's last is published as no tile (the consumers never read it)
    if QUEUE:
        t = _take_tile(queue_ptr, bound, nprog)
    else:
        t = _snake(i + 1, pid, nprog)
    nxt = _publish_tile(q_desc, qs_desc, q_ring, qs_ring, info_smem, q_full, q_empty, i + 1, t, bound,
                        cu_seqlens_q_ptr, seq_lens_ptr, num_reqs, tiles_per_head, num_kv_heads, G, TILE, BLOCK_B,
                        HEADS_INNER, QUEUE)
    _stamp(trace, 2, 1, 0, TRACE)
    if ok:
        _produce_fp8_steps(k_desc, v_desc, k_smem, v_smem, full, empty, vt_smem, vt_full, vt_empty, bt_row,
                           bt_width, num_blocks, k_col, v_col, n, seq_len, g0, D, TILE, PAGE, STAGES, FP8, True, 2,
                           PRMT, TRACE, trace)
        g0 += n
    return t, nxt, g0


@gluon.jit
def _prefetch_consume(args, i, g0, t0, k_scale, v_scale, p_bufs, D: gl.constexpr, G: gl.constexpr,
                      TILE: gl.constexpr, PAGE: gl.constexpr, STAGES: gl.constexpr, FP8: gl.constexpr,
                      SOFTMAX: gl.constexpr, ROLE: gl.constexpr, TRACE: gl.constexpr = False, trace_ptr=None):
    """Consumer ROLE's step i of `_ws_prefetch`: the slot's state, metadata, q and scales from the ring, then the
    tile (`_attend`) if the state is 1. Returns (state, g0, t0) past it."""
    (q_ptr, out_ptr, k_desc, v_desc, q_desc, qs_desc, q_ring, qs_ring, info_smem, q_full, q_empty, k_smem, v_smem,
     full, empty, turn, bt_ptr, stride_bt, bt_width, num_blocks, stride_kh, stride_vh, cu_seqlens_q_ptr,
     seq_lens_ptr, num_reqs, tiles_per_head, num_kv_heads, c, stride_qt, stride_qh, stride_ot, stride_oh,
     q_scale_ptr, stride_qst, stride_qsh, k_scale_ptr, v_scale_ptr, vt_smem, p_smem, vt_full, vt_empty,
     ones_smem, queue_ptr) = args
    info_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[8], threads_per_warp=[32], warps_per_cta=[4],
                                                 order=[0])
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, TILE, 32])
    q_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=4)
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    slot = i % 2
    mbarrier.wait(q_full.index(slot), (i // 2) & 1)
    v = info_smem.index(slot).load(info_layout)
    state = _field(v, 0, info_layout)
    if state == 1:
        kv_head = _field(v, 1, info_layout)
        req = _field(v, 2, info_layout)
        q_start = _field(v, 3, info_layout)
        q_len = _field(v, 4, info_layout)
        seq_len = _field(v, 5, info_layout)
        first_tok = _field(v, 6, info_layout)
        n = _field(v, 7, info_layout)
        q_op = q_ring.index(2 * slot + ROLE).load(q_layout)
        qs = qs_ring.index(2 * slot + ROLE)._reinterpret(gl.float32, [64], flat).load(gl.SliceLayout(1, s_layout))
        mbarrier.arrive(q_empty.index(slot), count=1)  # this consumer's q is in registers
        bt_row = bt_ptr + req.to(gl.int64) * stride_bt
        _attend(q_ptr, out_ptr, k_desc, v_desc, q_ring.index(ROLE), k_smem, v_smem, full, empty, turn,
                bt_row, bt_width, num_blocks, kv_head * stride_kh, kv_head * stride_vh, n, q_start, q_len,
                first_tok, seq_len - q_len, seq_len, kv_head, c, stride_qt, stride_qh, stride_ot, stride_oh,
                (q_scale_ptr, stride_qst, stride_qsh, k_scale_ptr, v_scale_ptr, vt_smem, p_bufs, vt_full,
                 vt_empty, ones_smem),
                ROLE * 64, 64, 4, D, G, TILE, PAGE, STAGES, True, ROLE, FP8, SOFTMAX, g0, t0, True,
                True, (q_op, qs, k_scale, v_scale), TRACE, (trace_ptr, gl.program_id(0), i))
        g0 += n
        t0 += n - 1
    else:
        mbarrier.arrive(q_empty.index(slot), count=1)
    return state, g0, t0


@gluon.jit
def _ws_prefetch(args, D: gl.constexpr, G: gl.constexpr, TILE: gl.constexpr, PAGE: gl.constexpr,
                 STAGES: gl.constexpr, FP8: gl.constexpr, SOFTMAX: gl.constexpr, BLOCK_B: gl.constexpr,
                 HEADS_INNER: gl.constexpr, QUEUE: gl.constexpr, ROLE: gl.constexpr, TRACE: gl.constexpr = False,
                 trace_ptr=None):
    """A partition of `prefill_gluon_ws_prefetch_kernel`: ROLE 0 / 1 consumer warpgroup ROLE, 2 the producer
    warpgroup. The producer publishes tile i+1 (`_publish_tile`) after tile i's first K/V loads and first Vᵀ (the
    consumers' first needs: the next tile's metadata load would delay them), before its other steps; the consumers
    read tile i from the ring. Without QUEUE every partition walks the program's tiles as `_ws_persist`'s do (a
    fixed number of steps); with QUEUE (`PrefillConfig.gluon_queue`) the producer takes each next tile from the
    launch's counter (`_take_tile`), and the consumers walk until the slot they read says the end (state 2)."""
    (q_ptr, out_ptr, k_desc, v_desc, q_desc, qs_desc, q_ring, qs_ring, info_smem, q_full, q_empty, k_smem, v_smem,
     full, empty, turn, bt_ptr, stride_bt, bt_width, num_blocks, stride_kh, stride_vh, cu_seqlens_q_ptr,
     seq_lens_ptr, num_reqs, tiles_per_head, num_kv_heads, c, stride_qt, stride_qh, stride_ot, stride_oh,
     q_scale_ptr, stride_qst, stride_qsh, k_scale_ptr, v_scale_ptr, vt_smem, p_smem, vt_full, vt_empty,
     ones_smem, queue_ptr) = args
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    bound = tiles_per_head * num_kv_heads
    g0 = pid * 0  # ring steps of this program's earlier tiles
    if ROLE == 2:
        if (SOFTMAX & 4) != 0:
            _store_ones(ones_smem, k_desc.dtype, TILE)  # published by the first vt_full
        if QUEUE:
            t = _take_tile(queue_ptr, bound, nprog)
        else:
            t = _snake(0, pid, nprog)
        cur = _publish_tile(q_desc, qs_desc, q_ring, qs_ring, info_smem, q_full, q_empty, 0, t, bound,
                            cu_seqlens_q_ptr, seq_lens_ptr, num_reqs, tiles_per_head, num_kv_heads, G, TILE, BLOCK_B,
                            HEADS_INNER, QUEUE)
        if QUEUE:  # until the counter passes the list (the end is published by the step that took it)
            i = pid * 0
            while t < bound:
                t, cur, g0 = _prefetch_produce(args, i, cur, g0, pid, nprog, bound, D, G, TILE, PAGE, STAGES, FP8,
                                               BLOCK_B, HEADS_INNER, QUEUE, (SOFTMAX & 128) != 0, TRACE, trace_ptr)
                i += 1
        else:
            for i in range(gl.cdiv(bound, nprog)):
                t, cur, g0 = _prefetch_produce(args, i, cur, g0, pid, nprog, bound, D, G, TILE, PAGE, STAGES, FP8,
                                               BLOCK_B, HEADS_INNER, QUEUE, (SOFTMAX & 128) != 0, TRACE, trace_ptr)
    else:
        if FP8 == 3:  # all four P buffers, two a consumer: `_attend` picks 2·WG + tile % 2
            p_bufs = p_smem
        else:
            p_bufs = p_smem.index(ROLE)
        k_scale = gl.load(k_scale_ptr)  # once a program
        v_scale = gl.load(v_scale_ptr)
        t0 = pid * 0  # turns of its earlier tiles (a tile of n K/V tiles takes n - 1)
        if QUEUE:
            i = pid * 0
            state = pid * 0
            while state != 2:
                state, g0, t0 = _prefetch_consume(args, i, g0, t0, k_scale, v_scale, p_bufs, D, G, TILE, PAGE,
                                                  STAGES, FP8, SOFTMAX, ROLE, TRACE, trace_ptr)
                i += 1
        else:
            for i in range(gl.cdiv(bound, nprog)):
                state, g0, t0 = _prefetch_consume(args, i, g0, t0, k_scale, v_scale, p_bufs, D, G, TILE, PAGE,
                                                  STAGES, FP8, SOFTMAX, ROLE, TRACE, trace_ptr)


@gluon.jit
def _ws_consumer0_prefetch(args, D: gl.constexpr, G: gl.constexpr, TILE: gl.constexpr, PAGE: gl.constexpr,
                           STAGES: gl.constexpr, FP8: gl.constexpr, SOFTMAX: gl.constexpr, BLOCK_B: gl.constexpr,
                           HEADS_INNER: gl.constexpr, QUEUE: gl.constexpr, TRACE: gl.constexpr = False, trace_ptr=None):
    _ws_prefetch(args, D, G, TILE, PAGE, STAGES, FP8, SOFTMAX, BLOCK_B, HEADS_INNER, QUEUE, 0, TRACE, trace_ptr)


@gluon.jit
def _ws_consumer1_prefetch(args, D: gl.constexpr, G: gl.constexpr, TILE: gl.constexpr, PAGE: gl.constexpr,
                           STAGES: gl.constexpr, FP8: gl.constexpr, SOFTMAX: gl.constexpr, BLOCK_B: gl.constexpr,
                           HEADS_INNER: gl.constexpr, QUEUE: gl.constexpr, TRACE: gl.constexpr = False, trace_ptr=None):
    _ws_prefetch(args, D, G, TILE, PAGE, STAGES, FP8, SOFTMAX, BLOCK_B, HEADS_INNER, QUEUE, 1, TRACE, trace_ptr)


@gluon.jit
def _ws_producer_prefetch(args, D: gl.constexpr, G: gl.constexpr, TILE: gl.constexpr, PAGE: gl.constexpr,
                          STAGES: gl.constexpr, FP8: gl.constexpr, SOFTMAX: gl.constexpr, BLOCK_B: gl.constexpr,
                          HEADS_INNER: gl.constexpr, QUEUE: gl.constexpr, TRACE: gl.constexpr = False, trace_ptr=None):
    _ws_prefetch(args, D, G, TILE, PAGE, STAGES, FP8, SOFTMAX, BLOCK_B, HEADS_INNER, QUEUE, 2, TRACE, trace_ptr)


@gluon.jit
def prefill_gluon_ws_prefetch_kernel(
    q_ptr, k_desc, v_desc, bt_ptr, seq_lens_ptr, cu_seqlens_q_ptr, out_ptr, sm_scale_log2,
    num_reqs, tiles_per_head, num_kv_heads, bt_width, num_blocks,
    stride_qt, stride_qh, stride_kh, stride_vh, stride_bt, stride_ot, stride_oh,
    q_scale_ptr, stride_qst, stride_qsh, k_scale_ptr, v_scale_ptr, q_desc, qs_desc, queue_ptr,
    D: gl.constexpr, G: gl.constexpr, TILE: gl.constexpr, PAGE: gl.constexpr, BLOCK_B: gl.constexpr,
    STAGES: gl.constexpr, HEADS_INNER: gl.constexpr, num_warps: gl.constexpr, FP8: gl.constexpr = 1,
    FP8_CONSUMER_REGS: gl.constexpr = 216, FP8_PRODUCER_REGS: gl.constexpr = 72, SOFTMAX: gl.constexpr = 0,
    QUEUE: gl.constexpr = False, TRACE: gl.constexpr = False, trace_ptr=None,
):
    """`prefill_gluon_ws_persist_kernel`'s fp8 mode (q in registers) with the producer prefetching each tile's
    metadata, q and q scales (`_ws_prefetch`): `q_desc` over q as [tokens·heads, D] (box [G, D]), `qs_desc` over
    q_scale [tokens, heads] (box [128 / G / 2, G]). Its own shared memory beside `_ws_buffers`': two slots of q
    (both consumers' 64 rows), scales and metadata, and their `q_full` / `q_empty` mbarriers. QUEUE
    (`PrefillConfig.gluon_queue`): the tiles from the int32 counter at `queue_ptr` (0 at launch, 0 again after it;
    `_take_tile`) instead of the snake's fixed walk; without it `queue_ptr` is not read. TRACE: the partitions'
    `_stamp`s into `trace_ptr`."""
    gl.static_assert(num_warps == 4, "the default partition is consumer warpgroup 0")
    gl.static_assert(FP8 == 1 or FP8 == 3, "fp8 with P in shared memory")
    gl.static_assert((SOFTMAX & 32) != 0, "q in registers (gluon_q_regs)")
    gl.static_assert(G % 8 == 0 and 64 % G == 0, "q boxes of whole 8-row swizzle atoms (G = 8, 16, 32, 64)")
    q_smem, k_smem, v_smem, full, empty, turn, vt_smem, p_smem, vt_full, vt_empty, ones_smem = _ws_buffers(
        k_desc, v_desc, D, TILE, STAGES, FP8, SOFTMAX)
    q_ring = gl.allocate_shared_memory(q_desc.dtype, [4, 64, D], q_desc.layout)
    qs_ring = gl.allocate_shared_memory(gl.float32, [4, 64 // G, G], qs_desc.layout)
    info_smem = gl.allocate_shared_memory(gl.int32, [2, 8], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    q_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for ib in gl.static_range(2):
        mbarrier.init(q_full.index(ib), count=1)
        mbarrier.init(q_empty.index(ib), count=2)  # both consumers
    args = (q_ptr, out_ptr, k_desc, v_desc, q_desc, qs_desc, q_ring, qs_ring, info_smem, q_full, q_empty, k_smem,
            v_smem, full, empty, turn, bt_ptr, stride_bt, bt_width, num_blocks, stride_kh, stride_vh,
            cu_seqlens_q_ptr, seq_lens_ptr, num_reqs, tiles_per_head, num_kv_heads, sm_scale_log2, stride_qt,
            stride_qh, stride_ot, stride_oh, q_scale_ptr, stride_qst, stride_qsh, k_scale_ptr, v_scale_ptr, vt_smem,
            p_smem, vt_full, vt_empty, ones_smem, queue_ptr)
    gl.warp_specialize([(_ws_consumer0_prefetch, (args, D, G, TILE, PAGE, STAGES, FP8, SOFTMAX, BLOCK_B,
                                                  HEADS_INNER, QUEUE, TRACE, trace_ptr)),
                        (_ws_consumer1_prefetch, (args, D, G, TILE, PAGE, STAGES, FP8, SOFTMAX, BLOCK_B,
                                                  HEADS_INNER, QUEUE, TRACE, trace_ptr)),
                        (_ws_producer_prefetch, (args, D, G, TILE, PAGE, STAGES, FP8, SOFTMAX, BLOCK_B,
                                                 HEADS_INNER, QUEUE, TRACE, trace_ptr))],
                       [4, 4], [FP8_CONSUMER_REGS, FP8_PRODUCER_REGS])
