"""`fused_moe`: routing index → gate-up GEMM (rows read through the index) + SiLU-and-mul + quant →
down GEMM → top-k weighted fp32 reduction (+ shared expert output). See README.md for the maths."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from hpcops._checks import (
    FP8_E4M3,
    HALF_DTYPES,
    check_choice,
    check_index_range,
    check_kernel_device,
    check_tensor,
    values_checkable,
)
from hpcops._library import register
from hpcops._platform import is_interpreter
from hpcops.moe import _moe_kernels as K
from hpcops.moe.configs import ACT_MUL_MODES, MoeConfig, get_config
from hpcops.moe.routing import build_moe_index
from hpcops.quant import Fp8Block128, Fp8PerTensor

_TL_DTYPE = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@functools.cache
def _cuda_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def device_name(dev: torch.device) -> str | None:
    """The CUDA device's name (the tuned-table key), None off CUDA."""
    if dev.type != "cuda":
        return None
    return _cuda_name(dev.index if dev.index is not None else torch.cuda.current_device())


def _quant_kind(quant) -> str:
    if quant is None:
        return "none"
    if isinstance(quant, Fp8PerTensor):
        return "fp8_tensor"
    if isinstance(quant, Fp8Block128):
        return "fp8_block"
    raise TypeError(f"quant must be None, Fp8PerTensor or Fp8Block128, got {type(quant).__name__}")


def _check_scale_shape(name: str, t, shapes: list[tuple[int, ...]], dev) -> None:
    check_tensor(name, t, dtypes=(torch.float32,), device=dev)
    if tuple(t.shape) not in shapes:
        want = " or ".join(str(list(s)) for s in shapes)
        raise ValueError(f"{name} must have shape {want}, got {list(t.shape)}")


def _validate(x, w13, w2, topk_weights, topk_ids, quant, expert_map, shared_output, out, x_scale, cfg):
    kind = _quant_kind(quant)
    check_tensor("x", x, dtypes=(*HALF_DTYPES, FP8_E4M3), ndim=2)
    dev = x.device
    T, H = x.shape
    check_tensor("w13", w13, ndim=3, device=dev)
    E, I2, Hw = w13.shape
    if Hw != H:
        raise ValueError(f"w13 must be [E_local, 2I, H] with H = x.shape[1] = {H}, got {list(w13.shape)}")
    if I2 % 2 or I2 == 0:
        raise ValueError(f"w13 must be [E_local, 2I, H] (gate rows then up rows), got {list(w13.shape)}")
    inter = I2 // 2
    check_tensor("w2", w2, ndim=3, device=dev)
    if tuple(w2.shape) != (E, H, inter):
        raise ValueError(f"w2 must have shape [E_local, H, I] = {[E, H, inter]} (from w13), got {list(w2.shape)}")
    for name, w in (("w13", w13), ("w2", w2)):
        if w.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous along its last dimension (K-major), got strides "
                             f"{tuple(w.stride())}")
    if x.stride(-1) != 1:
        raise ValueError(f"x must be contiguous along its last dimension, got strides {tuple(x.stride())}")
    check_tensor("topk_ids", topk_ids, dtypes=(torch.int32,), ndim=2, device=dev)
    k = topk_ids.shape[1]
    if topk_ids.shape[0] != T or k == 0:
        raise ValueError(f"topk_ids must have shape [T={T}, k>0], got {list(topk_ids.shape)}")
    check_tensor("topk_weights", topk_weights, dtypes=(torch.float32,), shape=(T, k), device=dev)
    if expert_map is not None:
        check_tensor("expert_map", expert_map, dtypes=(torch.int32,), ndim=1, device=dev)
    out_dt = x.dtype if x.dtype in HALF_DTYPES else torch.bfloat16
    if shared_output is not None:
        check_tensor("shared_output", shared_output, dtypes=(out_dt,), shape=(T, H), device=dev)
        if shared_output.stride(-1) != 1:
            raise ValueError("shared_output must be contiguous along its last dimension")
    if out is not None:
        check_tensor("out", out, dtypes=(out_dt,), shape=(T, H), device=dev)
        if out.stride(-1) != 1:
            raise ValueError("out must be contiguous along its last dimension")
    if kind == "none":
        if x.dtype == FP8_E4M3:
            raise TypeError("x is float8_e4m3fn but quant is None; pass Fp8PerTensor or Fp8Block128")
        check_tensor("w13", w13, dtypes=(x.dtype,))
        check_tensor("w2", w2, dtypes=(x.dtype,))
        if x_scale is not None:
            raise ValueError("x_scale is only meaningful for an fp8 x")
    else:
        check_tensor("w13", w13, dtypes=(FP8_E4M3,))
        check_tensor("w2", w2, dtypes=(FP8_E4M3,))
    if kind == "fp8_tensor":
        _check_scale_shape("quant.w13_scale", quant.w13_scale, [(E,), (1,)], dev)
        _check_scale_shape("quant.w2_scale", quant.w2_scale, [(E,), (1,)], dev)
        if quant.a13_scale is not None:
            _check_scale_shape("quant.a13_scale", quant.a13_scale, [(1,)], dev)
        if quant.a2_scale is not None:
            _check_scale_shape("quant.a2_scale", quant.a2_scale, [(1,)], dev)
        if x.dtype == FP8_E4M3:
            if x_scale is None and quant.a13_scale is None:
                raise ValueError("x is fp8: pass x_scale ([1] per-tensor or [T] per-token) or quant.a13_scale")
            if x_scale is not None:
                _check_scale_shape("x_scale", x_scale, [(1,), (T,), (T, 1)], dev)
        elif x_scale is not None:
            raise ValueError("x_scale is only meaningful for an fp8 x (a bf16/fp16 x is quantized inside)")
    if kind == "fp8_block":
        b = quant.block
        if b != 128:
            raise ValueError(f"quant.block must be 128, got {b}")
        if inter % b:
            raise ValueError(f"Fp8Block128 needs I % 128 == 0 (I = w2.shape[2] = {inter})")
        cd = triton.cdiv
        _check_scale_shape("quant.w13_scale", quant.w13_scale, [(E, cd(I2, b), cd(H, b))], dev)
        _check_scale_shape("quant.w2_scale", quant.w2_scale, [(E, cd(H, b), cd(inter, b))], dev)
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
    check_choice("config.act_mul", cfg.act_mul, ACT_MUL_MODES)
    # last: argument errors first; then whether the kernels can run where the tensors are
    check_kernel_device("x", x)
    return kind, T, H, E, inter, k, out_dt


def _validate_ids(topk_ids: torch.Tensor, n_global: int, expert_map: torch.Tensor | None = None,
                  n_local: int = 0) -> None:
    """Value check of topk_ids (and expert_map), where it costs no device sync (on the host) or when
    asked for (HPCOPS_CHECK=1, outside graph capture). Elsewhere the kernels drop out-of-range ids like
    remote experts: never an out-of-bounds access, and no host sync on the per-layer path."""
    if topk_ids.numel() and values_checkable(topk_ids):
        check_index_range("topk_ids", topk_ids, 0, n_global, "a global expert id")
    if expert_map is not None and expert_map.numel() and values_checkable(expert_map):
        check_index_range("expert_map", expert_map, -1, n_local, "a local expert id, or -1 for a remote expert")


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, *, quant: Fp8PerTensor | Fp8Block128 | None = None,
              expert_map: torch.Tensor | None = None, shared_output: torch.Tensor | None = None,
              out: torch.Tensor | None = None, x_scale: torch.Tensor | None = None,
              config: MoeConfig | None = None) -> torch.Tensor:
    """Mixture-of-experts FFN: out[t] = Σ_j topk_weights[t,j] · FFN_{topk_ids[t,j]}(x[t]) (+ shared_output[t]).

    FFN_e(x) = w2[e] · (silu(w13[e, :I] · x) ⊙ (w13[e, I:] · x)).

    Args:
        x: `[T, H]` bf16/fp16, or float8_e4m3fn already quantized (then `x_scale`, see below).
        w13: `[E_local, 2I, H]` gate rows then up rows; x's dtype, or fp8 e4m3 with `quant`.
        w2: `[E_local, H, I]`.
        topk_weights: `[T, k]` fp32 combine weights. topk_ids: `[T, k]` int32 *global* expert ids.
        quant: None (16-bit), `Fp8PerTensor` (per-expert weight scales; static a13/a2 activation scales,
            or dynamic per token when they are None), `Fp8Block128` (128×128 weight blocks, activations
            per token per group of 128, dynamic).
        expert_map: `[E_global]` int32, local id of each global expert or −1 (expert parallelism; pairs
            routed to remote experts contribute nothing). None: E_global = E_local.
        shared_output: `[T, H]` output dtype, added in the fp32 reduction.
        out: `[T, H]` output buffer (last dim contiguous); written fully.
        x_scale: only for an fp8 `x`: per-tensor `[1]` or per-token `[T]` (`Fp8PerTensor`; defaults to
            quant.a13_scale), or `[T, ceil(H/128)]` (`Fp8Block128`). Dequantization multipliers.
        config: tile config (default: `get_config` heuristic from the average tokens per expert).

    Returns:
        `[T, H]` in x's dtype (bf16 for an fp8 x).

    No host sync and no data-dependent allocation (CUDA-graph safe). topk_ids values are checked where
    they are on the host, or with HPCOPS_CHECK=1 (`config.validate_ids` turns the check off entirely).
    """
    kind = _quant_kind(quant)
    if config is None:
        check_tensor("x", x, ndim=2)
        check_tensor("topk_ids", topk_ids, ndim=2)
        n_global = expert_map.shape[0] if isinstance(expert_map, torch.Tensor) else w13.shape[0]
        config = get_config(num_tokens=x.shape[0], top_k=topk_ids.shape[1], num_experts=n_global,
                            hidden=x.shape[1], inter=w2.shape[-1], quant=kind, interpreter=is_interpreter(),
                            num_local_experts=w13.shape[0], device_name=device_name(x.device))
    kind, T, H, E, inter, k, out_dt = _validate(x, w13, w2, topk_weights, topk_ids, quant, expert_map,
                                                 shared_output, out, x_scale, config)
    n_global = expert_map.shape[0] if expert_map is not None else E
    if config.validate_ids:
        _validate_ids(topk_ids, n_global, expert_map, E)
    dev = x.device
    if out is None:
        out = torch.empty((T, H), dtype=out_dt, device=dev)
    if T == 0:
        return out
    cfg = config
    topk_ids = topk_ids.contiguous()
    topk_weights = topk_weights.contiguous()
    n = T * k
    idx = build_moe_index(topk_ids, E, cfg.block_m, expert_map=expert_map, small_max=cfg.index_small_max)
    cap, dummy = idx.cap, idx.offsets  # dummy: placeholder pointer for arguments a mode does not read
    tasks, offsets, sorted_pair = idx.tasks, idx.offsets, idx.sorted_pair
    f32 = torch.float32

    # gate-up operand x and its scales
    x_fp8 = x.dtype == FP8_E4M3
    xs, stride_xst, stride_xsg = dummy, 0, 0
    a13 = dummy
    if kind == "fp8_tensor":
        if x_fp8:
            xs = x_scale if x_scale is not None else quant.a13_scale
            stride_xst = 1 if xs.numel() == T and xs.numel() > 1 else 0
            xs = xs.reshape(-1)
        elif quant.a13_scale is not None and not cfg.prequant_x:
            a13 = quant.a13_scale  # quantized while loading the gate-up A tiles
        else:  # dynamic per token (a full-row amax is needed before the K loop), or prequant_x
            static = quant.a13_scale is not None
            xq = torch.empty((T, H), dtype=FP8_E4M3, device=dev)
            xs = quant.a13_scale if static else torch.empty(T, dtype=f32, device=dev)
            K.moe_quant_x_kernel[(T,)](x, xq, xs, xs, H, x.stride(0), xq.stride(0), 1, MODE=0 if static else 1,
                                       BLOCK_H=triton.next_power_of_2(H), num_warps=8 if H >= 4096 else 4)
            x, x_fp8, stride_xst = xq, True, 0 if static else 1
    elif kind == "fp8_block":
        if x_fp8:
            xs, stride_xst, stride_xsg = x_scale, x_scale.stride(0), 1
        elif cfg.prequant_x:
            xq = torch.empty((T, H), dtype=FP8_E4M3, device=dev)
            xs = torch.empty((T, triton.cdiv(H, 128)), dtype=f32, device=dev)
            K.moe_quant_x_kernel[(T,)](x, xq, xs, xs, H, x.stride(0), xq.stride(0), xs.stride(0), MODE=2,
                                       BLOCK_H=128, num_warps=4)
            x, x_fp8, stride_xst, stride_xsg = xq, True, xs.stride(0), 1

    # intermediate activation [N, I], rows in expert-sorted order
    act_dt = out_dt
    act_s, a2, rowmax, stride_acts = dummy, dummy, dummy, 0
    if kind == "none":
        act_out = 0
        act = torch.empty((n, inter), dtype=act_dt, device=dev)
    elif kind == "fp8_tensor":
        if quant.a2_scale is not None:
            act_out, a2 = 1, quant.a2_scale
            act = torch.empty((n, inter), dtype=FP8_E4M3, device=dev)
        else:
            act_out = 2
            act = torch.empty((n, inter), dtype=act_dt, device=dev)
            rowmax = torch.zeros(n, dtype=f32, device=dev)
    elif cfg.block_n == 128:  # each program owns whole 128-groups: quantize in the epilogue
        act_out = 3
        act = torch.empty((n, inter), dtype=FP8_E4M3, device=dev)
        act_s = torch.empty((n, inter // 128), dtype=f32, device=dev)
        stride_acts = act_s.stride(0)
    else:  # narrower N tiles (decode): 16-bit act + group amax, quantized by the down GEMM's loader
        act_out = 4
        act = torch.empty((n, inter), dtype=act_dt, device=dev)
        act_s = torch.zeros((n, inter // 128), dtype=f32, device=dev)
        stride_acts = act_s.stride(0)
    quant_id = {"none": 0, "fp8_tensor": 1, "fp8_block": 2}[kind]
    ws13, ws2 = (quant.w13_scale, quant.w2_scale) if kind != "none" else (dummy, dummy)
    # per-tensor weight scales of shape [1] broadcast over experts through a zero stride
    wse13 = (ws13.stride(0) if ws13.shape[0] == E and E > 1 else 0) if kind == "fp8_tensor" else 0
    wse2 = (ws2.stride(0) if ws2.shape[0] == E and E > 1 else 0) if kind == "fp8_tensor" else 0
    wb13 = ws13.stride() if kind == "fp8_block" else (wse13, 0, 0)
    wb2 = ws2.stride() if kind == "fp8_block" else (wse2, 0, 0)

    grid1 = (cap * triton.cdiv(inter, cfg.block_n),)
    K.moe_gate_up_kernel[grid1](
        x, xs, w13, ws13, a13, tasks, offsets, sorted_pair,
        act, act_s, a2, rowmax,
        H, inter, cap, k,
        x.stride(0), stride_xst, stride_xsg,
        w13.stride(0), w13.stride(1), wb13[0], wb13[1], wb13[2],
        act.stride(0), stride_acts,
        QUANT=quant_id, X_FP8=x_fp8, ACT_OUT=act_out, ACT_DT=_TL_DTYPE[act_dt],
        BF16_MUL=cfg.act_mul == "bf16",
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)

    has_shared = shared_output is not None
    sh = shared_output if has_shared else out
    y = torch.empty((n, H), dtype=out_dt, device=dev)
    grid2 = (cap * triton.cdiv(H, cfg.down_block_n),)
    K.moe_down_kernel[grid2](
        act, act_s, a2, rowmax, w2, ws2, tasks, offsets, y,
        H, inter, cap,
        act.stride(0), stride_acts, w2.stride(0), w2.stride(1), wb2[0], wb2[1], wb2[2],
        y.stride(0),
        QUANT=quant_id, ACT_IN=act_out,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.down_block_n, BLOCK_K=cfg.down_block_k,
        num_warps=cfg.down_num_warps, num_stages=cfg.down_num_stages)

    bh = min(cfg.reduce_block_h, triton.next_power_of_2(H))
    K.moe_reduce_kernel[(T, triton.cdiv(H, bh))](
        y, idx.pair_pos, topk_weights, sh, out, H,
        y.stride(0), topk_weights.stride(0), sh.stride(0), out.stride(0),
        TOP_K=k, HAS_SHARED=has_shared, BLOCK_H=bh, num_warps=4)
    return out


# ---- torch.library: the mutating out= form, for torch.compile and graph-capturing frameworks ----

def _fused_moe_out(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor, out: torch.Tensor, quant_kind: str,
                   w13_scale: torch.Tensor | None, w2_scale: torch.Tensor | None,  # noqa: UP045
                   a13_scale: torch.Tensor | None, a2_scale: torch.Tensor | None,  # noqa: UP045
                   x_scale: torch.Tensor | None, expert_map: torch.Tensor | None,  # noqa: UP045
                   shared_output: torch.Tensor | None, act_mul: str) -> None:  # noqa: UP045
    if quant_kind == "none":
        quant = None
    elif quant_kind == "fp8_tensor":
        quant = Fp8PerTensor(w13_scale, w2_scale, a13_scale, a2_scale)
    elif quant_kind == "fp8_block":
        quant = Fp8Block128(w13_scale, w2_scale)
    else:
        raise ValueError(f"quant_kind must be 'none', 'fp8_tensor' or 'fp8_block', got {quant_kind!r}")
    n_global = expert_map.shape[0] if expert_map is not None else w13.shape[0]
    cfg = get_config(num_tokens=x.shape[0], top_k=topk_ids.shape[1], num_experts=n_global, hidden=x.shape[1],
                     inter=w2.shape[-1], quant=quant_kind, interpreter=is_interpreter(),
                     num_local_experts=w13.shape[0], device_name=device_name(x.device))
    fused_moe(x, w13, w2, topk_weights, topk_ids, quant=quant, expert_map=expert_map,
              shared_output=shared_output, out=out, x_scale=x_scale,
              config=cfg.with_(act_mul=act_mul, validate_ids=False))


def _fused_moe_out_fake(x, w13, w2, topk_weights, topk_ids, out, quant_kind, w13_scale, w2_scale, a13_scale,
                        a2_scale, x_scale, expert_map, shared_output, act_mul) -> None:
    return None


fused_moe_out_op = register("fused_moe_out", _fused_moe_out, mutates_args=("out",), fake=_fused_moe_out_fake)
