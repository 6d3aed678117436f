"""The modes the MoE launchers pass to the kernels, as named codes (constexpr arguments).

The kernels (`_moe_kernels.py`) compare against `tl.constexpr` mirrors of these members; the schemes
(`schemes.py`) choose them. A value is never written as a bare number anywhere else.
"""

from __future__ import annotations

from enum import IntEnum


class QuantCode(IntEnum):
    """How the GEMMs read weights (`QUANT`)."""

    NONE = 0  # 16-bit weights, 16-bit dot
    FP8_TENSOR = 1  # fp8 weights, one scale per expert (epilogue), activations per tensor or per row
    FP8_BLOCK = 2  # fp8 weights, 128×128 block scales per K tile; activations per row and 128-group


class ActMode(IntEnum):
    """How the gate-up GEMM writes the activation and the down GEMM reads it (`ACT_OUT` / `ACT_IN`)."""

    WIDE = 0  # 16-bit
    FP8_STATIC = 1  # fp8 with the static a2 scale
    WIDE_ROW_AMAX = 2  # 16-bit + row amax (atomic max); the down GEMM quantizes per row
    FP8_GROUP = 3  # fp8 with a scale per row and 128-group (gate-up N tile = 128)
    WIDE_GROUP_AMAX = 4  # 16-bit + amax per row and 128-group; the down GEMM quantizes per group


class XMode(IntEnum):
    """How `moe_quant_x_kernel` quantizes x (`MODE`)."""

    STATIC = 0  # the static a13 scale
    PER_TOKEN = 1  # dynamic: amax of the row / 448
    PER_TOKEN_GROUP = 2  # dynamic: amax of each 128-group of the row / 448
