"""The quantization schemes of `fused_moe`, one class each: what a scheme accepts, how it prepares the
gate-up operand, how the activation travels between the GEMMs, and the codes its kernels run with.

A scheme is chosen from the `quant` argument (`scheme_for`): None → `Wide16`, `Fp8PerTensor` →
`Fp8Tensor`, `Fp8Block128` → `Fp8Block`. Its `name` is the key of the tile heuristic and of the tuned
table (`configs.get_config(quant=...)`) and of the torch.library op. Adding a scheme is one class here
(and, where it needs new kernel behaviour, a new code in `codes.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import triton

from hpcops._checks import FP8_E4M3, check_tensor
from hpcops.moe import _moe_kernels as K
from hpcops.moe.codes import ActMode, QuantCode, XMode
from hpcops.moe.configs import MoeConfig
from hpcops.quant import Fp8Block128, Fp8PerTensor


@dataclass
class XQuant:
    """x's fp8 quantization pass, planned and not yet launched (`moe_quant_x_kernel`, one program a token): `x`
    into `q`, `mode` (`XMode`), the static scale `in_scale` (STATIC), the dynamic scales `s` by row through
    `stride_s`; `block_h` columns a step, `warps`. `fused_moe` runs it alone right before the gate-up GEMM
    (`launch`), or as T more programs of the single-program index build's launch (`build_moe_index(x_quant=)`,
    `MoeConfig.index_quant`)."""

    x: torch.Tensor
    q: torch.Tensor
    s: torch.Tensor
    in_scale: torch.Tensor
    mode: XMode
    stride_s: int
    block_h: int
    warps: int

    def args(self) -> tuple:
        """The quantization's kernel arguments (x, q, s, in_scale, H and the row strides)."""
        return self.x, self.q, self.s, self.in_scale, self.x.shape[1], self.x.stride(0), self.q.stride(0), self.stride_s

    def launch(self, pdl_next: int = 0) -> None:
        """Alone: `moe_quant_x_kernel`, which releases the gate-up GEMM's launch where `pdl_next` (`MoeConfig.pdl`)."""
        K.moe_quant_x_kernel[(self.x.shape[0],)](*self.args(), MODE=int(self.mode), BLOCK_H=self.block_h,
                                                 PDL_NEXT=pdl_next, num_warps=self.warps)


@dataclass
class GateUpInput:
    """The gate-up GEMM's A operand: x (16-bit, or fp8 with `scale` by row through `stride_t` and by
    128-group through `stride_g`), and `a13`, the static scale that quantizes a 16-bit x while loading.
    `pending`: the pass that writes an fp8 `x` from the caller's 16-bit one, still to be launched (None: nothing
    to run)."""

    x: torch.Tensor
    scale: torch.Tensor
    stride_t: int
    stride_g: int
    a13: torch.Tensor
    pending: XQuant | None = None

    @property
    def fp8(self) -> bool:
        return self.x.dtype == FP8_E4M3


@dataclass
class Activation:
    """The intermediate `act [N, I]` (rows in expert-sorted order) and how it is encoded (`mode`):
    `scale` per row and 128-group (FP8_GROUP / WIDE_GROUP_AMAX), `a2` the static scale, `rowmax` the
    row amax (WIDE_ROW_AMAX)."""

    act: torch.Tensor
    mode: ActMode
    scale: torch.Tensor
    stride_s: int
    a2: torch.Tensor
    rowmax: torch.Tensor


@dataclass
class WeightScales:
    """Scale tensors of w13 / w2 and their (expert, N block, K block) strides (zeros broadcast)."""

    w13: torch.Tensor
    w13_strides: tuple[int, int, int]
    w2: torch.Tensor
    w2_strides: tuple[int, int, int]


def _check_scale_shape(name: str, t, shapes: list[tuple[int, ...]], dev) -> None:
    check_tensor(name, t, dtypes=(torch.float32,), device=dev)
    if tuple(t.shape) not in shapes:
        want = " or ".join(str(list(s)) for s in shapes)
        raise ValueError(f"{name} must have shape {want}, got {list(t.shape)}")


class Scheme:
    """A quantization scheme bound to the call's `quant` object."""

    name: ClassVar[str]
    code: ClassVar[QuantCode]

    def __init__(self, quant):
        self.quant = quant

    def validate(self, x, w13, w2, x_scale, cfg: MoeConfig, T: int, H: int, E: int, inter: int) -> None:
        """Dtypes, scale shapes and config constraints of this scheme (the common shapes are checked)."""
        raise NotImplementedError

    def gate_up_input(self, x, x_scale, cfg: MoeConfig, dummy) -> GateUpInput:
        """The gate-up GEMM's x: as given, or an fp8 x that `pending` (`XQuant`, the caller launches it) writes."""
        return GateUpInput(x, dummy, 0, 0, dummy)

    def activation(self, n: int, inter: int, act_dt: torch.dtype, cfg: MoeConfig, dummy) -> Activation:
        raise NotImplementedError

    def weight_scales(self, E: int, dummy) -> WeightScales:
        return WeightScales(dummy, (0, 0, 0), dummy, (0, 0, 0))

    def per_token_inputs(self, a: GateUpInput, act: Activation) -> tuple[bool, bool]:
        """Whether the gate-up's and the down GEMM's fp8 inputs carry per-token (dynamic) scales with per-tensor
        weights: where `MoeConfig.fp8_promote`'s default promotes the MMA sums of any tile."""
        return False, False

    @staticmethod
    def from_op_args(w13_scale, w2_scale, a13_scale, a2_scale):
        """The `quant` object from the torch.library op's flat scale arguments."""
        raise NotImplementedError


def _quantize_x(x: torch.Tensor, mode: XMode, scale: torch.Tensor | None, dummy) -> GateUpInput:
    """x quantized to fp8 by a pass of its own (`XQuant`, left `pending`): per tensor with a static `scale`, or
    dynamic per token / per token and 128-group."""
    T, H = x.shape
    xq = torch.empty((T, H), dtype=FP8_E4M3, device=x.device)
    if mode == XMode.PER_TOKEN_GROUP:
        s = torch.empty((T, triton.cdiv(H, 128)), dtype=torch.float32, device=x.device)
        job = XQuant(x, xq, s, s, mode, s.stride(0), 128 * min(16, triton.next_power_of_2(triton.cdiv(H, 128))), 4)
        return GateUpInput(xq, s, s.stride(0), 1, dummy, job)
    s = scale if mode == XMode.STATIC else torch.empty(T, dtype=torch.float32, device=x.device)
    job = XQuant(x, xq, s, s, mode, 1, triton.next_power_of_2(H), 8 if H >= 4096 else 4)
    return GateUpInput(xq, s, 0 if mode == XMode.STATIC else 1, 0, dummy, job)


class Wide16(Scheme):
    """No quantization: bf16/fp16 x and weights, 16-bit dots, fp32 accumulation."""

    name = "none"
    code = QuantCode.NONE

    def validate(self, x, w13, w2, x_scale, cfg, T, H, E, inter):
        if x.dtype == FP8_E4M3:
            raise TypeError("x is float8_e4m3fn but quant is None; pass Fp8PerTensor or Fp8Block128")
        check_tensor("w13", w13, dtypes=(x.dtype,))
        check_tensor("w2", w2, dtypes=(x.dtype,))
        if x_scale is not None:
            raise ValueError("x_scale is only meaningful for an fp8 x")

    def activation(self, n, inter, act_dt, cfg, dummy):
        act = torch.empty((n, inter), dtype=act_dt, device=dummy.device)
        return Activation(act, ActMode.WIDE, dummy, 0, dummy, dummy)

    @staticmethod
    def from_op_args(w13_scale, w2_scale, a13_scale, a2_scale):
        return None


class Fp8Tensor(Scheme):
    """`Fp8PerTensor`: fp8 weights with a scale per expert; activations with static per-tensor scales
    (a13, a2) or dynamic per token."""

    name = "fp8_tensor"
    code = QuantCode.FP8_TENSOR

    def validate(self, x, w13, w2, x_scale, cfg, T, H, E, inter):
        q, dev = self.quant, x.device
        p = cfg.fp8_promote
        if p is not None and (type(p) is not int or p < 0 or p % 32):
            raise ValueError(f"config.fp8_promote must be None, 0 or a positive multiple of 32 (products in one fp8 "
                             f"MMA sum), got {p!r}")
        check_tensor("w13", w13, dtypes=(FP8_E4M3,))
        check_tensor("w2", w2, dtypes=(FP8_E4M3,))
        _check_scale_shape("quant.w13_scale", q.w13_scale, [(E,), (1,)], dev)
        _check_scale_shape("quant.w2_scale", q.w2_scale, [(E,), (1,)], dev)
        if q.a13_scale is not None:
            _check_scale_shape("quant.a13_scale", q.a13_scale, [(1,)], dev)
        if q.a2_scale is not None:
            _check_scale_shape("quant.a2_scale", q.a2_scale, [(1,)], dev)
        if x.dtype == FP8_E4M3:
            if x_scale is None and q.a13_scale is None:
                raise ValueError("x is fp8: pass x_scale ([1] per-tensor or [T] per-token) or quant.a13_scale")
            if x_scale is not None:
                _check_scale_shape("x_scale", x_scale, [(1,), (T,), (T, 1)], dev)
        elif x_scale is not None:
            raise ValueError("x_scale is only meaningful for an fp8 x (a bf16/fp16 x is quantized inside)")

    def gate_up_input(self, x, x_scale, cfg, dummy):
        a13 = self.quant.a13_scale
        if x.dtype == FP8_E4M3:
            xs = x_scale if x_scale is not None else a13
            per_token = xs.numel() == x.shape[0] and xs.numel() > 1
            return GateUpInput(x, xs.reshape(-1), 1 if per_token else 0, 0, dummy)
        if a13 is not None and not cfg.prequant_x:
            return GateUpInput(x, dummy, 0, 0, a13)  # quantized while loading the gate-up A tiles
        # dynamic per token (a full-row amax is needed before the K loop), or prequant_x
        return _quantize_x(x, XMode.STATIC if a13 is not None else XMode.PER_TOKEN, a13, dummy)

    def activation(self, n, inter, act_dt, cfg, dummy):
        dev = dummy.device
        if self.quant.a2_scale is not None:
            act = torch.empty((n, inter), dtype=FP8_E4M3, device=dev)
            return Activation(act, ActMode.FP8_STATIC, dummy, 0, self.quant.a2_scale, dummy)
        act = torch.empty((n, inter), dtype=act_dt, device=dev)
        rowmax = torch.zeros(n, dtype=torch.float32, device=dev)
        return Activation(act, ActMode.WIDE_ROW_AMAX, dummy, 0, dummy, rowmax)

    def weight_scales(self, E, dummy):
        # a scale of shape [1] broadcasts over the experts through a zero stride
        def stride(s):
            return (s.stride(0) if s.shape[0] == E and E > 1 else 0, 0, 0)

        q = self.quant
        return WeightScales(q.w13_scale, stride(q.w13_scale), q.w2_scale, stride(q.w2_scale))

    def per_token_inputs(self, a, act):
        # x quantized per token (a scale a row), the activation quantized by its row amax
        return a.stride_t != 0, act.mode == ActMode.WIDE_ROW_AMAX

    @staticmethod
    def from_op_args(w13_scale, w2_scale, a13_scale, a2_scale):
        return Fp8PerTensor(w13_scale, w2_scale, a13_scale, a2_scale)


class Fp8Block(Scheme):
    """`Fp8Block128`: fp8 weights with 128×128 block scales; activations dynamic per token and
    128-group."""

    name = "fp8_block"
    code = QuantCode.FP8_BLOCK

    def validate(self, x, w13, w2, x_scale, cfg, T, H, E, inter):
        q, dev, cd = self.quant, x.device, triton.cdiv
        check_tensor("w13", w13, dtypes=(FP8_E4M3,))
        check_tensor("w2", w2, dtypes=(FP8_E4M3,))
        b = q.block
        if b != 128:
            raise ValueError(f"quant.block must be 128, got {b}")
        if inter % b:
            raise ValueError(f"Fp8Block128 needs I % 128 == 0 (I = w2.shape[2] = {inter})")
        _check_scale_shape("quant.w13_scale", q.w13_scale, [(E, cd(2 * inter, b), cd(H, b))], dev)
        _check_scale_shape("quant.w2_scale", q.w2_scale, [(E, cd(H, b), cd(inter, b))], dev)
        if x.dtype == FP8_E4M3:
            if x_scale is None:
                raise ValueError("x is fp8: pass x_scale [T, ceil(H/128)] (per token, per group of 128)")
            _check_scale_shape("x_scale", x_scale, [(T, cd(H, b))], dev)
            if x_scale.stride(-1) != 1:
                raise ValueError("x_scale must be contiguous along its last dimension")
        elif x_scale is not None:
            raise ValueError("x_scale is only meaningful for an fp8 x (a bf16/fp16 x is quantized inside)")
        if cfg.block_k != 128 or cfg.down_block_k != 128 or 128 % cfg.block_n or 128 % cfg.down_block_n:
            raise ValueError("config: Fp8Block128 needs block_k = down_block_k = 128 and block_n, "
                             f"down_block_n dividing 128, got {cfg}")

    def gate_up_input(self, x, x_scale, cfg, dummy):
        if x.dtype == FP8_E4M3:
            return GateUpInput(x, x_scale, x_scale.stride(0), 1, dummy)
        if cfg.prequant_x:
            return _quantize_x(x, XMode.PER_TOKEN_GROUP, None, dummy)
        return GateUpInput(x, dummy, 0, 0, dummy)  # quantized per row and 128-group while loading

    def activation(self, n, inter, act_dt, cfg, dummy):
        dev = dummy.device
        if cfg.block_n == 128:  # each program owns whole 128-groups: quantize in the epilogue
            act = torch.empty((n, inter), dtype=FP8_E4M3, device=dev)
            s = torch.empty((n, inter // 128), dtype=torch.float32, device=dev)
            return Activation(act, ActMode.FP8_GROUP, s, s.stride(0), dummy, dummy)
        # narrower N tiles: 16-bit act + group amax, quantized by the down GEMM's loader
        act = torch.empty((n, inter), dtype=act_dt, device=dev)
        s = torch.zeros((n, inter // 128), dtype=torch.float32, device=dev)
        return Activation(act, ActMode.WIDE_GROUP_AMAX, s, s.stride(0), dummy, dummy)

    def weight_scales(self, E, dummy):
        q = self.quant
        return WeightScales(q.w13_scale, tuple(q.w13_scale.stride()), q.w2_scale, tuple(q.w2_scale.stride()))

    @staticmethod
    def from_op_args(w13_scale, w2_scale, a13_scale, a2_scale):
        return Fp8Block128(w13_scale, w2_scale)


SCHEMES: dict[type | None, type[Scheme]] = {type(None): Wide16, Fp8PerTensor: Fp8Tensor, Fp8Block128: Fp8Block}
BY_NAME: dict[str, type[Scheme]] = {cls.name: cls for cls in SCHEMES.values()}


def scheme_for(quant) -> Scheme:
    """The scheme of a `quant` argument: None, `Fp8PerTensor` or `Fp8Block128`."""
    cls = SCHEMES.get(type(quant))
    if cls is None:
        raise TypeError(f"quant must be None, Fp8PerTensor or Fp8Block128, got {type(quant).__name__}")
    return cls(quant)


def scheme_named(name: str) -> type[Scheme]:
    """The scheme class of a name ("none", "fp8_tensor", "fp8_block")."""
    if name not in BY_NAME:
        raise ValueError(f"quant_kind must be one of {sorted(BY_NAME)}, got {name!r}")
    return BY_NAME[name]
