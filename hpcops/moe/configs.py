"""Tile configurations for the fused MoE: a heuristic from the average tokens per expert, overridden by
measured entries of a tuned table (`hpcops/moe/tuned.py`, or a JSON file named by `HPCOPS_MOE_TUNED`).

No autotuning at run time: `get_config` maps (tokens, top-k, experts, H, I, quantization, device) to a
frozen `MoeConfig`; tests and benchmarks pass their own `MoeConfig` to `fused_moe(..., config=...)`.
"""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass, fields, replace

ACT_MUL_MODES = ("fp32", "bf16")


@dataclass(frozen=True)
class MoeConfig:
    """Tiles and launch parameters of the three GEMM-side kernels and the index build.

    Gate-up GEMM: a program computes `block_m` expert-sorted rows × `block_n` activation columns, i.e.
    reads `2·block_n` rows of w13 (the gate rows and the matching up rows), looping over H by `block_k`.
    Down GEMM: `block_m` rows × `down_block_n` output columns, looping over I by `down_block_k`.
    For `Fp8Block128`, both K tiles must be 128 and `block_n`, `down_block_n` must divide 128.

    `index_small_max`: up to this many (token, slot) pairs the index is built by one program (sort);
    above it by count (atomics) / scan / scatter kernels.
    `act_mul`: "fp32" computes silu(gate)·up on the fp32 accumulators; "bf16" rounds gate and up to the
    16-bit activation dtype first and rounds silu(gate) before the product, as torch does in bf16.
    `prequant_x`: quantize a bf16/fp16 x to fp8 in a separate pass (one read of x) instead of inside
    every gate-up program's loader (which re-reads bf16 rows once per N tile): pays for large batches.
    `index_quant` (default on): where the index is built by one program (up to `index_small_max` pairs, not
    `naive_max_pairs`), x's fp8 quantization pass (`prequant_x`, dynamic per-token or 128-group scales) runs as T
    more programs of that launch, one launch less before the GEMMs; the gate-up GEMM's launch starts once it has
    exited (`pdl`: its programs wait before they read the index). Off: the index, then the quantization alone.
    Measured on the H200 (bench/results/moe_index_quant.md, kernel sums, same run): Hy3 EP8 fp8 B4 26.5 against
    27.7 µs, TP8 fp8 B16 65.5 / 66.5, EP8 fp8 B64 107.7 / 109.8 (profiler, pdl off; the quantization costs
    nothing beside the one-program sort).
    `validate_ids`: check topk_ids values on the host (a device sync) when not capturing a CUDA graph.
    `swap_ab`: both GEMMs compute weights × activations^T, the weight rows on the tensor core's M side
    (Hopper's wgmma needs 64 rows there): for M tiles below 64 rows.
    `naive_max_pairs`: up to this many (token, slot) pairs there is no index at all: one task per pair,
    its expert read from topk_ids; a weight tile is read once per pair routed to its expert (decode).
    `fp8_promote`: fp8 per-tensor tiles add their MMA's sum to the fp32 accumulator after at most this many
    products, and at least once a K step (`max_num_imprecise_acc` = min(fp8_promote, the K tile);
    `_moe_kernels._mma`); 0: never (Triton's sm_90 default, one reduced-precision sum over the whole K loop); a
    multiple of 32 (the fp8 MMA's K step). None (default): 128 on the swap-AB tiles and on a GEMM whose fp8 input
    has per-token (dynamic) scales, 0 elsewhere. Hopper's fp8 MMA keeps a reduced-precision sum, so the error grows
    with K (Hy3 T 2048 on the H200, bench/results/probe_moe_wide_promote.md): with dynamic scales max 6.9e-2 / rms
    2.8e-2 unpromoted, over the fp8 budget (4e-2 / 1.5e-2), 4.0e-3 / 4.8e-3 promoted; with static scales 1.1e-2 /
    9.1e-3 and 6.5e-3 / 4.2e-3, where promoting the 64+ row tiles costs 14 % (T 2048) to 33 % (T 16384) of the
    layer's time (moe_promote_63253cc.md).
    `pdl` (sm_90 and later; ignored elsewhere and in the interpreter): the gate-up, down and reduce kernels are
    launched with programmatic dependent launch, so each one's programs start on the SM slots the previous kernel
    leaves free (its launch and start-up under the previous kernel's tail) and wait (griddepcontrol.wait) before
    they read its output; 0 off, 1 (default) a kernel releases the next one at each program's start, 2 once the
    program's work is done. Measured on the H200 (bench/results/moe_pdl_e45d138.md, graph replay): 1 is 0.93x the
    time without at TP8 fp8 B4, 0.94x at EP8 fp8 B4, 0.96-0.99x at every other B 4-64 case; 2 0.96-1.00x.
    `down_n_per`: N tiles a down GEMM program computes (1: a program a tile), in one flat loop over (N tile, K
    step) so that a single software pipeline streams their weight tiles and a tile's epilogue runs under the next
    tiles' loads; with `down_block_k` ≥ I (one K step, masked) the activation tile is loaded once and the loop runs
    over N alone. Measured on the H200 (bench/results/profile_moe_large_b_53018d0.txt): Hy3 TP8 fp8 T 16384 with
    32 tiles and one K step of 256, down GEMM 526 against 625 µs (the tuned entry); the flat loop is slower there
    and at T 2048-4096, and level or slower at decode sizes (moe_down_n_per_4e4c50e.md).
    `split_k`: gate-up programs a task's K loop (over H) is split over (1: one). Each stores an fp32 partial tile
    and the last of them to finish sums them in a fixed order (the result is the same whichever is last) and runs
    the epilogue; a per-call workspace of split_k fp32 tiles per task and a zeroed count per task come with it. For
    small batches with few tasks: there a gate-up program's time follows its K steps, not its bytes (the 128-block
    fp8 tile waits on its MMA and scales every step), and fewer tasks than SMs leave SMs idle: Hy3 EP8 fp8 128-block
    T 4, gate-up 28.4 µs over 32 K steps, 16.3 over 16 (bench/results/probe_moe_ksteps_2c734ee.md). The heuristic
    splits the 128-block scheme only (`gate_up_split`: Hy3 EP8 T 4 over 2, DeepSeek-V3 TP8 T 1 over 8, 0.89x vLLM's
    GEMMs there against 1.91x unsplit); the per-tensor and 16-bit tiles measured 3-25 % slower split
    (moe_split_k_addaa6c.md).
    `gluon` (opt-in; sm_90, the fp8 128-block scheme at decode tiles: `swap_ab`, `block_m` 16, `block_n` and
    `block_k` 128, x quantized up front, no fused shared expert): the gate-up GEMM as a Gluon kernel
    (`_moe_gluon.py`) that keeps a K step's MMAs in flight while the previous step's result is scaled, where the
    `tl` kernel waits for every step's MMA before the next (the scales apply to each step's result). Measured on
    the H200 it is not faster (moe_gluon_1b7691f.md, graph replay with x quantized up front against the default:
    Hy3 EP8 T 4 36.9 against 35.7 µs, T 64 130.8 / 120.8, the public shapes' T 1 1.00-1.05x): the MMA wait is not
    what a 128-block step waits on; the kernel stays as the base for the next Hopper levers (a producer warp,
    more programs an SM).
    """

    block_m: int = 16
    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3
    down_block_n: int = 64
    down_block_k: int = 64
    down_num_warps: int = 4
    down_num_stages: int = 3
    reduce_block_h: int = 1024
    index_small_max: int = 1024
    prequant_x: bool = False
    index_quant: bool = True
    act_mul: str = "fp32"
    validate_ids: bool = True
    swap_ab: bool = False
    naive_max_pairs: int = 0
    fp8_promote: int | None = None
    pdl: int = 1
    down_n_per: int = 1
    split_k: int = 1
    gluon: bool = False

    def with_(self, **kw) -> MoeConfig:
        return replace(self, **kw)


def _k_tile(k: int) -> int:
    """The largest of 128/64/32 dividing `k` (no masked tail iteration), else 64."""
    for t in (128, 64, 32):
        if k % t == 0:
            return t
    return 64


def block_m_for(avg_tokens_per_expert: float) -> int:
    """M tile from the average number of rows an expert receives (small for decode, large for prefill)."""
    if avg_tokens_per_expert <= 16:
        return 16
    if avg_tokens_per_expert <= 32:
        return 32
    if avg_tokens_per_expert <= 96:
        return 64
    return 128


def get_config(*, num_tokens: int, top_k: int, num_experts: int, hidden: int, inter: int,
               quant: str = "none", interpreter: bool = False, num_local_experts: int | None = None,
               device_name: str | None = None) -> MoeConfig:
    """Config for one call. `num_experts` is the global count (the routing spreads over all of them),
    `num_local_experts` the experts this rank holds (default: all); `quant` is "none", "fp8_tensor" or
    "fp8_block". A tuned entry for `device_name` (`torch.cuda.get_device_name()`) and this shape replaces
    the heuristic's tiles (see `tuned_entry`); the interpreter always uses the heuristic."""
    cfg = heuristic_config(num_tokens=num_tokens, top_k=top_k, num_experts=num_experts, hidden=hidden,
                           inter=inter, quant=quant, interpreter=interpreter, num_local_experts=num_local_experts)
    if interpreter or not device_name:
        return cfg
    entry = tuned_entry(device_name, num_tokens=num_tokens, num_experts=num_experts,
                        num_local_experts=num_local_experts or num_experts, hidden=hidden, inter=inter,
                        quant=quant)
    return replace(cfg, **entry) if entry else cfg


def heuristic_config(*, num_tokens: int, top_k: int, num_experts: int, hidden: int, inter: int,
                     quant: str = "none", interpreter: bool = False,
                     num_local_experts: int | None = None) -> MoeConfig:
    """The untuned heuristic: tiles from the average rows per expert `num_tokens·top_k / num_experts`.
    Rules measured on the H200 (`hpcops tune moe`, bench/results/moe_tune.md): fp8 per-tensor x (and the
    128-block scheme's from 64 tokens) is quantized once up front; 16-bit decode tiles take K steps of 128; the
    128-block scheme's gate-up tile (gate and up halves, 2·block_n rows) runs on 8 warps; no naive tasks under expert
    parallelism."""
    avg = num_tokens * top_k / max(num_experts, 1)
    bm = block_m_for(avg)
    fp8 = quant != "none"
    if interpreter:
        # The CPU interpreter pays per program and per loop iteration: few, large tiles.
        bm = max(bm, 16)
    if bm <= 32:
        # Decode: the weight stream dominates. Split N finely so many programs stream each expert's
        # weights at once; small M tile; deep pipeline on K.
        cfg = MoeConfig(block_m=bm, block_n=32, block_k=128, num_warps=4, num_stages=4,
                        down_block_n=64, down_block_k=_k_tile(inter), down_num_warps=4,
                        down_num_stages=4)
    elif bm == 64:
        cfg = MoeConfig(block_m=64, block_n=64, block_k=128 if fp8 else 64, num_warps=4, num_stages=4,
                        down_block_n=128, down_block_k=_k_tile(inter), down_num_warps=4,
                        down_num_stages=4)
    else:
        cfg = MoeConfig(block_m=128, block_n=64, block_k=128 if fp8 else 64, num_warps=8, num_stages=3,
                        down_block_n=128, down_block_k=_k_tile(inter), down_num_warps=8,
                        down_num_stages=3)
    # M tiles below 64 rows: weights on the wgmma M side. Few pairs per expert: no index (as vLLM's
    # naive block assignment, T·k·4 ≤ E).
    # naive_max_pairs = 0 under expert parallelism (measured: the index wins at EP8 B4).
    n_local = num_local_experts or num_experts
    # The reduction's columns a program: 256 up to 64 tokens, where its few programs are latency-bound (Hy3 on the
    # H200, bench/results/profile_moe_small_b_2cd84a7.txt: the reduce kernel 1.6 against 2.4 µs at TP8 fp8 T 4, 2.0
    # against 3.3 at T 16; graph replay 0.98-1.00x the call's time at T 4-64, moe_sweep_reduce_naive_2cd84a7.md).
    cfg = replace(cfg, prequant_x=bm >= 64 or quant == "fp8_tensor", swap_ab=bm <= 32,
                  naive_max_pairs=num_experts // 4 if n_local == num_experts else 0,
                  reduce_block_h=256 if num_tokens <= 64 else 1024)
    if quant == "fp8_block":
        # block_n 128 lets the gate-up epilogue quantize whole 128-groups. Its 256-row gate+up tile runs on 8
        # warps. Narrower N tiles for more programs at tiny batches measured slower (EP8 B4: 49.8 µs at
        # block_n 32 against 42.5 at 128; DeepSeek-V3 TP8 B16: 1.25x slower at 64).
        # From 64 tokens x is quantized up front (moe_prequant_d4ebce6.md, Hy3 EP8: 9 % faster at T 512, 4 % at
        # 64; level at 4, and at T 1 the extra launch costs 6 %).
        cfg = replace(cfg, block_n=128, block_k=128, down_block_k=128, block_m=min(cfg.block_m, 64),
                      down_block_n=min(cfg.down_block_n, 128), num_warps=8,
                      prequant_x=cfg.prequant_x or num_tokens >= 64)
        # its tile waits on its MMA and scales every K step, so a program's time follows its K steps: where the
        # batch's gate-up tiles leave most SMs idle, their K loops go over several programs (`split_k`)
        cfg = replace(cfg, split_k=gate_up_split(num_tokens, top_k, num_experts, n_local, hidden, inter,
                                                 cfg.block_n, cfg.block_k))
    if interpreter:
        cfg = replace(cfg, block_n=max(cfg.block_n, 64), down_block_n=max(cfg.down_block_n, 128),
                      block_k=128, down_block_k=128 if quant == "fp8_block" else _k_tile(inter))
    return cfg


SMS = 132  # streaming multiprocessors of an H100 / H200 (the machines the heuristic's rules were measured on)


def gate_up_split(num_tokens: int, top_k: int, num_experts: int, n_local: int, hidden: int, inter: int,
                  block_n: int, block_k: int) -> int:
    """`split_k` for a gate-up GEMM of one M tile per touched expert: the largest power of two up to 8 that keeps
    (expected touched local experts) × (N tiles) × split within the SMs and at least 4 K steps a program. The
    expected touched experts under uniform top-k routing: n_local · (1 − (1 − k/E)^T)."""
    if num_tokens <= 0:
        return 1
    touched = n_local * (1.0 - (1.0 - min(top_k / max(num_experts, 1), 1.0)) ** num_tokens)
    tiles = max(touched, 1.0) * -(-inter // block_n)
    steps = -(-hidden // block_k)
    split = 1
    while split < 8 and tiles * split * 2 <= SMS and steps >= 4 * split * 2:
        split *= 2
    return split


# ---- tuned table ----------------------------------------------------------------------------------
# An entry is a dict: {"E": global experts, "E_local": local experts, "H": hidden, "I": intermediate,
# "quant": "none" | "fp8_tensor" | "fp8_block", "T": the batch it was measured at, "config": {MoeConfig
# fields}} (extra keys such as "us" are kept as documentation). `hpcops tune moe` writes them.

# (reduce_block_h is not among them: `hpcops tune moe` does not sweep it, so the heuristic sets it)
TUNABLE = ("block_m", "block_n", "block_k", "num_warps", "num_stages", "down_block_n", "down_block_k",
           "down_num_warps", "down_num_stages", "index_small_max", "prequant_x", "swap_ab",
           "naive_max_pairs", "fp8_promote", "pdl", "down_n_per", "split_k")


@functools.cache
def _env_entries(path: str) -> tuple[str, tuple[dict, ...]]:
    with open(path) as f:
        data = json.load(f)
    return data.get("device", ""), tuple(data.get("entries", ()))


def tuned_entries(device_name: str) -> list[dict]:
    """Entries for `device_name`: `HPCOPS_MOE_TUNED` (a JSON file {"device": name, "entries": [...]},
    e.g. `hpcops tune moe`'s moe_tuned.json) first, then `hpcops.moe.tuned.TUNED[device_name]`."""
    from hpcops.moe.tuned import TUNED

    out: list[dict] = []
    path = os.environ.get("HPCOPS_MOE_TUNED", "").strip()
    if path:
        dev, entries = _env_entries(path)
        if not dev or dev == device_name:
            out += list(entries)
    return out + list(TUNED.get(device_name, ()))


def tuned_entry(device_name: str, *, num_tokens: int, num_experts: int, num_local_experts: int, hidden: int,
                inter: int, quant: str) -> dict | None:
    """MoeConfig fields of the entry for this shape measured at the batch nearest to `num_tokens` (in
    log2; ties to the smaller batch), or None. Batches beyond half the smallest / twice the largest
    measured one keep the heuristic: nothing was measured near them."""
    key = (num_experts, num_local_experts, hidden, inter, quant)
    cands = [e for e in tuned_entries(device_name)
             if (e["E"], e.get("E_local", e["E"]), e["H"], e["I"], e["quant"]) == key]
    if not cands or num_tokens <= 0:
        return None
    ts = sorted({int(e["T"]) for e in cands})
    if not ts[0] / 2 <= num_tokens <= ts[-1] * 2:
        return None
    best_t = min(ts, key=lambda t: (abs(math.log2(t) - math.log2(num_tokens)), t))
    entry = next(e for e in cands if int(e["T"]) == best_t)  # the first listed wins (env file first)
    known = {f.name for f in fields(MoeConfig)}
    cfg = {k: v for k, v in entry["config"].items() if k in TUNABLE}
    bad = set(entry["config"]) - known
    if bad:
        raise ValueError(f"tuned MoE entry {key} T={best_t}: unknown MoeConfig fields {sorted(bad)}")
    return cfg
