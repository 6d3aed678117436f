"""`prefill_attention`: varlen causal prefill/extend attention over a paged KV cache (see PREFILL.md)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import triton

from hpcops._checks import (
    FP8_E4M3,
    HALF_DTYPES,
    check_block_table_values,
    check_kernel_device,
    check_scale,
    check_tensor,
    values_checkable,
)
from hpcops._library import register
from hpcops._platform import num_sms
from hpcops.attention import decode as _decode
from hpcops.attention._prefill_kernels import prefill_attention_fwd_kernel, quantize_q_kernel
from hpcops.attention._tma import gluon_kv_descriptor, kv_descriptor, kv_tma_unsupported_reason, tma_unsupported_reason

SUPPORTED_HEAD_DIMS = (64, 128, 256)


@dataclass(frozen=True)
class PrefillConfig:
    """Launch parameters of the prefill kernel.

    `block_m`: rows of a query tile (tokens × the query heads of one kv group; a power of two ≥ the
    group size); `block_n`: keys per KV tile; `num_warps`, `num_stages`: as for any Triton kernel.
    `pv_fp8`: with fp8 q (given, or from `quant_q`) and fp8 KV, run P·V as an fp8 dot (P scaled by
    256) instead of upcasting V to bf16 (needs block_n ≥ 32: fp8 MMAs take K ≥ 32).
    `tma`: load K/V tiles with TMA descriptors (host TensorDescriptor over the cache seen as 2-D
    [num_blocks·block_size, token row]). `None` (default) uses TMA whenever the layout allows it
    (block_size % block_n == 0, blocks laid out back to back, 16-byte aligned rows and base) and the
    pointer path otherwise; `True` requires TMA (ValueError naming the reason when the layout does
    not allow it); `False` always runs the pointer path.
    `quant_q`: with bf16/fp16 q and fp8 KV, quantize each q row (token, head) to e4m3 in the kernel
    (scale amax/448, like `quantize_per_token_head`) and run the fp8 QK dot instead of upcasting K
    (fp8-q accuracy; off by default). `fma_scale`: apply the softmax scale inside exp2's argument (one
    FFMA per logit) instead of scaling the logits first; used when the softmax scale is positive (the
    fp8 dequantization scales k_scale, q_scale are taken as ≥ 0).
    `heads_inner`: launch order tile-major (pid = tile·Hkv + kv_head: the heaviest tiles of all kv
    heads first) instead of head-major (one kv head's tiles after another).
    `gluon`: run the Hopper kernel in Gluon (`_prefill_gluon.py`: TMA-fed K/V, asynchronous wgmma with one
    tile's softmax under the next tile's MMAs) instead of the `tl` kernel. It takes a 16-bit q over a KV cache
    of the same dtype on an sm_90 GPU, `block_m` 64 or 128 on `block_m // 16` warps, a cache TMA can read in
    tiles of `block_n` keys (or a page a box), and a positive softmax scale (`gluon_unsupported_reason`).
    `True` insists (ValueError with the reason), `False` never uses it, `None` uses it where it can run.
    `gluon_ws` (with `gluon`, block_m 128 on 8 warps): the warp-specialized Gluon kernel, FA3's layout: a TMA
    producer warp and two consumer warpgroups of 64 q rows that take turns at the tensor cores. It also takes an
    fp8 q over fp8 KV (the heuristic's choice there on an H200; `gluon=False` keeps the tl kernel, whose P·V is
    16-bit), both GEMMs in fp8 with e4m3(P·256) probabilities (as `pv_fp8`). `gluon_p_regs` (that fp8 kernel
    only): P stays in registers as P·V's A operand and P·V runs synchronously, instead of P through shared memory
    with P·V under the warpgroup's own softmax (the two are timed side by side: the bench's `hpcops-fp8q` and
    `hpcops-fp8q-gluon-preg` rows). `gluon_tree` (either Gluon kernel): the softmax's row max and row sum as
    pairwise trees over the 32 scores a thread holds of a row instead of Triton's in-thread loop (a chain of 32
    dependent FMNMX / FADD before every exp2 and after); opt-in until measured (bench rows `hpcops-fp8q-tree`,
    `hpcops-tree`).
    `gluon_p_dbuf` (the fp8 kernel with P in shared memory): two P buffers a consumer, so that P_{j+1} is stored
    before P_j·V_j is waited for. With one buffer ptxas places that wait before the softmax (the SASS has
    `WARPGROUP.DEPBAR.LE gsb0, 0x0` ahead of the ex2s): this warpgroup's P·V then never runs under its own
    softmax. With two the wait follows the P stores. 16 KB more shared memory; opt-in: the H200 timed it at
    1.02–1.07× the default's time (fec40b5). `gluon_pv_overlap` (the 16-bit warp-specialized kernel, which has
    the same ordering): each consumer stores its row sums into a 256-byte scratch before the P·V wait, a side
    effect that needs every exp2, so the softmax runs under the warpgroup's own P·V; opt-in: 1.00–1.07× the
    default's time there.
    `gluon_mma_sum` (the fp8 kernel with P in shared memory): the row sums by the tensor cores, l += P8·1 as an
    N = 8 wgmma over the e4m3 P beside P·V (against 1 KB of ones the producer writes), instead of 64 FADD a thread
    and tile and a quad shuffle a row on the CUDA cores, whose softmax is the loop's critical path (`PREFILL.md`);
    l then sums the same e4m3 probabilities P·V weighs V by. Each tile's sums start from zero in the wgmma and join
    l in fp32: at `fc7b07d` l rode in the wgmma's accumulator across tiles, and Hopper's fp8 wgmma keeps only ~14
    bits where it adds to a large accumulator, so its error grew with the keys a row sees (H200: RMS 3.05e-2 on
    the Hy3 h64/8 case, 5.6e-2 on 2q1ks4k, over the 3e-2 fp8 budget); promoted a tile, its error on the bench's
    fp8 cases is the CUDA-core sums' or lower (H200, `bench/results/probe_prefill_fp8_err.md`: 2q1ks4k RMS 2.50e-2
    both, h8/1 q4k max 9.2e-3 against 1.08e-2). `gluon_config(fp8=True)` turns it on (bench row `hpcops-fp8q-fsum`:
    the CUDA-core sums beside it).
    `gluon_persist` (the warp-specialized kernel, 16-bit or fp8 with P in shared memory): a persistent grid, a
    program an SM walking the flat tile list in snake order (`prefill_gluon_ws_persist_kernel`), so that the
    producer loads the next q tile's K/V while the consumers finish this one: a program a tile leaves each tile's
    pipeline fill and drain (the q load, the first K/V TMA (fp8: and transpose), the last P·V, the epilogue)
    exposed, ~6-10 % of a tile at q4k-q8k by the bench's per-wave times. Measured on the H200 (two runs,
    `bench/results/prefill_persist_f014e59.md`, `prefill_fexp_qregs_633e984.md`): no faster anywhere, fp8
    1.00-1.04x the default's time at q4k/q8k, bf16 0.97-1.12x its base's; the fill and drain are not what bounds
    the loop (the consumers' softmax is, `PREFILL.md`). Opt-in, kept as the base for overlapping a tile's epilogue
    with the next tile's loop (bench rows `hpcops-fp8q-persist`, `hpcops-persist`).
    `gluon_q_regs` (the fp8 kernel): q in registers as S's A operand, loaded once (16 registers a thread), instead
    of read from shared memory by every S wgmma (a 128×128 fp8 step reads ~190 KB of shared memory: wgmma operands,
    the Vᵀ transpose and P). `gluon_config(fp8=True)` turns it on: H200, same run, 0.986-0.991x the time of q from
    shared memory at every fp8 q4k/q8k case (`bench/results/prefill_fexp_qregs_633e984.md`; bench row
    `hpcops-fp8q-smemq` beside it). A 16-bit q in registers spills (24 bytes a consumer at head_dim 128).
    `gluon_prefetch` (the persistent fp8 kernel with q in registers, `gluon_persist` and `gluon_q_regs`, GQA groups
    of 8, 16, 32 or 64 heads): its producer walks the tiles one ahead and, while the consumers work on a tile, reads
    the next tile's metadata and TMAs its q and q scales into shared memory (`prefill_gluon_ws_prefetch_kernel`), so
    a consumer starts a tile without a global load: in the persistent kernel a tile's start is still a chain of
    dependent round trips (metadata, then q and its scales) before its first S. Measured on an H100 (session 65,
    `bench/results/prefill_prefetch_h100_a8aeb15.md`, bench row `hpcops-fp8q-prefetch`): 4-6 % faster than
    `gluon_persist` at every fp8 q4k/q8k case, 0.92-1.03x the default's time (h64/8 q4k 407.7 against 443.0 µs,
    q8k 1578.2 against 1535.4). The q8k deficit was the bench's row order (the clocks drift over a case): in two
    interleaved rounds (session 66, H100, `bench/results/prefill_queue_h100_ca47d45.md`) it runs 0.91x / 0.96x the
    default's time at h64/8 q4k / q8k (405.1 / 1539.6 against 445.1 / 1596.9 µs: fp8 / bf16 1.303 / 1.306) and
    1.00x at h8/1 (56.8 / 188.5 against 57.0 / 188.4). `gluon_config(fp8=True)` turns it on (with `gluon_persist`)
    for groups of 8-64 heads; bench row `hpcops-fp8q-plain`: the kernel a program a tile beside it.
    `gluon_queue` (with `gluon_prefetch`): the producer takes each next tile from a counter a launch (one relaxed
    atomic add, `_take_tile`) instead of the snake's fixed walk, so a program that finishes early takes the next
    heaviest tile, as the hardware's block scheduler hands tiles to the non-persistent kernel; the consumers walk
    until the slot they read says the end. The counter (int32, one a device and stream: `_tile_queue`) is 0 before
    a launch and put back to 0 by its last take: no memset, CUDA-graph safe; launches of one counter must not run
    concurrently (two streams: two counters). Measured slower than the snake (session 66, H100, same run as above,
    µs queue / prefetch: h64/8 q4k 408.1 / 405.1, q8k 1573.6 / 1539.6, h8/1 q4k 73.7 / 56.8, q8k 194.8 / 188.5):
    the next tile is taken when the current one starts, so at two tiles a program heavy tiles pair at random where
    the snake pairs the heaviest with the lightest (PREFILL.md). Opt-in (bench row `hpcops-fp8q-queue`).
    `gluon_vt3` (the fp8 kernels): three Vᵀ buffers instead of two (16 KB more shared memory at the default tile), so
    the producer may transpose V_j once P·V_{j-3} is done in both consumers, not P·V_{j-2}. Nsight Compute on h8/1 q4k
    (session 67, H100, `bench/results/ncu_prefill_q4k_h8_h100_84a654c.txt`) found the consumers' waits in their
    softmax loops on `vt_full` (the transposed V) and the producer, whose transpose it is, busy 83 % of its samples:
    with a step more of slack its transposes may run ahead. Opt-in (bench row `hpcops-fp8q-vt3`). Measured level
    with two (session 68, H100, `bench/results/prefill_fp8_rounds_h100_2064bf4.md`, µs vt3 / default: h64/8 q4k
    405.2 / 401.7, q8k 1541.2 / 1533.4, h8/1 q4k 57.0 / 56.2, q8k 186.1 / 191.4): the producer is short of
    throughput, not of slack.
    `gluon_vt_prmt` (the fp8 kernels at block_n 128, head_dim 64 or 128, P in shared memory): the producer's
    permuted V transpose as 4×4 byte blocks by inline-asm PRMT (`_transpose_v_prmt`: 64 PRMT a thread and tile at
    D 128) instead of `convert_layout` of the fp8 tile (119 PRMT and more registers: sm_90 SASS). Measured on an
    H100 (session 68, `bench/results/prefill_prmt_h100_c060fea.md`, two interleaved rounds, µs against the
    convert_layout transpose): h64/8 q4k 390.2 / 407.8, q8k 1498.7 / 1525.1, h8/1 q4k 55.7 / 56.0, q8k 180.1 /
    191.6. `gluon_config(fp8=True)` turns it on where the tile allows; bench row `hpcops-fp8q-cvt`: the default
    with the convert_layout transpose.
    `gluon_wide_store` (every Gluon kernel): the epilogue stores the output in 16-byte pieces, a warp's store
    covering whole rows (`convert_layout` through shared memory first), instead of 4 bytes a thread from the wgmma
    accumulator's layout, where one store instruction touches 8 rows of the GQA-packed tile (8 lines). The kernel
    trace (`scripts/probe_prefill_trace.py`, session 71, H100, `bench/results/probe_prefill_trace_h100.md`) put the
    epilogue at ~2200 cycles a q tile in both dtypes: 32 such stores a thread on 8 warps, ~2048 lines through
    the SM's load/store unit; the wide stores took it to ~1000 (session 72, same probe) and the SM-to-SM spread of
    the fp8 kernel's end at h8/1 q4k from 51-62 µs to 51-54 µs. `gluon_config`'s default for the 128-row tiles
    (every fp8 one) since session 72 (H100, two and three interleaved rounds,
    `bench/results/prefill_wstore_h100_951d61e.md`: fp8 0.92-0.97x the time of the 4-byte stores at h64/8 and h8/1
    q4k / q8k but one run of h8/1 q8k at 1.01x, bf16 0.93-0.95x at q4k), and for the 64-row tile of few-tile
    shapes since session 73 (H100, two interleaved rounds, `bench/results/prefill_wide64_h100_a23925e.md`: 10.8 /
    27.8 µs against 11.4 / 28.5 at h8/1 q512 / q1ks2k). Bench rows `hpcops-narrow` (the 128-row tile),
    `hpcops-narrow64` (the 64-row one), `hpcops-bf16kv-narrow` and `hpcops-fp8q-narrow` time the 4-byte stores.
    With fp8 the conversion takes 16 KB of shared memory (the compiler's scratch): four K/V buffers no longer fit
    beside it.
    `tma`, `pv_fp8`, `quant_q` and `fma_scale` are the `tl` kernel's (the Gluon kernel always reads by TMA and
    scales inside exp2).
    """

    block_m: int = 128
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 2
    pv_fp8: bool = False
    tma: bool | None = None
    quant_q: bool = False
    fma_scale: bool = True
    heads_inner: bool = False
    gluon: bool | None = False
    gluon_ws: bool = False
    gluon_p_regs: bool = False
    gluon_tree: bool = False
    gluon_p_dbuf: bool = False
    gluon_pv_overlap: bool = False
    gluon_mma_sum: bool = False
    gluon_persist: bool = False
    gluon_q_regs: bool = False
    gluon_prefetch: bool = False
    gluon_queue: bool = False
    gluon_vt3: bool = False
    gluon_vt_prmt: bool = False
    gluon_wide_store: bool = False

    def __post_init__(self):
        for name in ("block_m", "block_n"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"PrefillConfig.{name} must be a power of two >= 16, got {v}")
        if self.pv_fp8 and self.block_n < 32:
            raise ValueError(
                f"PrefillConfig.pv_fp8 needs block_n >= 32 (an fp8 P·V dot has K = block_n and fp8 MMAs "
                f"take K >= 32), got block_n={self.block_n}"
            )


def prefill_config(
    *,
    head_dim: int,
    group: int,
    max_seqlen_q: int,
    q_dtype: torch.dtype,
    kv_dtype: torch.dtype,
    gluon: bool | None = False,
    num_kv_heads: int | None = None,
    total_q: int | None = None,
) -> PrefillConfig:
    """The heuristic config (H200 sweeps, bench/results/prefill_tune_*.md): for D = 128 a 16-bit q runs
    64×64 tiles on one warpgroup, an fp8 q over fp8 KV 128×128 tiles on two, both in tile-major order;
    smaller M tiles for short queries. `gluon` (True or None, `PrefillConfig.gluon`): the Gluon kernel's tiles
    (`gluon_config`, which also reads `num_kv_heads` and `total_q`) where it takes this dtype pair, a 16-bit q
    over KV of its dtype or an fp8 q over fp8 KV; None keeps the tl tiles where `gluon_config` finds the tl
    kernel faster."""
    fp8 = kv_dtype == FP8_E4M3 and q_dtype == FP8_E4M3
    if gluon is not False and (fp8 or (q_dtype in HALF_DTYPES and kv_dtype == q_dtype)):
        cfg = gluon_config(head_dim=head_dim, group=group, max_seqlen_q=max_seqlen_q, num_kv_heads=num_kv_heads,
                           total_q=total_q, gluon=gluon, fp8=fp8)
        if cfg is not None:
            return cfg
    heads_inner = False
    if head_dim <= 64:
        block_m, block_n, warps, stages = 128, 64, 8, 3
    elif head_dim <= 128 and fp8:
        # tile-major order: 1–20 % faster at h64/8 fp8 q up to q4k in the sweep
        block_m, block_n, warps, stages = 128, 128, 8, 2
        heads_inner = True
    elif head_dim <= 128:
        # one warpgroup per 64-row tile: 7–23 % faster than 128×64 on 8 warps for every bf16 case of the
        # sweep (more programs per SM overlap one's softmax with another's MMAs); tile-major order adds
        # 4–9 % at h64/8 up to q4k (−2.6 % at q8k)
        block_m, block_n, warps, stages = 64, 64, 4, 2
        heads_inner = True
    else:
        # 64×32 on two warpgroups: ptxas spills nothing (the former 64×64 / 4 warps spilled ~0.5 KB)
        block_m, block_n, warps, stages = 64, 32, 8, 2
    rows = group * max(int(max_seqlen_q), 1)
    block_m = min(block_m, max(16, triton.next_power_of_2(rows)))
    block_m = max(block_m, triton.next_power_of_2(group))
    if block_m < 64 or (block_m == 64 and head_dim <= 128):
        warps = 4
    elif block_m >= 128:
        warps = 8  # a group wider than 64 heads: two warpgroups for its 128-row tile
    return PrefillConfig(block_m=block_m, block_n=block_n, num_warps=warps, num_stages=stages, heads_inner=heads_inner)


GLUON_SMEM_BYTES = 227 * 1024  # an H100/H200 SM's shared memory for one block
GLUON_WS_CONSUMER_REGS = 240  # registers of a consumer warpgroup in the warp-specialized kernel
# fp8: the consumers' and the 4-warp producer's registers (the producer transposes V): 2 · 224 + 56 = 504, the
# launch's 168 a thread over 3 warpgroups (no spill in ptxas)
GLUON_WS_FP8_REGS = (224, 56)
# the persistent fp8 kernel (`gluon_persist`): its producer keeps the tile walk's state beside the transpose (56
# spilled ~56 bytes in its K/V loop in ptxas), its consumers need less than 224 (208 builds without a spill)
GLUON_WS_FP8_PERSIST_REGS = (216, 72)
# the persistent 16-bit kernel: consumers and the 1-warp producer, which walks the tiles too (at 24 it spilled 48
# bytes in ptxas, at 40 24)
GLUON_WS_PERSIST_REGS = (240, 40)
# the prefetching persistent fp8 kernel (`gluon_prefetch`): the producer also carries the next tile's metadata (at
# (216, 72) ptxas spilled 72 bytes, at (208, 88) 48)
GLUON_WS_FP8_PREFETCH_REGS = (208, 88)
GLUON_FEW_TILES = 96  # fewer 128-row tiles than this (of an H200's 132 SMs) run on 64-row tiles
GLUON_MIN_Q = 512  # up to this q_len with many tiles the heuristic keeps the tl kernel (faster at h64/8 q512)


def gluon_smem_bytes(block_m: int, block_n: int, stages: int, head_dim: int, elem_bytes: int = 2,
                     fp8: bool = False, p_bufs: int = 1, row_sums: bool = False, mma_sum: bool = False,
                     vt_bufs: int = 2) -> int:
    """Shared memory of a Gluon prefill program: its q tile and `stages` K/V buffer pairs; `fp8` (the
    warp-specialized kernel over fp8 q and KV, 1-byte elements) adds the `vt_bufs` Vᵀ [D, block_n] buffers (3 with
    `gluon_vt3`) and each consumer's `p_bufs` e4m3 P [64, block_n] (2 with `gluon_p_dbuf`); `row_sums`
    (`gluon_pv_overlap`) the two consumers' [64] fp32 scratch; `mma_sum` (`gluon_mma_sum`, fp8) the [8, block_n]
    e4m3 ones."""
    if fp8:
        ones = 8 * block_n if mma_sum else 0
        return (block_m + 2 * stages * block_n) * head_dim + (vt_bufs * head_dim + 2 * 64 * p_bufs) * block_n + ones
    return (block_m + 2 * stages * block_n) * head_dim * elem_bytes + (2 * 64 * 4 if row_sums else 0)


def gluon_config(*, head_dim: int, group: int, max_seqlen_q: int, num_kv_heads: int | None = None,
                 total_q: int | None = None, gluon: bool | None = True, fp8: bool = False) -> PrefillConfig | None:
    """The Gluon kernel's tiles (`PrefillConfig.gluon`), from the H200 sweep (`bench/results/prefill-gluon_tune.md`):
    the warp-specialized kernel on 128-row q tiles, 128-key tiles up to head_dim 128 (64 above) and three K/V buffers
    where they fit in shared memory (two at head_dim 256); 64-row tiles on one warpgroup (not specialized) where
    fewer than GLUON_FEW_TILES 128-row tiles would leave SMs idle (h8/1 q512 and q1ks2k, 32 and 64 tiles: 1.3-1.8x;
    at 128 tiles, h8/1 q2k and 2q1ks4k, the warp-specialized tile is level or faster). `gluon=None`
    (the automatic choice) returns None where the tl kernel is the faster one: q_len·G under 64 rows (the tl tile
    shrinks to 16 rows), or a longest query of at most GLUON_MIN_Q tokens with many tiles.
    `fp8` (an fp8 q over fp8 KV): the warp-specialized kernel in fp8 on 128×128 tiles and three K/V buffers for
    every query of 64 rows and more (faster than the tl fp8-q kernel at every case of the prefill suite, h8/1 q512's
    32 tiles included: 0.68-0.96x its time, bench/results/prefill.md), its row sums on the tensor cores
    (`gluon_mma_sum`) and q in registers (`gluon_q_regs`), None below; for GQA groups of 8, 16, 32 or 64 heads as the
    persistent kernel whose producer prefetches each tile's q (`gluon_persist`, `gluon_prefetch`: on an H100, in two
    interleaved rounds, 0.91x / 0.96x the time of the non-persistent kernel at h64/8 q4k / q8k and level at h8/1,
    `bench/results/prefill_queue_h100_ca47d45.md`; where q's layout does not suit its TMA, `prefill_attention`
    takes the non-persistent kernel, `_without_prefetch`); its producer transposes V by byte permutes where the
    tile allows (`gluon_vt_prmt`: block_n 128 at head_dim 64 or 128). Every Gluon tile stores its output in 16-byte
    pieces (`gluon_wide_store`; its measurements in `PrefillConfig`'s docstring)."""
    rows = group * max(int(max_seqlen_q), 1)
    if fp8:
        if gluon is None and rows < 64:
            return None
        block_n = 128 if head_dim <= 128 else 64
        stages = 3 if gluon_smem_bytes(128, block_n, 3, head_dim, 1, True, mma_sum=True) <= GLUON_SMEM_BYTES else 2
        prefetch = group in (8, 16, 32, 64)
        return PrefillConfig(block_m=128, block_n=block_n, num_warps=8, num_stages=stages, heads_inner=True,
                             gluon=gluon, gluon_ws=True, gluon_mma_sum=True, gluon_q_regs=True,
                             gluon_persist=prefetch, gluon_prefetch=prefetch,
                             gluon_vt_prmt=block_n == 128 and head_dim in (64, 128), gluon_wide_store=True)
    tiles = None
    if num_kv_heads is not None and total_q is not None:
        tiles = num_kv_heads * triton.cdiv(max(int(total_q), 1) * group, 128)
    few = rows <= 64 or (tiles is not None and tiles < GLUON_FEW_TILES)
    if gluon is None and (rows < 64 or (not few and max_seqlen_q <= GLUON_MIN_Q)):
        return None
    block_m = 64 if few else 128
    block_n = 128 if head_dim <= 128 else 64
    stages = 3 if gluon_smem_bytes(block_m, block_n, 3, head_dim) <= GLUON_SMEM_BYTES else 2
    return PrefillConfig(block_m=block_m, block_n=block_n, num_warps=block_m // 16, num_stages=stages,
                         heads_inner=True, gluon=gluon, gluon_ws=block_m == 128, gluon_wide_store=True)


def _check_mode(check: bool | None, seq_lens: torch.Tensor) -> bool:
    """Always on the host; else `check`, or by default checking mode outside graph capture."""
    if seq_lens.device.type == "cpu":
        return True
    if check is not None:
        return bool(check)
    return values_checkable(seq_lens)


def _check_metadata(q, k_cache, block_table, seq_lens, cu_seqlens_q) -> None:
    """Value checks on the metadata (a host copy: free on the CPU, a sync on the GPU)."""
    cu = cu_seqlens_q.cpu().long()
    sl = seq_lens.cpu().long()
    if cu.numel() and int(cu[0]) != 0:
        raise ValueError(f"cu_seqlens_q must start at 0, got {int(cu[0])}")
    q_lens = cu[1:] - cu[:-1]
    if bool((q_lens < 0).any()):
        raise ValueError("cu_seqlens_q must be non-decreasing")
    if cu.numel() and int(cu[-1]) > q.shape[0]:
        raise ValueError(f"cu_seqlens_q[-1] = {int(cu[-1])} exceeds the {q.shape[0]} rows of q")
    if bool((q_lens > sl).any()):
        b = int((q_lens > sl).nonzero()[0])
        raise ValueError(
            f"request {b}: q_len {int(q_lens[b])} > seq_lens {int(sl[b])} "
            "(seq_lens counts the whole sequence, new tokens included)"
        )
    page = k_cache.shape[1]
    need = int(((sl + page - 1) // page).max()) if sl.numel() else 0
    if need > block_table.shape[1]:
        raise ValueError(
            f"block_table has {block_table.shape[1]} columns but seq_lens needs {need} pages of {page} tokens"
        )
    check_block_table_values(block_table, sl, page, k_cache.shape[0])


def _validate(
    q,
    k_cache,
    v_cache,
    block_table,
    seq_lens,
    cu_seqlens_q,
    max_seqlen_q,
    k_scale,
    v_scale,
    q_scale,
    out,
    check,
):
    check_tensor("q", q, dtypes=(*HALF_DTYPES, FP8_E4M3), ndim=3)
    total_q, hq, d = q.shape
    if d not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {SUPPORTED_HEAD_DIMS}, got {d}")
    dev = q.device
    q_fp8 = q.dtype == FP8_E4M3
    kv_dtypes = (FP8_E4M3,) if q_fp8 else (q.dtype, FP8_E4M3)
    check_tensor("k_cache", k_cache, dtypes=kv_dtypes, ndim=4, device=dev)
    nb, page, hkv, _ = k_cache.shape
    check_tensor("k_cache", k_cache, shape=(None, None, None, d))
    check_tensor("v_cache", v_cache, dtypes=(k_cache.dtype,), shape=tuple(k_cache.shape), device=dev)
    if hkv < 1 or hq % hkv:
        raise ValueError(f"the number of query heads ({hq}) must be a multiple of num_kv_heads ({hkv})")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must have a contiguous last (head_dim) dimension")
    check_tensor("block_table", block_table, dtypes=(torch.int32,), ndim=2, device=dev)
    b = block_table.shape[0]
    if b and block_table.shape[1] == 0:
        raise ValueError("block_table must have at least one column")
    check_tensor("seq_lens", seq_lens, dtypes=(torch.int32,), shape=(b,), device=dev)
    check_tensor("cu_seqlens_q", cu_seqlens_q, dtypes=(torch.int32,), ndim=1, device=dev)
    if cu_seqlens_q.shape[0] != b + 1:
        raise ValueError(
            f"cu_seqlens_q must have B+1 = {b + 1} entries (B = block_table.shape[0]), got {cu_seqlens_q.shape[0]}"
        )
    if isinstance(max_seqlen_q, torch.Tensor) or not isinstance(max_seqlen_q, int) or max_seqlen_q < 0:
        raise TypeError(f"max_seqlen_q must be a non-negative host int, got {max_seqlen_q!r}")
    kv_fp8 = k_cache.dtype == FP8_E4M3
    if kv_fp8:
        if k_scale is None or v_scale is None:
            raise ValueError("an fp8 KV cache needs k_scale and v_scale (fp32 tensors of one element)")
        check_scale("k_scale", k_scale, device=dev)
        check_scale("v_scale", v_scale, device=dev)
    if q_fp8:
        if q_scale is None:
            raise ValueError("fp8 q needs q_scale (fp32 [total_q, num_heads], per token per head)")
        check_tensor("q_scale", q_scale, dtypes=(torch.float32,), shape=(total_q, hq), device=dev)
    elif q_scale is not None:
        raise ValueError(f"q_scale is for an fp8 q; q is {str(q.dtype).replace('torch.', '')}")
    out_dtype = torch.bfloat16 if q_fp8 else q.dtype
    if out is not None:
        check_tensor("out", out, dtypes=(out_dtype,), shape=(total_q, hq, d), device=dev)
    if _check_mode(check, seq_lens):
        _check_metadata(q, k_cache, block_table, seq_lens, cu_seqlens_q)
    return out_dtype


def _use_tma(k_cache: torch.Tensor, v_cache: torch.Tensor, config: PrefillConfig) -> bool:
    """TMA when `config.tma` is None and the layout allows it; always / never for True / False."""
    if config.tma is False:
        return False
    why = tma_unsupported_reason(k_cache, config.block_n) or tma_unsupported_reason(v_cache, config.block_n)
    if why is None:
        return True
    if config.tma:
        raise ValueError(f"PrefillConfig(tma=True) but the KV cache cannot be read with TMA: {why}")
    return False


def gluon_unsupported_reason(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             config: PrefillConfig, scale: float, out: torch.Tensor | None = None) -> str | None:
    """Why the Gluon prefill kernel (`PrefillConfig.gluon`) cannot serve this call (None: it can)."""
    why = _decode._hopper(q.device)
    if why is not None:
        return why
    d = q.shape[-1]
    for name, t in (("q", q), ("out", out)):
        if t is not None and t.stride(-1) != 1:
            return f"{name} is not contiguous along head_dim"
    fp8 = q.dtype == FP8_E4M3
    if (q.dtype not in HALF_DTYPES and not fp8) or k_cache.dtype != q.dtype:
        return (f"q {q.dtype} over a {k_cache.dtype} cache (the Gluon kernels take a 16-bit q over the same KV dtype, "
                "or with gluon_ws an fp8 q over fp8 KV)")
    if not scale > 0:
        return f"softmax scale {scale} (the Gluon kernel scales inside exp2: it needs a positive scale)"
    page = k_cache.shape[1]
    why = gluon_config_reason(config, fp8=fp8, head_dim=d, group=q.shape[1] // k_cache.shape[2], page=page,
                              elem_bytes=q.element_size())
    if why is not None:
        return why
    if config.gluon_prefetch and (q.stride(1) != d or q.stride(0) != q.shape[1] * d or q.data_ptr() % 16):
        return "gluon_prefetch reads q by TMA as [tokens·heads, head_dim]: q must be contiguous and 16-byte aligned"
    return kv_tma_unsupported_reason(k_cache, v_cache, min(config.block_n, page))


def gluon_config_reason(config: PrefillConfig, *, fp8: bool, head_dim: int, group: int, page: int,
                        elem_bytes: int) -> str | None:
    """Why the Gluon prefill kernel cannot run `config` for this shape (None: it can): the dtype's paths and knobs,
    the tile, the pages, shared memory. The config part of `gluon_unsupported_reason`, which adds the device, the
    tensors and TMA; `hpcops tune prefill-gluon` asks it which candidates are valid."""
    d = head_dim
    if fp8 and not config.gluon_ws:
        return "an fp8 q over fp8 KV runs on the warp-specialized kernel only (gluon_ws)"
    if config.gluon_p_regs and not fp8:
        return "gluon_p_regs is for an fp8 q over fp8 KV (a 16-bit P is always in registers)"
    if config.gluon_p_dbuf and (not fp8 or config.gluon_p_regs):
        return "gluon_p_dbuf is for an fp8 q over fp8 KV with P in shared memory (not gluon_p_regs)"
    if config.gluon_pv_overlap and (fp8 or not config.gluon_ws):
        return "gluon_pv_overlap is for the 16-bit warp-specialized kernel (fp8: gluon_p_dbuf)"
    if config.gluon_mma_sum and (not fp8 or config.gluon_p_regs):
        return "gluon_mma_sum is for an fp8 q over fp8 KV with P in shared memory (not gluon_p_regs)"
    if config.gluon_persist and (not config.gluon_ws or config.gluon_p_regs):
        return ("gluon_persist is for the warp-specialized kernel (gluon_ws), fp8 with P in shared memory "
                "(not gluon_p_regs)")
    if config.gluon_prefetch and not (fp8 and config.gluon_persist and config.gluon_q_regs):
        return "gluon_prefetch is for the persistent fp8 kernel with q in registers (gluon_persist, gluon_q_regs)"
    if config.gluon_queue and not config.gluon_prefetch:
        return "gluon_queue is for the prefetching persistent fp8 kernel (gluon_prefetch)"
    if config.gluon_vt3 and not fp8:
        return "gluon_vt3 is for an fp8 q over fp8 KV (the producer's Vᵀ buffers)"
    if config.gluon_vt_prmt and not (fp8 and config.block_n == 128 and d in (64, 128) and not config.gluon_p_regs):
        return ("gluon_vt_prmt is for the permuted Vᵀ transpose: an fp8 q over fp8 KV, block_n 128, head_dim 64 or "
                "128, P in shared memory (not gluon_p_regs)")
    if config.gluon_prefetch and group not in (8, 16, 32, 64):
        return (f"gluon_prefetch with a GQA group of {group} heads (its q boxes are one token's heads: whole 8-row "
                "swizzle atoms of a 64-row q, so 8, 16, 32 or 64)")
    if config.gluon_q_regs and not fp8:
        return ("gluon_q_regs is for an fp8 q over fp8 KV (a 16-bit q in registers spills: 24 bytes a consumer at "
                "head_dim 128 in ptxas)")
    if fp8 and d > 128:
        return f"head_dim {d} with fp8 (the fp8 consumer's registers spill above 128: 496 bytes at 256 in ptxas)"
    if fp8 and config.block_n % 32:
        return f"block_n {config.block_n} with fp8 (an fp8 P·V dot has K = block_n: a multiple of 32)"
    bm, bn = config.block_m, config.block_n
    if bm not in (64, 128) or config.num_warps != bm // 16:
        return f"block_m {bm} on {config.num_warps} warps (64 or 128 rows, 16 a warp)"
    if config.gluon_ws and bm != 128:
        return f"gluon_ws with block_m {bm} (two consumer warpgroups of 64 rows: block_m 128)"
    if bm < group:
        return f"block_m {bm} is below the GQA group ({group} heads)"
    if bn > 256 or config.num_stages < 2:
        return f"block_n {bn} / num_stages {config.num_stages} (at most 256 keys a tile, two buffers at least)"
    if page < bn and (page < 8 or bn % page):
        return f"block_size {page} (pages under block_n {bn} must divide it, 8 tokens at least)"
    smem = gluon_smem_bytes(bm, bn, config.num_stages, d, elem_bytes, fp8, 2 if config.gluon_p_dbuf else 1,
                            config.gluon_pv_overlap, config.gluon_mma_sum, 3 if config.gluon_vt3 else 2)
    if config.gluon_prefetch:  # its ring of two q tiles, their scales and metadata (an upper bound: sm_90 builds
        smem += 2 * 128 * d + 2 * 128 * 4 + 128  # at the default tile measured 182888 bytes against 198784 here)
    if config.gluon_wide_store and fp8:  # the output's layout conversion through the compiler's scratch: a
        smem += 64 * d * 2  # consumer's 64 rows of 16-bit output (sm_90 builds: 16 KB more at head_dim 128)
    vts = "three" if config.gluon_vt3 else "two"
    what = f"q and {config.num_stages} K/V buffers" + (f", {vts} Vᵀ buffers and each consumer's P" if fp8 else "")
    if smem > GLUON_SMEM_BYTES:
        return f"{smem} bytes of shared memory for {what} (at most {GLUON_SMEM_BYTES})"
    return None


def _prefetch_descriptors(q: torch.Tensor, q_scale: torch.Tensor, group: int):
    """`gluon_prefetch`'s TMA descriptors: q as [tokens·heads, head_dim] with one token's `group` heads a box, and
    q_scale [tokens, heads] with a consumer's 64 rows (64 / group tokens) a box (q_scale made contiguous if not)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    t, h, d = q.shape
    q2 = q.view(t * h, d)
    q_desc = TensorDescriptor(q2, [t * h, d], [d, 1], [group, d],
                              gl.NVMMASharedLayout.get_default_for([group, d], gl.float8e4nv))
    aligned = q_scale.stride() == (h, 1) and q_scale.data_ptr() % 16 == 0
    qs = q_scale if aligned else q_scale.clone(memory_format=torch.contiguous_format)  # a fresh, aligned copy
    qs_desc = TensorDescriptor(qs, [t, h], [h, 1], [64 // group, group],
                               gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2))
    return q_desc, qs_desc


_TILE_QUEUES: dict[tuple[int, int], torch.Tensor] = {}


def _tile_queue(device: torch.device) -> torch.Tensor:
    """`gluon_queue`'s tile counter for the current stream of `device`: one int32, zero when made and put back to
    zero by every launch's last take (`_take_tile`), so it needs no memset a call. One a (device, stream): launches
    on one stream run one after another; two streams get two counters."""
    stream = torch.cuda.current_stream(device)
    key = (device.index if device.index is not None else torch.cuda.current_device(), stream.cuda_stream)
    counter = _TILE_QUEUES.get(key)
    if counter is None:
        counter = _TILE_QUEUES[key] = torch.zeros(1, dtype=torch.int32, device=device)
    return counter


def _fp8_mode(config: PrefillConfig) -> int:
    """The fp8 kernel's FP8 constexpr: 1 P through one shared buffer, 2 P in registers, 3 two P buffers."""
    return 2 if config.gluon_p_regs else 3 if config.gluon_p_dbuf else 1


def tile_bounds(total_q: int, num_reqs: int, block_m: int, group: int) -> tuple[int, int]:
    """(tiles_per_head, block_b) of a launch, from host shapes (no sync): Σ_b cdiv(q_len_b, T) <= (Σ q_len_b +
    B (T - 1)) / T with T = block_m / group tokens a tile, and the power-of-two block the kernels scan the requests
    in."""
    tokens = block_m // group
    return (total_q + num_reqs * (tokens - 1)) // tokens, max(16, triton.next_power_of_2(num_reqs))


def gluon_programs(config: PrefillConfig, tiles: int, device) -> int:
    """How many programs `_launch_gluon` launches over `tiles` q tiles: a program an SM (at most one a tile) for the
    persistent kernels, else a program a tile."""
    return max(1, min(tiles, num_sms(device))) if config.gluon_persist else tiles


def _launch_gluon(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, out, sm_scale, tiles_per_head, block_b,
                  config: PrefillConfig, q_scale=None, k_scale=None, v_scale=None, trace=None) -> None:
    """The Gluon kernel (`PrefillConfig.gluon`) over the `tl` kernel's flat tile list; with an fp8 q (its
    `q_scale`) over fp8 KV the warp-specialized kernel's FP8 mode. `trace` (`scripts/probe_prefill_trace.py`; the
    warp-specialized kernel a program a tile, or the prefetching persistent one): an int32 buffer of [programs, 3,
    TRACE_KINDS, TRACE_STEPS] that the kernel's `_stamp`s fill (`_prefill_gluon.py`'s trace section)."""
    from hpcops.attention._prefill_gluon import (
        prefill_gluon_kernel,
        prefill_gluon_ws_kernel,
        prefill_gluon_ws_persist_kernel,
        prefill_gluon_ws_prefetch_kernel,
    )

    hq, d = q.shape[1], q.shape[2]
    page, hkv = k_cache.shape[1], k_cache.shape[2]
    box = min(config.block_n, page)
    args = (q, gluon_kv_descriptor(k_cache, box), gluon_kv_descriptor(v_cache, box), block_table, seq_lens,
            cu_seqlens_q, out, sm_scale * 1.4426950408889634, block_table.shape[0], tiles_per_head, hkv,
            block_table.shape[1], k_cache.shape[0], q.stride(0), q.stride(1), k_cache.stride(2), v_cache.stride(2),
            block_table.stride(0), out.stride(0), out.stride(1))
    common = dict(D=d, G=hq // hkv, TILE=config.block_n, PAGE=page, BLOCK_B=block_b, STAGES=config.num_stages,
                  HEADS_INNER=bool(config.heads_inner))
    bits = (1 if config.gluon_tree else 0) | (2 if config.gluon_pv_overlap else 0) | (4 if config.gluon_mma_sum else 0)
    bits |= (32 if config.gluon_q_regs else 0) | (64 if config.gluon_vt3 else 0) | (128 if config.gluon_vt_prmt else 0)
    bits |= 512 if config.gluon_wide_store else 0
    knobs = {"SOFTMAX": bits} if bits else {}  # the defaults' launches keep their signature
    if trace is not None:
        if not config.gluon_ws or (config.gluon_persist and not config.gluon_prefetch):
            raise ValueError("trace is for the warp-specialized kernel, non-persistent or prefetching")
        knobs.update(TRACE=True, trace_ptr=trace)
    if config.gluon_ws:
        fp8 = q.dtype == FP8_E4M3
        # fp8: q's per token-head scales and the KV scales; else placeholders the kernel does not read
        scales = ((q_scale, q_scale.stride(0), q_scale.stride(1), k_scale, v_scale) if fp8 else
                  (seq_lens, 0, 0, seq_lens, seq_lens))
        # 3 warpgroups (consumer 0 = the default partition, consumer 1, the producer warp rounded up; fp8: a 4-warp
        # producer): 168 registers each at launch, moved by setmaxnreg to 240 / 240 / 24 (fp8: 224 / 224 / 56)
        # inside the specialized region
        grid = (gluon_programs(config, tiles_per_head * hkv, q.device),)
        if config.gluon_prefetch:  # persistent, the producer prefetching each tile's q (gluon_config_reason: fp8)
            queue = _tile_queue(q.device) if config.gluon_queue else seq_lens  # a placeholder it does not read
            prefill_gluon_ws_prefetch_kernel[grid](*args, *scales, *_prefetch_descriptors(q, q_scale, hq // hkv),
                                                   queue, **common, num_warps=4, FP8=_fp8_mode(config),
                                                   FP8_CONSUMER_REGS=GLUON_WS_FP8_PREFETCH_REGS[0],
                                                   FP8_PRODUCER_REGS=GLUON_WS_FP8_PREFETCH_REGS[1], maxnreg=168,
                                                   QUEUE=bool(config.gluon_queue), **knobs)
            return
        if config.gluon_persist:  # a program an SM, each walking q tiles
            prefill_gluon_ws_persist_kernel[grid](*args, *scales, **common, num_warps=4,
                                                  FP8=_fp8_mode(config) if fp8 else 0,
                                                  FP8_CONSUMER_REGS=GLUON_WS_FP8_PERSIST_REGS[0],
                                                  FP8_PRODUCER_REGS=GLUON_WS_FP8_PERSIST_REGS[1],
                                                  CONSUMER_REGS=GLUON_WS_PERSIST_REGS[0],
                                                  PRODUCER_REGS=GLUON_WS_PERSIST_REGS[1], maxnreg=168, **knobs)
            return
        prefill_gluon_ws_kernel[grid](*args, *scales, **common, CONSUMER_REGS=GLUON_WS_CONSUMER_REGS, num_warps=4,
                                      FP8=_fp8_mode(config) if fp8 else 0, FP8_CONSUMER_REGS=GLUON_WS_FP8_REGS[0],
                                      FP8_PRODUCER_REGS=GLUON_WS_FP8_REGS[1], maxnreg=168, **knobs)
    else:
        prefill_gluon_kernel[(tiles_per_head * hkv,)](*args, **common, BLOCK_M=config.block_m,
                                                      num_warps=config.num_warps, **knobs)


def _without_prefetch(config: PrefillConfig) -> PrefillConfig:
    """The fp8 heuristic's config without the prefetching persistent kernel: the non-persistent warp-specialized
    kernel on the same tiles (q read by each consumer's loads, no TMA box over q)."""
    return replace(config, gluon_persist=False, gluon_prefetch=False, gluon_queue=False)


def _choose_kernel(q, k_cache, v_cache, max_seqlen_q, sm_scale, out,
                   config: PrefillConfig | None) -> tuple[PrefillConfig, str | None]:
    """The config a call runs and why the Gluon kernel does not serve it (None: it does). Without `config`, the
    heuristic: the Gluon kernel where it runs and is the faster one, else the tl kernel's tiles; `config.gluon`
    True that cannot serve the call is a ValueError. `q` is read for its dtype, head_dim and strides only."""
    total_q, hq, d = q.shape
    hkv = k_cache.shape[2]
    why = "not asked for"
    if config is None:
        config = prefill_config(head_dim=d, group=hq // hkv, max_seqlen_q=max_seqlen_q, q_dtype=q.dtype,
                                kv_dtype=k_cache.dtype, gluon=None, num_kv_heads=hkv, total_q=total_q)
        if config.gluon is None:
            why = gluon_unsupported_reason(q, k_cache, v_cache, config, sm_scale, out)
            if why is not None and config.gluon_prefetch:  # e.g. a q whose layout its TMA cannot read
                plain = _without_prefetch(config)
                if gluon_unsupported_reason(q, k_cache, v_cache, plain, sm_scale, out) is None:
                    config, why = plain, None
            if why is not None:
                config = prefill_config(head_dim=d, group=hq // hkv, max_seqlen_q=max_seqlen_q, q_dtype=q.dtype,
                                        kv_dtype=k_cache.dtype)
    elif config.gluon is not False:
        why = gluon_unsupported_reason(q, k_cache, v_cache, config, sm_scale, out)
        if why is not None and config.gluon:
            raise ValueError(f"PrefillConfig(gluon=True) cannot serve this call: {why}")
    return config, why


def _launch(
    q,
    k_cache,
    v_cache,
    block_table,
    seq_lens,
    cu_seqlens_q,
    out,
    max_seqlen_q,
    scale,
    k_scale,
    v_scale,
    q_scale,
    config: PrefillConfig | None,
    chosen: tuple[PrefillConfig, str | None] | None = None,
) -> None:
    total_q, hq, d = q.shape
    page, hkv = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    b = block_table.shape[0]
    q_fp8 = q.dtype == FP8_E4M3
    kv_fp8 = k_cache.dtype == FP8_E4M3
    sm_scale = float(scale) if scale is not None else 1.0 / math.sqrt(d)
    config, why = chosen or _choose_kernel(q, k_cache, v_cache, max_seqlen_q, sm_scale, out, config)
    if config.block_m < group:
        raise ValueError(f"PrefillConfig.block_m ({config.block_m}) must be >= the GQA group size ({group})")
    use_gluon = why is None
    # after every argument check: whether the kernels can run where the tensors are
    check_kernel_device("q", q)
    if total_q == 0 or b == 0:
        return
    tiles_per_head, block_b = tile_bounds(total_q, b, config.block_m, group)
    if use_gluon:
        _launch_gluon(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, out, sm_scale, tiles_per_head,
                      block_b, config, q_scale, k_scale, v_scale)
        return
    dummy = k_cache  # stands in for absent optional pointers (never read)
    use_tma = _use_tma(k_cache, v_cache, config)
    if use_tma:
        k_desc, v_desc = kv_descriptor(k_cache, config.block_n), kv_descriptor(v_cache, config.block_n)
    else:
        k_desc, v_desc = dummy, dummy
    quant_q = bool(config.quant_q and kv_fp8 and not q_fp8)
    qs = q_scale if q_fp8 else dummy
    qs_strides = (q_scale.stride(0), q_scale.stride(1)) if q_fp8 else (0, 0)
    grid = (tiles_per_head * hkv,)
    prefill_attention_fwd_kernel[grid](
        q,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        qs,
        *qs_strides,
        k_cache,
        *k_cache.stride(),
        v_cache,
        *v_cache.stride(),
        block_table,
        block_table.stride(0),
        block_table.shape[1],
        k_cache.shape[0],
        seq_lens,
        cu_seqlens_q,
        k_scale if kv_fp8 else dummy,
        v_scale if kv_fp8 else dummy,
        k_desc,
        v_desc,
        out,
        out.stride(0),
        out.stride(1),
        out.stride(2),
        sm_scale,
        b,
        tiles_per_head,
        hkv,
        HEAD_DIM=d,
        GROUP=group,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        PAGE=page,
        BLOCK_B=block_b,
        Q_FP8=q_fp8,
        KV_FP8=kv_fp8,
        PV_FP8=bool(config.pv_fp8 and (q_fp8 or quant_q) and kv_fp8),
        USE_TMA=use_tma,
        QUANT_Q=quant_q,
        FMA_SCALE=bool(config.fma_scale and sm_scale > 0),
        HEADS_INNER=bool(config.heads_inner),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


def quantize_q(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A 16-bit q [T, H, D] (any token and head strides, a contiguous D) to (q8 e4m3 [T, H, D] contiguous, scale
    fp32 [T, H]) with scale = amax over D / 448, rounded as `hpcops.quant.quantize_per_token_head` (its torch
    reference, same signature) rounds: one kernel, no host sync."""
    check_tensor("q", q, dtypes=HALF_DTYPES, ndim=3)
    if q.stride(-1) != 1:
        raise ValueError("q must be contiguous along head_dim (its last dimension)")
    t, h, d = q.shape
    q8 = torch.empty((t, h, d), dtype=FP8_E4M3, device=q.device)
    qs = torch.empty((t, h), dtype=torch.float32, device=q.device)
    check_kernel_device("q", q)
    if t * h:
        block_r = 32
        quantize_q_kernel[(triton.cdiv(t * h, block_r),)](q, q8, qs, t * h, h, q.stride(0), q.stride(1), HEAD_DIM=d,
                                                           D_PAD=triton.next_power_of_2(d), BLOCK_R=block_r,
                                                           num_warps=4)
    return q8, qs


def _quantized_q_for_gluon(q, k_cache, v_cache, max_seqlen_q, scale, out, config):
    """Where the fp8 Gluon kernel will serve the call with q quantized (a bf16 q, whose output dtype the fp8 kernel
    writes; `_choose_kernel` for an fp8 q picks it): (q8, its scales, the kernel choice for `_launch`), q
    quantized by `quantize_q`; else None (nothing launched)."""
    if q.dtype != torch.bfloat16 or (config is not None and config.gluon is False):
        return None
    sm_scale = float(scale) if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    stand_in = torch.empty((0, *q.shape[1:]), dtype=FP8_E4M3, device=q.device)  # dtype, D and strides: an fp8 q
    try:
        chosen = _choose_kernel(stand_in, k_cache, v_cache, max_seqlen_q, sm_scale, out, config)
    except ValueError:  # gluon=True that cannot serve it: the tl route below says so for the 16-bit q
        return None
    if chosen[1] is not None:
        return None
    return (*quantize_q(q), chosen)


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    *,
    max_seqlen_q: int,
    scale: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    q_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    check: bool | None = None,
    config: PrefillConfig | None = None,
    quantize_q: bool = False,
) -> torch.Tensor:
    """Causal attention of the new tokens of each request over its whole paged sequence.

    q: [total_q, Hq, D] bf16/fp16, or fp8 e4m3 with `q_scale` fp32 [total_q, Hq] (per token, per
    head); rows of request b are q[cu_seqlens_q[b]:cu_seqlens_q[b+1]] and are the *last* tokens of
    its sequence (causal mask aligned bottom-right). Rows past cu_seqlens_q[-1] (CUDA-graph padding)
    are not written. D in {64, 128, 256}.
    k_cache, v_cache: [num_blocks, block_size, Hkv, D], any strides with a contiguous D, q's dtype
    or fp8 e4m3 with `k_scale`, `v_scale` fp32 [1] (dequantization multipliers). Hq % Hkv == 0.
    block_table: int32 [B, max_blocks]; seq_lens: int32 [B], total KV length including the new
    tokens; cu_seqlens_q: int32 [B+1]. max_seqlen_q: host int (only picks the tile shape).
    scale: softmax scale, default 1/sqrt(D). out: [total_q, Hq, D] in q's dtype (bf16 for fp8 q).
    check: validate metadata values (a device sync on the GPU; default: env HPCOPS_CHECK=1; always on
    CPU tensors). config: override the launch heuristic.
    Accuracy of an fp8 q over fp8 KV: on an H200 the heuristic runs both GEMMs in fp8 (the warp-specialized
    Gluon kernel), the probabilities rounded to e4m3(P·256), ~2^-5 relative error a weight (the GPU tier's
    bound against the fp32 reference: max 6e-2, rms 3e-2); `config=prefill_config(..., gluon=False)` keeps
    the tl kernel with a bf16 P·V (1.5x slower at h64/8 q8k on the H200).
    quantize_q: with a 16-bit q over an fp8 KV cache, run the fp8-q path: each q row (token, head) to e4m3 with
    scale amax/448, as `quantize_per_token_head` and `rope_norm_store_kv(quantize_q=True)` round it (fp8-q
    accuracy, as above; what vLLM's FlashAttention backend does with an fp8 cache, with a per-tensor scale there).
    Where the fp8 Gluon kernel serves the call (a bf16 q on an sm_90 GPU), a quantizing kernel writes q8 and its
    scales first (one pass over q) and the fp8 kernel runs; elsewhere the tl kernel quantizes its q tile as it
    loads it (`PrefillConfig.quant_q`). `out` stays in q's dtype.
    Returns `out`.
    """
    out_dtype = _validate(
        q,
        k_cache,
        v_cache,
        block_table,
        seq_lens,
        cu_seqlens_q,
        max_seqlen_q,
        k_scale,
        v_scale,
        q_scale,
        out,
        check,
    )
    if not isinstance(quantize_q, bool):
        raise TypeError(f"quantize_q must be a bool, got {type(quantize_q).__name__}")
    if quantize_q and (q.dtype not in HALF_DTYPES or k_cache.dtype != FP8_E4M3):
        raise ValueError(f"quantize_q=True takes a 16-bit q over an fp8 KV cache; q is {q.dtype}, the cache "
                         f"{k_cache.dtype}")
    if out is None:
        out = torch.empty(q.shape, dtype=out_dtype, device=q.device)
    chosen = None
    if quantize_q:
        q8 = _quantized_q_for_gluon(q, k_cache, v_cache, max_seqlen_q, scale, out, config)
        if q8 is not None:  # the fp8 Gluon kernel serves it: q quantized by its own kernel first
            q, q_scale, chosen = q8
        else:  # the tl kernel quantizes its q tiles as it loads them
            d = q.shape[-1]
            config = replace(config or prefill_config(head_dim=d, group=q.shape[1] // k_cache.shape[2],
                                                      max_seqlen_q=max_seqlen_q, q_dtype=q.dtype,
                                                      kv_dtype=k_cache.dtype), quant_q=True)
    _launch(
        q,
        k_cache,
        v_cache,
        block_table,
        seq_lens,
        cu_seqlens_q,
        out,
        max_seqlen_q,
        scale,
        k_scale,
        v_scale,
        q_scale,
        config,
        chosen,
    )
    return out


def _prefill_attention_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    out: torch.Tensor,
    max_seqlen_q: int,
    scale: float | None,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    q_scale: torch.Tensor | None,
) -> None:
    prefill_attention(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, max_seqlen_q=max_seqlen_q,
                      scale=scale, k_scale=k_scale, v_scale=v_scale, q_scale=q_scale, out=out)


def _prefill_attention_fake(
    q,
    k_cache,
    v_cache,
    block_table,
    seq_lens,
    cu_seqlens_q,
    out,
    max_seqlen_q,
    scale,
    k_scale,
    v_scale,
    q_scale,
) -> None:
    return None


# torch.ops.hpcops.prefill_attention(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, out,
# max_seqlen_q, scale, k_scale, v_scale, q_scale): the mutating out= form, for torch.compile and graphs
prefill_attention_op = register(
    "prefill_attention", _prefill_attention_op, mutates_args=("out",), fake=_prefill_attention_fake
)

__all__ = [
    "PrefillConfig",
    "gluon_config",
    "gluon_smem_bytes",
    "gluon_unsupported_reason",
    "prefill_attention",
    "prefill_config",
    "prefill_attention_op",
    "quantize_q",
]
