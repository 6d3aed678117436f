"""Triton kernel of the decode plan (the assign step). Only @triton.jit code lives here."""

import triton
import triton.language as tl


@triton.jit
def _tiles_of(seq_lens_ptr, idx, B, TILE: tl.constexpr):
    """[BLOCK_B] tiles per request (0 past the batch); an empty sequence still owns one (empty) tile."""
    n = tl.load(seq_lens_ptr + idx, mask=idx < B, other=0)
    return tl.where(idx < B, tl.maximum((n + TILE - 1) // TILE, 1), 0)


@triton.jit
def _locate(starts, r, BLOCK_B: tl.constexpr):
    """For each stream offset r [C] against one block of increasing starts [BLOCK_B] (int32 max past
    the batch): how many are <= r (one reduction of the [C, BLOCK_B] compare), the largest of them (0 if
    none) and the smallest one > r (int32 max if none), both gathered by that count."""
    cnt = tl.sum((starts[None, :] <= r[:, None]).to(tl.int32), axis=1)
    lo = tl.where(cnt > 0, tl.gather(starts, tl.maximum(cnt - 1, 0), axis=0), 0)
    hi = tl.gather(starts, tl.minimum(cnt, BLOCK_B - 1), axis=0)
    hi = tl.where(cnt < BLOCK_B, hi, 2147483647)
    return cnt, lo, hi


@triton.jit
def _starts_of(incl, tiles, idx, B, unit, task_cost):
    """Where each request's first tile starts in one kv head's cost stream (int32 max past the batch)."""
    return tl.where(idx < B, unit * (incl - tiles) + task_cost * (idx + 1), 2147483647)


@triton.jit
def _snapped(before, t, unit, snap):
    """A cut leaving `before` of a request's t tiles on its left: moved to the request's nearer boundary
    when the piece on that side is at most `snap` cost units (the left piece first on a tie)."""
    split = (before > 0) & (before < t)
    down = split & (before * unit <= snap) & (before <= t - before)
    up = split & (~down) & ((t - before) * unit <= snap)
    return tl.where(down, 0, tl.where(up, t, before))


@triton.jit
def _in_stream(x, cnt, lo, hi, s_cost, s_total, unit, task_cost, snap):
    """Cost positions x [C] with (cnt, lo, hi) = `_locate(starts, x mod s_cost − 1)`: x's kv head, the
    request b* whose first tile is the last to start before x (cnt = b* + 1; 0: none in this head),
    b*'s first tile in the head (cum[b*]), its end (cum[b*+1]), and the tiles of b* left of the
    (snapped) cut."""
    h = x // s_cost
    r = x - h * s_cost
    bs = cnt - 1
    cum_b = (lo - task_cost * (bs + 1)) // unit
    cum_next = tl.where(hi == 2147483647, s_total, (hi - task_cost * (bs + 2)) // unit)
    before = tl.minimum((r - lo + unit - 1) // unit, cum_next - cum_b)
    before = tl.where(cnt > 0, _snapped(before, cum_next - cum_b, unit, snap), 0)
    return h, bs, cum_b, cum_next, before


@triton.jit
def plan_decode_kernel(
    seq_lens_ptr, cum_ptr, header_ptr, first_b_ptr, last_b_ptr, task_desc_ptr, merge_desc_ptr, pair_desc_ptr,
    merge_sem_ptr, B, num_kv_heads, num_programs, min_tiles, unit, task_cost, snap, split_cost, num_sms,
    TILE: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_C: tl.constexpr, ONE_BLOCK: tl.constexpr = False,
    DESC: tl.constexpr = False, PAIRS: tl.constexpr = False, SLICES: tl.constexpr = 1,
):
    """Tiles per request, their prefix sums, the bucket, each program's first/last request, and (DESC)
    the per-program task and merge descriptors: the cost-stream cut of plan.py (program k runs the
    tiles that start in [k·bucket, (k+1)·bucket) of the cost stream, each cut snapped to a request
    boundary when it would cut off at most `snap` units; with `split_cost` > 0, where a bucket of whole largest
    requests costs its busiest SM (of `num_sms`) at most that much more than the equal one, that bucket and every
    cut at a request boundary: `plan.whole_pays`).

    Every program computes the prefix sums (O(B) loads), then serves BLOCK_C entries of the plan by
    locating both ends of each entry's range among the requests' first-tile starts (one reduction of a
    [BLOCK_C, BLOCK_B] compare per block of requests, the neighbours gathered); program 0 of this grid
    writes `cum` and the header. No cross-program communication. ONE_BLOCK (B <= BLOCK_B): one load and
    one scan, kept in registers for the compare; else the requests are read again, block by block.
    PAIRS (with DESC): each merge also written from the pair's side, pair_desc[head·B + request] = (owning
    program, partials, first slot), for the attention kernel's tail merge; program 0 zeroes the groups' and the
    pairs' counts (merge_sem), which the attention kernels leave at 0: a step starts clean even after an aborted one.
    SLICES (> 1, with DESC; `DecodeConfig.merge_slices`): a split of more than 16 pieces (an unsnapped cut) gets
    merge helpers: the SLICES − 1 programs after its owner, all inside it (nothing of their own to merge), have
    their merge_desc row written as the owner's (the combine kernel's MERGE_SLICES).
    """
    pid = tl.program_id(0)
    offs_b = tl.arange(0, BLOCK_B)
    BIG: tl.constexpr = 2147483647
    if ONE_BLOCK:
        tiles0 = _tiles_of(seq_lens_ptr, offs_b, B, TILE)
        incl0 = tl.cumsum(tiles0, axis=0)
        if pid == 0:
            tl.store(cum_ptr + 1 + offs_b, incl0, mask=offs_b < B)
        s_total = tl.sum(tiles0, axis=0)
        t_max = tl.max(tiles0, axis=0)
    else:
        s_total = B * 0
        t_max = B * 0
        for start in range(0, B, BLOCK_B):
            idx = start + offs_b
            tiles = _tiles_of(seq_lens_ptr, idx, B, TILE)
            incl = tl.cumsum(tiles, axis=0) + s_total
            if pid == 0:
                tl.store(cum_ptr + 1 + idx, incl, mask=idx < B)
            s_total += tl.sum(tiles, axis=0)
            t_max = tl.maximum(t_max, tl.max(tiles, axis=0))
    s_cost = unit * s_total + task_cost * B
    total = s_cost * num_kv_heads
    bucket = tl.maximum(tl.maximum((total + num_programs - 1) // num_programs, unit * min_tiles), unit + task_cost)
    snap = tl.minimum(snap, bucket // 4)
    c_max = unit * t_max + task_cost  # the largest (head, request)'s cost
    whole = c_max * ((bucket + c_max - 1) // c_max)
    # plan.whole_pays: the busiest SM's load, whole buckets × whole programs an SM against the equal cut's share
    per_sm_whole = whole * (((total - unit) // whole + 1 + num_sms - 1) // num_sms)
    per_sm_split = tl.maximum(bucket, (total + num_sms - 1) // num_sms)
    no_split = (split_cost > 0) & (per_sm_whole <= per_sm_split + split_cost)
    bucket = tl.where(no_split, whole, bucket)
    snap = tl.where(no_split, BIG, snap)
    if PAIRS:
        if pid == 0:
            n_sem = 2 * num_programs + B * num_kv_heads  # the groups' counts, then the pairs'
            for start in range(0, n_sem, BLOCK_B):
                tl.store(merge_sem_ptr + start + offs_b, tl.zeros([BLOCK_B], dtype=tl.int32),
                         mask=start + offs_b < n_sem)
    if pid == 0:
        tl.store(cum_ptr, 0)
        tl.store(header_ptr + 0, bucket)
        tl.store(header_ptr + 1, s_total)
        tl.store(header_ptr + 2, total)
        tl.store(header_ptr + 3, (total - unit) // bucket + 1)
        tl.store(header_ptr + 4, snap)
    # each plan entry's cost range [x0, x1); locate both ends among the requests' first-tile starts
    offs_c = pid * BLOCK_C + tl.arange(0, BLOCK_C)
    x0 = tl.minimum(offs_c * bucket, total)
    x1 = tl.minimum(x0 + bucket, total)
    r0 = x0 - (x0 // s_cost) * s_cost
    r1 = x1 - (x1 // s_cost) * s_cost
    if ONE_BLOCK:
        starts = _starts_of(incl0, tiles0, offs_b, B, unit, task_cost)
        cnt0, lo0, hi0 = _locate(starts, r0 - 1, BLOCK_B)
        cnt1, lo1, hi1 = _locate(starts, r1 - 1, BLOCK_B)
    else:
        cnt0 = tl.zeros([BLOCK_C], dtype=tl.int32)
        cnt1 = tl.zeros([BLOCK_C], dtype=tl.int32)
        lo0 = tl.zeros([BLOCK_C], dtype=tl.int32)
        lo1 = tl.zeros([BLOCK_C], dtype=tl.int32)
        hi0 = tl.full([BLOCK_C], BIG, tl.int32)
        hi1 = tl.full([BLOCK_C], BIG, tl.int32)
        carry = B * 0
        for start in range(0, B, BLOCK_B):
            idx = start + offs_b
            tiles = _tiles_of(seq_lens_ptr, idx, B, TILE)
            incl = tl.cumsum(tiles, axis=0) + carry
            starts = _starts_of(incl, tiles, idx, B, unit, task_cost)
            # blocks come in increasing order: the last block with a start <= r holds the largest, the first
            # with one > r the smallest
            c0, l0, h0 = _locate(starts, r0 - 1, BLOCK_B)
            c1, l1, h1 = _locate(starts, r1 - 1, BLOCK_B)
            cnt0 += c0
            cnt1 += c1
            lo0 = tl.where(c0 > 0, l0, lo0)
            lo1 = tl.where(c1 > 0, l1, lo1)
            hi0 = tl.minimum(hi0, h0)
            hi1 = tl.minimum(hi1, h1)
            carry += tl.sum(tiles, axis=0)
    hd0, b0, cum0, next0, before0 = _in_stream(x0, cnt0, lo0, hi0, s_cost, s_total, unit, task_cost, snap)
    hd1, b1, cum1, next1, before1 = _in_stream(x1, cnt1, lo1, hi1, s_cost, s_total, unit, task_cost, snap)
    g0 = hd0 * s_total + tl.where(cnt0 > 0, cum0 + before0, 0)
    g1 = hd1 * s_total + tl.where(cnt1 > 0, cum1 + before1, 0)
    c_ok = offs_c < num_programs
    active = c_ok & (g1 > g0)
    # the first tile: in b* when it still has tiles from the cut on, else the next request (or head)
    in_b = (cnt0 > 0) & (before0 < next0 - cum0)
    nxt = tl.where(cnt0 > 0, b0 + 1, 0)
    first_req = tl.where(in_b, b0, tl.where(nxt == B, 0, nxt))
    first_head = tl.where(in_b | (nxt < B), hd0, hd0 + 1)
    # the last tile: the last of b* left of the cut (before1 > 0), else the request before b* (b* − 1,
    # or the last request of the previous head), which then ends at the cut
    in_last = (cnt1 > 0) & (before1 > 0)
    prev = tl.where(cnt1 > 0, b1 - 1, -1)  # b* − 1 when the cut left nothing of b* (−1: previous head)
    last_req = tl.where(in_last, b1, tl.where(prev >= 0, prev, B - 1))
    last_head = tl.where(in_last | (prev >= 0), hd1, hd1 - 1)
    tl.store(first_b_ptr + offs_c, tl.where(active, first_req, -1), mask=c_ok)
    tl.store(last_b_ptr + offs_c, tl.where(active, last_req, -1), mask=c_ok)
    if DESC:
        # task descriptor: where the program starts (request, head, tile in the request), its length in tiles
        td = task_desc_ptr + offs_c * 8
        tl.store(td + 0, tl.where(active, first_req, -1), mask=c_ok)
        tl.store(td + 1, tl.where(active, first_head, 0), mask=c_ok)
        tl.store(td + 2, tl.where(active & in_b, before0, 0), mask=c_ok)
        tl.store(td + 3, tl.where(active, g1 - g0, 0), mask=c_ok)
        # the first request's length: the attention program's first tile range without a load level of its own
        tl.store(td + 4, tl.load(seq_lens_ptr + first_req, mask=active, other=0), mask=c_ok)
        # merge descriptor: the split (head, request) P of the last tile, when it starts in this program
        # and leaves it. P's pieces: this program's, then one for each cut inside P; only the last cut
        # inside P can have snapped (to P's end: the others are a bucket or more from both ends).
        pair_cum = tl.where(in_last, cum1, lo1 * 0)
        pair_tiles = tl.where(in_last, next1 - cum1, 0)
        p_lo = tl.where(in_last, hd1 * s_total + cum1, 0)
        p_hi = tl.where(in_last, hd1 * s_total + next1, 0)
        pos = hd1 * s_cost + unit * pair_cum + task_cost * (b1 + 1)  # where P's first tile starts
        last_cut = (pos + unit * (pair_tiles - 1)) // bucket  # the last cut left of P's last tile start
        x_last = last_cut * bucket
        cut_before = tl.minimum((x_last - pos + unit - 1) // unit, pair_tiles)
        closed = _snapped(cut_before, pair_tiles, unit, snap) == pair_tiles
        parts = last_cut - offs_c + 1 - tl.where(closed & (last_cut > offs_c), 1, 0)
        merge = active & in_last & (p_lo >= g0) & (p_hi > g1)
        md = merge_desc_ptr + offs_c * 4
        if SLICES > 1:
            # a merge helper: a program inside the split pair P of its first tile (P started before it and goes on
            # after it) among the SLICES − 1 after P's owner, the program of P's first tile (an unsnapped cut)
            h_lo = hd0 * s_total + cum0
            h_hi = hd0 * s_total + next0
            h_pos = hd0 * s_cost + unit * cum0 + task_cost * (b0 + 1)  # where P's first tile starts
            owner = h_pos // bucket
            h_parts = (h_pos + unit * (next0 - cum0 - 1)) // bucket - owner + 1
            # P's partial is the owner's first (slot 2·owner) unless a tile of the owner's starts before P's first
            h_slot = 2 * owner + tl.where(h_pos - task_cost - unit < owner * bucket, 0, 1)
            helper = active & in_b & (h_lo < g0) & (h_hi > g1) & (snap == 0) & (h_parts > 16) & \
                (offs_c - owner < SLICES)
            tl.store(md + 0, tl.where(merge, last_req, tl.where(helper, first_req, -1)), mask=c_ok)
            tl.store(md + 1, tl.where(merge, last_head, tl.where(helper, first_head, 0)), mask=c_ok)
            tl.store(md + 2, tl.where(merge, 2 * offs_c + tl.where(p_lo == g0, 0, 1), tl.where(helper, h_slot, 0)),
                     mask=c_ok)
            tl.store(md + 3, tl.where(merge, parts, tl.where(helper, h_parts, 0)), mask=c_ok)
        else:
            tl.store(md + 0, tl.where(merge, last_req, -1), mask=c_ok)
            tl.store(md + 1, tl.where(merge, last_head, 0), mask=c_ok)
            tl.store(md + 2, tl.where(merge, 2 * offs_c + tl.where(p_lo == g0, 0, 1), 0), mask=c_ok)
            tl.store(md + 3, tl.where(merge, parts, 0), mask=c_ok)
        if PAIRS:
            pd = pair_desc_ptr + (last_head * B + last_req).to(tl.int64) * 4
            tl.store(pd + 0, offs_c, mask=c_ok & merge)
            tl.store(pd + 1, parts, mask=c_ok & merge)
            tl.store(pd + 2, 2 * offs_c + tl.where(p_lo == g0, 0, 1), mask=c_ok & merge)
