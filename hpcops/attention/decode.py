"""Paged decode attention over a load-balanced plan (``schedule="dynamic"``) or a classic static
split-KV grid (``schedule="static"``, the ablation), sharing one inner loop."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace

import torch
import triton

from hpcops import _platform
from hpcops._checks import (
    FP8_E4M3,
    check_block_table_values,
    check_choice,
    check_kernel_device,
    check_scale,
    check_tensor,
    kernels_are_replaced,
    values_checkable,
)
from hpcops._library import register
from hpcops.attention._tma import kv_descriptor, kv_tma_unsupported_reason, tma_unsupported_reason
from hpcops.attention.plan import MAX_Q_LEN, MAX_SPLIT_COST, TILE, DecodePlan, check_plan_matches, plan_decode

SUPPORTED_HEAD_DIMS = (64, 96, 128, 256)
MAX_GQA = 16
LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class DecodeConfig:
    """Launch knobs of the decode kernels (defaults from the H200 sweep, bench/results/decode_sweep.md).

    num_stages: software-pipelining depth of the KV loop; num_warps: None = 4 for D ≤ 128, else 8;
    block_n: keys per step of the KV loop (a multiple of the 64-token tile; 64 or 128);
    combine_chunks: partials merged per round of loads by the combine kernels (one pass, a running
        maximum), at most 8192 / head_dim (padded): a [chunks, head_dim] fp32 tile of 64 registers a thread
        on 4 warps. 64 (was 16 in two passes): a merge of up to 64 partials is one round of loads; merges of
        up to 16 take a 16-partial tile (fewer addresses a program: the H200 had 64 slower there);
    use_tma: load K/V tiles with TMA descriptors where the layout allows it (pages ≥ 64 tokens,
        pages contiguous, 16-byte aligned rows, power-of-two head_dim); elsewhere pointer loads. None
        (default): TMA for a 16-bit KV cache (with lean_mode "tma": 4.4 % faster over the h8/1 sweep,
        bench/results/decode_tune_lean.md, and best at h64/8), pointer loads for fp8 KV (there the lean
        loop's recomputed offsets are level with TMA at h8/1 and 3–9 % faster at h64/8,
        decode_tune_h64_lean.md). True / False: always / never where the layout allows it.
    pdl: launch the combine kernel with programmatic dependent launch (sm90), overlapping its
        launch with the attention kernel's tail: 0.5–8.5% faster in every decode scenario of the H200
        sweep (bench/results/decode_tune_h8.md, decode_tune_h64.md). Never under the interpreter.
    min_rows: the score tile has max(min_rows, next_pow2(q_len·G)) rows. 64 lets 4 warps split rows
        instead of keys, so the softmax reductions stay inside a warp (padded rows cost MMA work).
    task_desc: the persistent kernel starts from the plan's per-program task descriptor (request,
        head, first tile, bucket length: one load level instead of header → first_b → cum/seq_lens)
        and walks on the request lengths alone, loading the next request's length before the current
        task's tiles; the combine reads the plan's per-program merge descriptor instead of
        last_b → header → cum. Dynamic schedule only. On: with lean_loop, 4–20% faster on fp8 KV in the
        H200 sweep; alone within ±1.5% on bf16 KV except 32x0.125K+32x4K h64/8 (3% faster).
    lean_loop: the KV loop runs the tiles every query row sees whole without sequence/causal masks,
        addressed as a scalar page base plus a loop-invariant [BLOCK_N, D] int32 offset tile; only
        the tail (at most 2 tiles: the causal edge, the sequence end) runs the masked step. Applies
        where a step is one tile inside one page (block_n 64, pages ≥ 64 tokens, no TMA); elsewhere
        the masked loop runs as before. Bad page ids are never read in either loop. None (default): on
        for an fp8 KV cache (the H200 sweep: 4–19% faster there), for 16-bit KV read through TMA
        (with lean_mode "tma": 4.4 % faster) and for pages smaller than a step (with lean_pages: 1.16–1.47×
        on 16-bit KV at pages 16 and 32, bench/results/decode-grid_tune_p16.md, _p32.md); off for 16-bit KV on
        pointer loads over pages ≥ 64 (the held and the recomputed offsets measured within ±2 % there).
    lean_mode: how the lean loop addresses its whole tiles (sm90 registers a thread, persistent kernel,
        4 warps, D 128, from ptxas: tests/test_decode_compile.py). "hold" (default): a [BLOCK_N, D]
        int32 offset tile each for K and V, held across the loop (255 on fp8 KV, 249 on bf16: 2
        programs an SM). "recompute": the offset tile rebuilt each step from the step's slots, one
        tile for K and V when their strides are equal (vLLM's layouts) (~190 fp8 KV, ~166 bf16).
        "tma": whole tiles through TMA descriptors (scalar page base; the masked tail as with
        use_tma) where use_tma applies (~128 fp8 KV, ~142 fp8 q, ~105 bf16); elsewhere as
        "recompute". With use_tma on, "hold" and "recompute" leave the lean loop off (the masked TMA
        loop runs, as before "tma" existed). Default "tma" (with use_tma): the H200 sweep
        (bench/results/decode_tune_lean.md) put it 4.3 % ahead of "hold" over the h8/1 cases, never
        behind; "recompute" 2.1 %.
    max_regs: a cap on the attention kernel's registers a thread (ptxas .maxnreg; None: ptxas's
        choice, which takes what the code can use: 255 for the held lean loop). 168 fits 3 programs
        of 4 warps an SM, 128 fits 4. On the lean loop (D 128) ptxas then spills 16–24 bytes, stored
        and reloaded once per task, none inside the KV loops (SASS, Triton 3.6). Off: with 3–4 programs
        an SM (`pps`) it wins up to 16 % on short or mixed batches but loses up to 30 % elsewhere in the
        H200 sweep (bench/results/decode_tune_lean.md).
    lean_pages: the lean loop also over pages smaller than a step (16, 32 tokens, pointer loads): each
        key row of a step takes its page id from one [block_n] load of the block-table row, loaded a step
        ahead, and the whole tiles run without the sequence/causal masks; off: those pages take the masked
        loop. lean_mode does not apply there (the row offsets are rebuilt each step). On: on fp8 KV 1.24×
        at 1x256K+15x2K h8/1 p16, 1.38–1.45× on the grid's p16 corners, level on short batches (the H200
        grid tune, bench/results/decode-grid_tune_p16.md, _p32.md).
    gluon: the dynamic schedule's attention kernel in Gluon on Hopper (`_decode_gluon.py`: TMA-fed K/V tiles, a
        swap-AB wgmma tile with the keys on the MMA's 64-row side, fp8 K never widened) where it applies
        (`gluon_unsupported_reason`: an sm_90 GPU, pages of 8–64 tokens dividing 64 or a multiple of 64, readable by
        TMA (pages under 64 tokens: one TMA box a page), head_dim 64 /
        128 / 256, q_len·G ≤ 16, an fp8 q over fp8 KV or a 16-bit q over the same 16-bit KV, task_desc on);
        elsewhere the `tl` kernel runs. True: wherever it applies; False: never; None (default): where the plan
        was built for it (`DecodePlan.kernel` "gluon": `plan_decode` told an fp8 q over fp8 KV with 2–16 q rows a
        kv head, `plan_kernel`), with the tail merge and 3 programs an SM. Over 16-bit KV, and with the
        combine at 2 programs an SM, the `tl` kernel is as fast or faster (bench/results/decode.md).
    row_path: where a (request, kv head) has one query row (q_len·G == 1: q_len 1 and as many q heads as
        kv heads), its KV loop runs on the CUDA cores instead of padding the row to a min_rows-row MMA
        tile: scores q·k as fp32 products summed over d (K widened to fp32 element by element), the
        online softmax kept per key slot (block_n running maxima, sums and fp32 [block_n, D] accumulator
        rows, each updated alone: no reduction over keys inside the loop), the slots merged into one row
        at the end of each task. Both schedules; K/V through pointer loads (use_tma does not apply);
        lean_loop None means on there, with lean_mode "tma" taken as "recompute". Elsewhere (q_len·G > 1)
        ignored. None (default) = on over fp8 KV, off over 16-bit KV: the H200 grid tune
        (bench/results/decode-grid_tune_gqa1_rows.md) has it 1.09–1.88× faster than the MMA tile on fp8 KV
        (32x8K h8/8 d128 183 -> 135 µs, d256 p16 521 -> 304, 1x256K+15x2K d64 p32 174 -> 93) and 2–16 %
        slower on bf16 KV, where the MMA tile already streams at the copy bandwidth. sm90 registers a thread
        (fp8 KV, D 128, from ptxas: tests/test_decode_compile.py): ~222 on 4 warps (2 programs an SM), 165
        without spills under max_regs 168 (3), ~128 on 8 warps; block_n 128 doubles the slot state (spills).
    tail_merge: the dynamic schedule merges split requests in the attention kernel instead of a combine
        kernel after it: a program that writes a split's partial counts it into the plan's `merge_sem`
        (CTA barrier, then one release/acquire atomic, as a semaphore does), and the one that writes the
        last partial merges them all (`_tail_merge`: every q row at once; the `tl` kernel one partial a step,
        the Gluon kernel rounds of 4096-element tiles) and resets the count. Saves the combine launch and its
        dependent wait (4.2-6.2 µs of 19-38 µs h8/1 steps in the H200 profile). Needs task_desc, and a plan
        built with it on (the plan then also writes `pair_desc`). True: both kernels; False: neither; None
        (default): where the plan wrote the pair table, which it does where it was built for it (`plan_tail`:
        the Gluon kernel, or the `tl` kernel on a 16-bit q over fp8 KV with few programs a kv head). On the H200
        the `tl` kernel + tail is level with its combine over the bench (`hpcops-tail`, geomean 1.006: h64/8
        2-9 % faster, long h8/1 batches up to 14 % slower); the Gluon kernel at 3 programs an SM gains most
        (`hpcops-fp8q` rows at `a686226`: h64/8 fp8 15-23 % faster than the `tl` kernel).
    tail_group: with tail_merge, a split of more partials than this is merged in two levels: groups of
        tail_group consecutive partials, each merged into its first slot by the program that completes it,
        then the groups by the program that completes the last group; so no program merges a long split
        alone (one program merging ~136 partials of 8 rows took ~100 µs in the `tl` kernel and ~20 in the
        Gluon kernel at 1x64K+15x4K h8/1, bench/results/decode_tune_tail_h8.md). None (default): four rounds
        of the merge's tile (16 partials at 8 rows of 128, 64 at one row), except in the Gluon kernel where a pair
        can gather at most TAIL_ONE_LEVEL_MAX partials (programs per kv head), and in either kernel where the
        block table is too narrow for a request of more tiles than a group (a piece holds one tile at least;
        64x0.5K h8/1: 8 tiles): there one level; 0: one level.
    merge_prefetch: the Gluon kernel's tail merge issues the next round of partial loads before folding this
        round (two L2 round trips in flight instead of one; sm_90 build 128 registers a thread at h8/1 d128
        instead of 90, still 3 programs an SM, no spill). On (default): 1.5-5.5 % faster on every h8/1 fp8 case
        of the H200 bench at `1080690` (1x128K+31x4K 32.8 -> 30.9 µs, 1x64K+15x4K 24.2 -> 23.0; h64/8 level);
        the `tl` kernel's merge has no such form.
    merge_round: fp32 elements of one Gluon tail-merge round, a [parts, r_pad, D_PAD] tile (a power of two in
        1024..16384; parts at most 16): more partials a round halve the dependent L2 round trips of a long split's
        merge (16 partials of 8 rows at d128: 2 rounds of 8 instead of 4 of 4) at the price of registers (sm_90
        build at h8/1 d128: 8 partials with merge_prefetch 236 registers a thread, 2 programs an SM; without it
        125). None (default): 4096. The H200 tune at `953957c` (bench/results/decode_tune_merge_round.md): 8192
        without the prefetch, groups of 16, is 0.6-2.5 % faster on the long h8/1 fp8 splits (1x64K+15x4K 22.4 ->
        21.8 µs) and 0.4-4 % slower on the short ones (64x0.5K 12.0 -> 12.5): no default.
    pv_fp16: the Gluon kernel's P·V over fp8 V in fp16 instead of bf16 (V widened e4m3 -> f16 in one conversion a
        pair; to bf16 it took one more an element, 64 F2F a tile a thread in the sm_90 SASS; P in [0, 1] keeps 3
        more mantissa bits). v_mask_tail: the Gluon kernel masks V (keys past the sequence, bad pages) only on a
        request's last, partial tile; inside the sequence every key is the request's, and a bad page's keys are
        already the zeros TMA reads past the cache. Both on (default): the H200 tune at `b257be1`
        (bench/results/decode_tune_pv_fp16_b257be1.md, graph replay) has the pair 1.08-1.13x faster on every h64/8
        fp8 case and 1.03-1.11x on four h8/1 fp8 cases (64x0.5K 11.7 -> 10.5 µs, 1x64K+15x4K 22.4 -> 20.3), level
        on 64x4K h8/1 (28.5 / 28.5; pv_fp16 alone 27.5) and 2x32K+30x4K (24.2 -> 23.5; alone 23.1); v_mask_tail
        alone is level or up to 7.5 % slower.
    merge_slices: a split request of more than 16 partials merged by this many combine programs (1, 2, 4, 8),
        each a slice of the row's columns in one round of up to 64 · merge_slices partials at head_dim 128,
        instead of one program in rounds of 64 (a long request's 130-odd partials: 3 dependent rounds). The
        helpers are the combine programs just after the split's owner, which have nothing of their own to
        merge (the plan writes their rows: build the plan under the same setting). The `tl` kernel's combine
        only. None (default): 4 with task descriptors, else 1 (off). With 2 combine warps, 4 slices take the long
        rows 5-8 % faster and stay within 0.5 % elsewhere (H100 tune, bench/results/decode_tune_merge_slices_h100.md:
        1x64K+15x4K h8/1 bf16 31.6 -> 29.4 µs, 1x128K+31x4K 54.4 -> 51.6, fp8 q16 1.07-1.08x).
    combine_warps: the `tl` path's combine kernel on 2 (default) or 4 warps a program. On 2 the merge's
        reductions over the partials stay in fewer warps and more programs sit beside the attention programs (sm_90
        builds at d128: 168 registers, 198 with 4 merge slices, no spill; 1 warp spills); alone 1-4 % faster on the
        mixed and 64x4K rows of the same tune, level on the rest.
    split_cost: the plan's cost model for splitting a request at all, in quarters of a tile (0..256; with a task
        cost, i.e. task descriptors): what a split adds to the step (partial writes, the merge and its wait). Where
        every (head, request) fits whole in a bucket of c_max·ceil(bucket / c_max) cost units (c_max: the
        largest pair's cost) whose busiest SM's load (buckets × programs an SM) is at most the equal cut's +
        split_cost (`plan.whole_pays`), the plan cuts there and moves every cut to a request boundary: no request
        is split (the static split's cut on uniform short batches, without its combine). Elsewhere the equal cut
        as before. 0: never. None (default): by the plan's kernel, `plan.SPLIT_COST_TL` (40, 10 tiles) for the
        `tl` kernel and 0 for the Gluon kernel. The H200 tune at `78dfefb`
        (bench/results/decode_tune_split_cost.md): on the `tl` kernel (merges through the combine kernel, 2 programs an
        SM) 32 takes 64x0.5K h8/1 bf16 from 13.0 to 11.6 µs (one request a program instead of a 4-tile bucket),
        h64/8 from 45.8 to 38.6 (two requests a program instead of 1.3: the static split's 38.6) and 64x4K h64/8
        from 255.9 to 249.4, and moves no long mix; on the Gluon kernel (merges in its tail, 3 programs an SM)
        whole cuts are slower (64x0.5K h8/1 fp8 12.6 -> 14.6 µs, h64/8 30.4 -> 33.4).
    plan_block_c, plan_warps, plan_block_b: launch of the plan kernel (`plan_decode`, once per step):
        plan entries (persistent programs) served per plan program (16..256: smaller = more plan
        programs, each with a smaller [plan_block_c, block] compare-count tile; 0 = by batch size,
        `plan.auto_plan_launch`, which also picks the warps), its warps (1..8), and
        the requests per block of its prefix-sum scan. Defaults from the H200 plan sweep
        (bench/results/decode_tune_plan.md): 16 entries on 1 warp, blocks of 256.
    plan_one_pass: a batch of at most plan_block_b requests is planned in one pass (one load, one
        scan kept in registers for the compare-count) instead of two (scan, then re-load and re-scan
        for the compare). On: with 16 entries on 1 warp the plan step is 1.8–2.9 µs for B 16–256
        (was 2.9–57 µs) in the H200 sweep.
    pdl_wait: the dynamic schedule's attention kernel (`tl` or Gluon) is itself launched with programmatic
        dependent launch (sm90): its programs may become resident while the previous kernel in the stream
        finishes, and wait (griddepcontrol.wait) before their first read, so nothing it reads (q, the plan, the
        cache, the partials and counts of the previous layer's call) can be stale; after the wait it lets the
        next kernel launch once its programs' work is done (and the combine after its merge). What it saves is
        the launch gap between a layer's attention and the kernel before it, as FlashInfer's decode (PDL on by
        default on sm90) saves it too. Never under the interpreter. On (default): the H200 tune at `c770934`
        (bench/results/decode_tune_pdl_c770934.md) has it 1.000-1.050x faster on all 27 decode scenarios (h8/1 fp8
        1.2-2.6 %, 64x0.5K h8/1 bf16 5 %, h64/8 0-2.7 %). Releasing the next kernel right after the wait instead
        (tree `0268b5e`) made h64/8 fp8 15 % slower: the next Gluon grid took the SM slots this one freed, unevenly
        (4 of its programs fit an SM where the plan counts 3).
    """

    num_stages: int = 3
    num_warps: int | None = None
    block_n: int = 64
    combine_chunks: int = 64
    use_tma: bool | None = None
    pdl: bool = True
    min_rows: int = 16
    task_desc: bool = True
    lean_loop: bool | None = None
    plan_block_c: int = 16
    plan_warps: int = 1
    plan_block_b: int = 256
    plan_one_pass: bool = True
    lean_mode: str = "tma"
    max_regs: int | None = None
    lean_pages: bool = True
    gluon: bool | None = None
    row_path: bool | None = None
    tail_merge: bool | None = None
    tail_group: int | None = None
    merge_prefetch: bool = True
    merge_round: int | None = None
    split_cost: int | None = None
    pdl_wait: bool = True
    pv_fp16: bool = True
    v_mask_tail: bool = True
    merge_slices: int | None = None
    combine_warps: int = 2

    def __post_init__(self):
        check_choice("DecodeConfig.lean_mode", self.lean_mode, LEAN_MODES)
        regs = self.max_regs
        if regs is not None and (type(regs) is not int or not 32 <= regs <= 255):
            raise ValueError(f"DecodeConfig.max_regs must be None or an int in 32..255, got {self.max_regs!r}")
        if self.tail_merge and not self.task_desc:
            raise ValueError("DecodeConfig.tail_merge needs task_desc (the plan's pair table is written with it)")
        tg = self.tail_group
        if tg is not None and (type(tg) is not int or not (tg == 0 or 2 <= tg <= 4096)):
            raise ValueError(f"DecodeConfig.tail_group must be None, 0 or an int in 2..4096, got {tg!r}")
        mr = self.merge_round
        if mr is not None and (type(mr) is not int or not 1024 <= mr <= 16384 or mr & (mr - 1)):
            raise ValueError(f"DecodeConfig.merge_round must be None or a power of two in 1024..16384, got {mr!r}")
        for name in ("merge_prefetch", "pdl_wait", "pv_fp16", "v_mask_tail"):
            if type(getattr(self, name)) is not bool:
                raise TypeError(f"DecodeConfig.{name} must be a bool, got {getattr(self, name)!r}")
        sc = self.split_cost
        if sc is not None and (type(sc) is not int or not 0 <= sc <= MAX_SPLIT_COST):
            raise ValueError(f"DecodeConfig.split_cost must be None or an int in 0..{MAX_SPLIT_COST} (quarters of a "
                             f"tile), got {sc!r}")
        ms = self.merge_slices
        if ms is not None and (type(ms) is not int or ms not in (1, 2, 4, 8)):
            raise ValueError(f"DecodeConfig.merge_slices must be None, 1, 2, 4 or 8, got {ms!r}")
        if self.combine_warps not in (2, 4) or type(self.combine_warps) is not int:
            raise ValueError(f"DecodeConfig.combine_warps must be 2 or 4, got {self.combine_warps!r}")
        if ms is not None and ms > 1 and not self.task_desc:
            raise ValueError("DecodeConfig.merge_slices needs task_desc (the helpers' rows are in the plan's "
                             "merge_desc)")
        cb = self.combine_chunks
        if type(cb) is not int or not 2 <= cb <= 256 or cb & (cb - 1):
            raise ValueError(f"DecodeConfig.combine_chunks must be a power of two in 2..256, got {cb!r}")

    def merge_slices_used(self) -> int:
        """The merge slices a plan built under this config writes: `merge_slices`, None = 4 with task descriptors
        (the helpers' rows are in the plan's merge_desc), 1 (none) without."""
        if not self.task_desc:
            return 1
        return 4 if self.merge_slices is None else self.merge_slices


LEAN_MODES = ("hold", "recompute", "tma")
_CONFIG = DecodeConfig()


def set_decode_config(**changes) -> DecodeConfig:
    """Replace fields of the process-wide decode config (for sweeps and tests); returns the previous one."""
    global _CONFIG
    old = _CONFIG
    _CONFIG = replace(_CONFIG, **changes)
    return old


@contextlib.contextmanager
def decode_config_changed(**changes) -> Iterator[DecodeConfig]:
    """Within the block the decode config has `changes` (a bench row, a tune candidate, a test); the whole
    previous config is back after it."""
    old = set_decode_config(**changes)
    try:
        yield _CONFIG
    finally:
        set_decode_config(**asdict(old))


def decode_config() -> DecodeConfig:
    """The process-wide decode config."""
    return _CONFIG


def _combine_chunks(head_dim: int) -> int:
    """Partials a combine round: DecodeConfig.combine_chunks, at most a [CB, D_PAD] fp32 tile of 8192 elements."""
    return max(1, min(_CONFIG.combine_chunks, 8192 // triton.next_power_of_2(head_dim)))


def _tail_parts(r_pad: int, head_dim: int, prefetch: bool = False, elems: int | None = None) -> int:
    """Partials a round of the tail merge: a [parts, r_pad, D_PAD] fp32 tile of at most `elems` elements (None:
    4096, DecodeConfig.merge_round's default: 4 at 8 rows of 128, so that with their 64-bit addresses the merge
    fits the attention loop's registers), ≤ 16. With
    the Gluon merge's prefetch (two rounds in flight) a head_dim under 128 counts as 128: at d64 the full tile
    took 233 registers at h8/1 and 243 at h16/1 in ptxas (2 programs an SM where the plan counts 3; the H200's
    d64 fp8 grid rows ran 1.6x slower), half of it 124 and 160."""
    width = triton.next_power_of_2(head_dim)
    if prefetch:
        width = max(width, 128)
    return max(1, min(16, (elems or 4096) // (r_pad * width)))


def _tail_group(tail_parts: int, max_tiles: int, programs_per_kv_head: int | None = None) -> int:
    """Partials a group of the two-level tail merge: DecodeConfig.tail_group; by default 4 rounds of the tile, or
    one level (0) where no pair can gather more partials than that: a piece of a request holds at least one tile,
    and no request is longer than the block table's `max_tiles` (the same merge, without the two-level code's
    cost: 64x0.5K h8/1 fp8 on the H200, 14.4 against 15.3 µs a call, bench/results/README.md), or (the Gluon
    kernel, `programs_per_kv_head` given) where a pair can gather at most ~64 partials."""
    if _CONFIG.tail_group is not None:
        return _CONFIG.tail_group
    if programs_per_kv_head is not None and programs_per_kv_head <= TAIL_ONE_LEVEL_MAX:
        return 0
    return 0 if max_tiles <= 4 * tail_parts else 4 * tail_parts


# A (request, kv head) pair gathers at most ~num_programs / kv heads partials (one request holding the batch's
# tiles); up to this many the Gluon kernel merges them in one level: the H200 tune at 5abd980 had one level 3-4 %
# faster on every h64/8 fp8 case (49.5 programs a kv head; 1x128K+31x4K 153.5 -> 147.6 µs), while at h8/1 (396)
# the long split needs two (1x64K+15x4K: 23.0 against 60.1 µs in one level).
TAIL_ONE_LEVEL_MAX = 64


def _num_stages() -> int:
    return 1 if _platform.is_interpreter() else _CONFIG.num_stages


def _validate(q, k_cache, v_cache, block_table, seq_lens, plan, schedule, k_scale, v_scale, q_scale, out):
    check_tensor("q", q, dtypes=(torch.bfloat16, torch.float16, FP8_E4M3), ndim=3)
    check_tensor("k_cache", k_cache, dtypes=(torch.bfloat16, torch.float16, FP8_E4M3), ndim=4)
    check_tensor("v_cache", v_cache, dtypes=(k_cache.dtype,), ndim=4)
    check_tensor("block_table", block_table, dtypes=(torch.int32,), ndim=2)
    check_tensor("seq_lens", seq_lens, dtypes=(torch.int32,), ndim=1)
    check_choice("schedule", schedule, ("dynamic", "static"))
    nb, bs, hkv, d = k_cache.shape
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {list(v_cache.shape)} != k_cache shape {list(k_cache.shape)}")
    if d not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim {d} is not supported; supported: {SUPPORTED_HEAD_DIMS}")
    if bs & (bs - 1) or bs > 256:
        raise ValueError(f"k_cache block size {bs} must be a power of two ≤ 256")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must be contiguous in head_dim (stride(-1) == 1); other strides are free")
    if q.stride(-1) != 1:
        raise ValueError("q must be contiguous in head_dim (stride(-1) == 1)")
    total_q, hq, dq = q.shape
    if dq != d:
        raise ValueError(f"q head_dim {dq} != k_cache head_dim {d}")
    if hq % hkv or not 1 <= hq // hkv <= MAX_GQA:
        raise ValueError(f"q heads ({hq}) must be a multiple of kv heads ({hkv}) with ratio 1..{MAX_GQA}")
    b = seq_lens.shape[0]
    if block_table.shape[0] < b:
        raise ValueError(f"block_table has {block_table.shape[0]} rows for {b} requests")
    if b and total_q % b:
        raise ValueError(f"q has {total_q} tokens, not a multiple of the batch size {b} (q_len × B must match q)")
    q_len = total_q // b if b else 1
    if b and not 1 <= q_len <= MAX_Q_LEN:
        raise ValueError(f"q_len = q tokens / batch = {q_len} must be in 1..{MAX_Q_LEN}")
    kv_fp8 = k_cache.dtype == FP8_E4M3
    if kv_fp8:
        if k_scale is None or v_scale is None:
            raise ValueError("fp8 k_cache/v_cache need k_scale and v_scale (one-element float32 tensors)")
        check_scale("k_scale", k_scale)
        check_scale("v_scale", v_scale)
    if q.dtype == FP8_E4M3:
        if not kv_fp8:
            raise TypeError("fp8 q needs an fp8 KV cache (use a bf16/fp16 q with a bf16/fp16 cache)")
        if q_scale is None:
            raise ValueError("fp8 q needs q_scale (float32 [B*q_len, Hq], per token per head)")
        check_tensor("q_scale", q_scale, dtypes=(torch.float32,), shape=(total_q, hq))
        if not q_scale.is_contiguous():
            raise ValueError("q_scale must be contiguous")
    elif not kv_fp8 and q.dtype != k_cache.dtype:
        raise TypeError(f"q dtype {q.dtype} must match the KV cache dtype {k_cache.dtype}")
    if q.dtype != FP8_E4M3 and q_scale is not None:
        raise ValueError(f"q_scale is for an fp8 q; q is {str(q.dtype).replace('torch.', '')}")
    if out is not None:
        check_tensor("out", out, dtypes=(torch.bfloat16, torch.float16), shape=(total_q, hq, d))
        if out.stride(-1) != 1:
            raise ValueError("out must be contiguous in head_dim")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("block_table", block_table),
                    ("seq_lens", seq_lens)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    if plan is not None:
        if not isinstance(plan, DecodePlan):
            raise TypeError(f"plan must be a DecodePlan from hpcops.plan_decode, got {type(plan).__name__}")
        if (plan.num_kv_heads, plan.q_len, plan.block_size, plan.batch) != (hkv, q_len, bs, b):
            raise ValueError(f"plan was built for (num_kv_heads, q_len, block_size, batch) = "
                             f"{(plan.num_kv_heads, plan.q_len, plan.block_size, plan.batch)}, got "
                             f"{(hkv, q_len, bs, b)}; re-plan with hpcops.plan_decode(seq_lens, ..., out=plan)")
        if plan.device != seq_lens.device:
            raise ValueError(f"plan's buffers are on {plan.device}, seq_lens on {seq_lens.device}")
        if schedule == "dynamic" and _CONFIG.task_desc and not plan.has_desc:
            raise ValueError("DecodeConfig.task_desc reads the plan's task descriptors, and this plan was built "
                             "without them: plan with task_desc on (plan_decode reads the same config)")
    # Values of the metadata: where they are on the host, or in checking mode (a device sync).
    if b and values_checkable(seq_lens):
        sl = seq_lens.cpu()
        if int(sl.min()) < 0:
            raise ValueError("seq_lens must be ≥ 0")
        need = math.ceil(int(sl.max()) / bs)
        if need > block_table.shape[1]:
            raise ValueError(f"block_table has {block_table.shape[1]} columns but the longest sequence "
                             f"({int(sl.max())} tokens) needs {need} blocks of {bs}")
        short = (sl > 0) & (sl < q_len)
        if bool(short.any()):
            i = int(short.nonzero()[0])
            raise ValueError(f"seq_lens[{i}] = {int(sl[i])} < q_len {q_len}: seq_lens count the whole sequence, "
                             "the q_len new tokens included (0 = an empty or padding request)")
        check_block_table_values(block_table, sl, bs, nb)
        if plan is not None and schedule == "dynamic" and not kernels_are_replaced():
            check_plan_matches(plan, sl)  # a plan left over from another step
    # last: argument errors first; then whether the kernels can run where the tensors are
    check_kernel_device("q", q)
    return q_len, hkv, hq // hkv, kv_fp8


def plan_kernel(num_kv_heads: int, q_len: int, block_size: int, device, *, num_q_heads: int | None = None,
                head_dim: int | None = None, q_dtype: torch.dtype | None = None,
                kv_dtype: torch.dtype | None = None) -> str:
    """The attention kernel a new plan is built for ("gluon" or "tl"; `plan_decode`'s hints): "gluon" where
    `DecodeConfig.gluon` is None (auto) and the step takes an fp8 q over fp8 KV on an sm_90 GPU, 2–16 q rows a kv
    head (2–8 at head_dim 64), head_dim 64/128/256 and pages of 8–64 tokens dividing 64 or a multiple of 64 (one
    query row a kv head keeps the `tl` kernel's row path: 1.09–1.88× the MMA tile there). Without all four hints,
    "tl"."""
    if _CONFIG.gluon is not None or not _CONFIG.task_desc:
        return "tl"
    if None in (num_q_heads, head_dim, q_dtype, kv_dtype) or q_dtype != FP8_E4M3 or kv_dtype != FP8_E4M3:
        return "tl"
    rows = q_len * num_q_heads // num_kv_heads
    if not 2 <= rows <= 16 or head_dim not in (64, 128, 256):
        return "tl"
    if head_dim == 64 and rows > 8:  # h16/1 d64: the tl kernel 28.2 µs against 31.2 (decode-grid_tune_d64_prefetch)
        return "tl"
    if block_size < TILE and (block_size < 8 or TILE % block_size):
        return "tl"
    return "tl" if _hopper(device) else "gluon"


def plan_tail(kernel: str, num_kv_heads: int, q_len: int, num_programs: int, *, num_q_heads: int | None = None,
              head_dim: int | None = None, q_dtype: torch.dtype | None = None,
              kv_dtype: torch.dtype | None = None, max_seq_len: int | None = None) -> bool:
    """Whether a new plan is built for the tail merge by default (`DecodeConfig.tail_merge` None; `plan_decode`'s
    hints), where a pair (request, kv head) can gather at most num_programs / kv heads partials:

    - the Gluon kernel where that is at most TAIL_ONE_LEVEL_MAX (h64/8: the H200 tunes have the tail level with the
      combine or faster there), or where the step's requests are short (`max_seq_len` told, at most
      GLUON_TAIL_MAX_SEQ): a combine kernel's fixed cost is what such a step notices (64x0.5K h8/1 fp8 on the
      H100, 10.4 against 12.9 µs). Past that, at h8/1 or h16/1, one program merging a long request's many
      partials ends the kernel late: the combine kernel is 6-19 % faster on every long case of the H100 grid tune
      (bench/results/decode-grid_tune_tail_pps_h100_c5844fd.md: 32x8K h8/1 35.5 -> 32.2 µs, 1x256K+15x2K
      39.2 -> 34.9, d256 65.9 -> 54.7) and 6-12 % on the H200's (decode_tune_tail_merge_pps.md);
    - the `tl` kernel on a 16-bit q over fp8 KV (the MMA tile, 2 or more q rows a kv head, head_dim up to 128)
      where it is at most TAIL_ONE_LEVEL_MAX: the H100 tunes at 2e12d99 (bench/results/
      decode_tune_q16_all_h100_2e12d99.md, _bf16_tail_) have every h64/8 row with a bf16 q over fp8 KV
      1.015-1.047x faster with it (64x4K 198.8 -> 189.7 µs), while at h8/1 (264 partials a pair) the long splits'
      merge costs 3-17 % and over bf16 KV it is level (0.99-1.01x at h64/8)."""
    few = -(-num_programs // num_kv_heads) <= TAIL_ONE_LEVEL_MAX
    if kernel == "gluon":
        return few or (max_seq_len is not None and max_seq_len <= GLUON_TAIL_MAX_SEQ)
    return few and _converting_tile(num_kv_heads, q_len, num_q_heads, head_dim, q_dtype, kv_dtype)


# The longest request (tokens) of a step the Gluon kernel still merges in its tail at h8/1-like plans (many
# partials a pair; `plan_tail`): 64x0.5K keeps the tail (1.24x the combine on the H100), 64x4K and every longer
# case takes the combine; between them unmeasured (scripts/probe_tail_threshold.py times 64x1K..64x4K).
GLUON_TAIL_MAX_SEQ = 1024


def plan_costs(kernel: str, tail: bool, num_kv_heads: int, q_len: int, *, num_q_heads: int | None = None,
               head_dim: int | None = None, q_dtype: torch.dtype | None = None,
               kv_dtype: torch.dtype | None = None) -> tuple[int, int, int] | None:
    """The cost model's (min_tiles, task_cost, split_cost) for a new plan (`plan_decode`'s hints; None: the defaults,
    `plan.DEFAULT_MIN_TILES`, `DEFAULT_TASK_COST` and the kernel's split cost; a None split cost: the kernel's) for
    the `tl` kernel's MMA tile over fp8 KV under a 16-bit q (2 or more q rows a kv head, head_dim up to 128), which
    converts K and V and so weighs about two plain tiles: `plan.CONVERT_TILE_COSTS` where its splits merge in the
    combine kernel, `plan.TAIL_TILE_COSTS` on a `plan_tail` plan (a tail-merged split is a dearer task)."""
    from hpcops.attention.plan import CONVERT_TILE_COSTS, TAIL_TILE_COSTS

    if kernel != "tl" or not _converting_tile(num_kv_heads, q_len, num_q_heads, head_dim, q_dtype, kv_dtype):
        return None
    return TAIL_TILE_COSTS if tail else CONVERT_TILE_COSTS


def plan_defaults(kernel: str, num_kv_heads: int, q_len: int, device, *, num_programs: int | None = None,
                  num_q_heads: int | None = None, head_dim: int | None = None, q_dtype: torch.dtype | None = None,
                  kv_dtype: torch.dtype | None = None,
                  max_seq_len: int | None = None) -> tuple[int, bool, int, int, int | None]:
    """A new plan's (num_programs, tail, min_tiles, task_cost, split_cost) from `plan_decode`'s hints: the tail
    merge (`plan_tail`, judged on the grid of a tail plan), then the programs (`num_programs`, else
    `plan_programs_per_sm` for that merge × SMs), then `plan_costs` or the defaults (`plan.DEFAULT_MIN_TILES`,
    `DEFAULT_TASK_COST`, None: the kernel's split cost). The device plan and its torch reference both take them
    from here."""
    from hpcops.attention.plan import DEFAULT_MIN_TILES, DEFAULT_TASK_COST, default_num_programs

    hints = dict(num_q_heads=num_q_heads, head_dim=head_dim, kv_dtype=kv_dtype)
    grid = lambda tail: num_programs or default_num_programs(  # noqa: E731
        q_len, device, programs_per_sm=plan_programs_per_sm(kernel, num_kv_heads, q_len, **hints, tail=tail))
    tail = plan_tail(kernel, num_kv_heads, q_len, grid(True), **hints, q_dtype=q_dtype, max_seq_len=max_seq_len)
    costs = plan_costs(kernel, tail, num_kv_heads, q_len, **hints, q_dtype=q_dtype) or \
        (DEFAULT_MIN_TILES, DEFAULT_TASK_COST, None)
    return (grid(tail), tail, *costs)


def _converting_tile(num_kv_heads: int, q_len: int, num_q_heads: int | None, head_dim: int | None,
                     q_dtype: torch.dtype | None, kv_dtype: torch.dtype | None) -> bool:
    """Whether the `tl` kernel runs these hints as its MMA tile over fp8 KV under a 16-bit q, converting K and V
    (2 or more q rows a kv head, head_dim up to 128; all four hints given): `plan_tail`'s and `plan_costs`' case."""
    if None in (num_q_heads, head_dim, q_dtype, kv_dtype) or kv_dtype != FP8_E4M3 or q_dtype == FP8_E4M3:
        return False
    return q_len * num_q_heads // num_kv_heads >= 2 and head_dim <= 128


def plan_programs_per_sm(kernel: str, num_kv_heads: int, q_len: int, *, num_q_heads: int | None = None,
                         head_dim: int | None = None, kv_dtype: torch.dtype | None = None,
                         tail: bool = True) -> int | None:
    """Persistent programs an SM for a new plan (`plan_decode`'s hints; None: `DEFAULT_PROGRAMS_PER_SM`).

    The Gluon kernel: with the tail merge (`tail`) `GLUON_PROGRAMS_PER_SM`, 2 at head_dim 256, where a program
    takes 180 registers a thread and 99 KB of shared memory (sm_90 ptxas; the H200 grid at 94c7162 timed the d256
    fp8 Gluon kernel at 49.1 µs on a plan of 2 an SM against 61.2 on one of 3 at 32x8K h8/1, 61.6 against 70.8 at
    logmix32). Its splits merged by the combine kernel, 2 at head_dim 128 and 256 and 3 at 64 (the H100 grid tune,
    bench/results/decode-grid_tune_tail_pps_h100_c5844fd.md: 32x8K h8/1 d128 32.2 µs on 2 against 33.7 on 3,
    logmix32 37.5 / 38.6; d64 20.7 / 19.4 and 23.8 / 22.0). The `tl` kernel's MMA
    tile above head_dim 128 runs on 8 warps with 172 (bf16 KV) to 190 (fp8 KV) registers a thread
    (tests/test_decode_compile.py): one program fills more than half of an SM's 64 K registers, so a plan of 2 an
    SM would run as two waves, the long requests' splits in the second: 1 there (the H200 grid tune,
    bench/results/decode-grid_tune_pps.md: bf16 d256 1x256K+15x2K h16/1 p32 118.3 → 89.9 µs, logmix32 h8/1
    96.9 → 86.5, 32x8K h8/1 74.4 → 71.0). The row path (one query row a kv head over fp8 KV, ~128 registers on
    8 warps) keeps 2."""
    from hpcops.attention.plan import GLUON_PROGRAMS_PER_SM

    if kernel == "gluon":  # at head_dim 256 (fp8, 3 buffers, tail merge): 180 registers and 99 KB of shared memory
        if head_dim is not None and head_dim > 128:
            return 2
        return GLUON_PROGRAMS_PER_SM if tail or head_dim == 64 else 2
    if None in (num_q_heads, head_dim, kv_dtype) or head_dim <= 128 or _CONFIG.num_warps not in (None, 8):
        return None
    rows = q_len * num_q_heads // num_kv_heads
    row_path = (kv_dtype == FP8_E4M3 if _CONFIG.row_path is None else _CONFIG.row_path) and rows == 1
    return None if row_path else 1


def _hopper(device) -> str | None:
    """Why `device` cannot run the Gluon kernel (None: an sm_90 GPU, outside the interpreter). One place, so that
    `scripts/ptx_fingerprint.py` can record the launches an H200 makes from the CPU."""
    device = torch.device(device)
    if _platform.is_interpreter() or device.type != "cuda":
        return "not a CUDA device (the interpreter cannot run Gluon)"
    if torch.cuda.get_device_capability(device)[0] != 9:
        return "not an sm_90 (Hopper) GPU: the kernel's MMA is wgmma"
    return None


def gluon_unsupported_reason(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: int) -> str | None:
    """Why the Gluon decode kernel (`DecodeConfig.gluon`) cannot serve this call (None: it can)."""
    why = _hopper(q.device)
    if why is not None:
        return why
    d = k_cache.shape[-1]
    if d not in (64, 128, 256):
        return f"head_dim {d} (64, 128 or 256)"
    if rows > 16:
        return f"q_len·G = {rows} q rows a kv head (at most 16)"
    if k_cache.dtype == FP8_E4M3:
        if q.dtype != FP8_E4M3:
            return "fp8 KV with a 16-bit q (the kernel takes the prologue's fp8 q)"
    elif q.dtype != k_cache.dtype:
        return f"q dtype {q.dtype} differs from the KV dtype {k_cache.dtype}"
    if not _CONFIG.task_desc:
        return "DecodeConfig.task_desc is off"
    page = k_cache.shape[1]
    if page < TILE and (page < 8 or TILE % page):
        return f"block_size {page} (pages of 8–64 tokens must divide the 64-key tile)"
    return kv_tma_unsupported_reason(k_cache, v_cache, min(TILE, page))


def _tma_ok(cache: torch.Tensor, block_n: int) -> bool:
    d = cache.shape[-1]
    return d & (d - 1) == 0 and tma_unsupported_reason(cache, block_n) is None


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                     seq_lens: torch.Tensor, *, plan: DecodePlan | None = None, schedule: str = "dynamic",
                     scale: float | None = None, k_scale: torch.Tensor | None = None,
                     v_scale: torch.Tensor | None = None, q_scale: torch.Tensor | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """Paged decode attention (q_len 1..8 new tokens per request, causal among them).

    Args:
        q: `[B·q_len, Hq, D]` bf16/fp16, or fp8 e4m3 with `q_scale` (fp8 KV only).
        k_cache, v_cache: `[num_blocks, block_size, Hkv, D]`, any strides with stride(-1) == 1
            (vLLM's packed K|V views work); bf16/fp16, or fp8 e4m3 with `k_scale`, `v_scale`.
        block_table: int32 `[B, max_blocks]`; seq_lens: int32 `[B]`, KV length incl. the new tokens.
        plan: from `hpcops.plan_decode` (computed here when None; pass it to share it across layers),
            planned from these very `seq_lens` this step: a plan is valid for exactly the seq_lens it
            was built from (and num_kv_heads, q_len, block_size), so re-plan every step before the
            layers (`plan_decode(seq_lens, ..., out=plan)`). The plan's shape fields are always
            checked; its tables against seq_lens where the values are checkable (host seq_lens, or
            HPCOPS_CHECK=1 outside CUDA-graph capture), elsewhere a stale plan gives a wrong result.
        schedule: "dynamic" (load-balanced persistent) or "static" (classic split-KV ablation).
        scale: softmax scale (default 1/sqrt(D)); q_scale: float32 `[B·q_len, Hq]` for fp8 q.
        out: optional `[B·q_len, Hq, D]` bf16/fp16 output (default: q's dtype, bf16 for fp8 q).

    Returns `out`. No host sync, no data-dependent allocation: capturable in a CUDA graph.
    """
    q_len, hkv, g, kv_fp8 = _validate(q, k_cache, v_cache, block_table, seq_lens, plan, schedule,
                                      k_scale, v_scale, q_scale, out)
    total_q, hq, d = q.shape
    if out is None:
        out = torch.empty((total_q, hq, d), dtype=torch.bfloat16 if q.dtype == FP8_E4M3 else q.dtype,
                          device=q.device)
    b = seq_lens.shape[0]
    if b == 0 or total_q == 0:
        return out
    sm_scale = (1.0 / math.sqrt(d)) if scale is None else float(scale)
    q_fp8 = q.dtype == FP8_E4M3
    lean_mode = _CONFIG.lean_mode
    rows = q_len * g
    common = dict(Q_LEN=q_len, G=g, HEAD_DIM=d, D_PAD=triton.next_power_of_2(d))
    m_pad = max(_CONFIG.min_rows, 16, triton.next_power_of_2(rows))
    block_n = _CONFIG.block_n if d <= 128 else 64
    dummy = seq_lens  # placeholder pointer for absent optional tensors (never read)
    nb, bs, _, _ = k_cache.shape
    args_kv = (k_scale if kv_fp8 else dummy, v_scale if kv_fp8 else dummy)
    strides = (q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
               v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_table.stride(0),
               out.stride(0), out.stride(1))
    num_warps = _CONFIG.num_warps or (4 if d <= 128 else 8)
    row_path = (kv_fp8 if _CONFIG.row_path is None else _CONFIG.row_path) and rows == 1
    want_tma = (not kv_fp8) if _CONFIG.use_tma is None else _CONFIG.use_tma
    use_tma = want_tma and not row_path and _tma_ok(k_cache, TILE) and _tma_ok(v_cache, TILE)
    small_pages = _CONFIG.lean_pages and bs < TILE
    lean = (kv_fp8 or use_tma or small_pages or row_path) if _CONFIG.lean_loop is None else _CONFIG.lean_loop
    if use_tma:
        block_n = TILE
        descs = (kv_descriptor(k_cache, TILE), kv_descriptor(v_cache, TILE))
        lean = lean and lean_mode == "tma"
    else:
        descs = (k_cache, v_cache)
    recompute = lean and not use_tma and lean_mode != "hold"
    attn_knobs = dict(LEAN=lean, LEAN_RECOMPUTE=recompute,
                      KV_SAME_STRIDES=recompute and k_cache.stride()[:2] == v_cache.stride()[:2],
                      LEAN_PAGES=_CONFIG.lean_pages, ROW_PATH=row_path)
    if _CONFIG.max_regs is not None:  # a launch option (the interpreter drops it)
        attn_knobs["maxnreg"] = _CONFIG.max_regs
    if schedule == "static":
        splits = static_splits(b, hkv, q.device)
        part_o = torch.empty((b * hkv * splits, rows, d), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((b * hkv * splits, rows), dtype=torch.float32, device=q.device)
        from hpcops.attention._decode_kernels import decode_static_combine_kernel, decode_static_kernel

        decode_static_kernel[(b, hkv, splits)](
            q, k_cache, v_cache, *descs, block_table, seq_lens, out, part_o, part_lse,
            q_scale if q_fp8 else dummy, *args_kv,
            sm_scale * LOG2E, hkv, hq, block_table.shape[1], nb, *strides,
            SPLITS=splits, BLOCK_SIZE=bs, TILE=TILE, BLOCK_N=block_n, KV_FP8=kv_fp8, Q_FP8=q_fp8,
            NUM_STAGES=_num_stages(), num_warps=num_warps, M_PAD=m_pad, USE_TMA=use_tma, **attn_knobs,
            **common)
        if splits > 1:
            decode_static_combine_kernel[(b, hkv, rows)](
                part_o, part_lse, out, seq_lens, hkv, out.stride(0), out.stride(1),
                SPLITS=splits, TILE=TILE, CB=_combine_chunks(d), num_warps=4, **common)
        return out
    if plan is None:
        plan = plan_decode(seq_lens, num_kv_heads=hkv, q_len=q_len, block_size=bs, num_q_heads=hq, head_dim=d,
                           q_dtype=q.dtype, kv_dtype=k_cache.dtype)
    part_o, part_lse = plan.workspace(rows, d)
    from hpcops.attention._decode_kernels import decode_combine_kernel, decode_persistent_kernel

    on_gpu = not _platform.is_interpreter()  # (tensors off the GPU were refused above; ptx_fingerprint records as here)
    pdl = _CONFIG.pdl and on_gpu
    pdl_launch = {"launch_pdl": True} if pdl else {}
    # DecodeConfig.pdl_wait: the attention kernel launched early itself, waiting before its first read
    pdl_wait = dict(PDL_WAIT=True, launch_pdl=True) if _CONFIG.pdl_wait and on_gpu else {}
    # the Gluon kernel: asked for (gluon True), or by default where the plan was built for it (`plan_kernel`)
    use_gluon = (_CONFIG.gluon or (_CONFIG.gluon is None and plan.kernel == "gluon")) and \
        gluon_unsupported_reason(q, k_cache, v_cache, rows) is None
    # the tail merge: asked for, or by default where the plan wrote the pair table for this kernel (`plan_tail`)
    tail = bool(_CONFIG.tail_merge or (_CONFIG.tail_merge is None and plan.has_pairs
                                       and (use_gluon or plan.kernel == "tl")))
    if tail and not plan.has_pairs:
        raise ValueError("plan was built without DecodeConfig.tail_merge (no pair table): re-plan with "
                         "hpcops.plan_decode under the same config as decode_attention")
    gluon_tail, tl_tail = {}, {}
    if tail:
        max_tiles = triton.cdiv(block_table.shape[1] * bs, TILE)  # the longest request the table can hold
        r_pad = triton.next_power_of_2(rows)
        parts = _tail_parts(r_pad, d)
        # the Gluon merge's round: [parts, r_pad, D]
        g_parts = _tail_parts(r_pad, d, _CONFIG.merge_prefetch, _CONFIG.merge_round)
        gluon_tail = dict(TAIL_MERGE=True, R_PAD=r_pad, TAIL_PARTS=g_parts,
                          TAIL_GROUP=_tail_group(g_parts, max_tiles, -(-plan.num_programs // hkv)),
                          MERGE_PREFETCH=_CONFIG.merge_prefetch)
        # the tl merge takes one partial a step: 3 in flight on the pointer path, 1 beside TMA (where 2 or 3
        # spill 16 bytes: tests/test_decode_compile.py)
        tl_tail = dict(TAIL_MERGE=True, R_PAD=r_pad, TAIL_GROUP=_tail_group(parts, max_tiles),
                       TAIL_STAGES=1 if use_tma else 3)
    if not tail and plan.merge_slices != _CONFIG.merge_slices_used():  # the combine reads the plan's merge helpers
        raise ValueError(f"plan was built with DecodeConfig.merge_slices={plan.merge_slices}, the decode runs with "
                         f"{_CONFIG.merge_slices_used()}: re-plan with hpcops.plan_decode under the same config")
    if use_gluon:
        _launch_gluon(q, k_cache, v_cache, block_table, seq_lens, out, part_o, part_lse, plan, q_scale, args_kv,
                      sm_scale, q_len, g, rows, gluon_tail, pdl_wait)
    else:
        decode_persistent_kernel[(plan.num_programs,)](
            q, k_cache, v_cache, *descs, block_table, seq_lens, out, part_o, part_lse,
            plan.header, plan.cum, plan.task_desc if _CONFIG.task_desc else plan.first_b,
            plan.pair_desc if tail else dummy, plan.merge_sem if tail else dummy,
            q_scale if q_fp8 else dummy, *args_kv,
            sm_scale * LOG2E, b, hq, block_table.shape[1], nb, *strides,
            BLOCK_SIZE=bs, TILE=TILE, BLOCK_N=block_n, KV_FP8=kv_fp8, Q_FP8=q_fp8, NUM_STAGES=_num_stages(),
            num_warps=num_warps, M_PAD=m_pad, USE_TMA=use_tma, USE_PDL=pdl and not tail,
            TASK_DESC=_CONFIG.task_desc, **attn_knobs, **common, **tl_tail, **pdl_wait)
    if tail:
        return out
    decode_combine_kernel[(plan.num_programs, rows)](
        part_o, part_lse, out, plan.header, plan.cum, plan.merge_desc if _CONFIG.task_desc else plan.last_b,
        out.stride(0), out.stride(1),
        CB=_combine_chunks(d), USE_PDL=pdl, MERGE_DESC=_CONFIG.task_desc, num_warps=_CONFIG.combine_warps, **common,
        **pdl_launch,
        **({"PDL_NEXT": True} if pdl and pdl_wait else {}),
        **({"MERGE_SLICES": plan.merge_slices} if plan.merge_slices > 1 else {}))
    return out


def _launch_gluon(q, k_cache, v_cache, block_table, seq_lens, out, part_o, part_lse, plan, q_scale, args_kv,
                  sm_scale, q_len, g, rows, tail_knobs, pdl_knobs):
    """The dynamic schedule's attention kernel in Gluon (`DecodeConfig.gluon`); the combine follows, unless the
    kernel merges the splits itself (`tail_knobs`: its TAIL_* constexprs, empty without the tail merge).
    `pdl_knobs`: PDL_WAIT and launch_pdl (`DecodeConfig.pdl_wait`), or empty."""
    from hpcops.attention._decode_gluon import decode_gluon_kernel
    from hpcops.attention._tma import gluon_kv_descriptor

    nb, bs, _, d = k_cache.shape
    kv_fp8 = k_cache.dtype == FP8_E4M3
    # K and V buffers of 64 keys: 3 deep where they fit beside other programs, 2 for 16-bit KV at head_dim 256
    stages = 2 if (not kv_fp8 and d > 128) else 3
    v_knobs = ({"PV_F16": True} if _CONFIG.pv_fp16 else {}) | ({"V_MASK_TAIL": True} if _CONFIG.v_mask_tail else {})
    decode_gluon_kernel[(plan.num_programs,)](
        q, gluon_kv_descriptor(k_cache, min(TILE, bs)), gluon_kv_descriptor(v_cache, min(TILE, bs)), block_table,
        seq_lens, out,
        part_o, part_lse, plan.task_desc,
        plan.pair_desc if tail_knobs else seq_lens, plan.merge_sem if tail_knobs else seq_lens,
        q_scale if q_scale is not None else seq_lens, *args_kv,
        sm_scale * LOG2E, seq_lens.shape[0], q.shape[1], block_table.shape[1], nb,
        q.stride(0), q.stride(1), k_cache.stride(2), v_cache.stride(2), block_table.stride(0),
        out.stride(0), out.stride(1),
        Q_LEN=q_len, G=g, NQ=max(8, triton.next_power_of_2(rows)), D=d, PAGE=bs, TILE=TILE, STAGES=stages,
        KV_FP8=kv_fp8, Q_FP8=q.dtype == FP8_E4M3, num_warps=4, **tail_knobs, **pdl_knobs, **v_knobs)


def static_splits(batch: int, num_kv_heads: int, device=None) -> int:
    """Splits per (request, head) of the static schedule: fill the machine assuming equal lengths
    (what a length-oblivious static split-KV does), at most 64."""
    target = 2 * _platform.num_sms(device)
    return int(max(1, min(64, -(-target // max(1, batch * num_kv_heads)))))


# torch.library: the mutating form, for torch.compile and graph-capturing frameworks.
def _decode_out(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                seq_lens: torch.Tensor, out: torch.Tensor, scale: float, k_scale: torch.Tensor | None,
                v_scale: torch.Tensor | None, q_scale: torch.Tensor | None, static: bool) -> None:
    decode_attention(q, k_cache, v_cache, block_table, seq_lens, schedule="static" if static else "dynamic",
                     scale=scale, k_scale=k_scale, v_scale=v_scale, q_scale=q_scale, out=out)


def _decode_out_fake(q, k_cache, v_cache, block_table, seq_lens, out, scale, k_scale, v_scale, q_scale,
                     static) -> None:
    return None


decode_attention_out = register("decode_attention_out", _decode_out, mutates_args=("out",), fake=_decode_out_fake)
