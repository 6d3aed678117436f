"""Tile configurations for the fused MoE, chosen by a heuristic from the average tokens per expert.

No autotuning: `get_config` maps (tokens, top-k, experts, H, I, quantization) to a frozen `MoeConfig`;
tests and benchmarks pass their own `MoeConfig` to `fused_moe(..., config=...)` to force a shape.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

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
    `validate_ids`: check topk_ids values on the host (a device sync) when not capturing a CUDA graph.
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
    act_mul: str = "fp32"
    validate_ids: bool = True

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
               quant: str = "none", interpreter: bool = False) -> MoeConfig:
    """Heuristic config. `num_experts` is the global count (the routing spreads over all of them);
    `quant` is "none", "fp8_tensor" or "fp8_block"."""
    avg = num_tokens * top_k / max(num_experts, 1)
    bm = block_m_for(avg)
    fp8 = quant != "none"
    if interpreter:
        # The CPU interpreter pays per program and per loop iteration: few, large tiles.
        bm = max(bm, 16)
    if bm <= 32:
        # Decode: the weight stream dominates. Split N finely so many programs stream each expert's
        # weights at once; small M tile; deep pipeline on K.
        cfg = MoeConfig(block_m=bm, block_n=32, block_k=128 if fp8 else 64, num_warps=4, num_stages=4,
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
    cfg = replace(cfg, prequant_x=bm >= 64)
    if quant == "fp8_block":
        # block_n 128 lets the gate-up epilogue quantize whole 128-groups; decode keeps narrow N tiles
        # for parallelism (the down GEMM then quantizes the 16-bit activation per group while loading)
        cfg = replace(cfg, block_n=128 if bm >= 64 else 64, block_k=128, down_block_k=128,
                      block_m=min(cfg.block_m, 64), down_block_n=min(cfg.down_block_n, 128))
    if interpreter:
        cfg = replace(cfg, block_n=max(cfg.block_n, 64), down_block_n=max(cfg.down_block_n, 128),
                      block_k=128, down_block_k=128 if quant == "fp8_block" else _k_tile(inter))
    return cfg
