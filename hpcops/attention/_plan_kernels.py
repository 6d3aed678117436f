"""Triton kernel of the decode plan (the assign step). Only @triton.jit code lives here."""

import triton
import triton.language as tl


@triton.jit
def plan_decode_kernel(
    seq_lens_ptr, cum_ptr, header_ptr, first_b_ptr, last_b_ptr,
    B, num_kv_heads, num_programs, min_tiles,
    TILE: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Tiles per request, their prefix sums, the bucket size, and each program's first/last request.

    Every program recomputes the prefix sums (O(B) loads), then serves BLOCK_C programs of the plan;
    program 0 of this grid writes `cum` and the header. No cross-program communication.
    """
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
