"""Triton kernel of the decode plan (the assign step). Only @triton.jit code lives here."""

import triton
import triton.language as tl


@triton.jit
def _tiles_of(seq_lens_ptr, idx, B, TILE: tl.constexpr):
    """[BLOCK_B] tiles per request (0 past the batch); an empty sequence still owns one (empty) tile."""
    n = tl.load(seq_lens_ptr + idx, mask=idx < B, other=0)
    return tl.where(idx < B, tl.maximum((n + TILE - 1) // TILE, 1), 0)


@triton.jit
def _locate(ends, r, LO: tl.constexpr, HI: tl.constexpr):
    """For each stream offset r [C] against one block of inclusive ends [BLOCK_B]: how many ends are
    <= r, and (LO / HI, else 0) the largest of them (0 if none) / the smallest end > r (int32 max if none)."""
    le = ends[None, :] <= r[:, None]  # [C, BLOCK_B]
    cnt = tl.sum(le.to(tl.int32), axis=1)
    lo = cnt * 0
    hi = cnt * 0
    if LO:
        lo = tl.max(tl.where(le, ends[None, :], 0), axis=1)
    if HI:
        hi = tl.min(tl.where(le, 2147483647, ends[None, :]), axis=1)
    return cnt, lo, hi


@triton.jit
def _plan_tables(seq_lens_ptr, cum_ptr, header_ptr, first_b_ptr, last_b_ptr, task_desc_ptr, merge_desc_ptr,
                 B, num_kv_heads, num_programs, min_tiles,
                 TILE: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_C: tl.constexpr, ONE_BLOCK: tl.constexpr,
                 DESC: tl.constexpr):
    """`plan_decode_kernel`'s one-pass (ONE_BLOCK) / descriptor (DESC) form."""
    pid = tl.program_id(0)
    offs_b = tl.arange(0, BLOCK_B)
    BIG: tl.constexpr = 2147483647
    if ONE_BLOCK:
        tiles = _tiles_of(seq_lens_ptr, offs_b, B, TILE)
        incl0 = tl.cumsum(tiles, axis=0)
        if pid == 0:
            tl.store(cum_ptr + 1 + offs_b, incl0, mask=offs_b < B)
        s_total = tl.sum(tiles, axis=0)
    else:
        s_total = B * 0
        for start in range(0, B, BLOCK_B):
            idx = start + offs_b
            tiles = _tiles_of(seq_lens_ptr, idx, B, TILE)
            incl = tl.cumsum(tiles, axis=0) + s_total
            if pid == 0:
                tl.store(cum_ptr + 1 + idx, incl, mask=idx < B)
            s_total += tl.sum(tiles, axis=0)
    total = s_total * num_kv_heads
    bucket = tl.maximum((total + num_programs - 1) // num_programs, min_tiles)
    if pid == 0:
        tl.store(cum_ptr, 0)
        tl.store(header_ptr + 0, bucket)
        tl.store(header_ptr + 1, s_total)
        tl.store(header_ptr + 2, total)
        tl.store(header_ptr + 3, (total + bucket - 1) // bucket)
    # for each of this program's plan entries, the request holding its first and last tile
    offs_c = pid * BLOCK_C + tl.arange(0, BLOCK_C)
    p_first = offs_c * bucket
    active = (offs_c < num_programs) & (p_first < total)
    p_last = tl.minimum(p_first + bucket, total) - 1
    safe_s = tl.maximum(s_total, 1)
    h_first = p_first // safe_s
    h_last = p_last // safe_s
    r_first = p_first - h_first * safe_s
    r_last = p_last - h_last * safe_s
    if ONE_BLOCK:
        ends = tl.where(offs_b < B, incl0, BIG)
        cnt_first, lo_first, _ = _locate(ends, r_first, DESC, False)
        cnt_last, lo_last, hi_last = _locate(ends, r_last, DESC, DESC)
    else:
        cnt_first = tl.zeros([BLOCK_C], dtype=tl.int32)
        cnt_last = tl.zeros([BLOCK_C], dtype=tl.int32)
        lo_first = tl.zeros([BLOCK_C], dtype=tl.int32)
        lo_last = tl.zeros([BLOCK_C], dtype=tl.int32)
        hi_last = tl.full([BLOCK_C], BIG, tl.int32)
        carry = B * 0
        for start in range(0, B, BLOCK_B):
            idx = start + offs_b
            tiles = _tiles_of(seq_lens_ptr, idx, B, TILE)
            incl = tl.cumsum(tiles, axis=0) + carry  # [BLOCK_B] inclusive ends
            ends = tl.where(idx < B, incl, BIG)
            # request b holds stream offset r iff cum[b] <= r < cum[b+1]: count the ends <= r
            c1, l1, _ = _locate(ends, r_first, DESC, False)
            c2, l2, h2 = _locate(ends, r_last, DESC, DESC)
            cnt_first += c1
            cnt_last += c2
            lo_first = tl.maximum(lo_first, l1)
            lo_last = tl.maximum(lo_last, l2)
            hi_last = tl.minimum(hi_last, h2)
            carry += tl.sum(tiles, axis=0)
    c_ok = offs_c < num_programs
    tl.store(first_b_ptr + offs_c, tl.where(active, cnt_first, -1), mask=c_ok)
    tl.store(last_b_ptr + offs_c, tl.where(active, cnt_last, -1), mask=c_ok)
    if DESC:
        # task descriptor: where the program starts (request, head, tile in the request), its length in tiles
        td = task_desc_ptr + offs_c * 8
        tl.store(td + 0, tl.where(active, cnt_first, -1), mask=c_ok)
        tl.store(td + 1, tl.where(active, h_first, 0), mask=c_ok)
        tl.store(td + 2, tl.where(active, r_first - lo_first, 0), mask=c_ok)
        tl.store(td + 3, tl.where(active, p_last + 1 - p_first, 0), mask=c_ok)
        # merge descriptor: the split (head, request) that starts in this program's bucket and leaves it
        pair_lo = h_last * safe_s + lo_last
        pair_hi = h_last * safe_s + hi_last
        first = pair_lo // bucket
        last = (pair_hi - 1) // bucket
        merge = active & (first == offs_c) & (last > first)
        md = merge_desc_ptr + offs_c * 4
        tl.store(md + 0, tl.where(merge, cnt_last, -1), mask=c_ok)
        tl.store(md + 1, tl.where(merge, h_last, 0), mask=c_ok)
        tl.store(md + 2, tl.where(merge, 2 * offs_c + tl.where(pair_lo == offs_c * bucket, 0, 1), 0), mask=c_ok)
        tl.store(md + 3, tl.where(merge, last - first + 1, 0), mask=c_ok)


@triton.jit
def plan_decode_kernel(
    seq_lens_ptr, cum_ptr, header_ptr, first_b_ptr, last_b_ptr, task_desc_ptr, merge_desc_ptr,
    B, num_kv_heads, num_programs, min_tiles,
    TILE: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_C: tl.constexpr, ONE_BLOCK: tl.constexpr = False,
    DESC: tl.constexpr = False,
):
    """Tiles per request, their prefix sums, the bucket size, each program's first/last request, and
    (DESC) the per-program descriptors (see plan.py).

    Every program computes the prefix sums (O(B) loads), then serves BLOCK_C programs of the plan
    with a dense [BLOCK_C, BLOCK_B] compare-count per block of requests; program 0 of this grid
    writes `cum` and the header. No cross-program communication. Without ONE_BLOCK or DESC: two
    passes over the requests (the prefix sums, then the compare-count; the launch the H200 results
    measured). ONE_BLOCK (B <= BLOCK_B): one load and one scan, kept in registers for the compare.
    DESC: also the task and merge descriptors (3 more reductions of the compare tile).
    """
    if ONE_BLOCK or DESC:
        _plan_tables(seq_lens_ptr, cum_ptr, header_ptr, first_b_ptr, last_b_ptr, task_desc_ptr, merge_desc_ptr,
                     B, num_kv_heads, num_programs, min_tiles, TILE, BLOCK_B, BLOCK_C, ONE_BLOCK, DESC)
    else:
        pid = tl.program_id(0)
        offs_b = tl.arange(0, BLOCK_B)
        # pass 1: S = total tiles of one kv head
        s_total = B * 0
        for start in range(0, B, BLOCK_B):
            idx = start + offs_b
            n = tl.load(seq_lens_ptr + idx, mask=idx < B, other=0)
            tiles = tl.maximum((n + TILE - 1) // TILE, 1)  # an empty sequence still owns one (empty) tile
            tiles = tl.where(idx < B, tiles, 0)
            incl = tl.cumsum(tiles, axis=0) + s_total
            if pid == 0:
                tl.store(cum_ptr + 1 + idx, incl, mask=idx < B)
            s_total += tl.sum(tiles, axis=0)
        total = s_total * num_kv_heads
        bucket = tl.maximum((total + num_programs - 1) // num_programs, min_tiles)
        if pid == 0:
            tl.store(cum_ptr, 0)
            tl.store(header_ptr + 0, bucket)
            tl.store(header_ptr + 1, s_total)
            tl.store(header_ptr + 2, total)
            tl.store(header_ptr + 3, (total + bucket - 1) // bucket)
        # pass 2: for each of this program's plan entries, the request holding its first and last tile
        offs_c = pid * BLOCK_C + tl.arange(0, BLOCK_C)
        p_first = offs_c * bucket
        active = (offs_c < num_programs) & (p_first < total)
        p_last = tl.minimum(p_first + bucket, total) - 1
        safe_s = tl.maximum(s_total, 1)
        r_first = p_first - (p_first // safe_s) * safe_s
        r_last = p_last - (p_last // safe_s) * safe_s
        cnt_first = tl.zeros([BLOCK_C], dtype=tl.int32)
        cnt_last = tl.zeros([BLOCK_C], dtype=tl.int32)
        carry = B * 0
        for start in range(0, B, BLOCK_B):
            idx = start + offs_b
            n = tl.load(seq_lens_ptr + idx, mask=idx < B, other=0)
            tiles = tl.where(idx < B, tl.maximum((n + TILE - 1) // TILE, 1), 0)
            incl = tl.cumsum(tiles, axis=0) + carry  # [BLOCK_B] inclusive ends
            ends = tl.where(idx < B, incl, 2147483647)
            # request b holds stream offset r iff cum[b] <= r < cum[b+1]: count the ends <= r
            cnt_first += tl.sum((ends[None, :] <= r_first[:, None]).to(tl.int32), axis=1)
            cnt_last += tl.sum((ends[None, :] <= r_last[:, None]).to(tl.int32), axis=1)
            carry += tl.sum(tiles, axis=0)
        tl.store(first_b_ptr + offs_c, tl.where(active, cnt_first, -1), mask=offs_c < num_programs)
        tl.store(last_b_ptr + offs_c, tl.where(active, cnt_last, -1), mask=offs_c < num_programs)
