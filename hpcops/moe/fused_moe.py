"""`fused_moe`: routing index → gate-up GEMM (rows read through the index) + SiLU-and-mul + quant →
down GEMM → top-k weighted fp32 reduction (+ shared expert output). See README.md for the maths."""

from __future__ import annotations

import functools
from dataclasses import dataclass

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
    is_interpreter,
    values_checkable,
)
from hpcops._library import register
from hpcops._platform import cuda_capability
from hpcops.moe import _moe_kernels as K
from hpcops.moe.configs import ACT_MUL_MODES, MoeConfig, get_config
from hpcops.moe.routing import build_moe_index, task_capacity
from hpcops.moe.schemes import Scheme, scheme_for, scheme_named
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


def _check_k_major(name: str, t: torch.Tensor) -> None:
    """A GEMM operand's K (its last dimension) must be contiguous: ValueError naming it otherwise."""
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous along its last dimension (K-major), got strides "
                         f"{tuple(t.stride())}")


def _validate(scheme: Scheme, x, w13, w2, topk_weights, topk_ids, expert_map, shared_output, out, x_scale, cfg,
              fused_shared: bool):
    """The shapes every scheme shares, then the scheme's own checks; returns (T, H, E, I, k, out dtype)."""
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
    for name, t in (("w13", w13), ("w2", w2), ("x", x)):
        _check_k_major(name, t)
    check_tensor("topk_ids", topk_ids, dtypes=(torch.int32,), ndim=2, device=dev)
    k = topk_ids.shape[1]
    if topk_ids.shape[0] != T or k == 0:
        raise ValueError(f"topk_ids must have shape [T={T}, k>0], got {list(topk_ids.shape)}")
    check_tensor("topk_weights", topk_weights, dtypes=(torch.float32,), shape=(T, k), device=dev)
    if expert_map is not None:
        check_tensor("expert_map", expert_map, dtypes=(torch.int32,), ndim=1, device=dev)
    out_dt = x.dtype if x.dtype in HALF_DTYPES else torch.bfloat16
    for name, t in (("shared_output", shared_output), ("out", out)):
        if t is not None:
            check_tensor(name, t, dtypes=(out_dt,), shape=(T, H), device=dev)
            if t.stride(-1) != 1:
                raise ValueError(f"{name} must be contiguous along its last dimension")
    scheme.validate(x, w13, w2, x_scale, cfg, T, H, E, inter)
    check_choice("config.act_mul", cfg.act_mul, ACT_MUL_MODES)
    check_choice("config.pdl", cfg.pdl, (0, 1, 2))
    if type(cfg.index_quant) is not bool:
        raise ValueError(f"config.index_quant must be a bool, got {cfg.index_quant!r}")
    if type(cfg.down_n_per) is not int or not 1 <= cfg.down_n_per <= 256:
        raise ValueError(f"config.down_n_per must be an int in 1..256 (N tiles a down GEMM program), got "
                         f"{cfg.down_n_per!r}")
    if type(cfg.split_k) is not int or not 1 <= cfg.split_k <= 16:
        raise ValueError(f"config.split_k must be an int in 1..16 (gate-up programs a task's K loop is split over), "
                         f"got {cfg.split_k!r}")
    if cfg.gluon:
        _check_gluon(scheme, x, w13, cfg, H, fused_shared)
    # last: argument errors first; then whether the kernels can run where the tensors are
    check_kernel_device("x", x)
    return T, H, E, inter, k, out_dt


def _check_gluon(scheme: Scheme, x: torch.Tensor, w13: torch.Tensor, cfg: MoeConfig, H: int,
                 fused_shared: bool) -> None:
    """`MoeConfig.gluon`: the Gluon gate-up kernel's conditions (ValueError naming the one that fails), before
    anything is launched."""
    why = None
    if type(cfg.gluon) is not bool:
        why = f"must be a bool, got {cfg.gluon!r}"
    elif scheme.name != "fp8_block":
        why = f"takes the fp8 128-block scheme (Fp8Block128) only, got quant {scheme.name!r}"
    elif not (cfg.swap_ab and cfg.block_m == 16 and cfg.block_n == 128 and cfg.block_k == 128):
        why = (f"takes swap_ab, block_m 16, block_n 128, block_k 128; got swap_ab {cfg.swap_ab}, block_m "
               f"{cfg.block_m}, block_n {cfg.block_n}, block_k {cfg.block_k}")
    elif cfg.act_mul != "fp32":
        why = f"takes act_mul 'fp32', got {cfg.act_mul!r}"
    elif fused_shared:
        why = "does not take a fused shared expert (shared_w13 / shared_w2): pass its output as shared_output"
    elif not (cfg.prequant_x or x.dtype == FP8_E4M3):
        why = "needs x quantized up front (config.prequant_x=True, or an fp8 x)"
    elif is_interpreter() or x.device.type != "cuda" or cuda_capability(x.device)[0] < 9:
        why = "needs an sm_90 GPU (a Gluon kernel: not the interpreter)"
    elif H % 16 or w13.stride(1) != H or w13.stride(0) != w13.shape[1] * H or w13.data_ptr() % 16:
        why = "needs a contiguous w13 with H a multiple of 16 (its tiles are read by TMA)"
    elif _gluon_stages(H, cfg.split_k) == 0:
        why = f"cannot hold x's rows of a {_gluon_steps(H, cfg.split_k) * 128}-wide K run in shared memory"
    if why:
        raise ValueError(f"config.gluon {why}")


def _gluon_steps(H: int, split_k: int) -> int:
    """K steps of 128 in a Gluon gate-up program's run (the most a program of the split has: its x rows' buffer)."""
    return triton.cdiv(triton.cdiv(H, 128), split_k)


def _gluon_stages(H: int, split_k: int) -> int:
    """TMA ring depth of the Gluon gate-up kernel that fits shared memory beside x's [16, K run] fp8 rows (0: none
    of 2-4 does)."""
    x_bytes = _gluon_steps(H, split_k) * 16 * 128
    return next((s for s in (4, 3, 2) if x_bytes + s * 2 * 128 * 128 <= 216 * 1024), 0)


def _check_shared_weights(shared_w13, shared_w2, shared_output, x, H: int) -> int:
    """The fused shared expert's weights ([2·I_s, H] and [H, I_s], x's 16-bit dtype): → I_s (0 without one)."""
    if shared_w13 is None and shared_w2 is None:
        return 0
    if shared_w13 is None or shared_w2 is None:
        raise ValueError("shared_w13 and shared_w2 come together (the shared expert's gate-up and down weights)")
    if shared_output is not None:
        raise ValueError("shared_output and shared_w13/shared_w2 are two ways to add the shared expert: pass one")
    if x.dtype not in HALF_DTYPES:
        raise TypeError(f"shared_w13: the fused shared expert needs a 16-bit x, got x of {x.dtype}")
    check_tensor("shared_w13", shared_w13, dtypes=(x.dtype,), ndim=2, device=x.device)
    i2, hw = shared_w13.shape
    if hw != H or i2 % 2 or i2 == 0:
        raise ValueError(f"shared_w13 must be [2·I_s, H] with H = x.shape[1] = {H}, got {list(shared_w13.shape)}")
    check_tensor("shared_w2", shared_w2, dtypes=(x.dtype,), shape=(H, i2 // 2), device=x.device)
    for name, t in (("shared_w13", shared_w13), ("shared_w2", shared_w2)):
        _check_k_major(name, t)
    return i2 // 2


def _check_shared_ready(shared_ready, shared_output, x) -> None:
    if shared_ready is None:
        return
    if shared_output is None:
        raise ValueError("shared_ready orders the reduction's read of shared_output: pass shared_output too")
    if not isinstance(shared_ready, torch.cuda.Event):
        raise TypeError(f"shared_ready must be a torch.cuda.Event, got {type(shared_ready).__name__}")
    if not x.is_cuda:
        raise ValueError(f"shared_ready orders CUDA streams: x must be a CUDA tensor, got {x.device}")


def _validate_ids(topk_ids: torch.Tensor, n_global: int, expert_map: torch.Tensor | None = None,
                  n_local: int = 0) -> None:
    """Value check of topk_ids (and expert_map), where it costs no device sync (on the host) or when
    asked for (HPCOPS_CHECK=1, outside graph capture). Elsewhere the kernels drop out-of-range ids like
    remote experts: never an out-of-bounds access, and no host sync on the per-layer path."""
    if topk_ids.numel() and values_checkable(topk_ids):
        check_index_range("topk_ids", topk_ids, 0, n_global, "a global expert id")
    if expert_map is not None and expert_map.numel() and values_checkable(expert_map):
        check_index_range("expert_map", expert_map, -1, n_local, "a local expert id, or -1 for a remote expert")


@dataclass
class _SharedExpert:
    """A shared expert computed in the routed GEMM kernels (`shared_w13` / `shared_w2`): its tiles are the first
    `n_gu` / `n_dn` programs of the two grids (16-bit K tiles of the routed tiles' bytes), its activation `act`
    [T, I_s] and output `y` [T, H] in the output dtype; placeholders (`dummy`, no programs) without one."""

    n_gu: int
    n_dn: int
    w13: torch.Tensor
    w2: torch.Tensor
    act: torch.Tensor
    y: torch.Tensor

    @staticmethod
    def of(shared_w13, shared_w2, i_s: int, T: int, H: int, cfg: MoeConfig, out_dt, dummy) -> _SharedExpert:
        if not i_s:
            return _SharedExpert(0, 0, dummy, dummy, dummy, dummy)
        m_tiles = triton.cdiv(T, cfg.block_m)
        return _SharedExpert(m_tiles * triton.cdiv(i_s, cfg.block_n), m_tiles * triton.cdiv(H, cfg.down_block_n),
                             shared_w13, shared_w2, torch.empty((T, i_s), dtype=out_dt, device=dummy.device),
                             torch.empty((T, H), dtype=out_dt, device=dummy.device))

    @property
    def i_s(self) -> int:
        """The shared expert's intermediate size (0 without one)."""
        return self.w2.shape[1] if self.n_gu else 0

    def strides(self) -> tuple[int, int, int, int]:
        """Row strides of w13, w2, act and y (zeros without a shared expert: its kernels' arguments, never read)."""
        return tuple(t.stride(0) for t in (self.w13, self.w2, self.act, self.y)) if self.n_gu else (0, 0, 0, 0)


def _fp8_promote(cfg: MoeConfig, narrow: bool, per_token: bool, block_k: int) -> dict[str, int]:
    """The FP8_PROMOTE launch argument of one GEMM (`MoeConfig.fp8_promote`): by default 128 products on the swap-AB
    tiles and where the GEMM's fp8 input has per-token scales, none elsewhere."""
    p = cfg.fp8_promote
    if p is None:
        p = 128 if cfg.swap_ab or per_token else 0
    return dict(FP8_PROMOTE=min(p, block_k)) if narrow and p > 0 else {}


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, *, quant: Fp8PerTensor | Fp8Block128 | None = None,
              expert_map: torch.Tensor | None = None, shared_output: torch.Tensor | None = None,
              out: torch.Tensor | None = None, x_scale: torch.Tensor | None = None,
              config: MoeConfig | None = None, shared_ready: torch.cuda.Event | None = None,
              shared_w13: torch.Tensor | None = None, shared_w2: torch.Tensor | None = None) -> torch.Tensor:
    """Mixture-of-experts FFN: out[t] = Σ_j topk_weights[t,j] · FFN_{topk_ids[t,j]}(x[t]) (+ shared_output[t],
    or + the shared expert FFN_s(x[t]) computed in the same kernels).

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
        shared_ready: a CUDA event recorded after `shared_output` was written on another stream (a shared
            expert run beside the routed experts, as vLLM runs it on an auxiliary stream at decode sizes):
            the reduction, the only kernel that reads `shared_output`, waits for it; the GEMMs do not.
            Graph-capture safe (the wait becomes a graph edge). The caller keeps `shared_output` alive
            until the reduction ran (`Tensor.record_stream` on this stream).
        shared_w13, shared_w2: a shared expert (every token, weight 1) computed inside the routed GEMM kernels:
            `[2·I_s, H]` gate rows then up rows and `[H, I_s]`, x's 16-bit dtype whatever `quant`. Its tiles are
            the first programs of the gate-up and down grids (its weight read beside the routed experts', no
            second stream); its output, rounded to the output dtype, is added in the fp32 reduction, as
            `shared_output` would be. Instead of `shared_output`.
        out: `[T, H]` output buffer (last dim contiguous); written fully.
        x_scale: only for an fp8 `x`: per-tensor `[1]` or per-token `[T]` (`Fp8PerTensor`; defaults to
            quant.a13_scale), or `[T, ceil(H/128)]` (`Fp8Block128`). Dequantization multipliers.
        config: tile config (default: `get_config` heuristic from the average tokens per expert).

    Returns:
        `[T, H]` in x's dtype (bf16 for an fp8 x).

    No host sync and no data-dependent allocation (CUDA-graph safe). topk_ids values are checked where
    they are on the host, or with HPCOPS_CHECK=1 (`config.validate_ids` turns the check off entirely).
    """
    scheme = scheme_for(quant)
    if config is None:
        check_tensor("x", x, ndim=2)
        check_tensor("topk_ids", topk_ids, ndim=2)
        n_global = expert_map.shape[0] if isinstance(expert_map, torch.Tensor) else w13.shape[0]
        config = get_config(num_tokens=x.shape[0], top_k=topk_ids.shape[1], num_experts=n_global,
                            hidden=x.shape[1], inter=w2.shape[-1], quant=scheme.name, interpreter=is_interpreter(),
                            num_local_experts=w13.shape[0], device_name=device_name(x.device))
    cfg = config
    _check_shared_ready(shared_ready, shared_output, x)
    T, H, E, inter, k, out_dt = _validate(scheme, x, w13, w2, topk_weights, topk_ids, expert_map, shared_output,
                                          out, x_scale, cfg, shared_w13 is not None or shared_w2 is not None)
    i_s = _check_shared_weights(shared_w13, shared_w2, shared_output, x, H)
    n_global = expert_map.shape[0] if expert_map is not None else E
    if cfg.validate_ids:
        _validate_ids(topk_ids, n_global, expert_map, E)
    if out is None:
        out = torch.empty((T, H), dtype=out_dt, device=x.device)
    if T == 0:
        return out
    topk_ids = topk_ids.contiguous()
    topk_weights = topk_weights.contiguous()
    naive = T * k <= cfg.naive_max_pairs  # one task per pair: no index
    # (split K's arrival counts zeroed ahead of the index build: the kernels after it stay one PDL chain)
    n_tasks = T * k if naive else task_capacity(T * k, E, cfg.block_m)  # (the index's `cap`)
    gu_split = _split_k_buffers(cfg, n_tasks * triton.cdiv(inter, cfg.block_n), x.device)
    # MoeConfig.pdl: the gate-up, down and reduce kernels launched with programmatic dependent launch (sm_90)
    pdl = cfg.pdl if not is_interpreter() and _pdl_capable(x.device) else 0
    dummy = topk_ids  # placeholder pointer for the arguments a mode does not read
    # (act's zero fill, if any, comes before the launch that releases the gate-up GEMM's)
    act = scheme.activation(T * k, inter, out_dt, cfg, dummy)
    a = scheme.gate_up_input(x, x_scale, cfg, dummy)  # x's quantization (a.pending) launched below
    # MoeConfig.index_quant: x's quantization in the index build's launch(es), last before the gate-up
    in_index = a.pending is not None and cfg.index_quant and not naive
    idx = None if naive else build_moe_index(topk_ids, E, cfg.block_m, expert_map=expert_map,
                                              small_max=cfg.index_small_max,
                                              x_quant=a.pending if in_index else None, pdl_next=pdl)
    if a.pending is not None and not in_index:
        a.pending.launch(pdl)
    # one launch of index and quantization, which releases the gate-up's: that waits before it reads the index (the
    # Gluon gate-up, which reads it before its wait, launched as usual after it)
    fused_index = in_index and T * k <= cfg.index_small_max
    tasks, offsets, sorted_pair, pair_pos = (dummy,) * 4 if naive else (idx.tasks, idx.offsets, idx.sorted_pair,
                                                                       idx.pair_pos)
    emap = expert_map if expert_map is not None else topk_ids
    routing = dict(NAIVE=naive, HAS_MAP=expert_map is not None)
    # a kernel launched with PDL may start before the previous one is done and reads only the call's inputs before
    # its wait: the first kernel of the call is launched as usual, so those inputs are complete when it starts
    gu_pdl = _pdl_launch(pdl and not fused_index and (not naive or a.x is not x or act.rowmax is not dummy))
    if pdl and fused_index and not cfg.gluon:
        gu_pdl = dict(PDL_WAIT=True, PDL_WAIT_FIRST=True, launch_pdl=True)
    ws = scheme.weight_scales(E, dummy)
    sx = _SharedExpert.of(shared_w13, shared_w2, i_s, T, H, cfg, out_dt, dummy)
    narrow = w13.element_size() == 1
    # fp8 tiles on wgmma: the MMA's reduced-precision sum joins the fp32 accumulator after at most
    # `fp8_promote` products, at least once a K step (`_mma`)
    gu_per_token, dn_per_token = scheme.per_token_inputs(a, act)
    gu_promote = _fp8_promote(cfg, narrow, gu_per_token, cfg.block_k)
    dn_promote = _fp8_promote(cfg, narrow, dn_per_token, cfg.down_block_k)
    call = _GemmCall(scheme, cfg, T, H, E, inter, k, n_global, n_tasks, tasks, offsets, topk_ids, emap, routing, sx,
                     narrow, pdl)
    _launch_gate_up(call, x, a, w13, ws, act, sorted_pair, out_dt, gu_promote, gu_pdl, gu_split)
    y = torch.empty((T * k, H), dtype=out_dt, device=x.device)
    reduce_pdl = bool(pdl) and shared_ready is None  # (an event wait between the two: launched as usual)
    _launch_down(call, w2, ws, act, y, dn_promote, reduce_pdl)

    if i_s:
        shared_output = sx.y
    sh = shared_output if shared_output is not None else out
    if shared_ready is not None:
        torch.cuda.current_stream(x.device).wait_event(shared_ready)
    bh = min(cfg.reduce_block_h, triton.next_power_of_2(H))
    K.moe_reduce_kernel[(T, triton.cdiv(H, bh))](
        y, pair_pos, topk_ids, emap, topk_weights, sh, out, H, n_global, E,
        y.stride(0), topk_weights.stride(0), sh.stride(0), out.stride(0),
        TOP_K=k, HAS_SHARED=shared_output is not None, **routing, BLOCK_H=bh, **_pdl_launch(reduce_pdl),
        num_warps=4)
    return out


@dataclass
class _GemmCall:
    """What the gate-up and down launches of one call share: scheme, config, sizes, the task form's tensors
    (placeholders where a form reads none), the fused shared expert and the PDL mode."""

    scheme: Scheme
    cfg: MoeConfig
    T: int
    H: int
    E: int
    inter: int
    k: int
    n_global: int
    n_tasks: int
    tasks: torch.Tensor
    offsets: torch.Tensor
    topk_ids: torch.Tensor
    emap: torch.Tensor
    routing: dict
    sx: _SharedExpert
    narrow: bool  # 1-byte weights
    pdl: int


def _launch_gate_up(c: _GemmCall, x, a, w13, ws, act, sorted_pair, out_dt, promote: dict, pdl_launch: dict,
                    split: dict) -> None:
    """`moe_gate_up_kernel` over the shared expert's tiles, then tasks × N tiles (× split_k)."""
    cfg, sx = c.cfg, c.sx
    if cfg.gluon:  # (its conditions checked by `_check_gluon`)
        _launch_gate_up_gluon(c, a, w13, ws, act, sorted_pair, out_dt, pdl_launch, split)
        return
    sx_w13, _, sx_act, _ = sx.strides()
    K.moe_gate_up_kernel[(sx.n_gu + c.n_tasks * triton.cdiv(c.inter, cfg.block_n) * cfg.split_k,)](
        a.x, a.scale, w13, ws.w13, a.a13, c.tasks, c.offsets, sorted_pair, c.topk_ids, c.emap,
        act.act, act.scale, act.a2, act.rowmax,
        c.H, c.inter, c.n_tasks, c.k, c.n_global, c.E,
        a.x.stride(0), a.stride_t, a.stride_g,
        w13.stride(0), w13.stride(1), *ws.w13_strides,
        act.act.stride(0), act.stride_s,
        x, sx.w13, sx.act, c.T, sx.i_s, sx.n_gu, x.stride(0), sx_w13, sx_act,
        QUANT=int(c.scheme.code), X_FP8=a.fp8, ACT_OUT=int(act.mode), ACT_DT=_TL_DTYPE[out_dt],
        BF16_MUL=cfg.act_mul == "bf16", SWAP_AB=cfg.swap_ab, **c.routing, SHARED=bool(sx.i_s),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        SHARED_BLOCK_K=max(16, cfg.block_k // 2) if c.narrow else cfg.block_k, **promote, **pdl_launch,
        PDL_NEXT=c.pdl, **split, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _launch_gate_up_gluon(c: _GemmCall, a, w13, ws, act, sorted_pair, out_dt, pdl_launch: dict, split: dict) -> None:
    """`moe_gate_up_block_gluon_kernel` (`MoeConfig.gluon`) over tasks × N tiles × split_k."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from hpcops.moe._moe_gluon import moe_gate_up_block_gluon_kernel

    cfg = c.cfg
    rows = w13.shape[0] * w13.shape[1]
    w_desc = TensorDescriptor(w13, [rows, c.H], [c.H, 1], [128, 128],
                              gl.NVMMASharedLayout.get_default_for([128, 128], gl.float8e4nv))
    dummy = c.offsets
    moe_gate_up_block_gluon_kernel[(c.n_tasks * (c.inter // 128) * cfg.split_k,)](
        a.x, a.scale, w_desc, ws.w13, c.tasks, c.offsets, sorted_pair, c.topk_ids, c.emap, act.act, act.scale,
        split.get("part_ptr", dummy), split.get("cnt_ptr", dummy),
        c.H, c.inter, c.n_tasks, c.k, c.n_global, c.E,
        a.x.stride(0), a.stride_t, a.stride_g, *ws.w13_strides, act.act.stride(0), act.stride_s,
        ACT_DT=gl.float16 if out_dt == torch.float16 else gl.bfloat16, **c.routing, BLOCK_M=16,
        STEPS=_gluon_steps(c.H, cfg.split_k), STAGES=_gluon_stages(c.H, cfg.split_k),
        SPLIT_K=cfg.split_k, PDL_NEXT=c.pdl, num_warps=cfg.num_warps, **(pdl_launch or {"PDL_WAIT": False}))


def _launch_down(c: _GemmCall, w2, ws, act, y, promote: dict, reduce_pdl: bool) -> None:
    """`moe_down_kernel` over the shared expert's tiles, then tasks × ceil(N tiles / down_n_per)."""
    cfg, sx = c.cfg, c.sx
    _, sx_w2, sx_act, sx_y = sx.strides()
    K.moe_down_kernel[(sx.n_dn + c.n_tasks * triton.cdiv(triton.cdiv(c.H, cfg.down_block_n), cfg.down_n_per),)](
        act.act, act.scale, act.a2, act.rowmax, w2, ws.w2, c.tasks, c.offsets, c.topk_ids, c.emap, y,
        c.H, c.inter, c.n_tasks, c.n_global, c.E,
        act.act.stride(0), act.stride_s, w2.stride(0), w2.stride(1), *ws.w2_strides,
        y.stride(0),
        sx.act, sx.w2, sx.y, c.T, sx.i_s, sx.n_dn, sx_act, sx_w2, sx_y,
        QUANT=int(c.scheme.code), ACT_IN=int(act.mode), SWAP_AB=cfg.swap_ab, **c.routing, SHARED=bool(sx.i_s),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.down_block_n, BLOCK_K=cfg.down_block_k,
        SHARED_BLOCK_K=max(16, cfg.down_block_k // 2) if c.narrow else cfg.down_block_k, **promote,
        **({"N_PER": cfg.down_n_per, "K_ONE": cfg.down_block_k >= c.inter} if cfg.down_n_per > 1 else {}),
        **_pdl_launch(c.pdl), PDL_NEXT=c.pdl if reduce_pdl else 0, num_warps=cfg.down_num_warps,
        num_stages=cfg.down_num_stages)


def _split_k_buffers(cfg: MoeConfig, tiles: int, dev: torch.device) -> dict:
    """The gate-up kernel's split-K arguments (`MoeConfig.split_k`): fp32 partial tiles [tiles, split_k, tile] and
    arrival counts [tiles], zeroed; none for split_k 1."""
    if cfg.split_k == 1:
        return {}
    part = torch.empty(tiles * cfg.split_k * 2 * cfg.block_n * cfg.block_m, dtype=torch.float32, device=dev)
    return dict(part_ptr=part, cnt_ptr=torch.zeros(tiles, dtype=torch.int32, device=dev), SPLIT_K=cfg.split_k)


def _pdl_capable(dev: torch.device) -> bool:
    """Programmatic dependent launch needs sm_90 or later (off CUDA only where launches are recorded, not run:
    ptx_fingerprint, the sm_90 build tests)."""
    return dev.type != "cuda" or cuda_capability(dev)[0] >= 9


def _pdl_launch(on: bool) -> dict:
    """Launch arguments of a kernel launched with programmatic dependent launch (it waits in PDL_WAIT), or none."""
    return dict(PDL_WAIT=True, launch_pdl=True) if on else {}


# ---- torch.library: the mutating out= form, for torch.compile and graph-capturing frameworks ----

def _fused_moe_out(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor, out: torch.Tensor, quant_kind: str,
                   w13_scale: torch.Tensor | None, w2_scale: torch.Tensor | None,  # noqa: UP045
                   a13_scale: torch.Tensor | None, a2_scale: torch.Tensor | None,  # noqa: UP045
                   x_scale: torch.Tensor | None, expert_map: torch.Tensor | None,  # noqa: UP045
                   shared_output: torch.Tensor | None, act_mul: str) -> None:  # noqa: UP045
    quant = scheme_named(quant_kind).from_op_args(w13_scale, w2_scale, a13_scale, a2_scale)
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
