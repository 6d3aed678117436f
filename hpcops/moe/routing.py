"""Router top-k (`select_experts`) and the device-side routing index of the fused MoE (`build_moe_index`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import triton

from hpcops import _platform
from hpcops._checks import check_choice, check_tensor, kernels_are_replaced
from hpcops._library import register
from hpcops.moe import _moe_kernels as K

if TYPE_CHECKING:
    from hpcops.moe.schemes import XQuant

INDEX_BLOCK = 1024  # pairs per program of the multi-program index build
CAP_BLOCK = 256  # task-map slots per iteration of the sentinel fill


# the kernel keeps a [BLOCK_T, next_pow2(E)] tile in registers and unrolls its top_k steps: beyond these
# bounds (no MoE model comes near them) the torch reference computes the routing
SELECT_MAX_EXPERTS = 4096
SELECT_MAX_TOP_K = 64


def select_experts(router_logits: torch.Tensor, top_k: int, *, scoring: str = "softmax",
                   bias: torch.Tensor | None = None, renormalize: bool = True,
                   scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing in one kernel launch (no host sync: CUDA-graph safe).

    Args:
        router_logits: `[T, E]`, any float dtype (computed in fp32).
        top_k: experts per token (≤ E).
        scoring: "softmax" (weights = softmax probabilities of the chosen experts) or "sigmoid"
            (Hy3 / DeepSeek-V3: weights = sigmoid(logits); `bias` [E] is added for the *selection only*).
        renormalize: divide the chosen weights by their sum.
        scale: multiply the final weights (Hy3: 2.826).

    Returns:
        (topk_weights fp32 `[T, top_k]`, topk_ids int32 `[T, top_k]`), experts in descending order of
        score (+ bias), the lower expert id first among equal scores; a NaN score ranks below every number.

    One Triton program routes a block of tokens (the sigmoid or softmax, the top-k, the renormalization and
    the scale in registers): in a decode step's CUDA graph this replaces the ~10 small launches of the torch
    sequence (`hpcops.moe.reference.select_experts`, the reference). CPU tensors without TRITON_INTERPRET, and
    E > 4096 or top_k > 64, take that torch reference.
    """
    _check_select(router_logits, top_k, scoring, bias, scale)
    T = router_logits.shape[0]
    if not _on_kernel(router_logits, top_k):
        from hpcops.moe.reference import select_experts as torch_select

        return torch_select(router_logits, top_k, scoring=scoring, bias=bias, renormalize=renormalize,
                            scale=scale)
    dev = router_logits.device
    weights = torch.empty((T, top_k), dtype=torch.float32, device=dev)
    ids = torch.empty((T, top_k), dtype=torch.int32, device=dev)
    _launch_select(router_logits, top_k, scoring, bias, renormalize, scale, weights, ids)
    return weights, ids


def _on_kernel(router_logits: torch.Tensor, top_k: int) -> bool:
    """The kernel computes the routing (else the torch reference): a CUDA tensor or the interpreter, within
    SELECT_MAX_EXPERTS / SELECT_MAX_TOP_K."""
    on_device = router_logits.is_cuda or _platform.is_interpreter() or kernels_are_replaced()
    return on_device and router_logits.shape[1] <= SELECT_MAX_EXPERTS and top_k <= SELECT_MAX_TOP_K


def select_launch(num_experts: int) -> tuple[int, int]:
    """(tokens a program, warps) of the routing kernel. From 128 to 512 experts one warp routes one token
    (the top_k rounds of reductions stay inside the warp: shuffles, no barriers); below 128 experts one warp
    holds several tokens' [tokens, next_pow2(E)] tile (~1 KB of scores a program); larger E spreads one
    token over 4 / 8 warps. `bench/results/router.md` (`hpcops-batched`: the batched tile at every E up to
    512): at 128–256 experts one token a program is 2.6–3.3x faster from T 4 to 512 and 1.1–1.5x at T 4096;
    at 8 experts the batched tile wins at T 4096."""
    e_pad = triton.next_power_of_2(num_experts)
    if e_pad < 128:
        return max(1, min(32, 1024 // e_pad)), 1
    return 1, 1 if e_pad <= 512 else 4 if e_pad <= 2048 else 8


def batched_select_launch(num_experts: int) -> tuple[int, int]:
    """The earlier rule (several tokens a program on one warp up to 512 experts), kept as the router
    bench's `hpcops-batched` row."""
    e_pad = triton.next_power_of_2(num_experts)
    if e_pad <= 512:
        return max(1, min(32, 1024 // e_pad)), 1
    return select_launch(num_experts)


def _launch_select(router_logits, top_k, scoring, bias, renormalize, scale, weights, ids,
                   launch: tuple[int, int] | None = None) -> None:
    """`router_logits` [T, E], or [S, T, E] partial sums (added in the kernel)."""
    parts = router_logits if router_logits.dim() == 3 else router_logits[None]
    _, T, E = parts.shape
    if T == 0:
        return
    block_t, warps = launch or select_launch(E)
    has_bias = bias is not None and scoring == "sigmoid"
    K.select_experts_kernel[(triton.cdiv(T, block_t),)](
        parts, parts.stride(1), parts.stride(2), bias if has_bias else weights,
        weights, ids, T, E, float(scale), parts.stride(0), TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k),
        E_PAD=triton.next_power_of_2(E), BLOCK_T=block_t, SIGMOID=scoring == "sigmoid", HAS_BIAS=has_bias,
        RENORM=bool(renormalize), SPLITS=parts.shape[0], num_warps=warps)


# route(): the router GEMM on the kernel up to this many tokens (its grid's third dimension, 8192 T tiles of the
# prefill tiles' 128 tokens, stays under CUDA's 65535); beyond it torch's GEMM (cuBLAS) then select_experts
ROUTE_KERNEL_MAX_T = 1 << 20
MAX_GRID_Z = 65535  # CUDA's limit on a grid's third dimension (the router GEMM's T tiles)


@dataclass(frozen=True)
class RouterLaunch:
    """The router GEMM's tiles: BLOCK_T tokens × BLOCK_E experts × BLOCK_K, `splits` programs along H of
    `k_split` elements each (a multiple of BLOCK_K), `warps` warps, `stages` software-pipeline stages of the K
    loop."""
    block_t: int
    block_e: int
    block_k: int
    k_split: int
    splits: int
    warps: int
    stages: int = 3


ROUTER_MIN_BLOCK_T = 16  # the MMA's smallest M
# decode tiles, below ROUTER_LARGE_T tokens (probe_route_256c82f): a split K spreads the weight read over the SMs
ROUTER_MAX_BLOCK_T, ROUTER_BLOCK_E, ROUTER_BLOCK_K, ROUTER_WARPS = 16, 32, 128, 4
ROUTER_DECODE = dict(max_block_t=ROUTER_MAX_BLOCK_T, block_e=ROUTER_BLOCK_E, block_k=ROUTER_BLOCK_K,
                     warps=ROUTER_WARPS, stages=3)
ROUTER_TARGET_PROGRAMS = 264  # two per SM of an H100/H200
# prefill tiles, from ROUTER_LARGE_T tokens: the MMAs are the cost (three a K step), so large tiles
# (probe_route_large_5820d34: 2.9-3.7x the decode tiles from 512 tokens)
ROUTER_LARGE_T = 256
ROUTER_LARGE = dict(max_block_t=128, block_e=64, block_k=64, warps=8, stages=3)


def router_launch(num_tokens: int, num_experts: int, hidden: int, *, max_block_t: int | None = None,
                  block_e: int | None = None, block_k: int | None = None, warps: int | None = None,
                  programs: int = ROUTER_TARGET_PROGRAMS, stages: int | None = None) -> RouterLaunch:
    """The router GEMM's launch: T tiles of 16 up to `max_block_t` tokens, about `programs` programs over the E and
    T tiles and the splits of H. Arguments left None take the decode tiles below ROUTER_LARGE_T tokens, the prefill
    tiles (ROUTER_LARGE) from there."""
    given = dict(max_block_t=max_block_t, block_e=block_e, block_k=block_k, warps=warps, stages=stages)
    c = {**(ROUTER_LARGE if num_tokens >= ROUTER_LARGE_T else ROUTER_DECODE),
         **{name: v for name, v in given.items() if v is not None}}
    block_t = max(ROUTER_MIN_BLOCK_T, min(triton.next_power_of_2(max(num_tokens, 1)), c["max_block_t"]))
    block_e, block_k = c["block_e"], c["block_k"]
    tiles = triton.cdiv(num_experts, block_e) * triton.cdiv(max(num_tokens, 1), block_t)
    want = max(1, min(programs // tiles, triton.cdiv(hidden, block_k)))
    k_split = triton.cdiv(triton.cdiv(hidden, want), block_k) * block_k
    return RouterLaunch(block_t, block_e, block_k, k_split, triton.cdiv(hidden, k_split), c["warps"], c["stages"])


def router_partials(hidden: torch.Tensor, router_weight: torch.Tensor,
                    launch: RouterLaunch | None = None) -> torch.Tensor:
    """→ [splits, T, E] fp32 partial logits (their sum over dim 0 is hidden · router_weightᵀ); inputs as
    `route` (which validates them)."""
    T, H = hidden.shape
    E = router_weight.shape[0]
    lc = launch or router_launch(T, E, H)
    if triton.cdiv(T, lc.block_t) > MAX_GRID_Z:
        raise ValueError(f"launch: {T} tokens in tiles of {lc.block_t} exceed CUDA's {MAX_GRID_Z} T tiles a grid")
    parts = torch.empty((lc.splits, T, E), dtype=torch.float32, device=hidden.device)
    if T:
        grid = (triton.cdiv(E, lc.block_e), lc.splits, triton.cdiv(T, lc.block_t))
        K.router_gemm_kernel[grid](hidden, router_weight, parts, T, E, H, lc.k_split, hidden.stride(0),
                                   router_weight.stride(0), parts.stride(0), parts.stride(1), BLOCK_T=lc.block_t,
                                   BLOCK_E=lc.block_e, BLOCK_K=lc.block_k, num_warps=lc.warps, num_stages=lc.stages)
    return parts


def route(hidden: torch.Tensor, router_weight: torch.Tensor, top_k: int, *, scoring: str = "softmax",
          bias: torch.Tensor | None = None, renormalize: bool = True,
          scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The router GEMM and `select_experts` in two launches: logits = hidden · router_weightᵀ in fp32, then the
    top-k as `select_experts` computes it (same arguments and results).

    Args:
        hidden: `[T, H]` bf16/fp16/fp32, last dim contiguous.
        router_weight: `[E, H]` fp32 (Hy3, DeepSeek-V3 keep the router in fp32) or 16-bit, last dim contiguous.
        top_k, scoring, bias, renormalize, scale: as `select_experts`.

    A bf16 `hidden` (up to ROUTE_KERNEL_MAX_T tokens): one split-K program grid computes partial logits with fp32
    precision on the tensor cores (`router_gemm_kernel`: the fp32 weight split in registers into three bf16 terms
    that sum to it exactly, so every product is exact; no weight copy, no cast of `hidden`) and the top-k kernel
    adds them, where torch's sequence is a cast and a SIMT sgemm with a split-K reduce. Otherwise torch's GEMM,
    then `select_experts`. No host sync.
    """
    check_tensor("hidden", hidden, ndim=2)
    if not hidden.is_floating_point():
        raise TypeError(f"hidden must be a floating tensor, got {hidden.dtype}")
    T, H = hidden.shape
    check_tensor("router_weight", router_weight, ndim=2, device=hidden.device)
    if not router_weight.is_floating_point():
        raise TypeError(f"router_weight must be a floating tensor, got {router_weight.dtype}")
    if router_weight.shape[1] != H:
        raise ValueError(f"router_weight must be [E, H] with H = hidden.shape[1] = {H}, got "
                         f"{list(router_weight.shape)}")
    for name, t in (("hidden", hidden), ("router_weight", router_weight)):
        if H > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous along its last dimension, got strides {tuple(t.stride())}")
    E = router_weight.shape[0]
    _check_routing(E, hidden.device, top_k, scoring, bias, scale)
    on_device = hidden.is_cuda or _platform.is_interpreter() or kernels_are_replaced()
    if (T > ROUTE_KERNEL_MAX_T or not on_device or hidden.dtype != torch.bfloat16 or E > SELECT_MAX_EXPERTS
            or top_k > SELECT_MAX_TOP_K):
        logits = hidden.float() @ router_weight.float().t()
        return select_experts(logits, top_k, scoring=scoring, bias=bias, renormalize=renormalize, scale=scale)
    parts = router_partials(hidden, router_weight)
    weights = torch.empty((T, top_k), dtype=torch.float32, device=hidden.device)
    ids = torch.empty((T, top_k), dtype=torch.int32, device=hidden.device)
    _launch_select(parts, top_k, scoring, bias, renormalize, scale, weights, ids)
    return weights, ids


def _check_select(router_logits, top_k, scoring, bias, scale) -> None:
    check_tensor("router_logits", router_logits, ndim=2)
    if not router_logits.is_floating_point():
        raise TypeError(f"router_logits must be a floating tensor, got {router_logits.dtype}")
    _check_routing(router_logits.shape[1], router_logits.device, top_k, scoring, bias, scale)


def _check_routing(E: int, device: torch.device, top_k, scoring, bias, scale) -> None:
    """The top-k arguments against E experts on `device`."""
    check_choice("scoring", scoring, ("softmax", "sigmoid"))
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= E:
        raise ValueError(f"top_k must be an int in [1, {E}] (the number of experts), got {top_k!r}")
    if bias is not None:
        check_tensor("bias", bias, shape=(E,), device=device)
        if not bias.is_floating_point():
            raise TypeError(f"bias must be a floating tensor, got {bias.dtype}")
        if scoring != "sigmoid":
            raise ValueError("bias (selection-only correction) is supported with scoring='sigmoid' only")
    if isinstance(scale, bool) or not isinstance(scale, int | float):
        raise TypeError(f"scale must be a python float, got {type(scale).__name__}")


# ---- torch.library: the mutating out= form, for torch.compile and graph-capturing frameworks ----

def _select_experts_out(router_logits: torch.Tensor, top_k: int, scoring: str, bias: torch.Tensor | None,  # noqa: UP045
                        renormalize: bool, scale: float, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> None:
    _check_select(router_logits, top_k, scoring, bias, scale)
    T = router_logits.shape[0]
    check_tensor("topk_weights", topk_weights, dtypes=(torch.float32,), shape=(T, top_k),
                 device=router_logits.device)
    check_tensor("topk_ids", topk_ids, dtypes=(torch.int32,), shape=(T, top_k), device=router_logits.device)
    if topk_weights.is_contiguous() and topk_ids.is_contiguous() and _on_kernel(router_logits, top_k):
        _launch_select(router_logits, top_k, scoring, bias, renormalize, scale, topk_weights, topk_ids)
        return
    w, ids = select_experts(router_logits, top_k, scoring=scoring, bias=bias, renormalize=renormalize, scale=scale)
    topk_weights.copy_(w)
    topk_ids.copy_(ids)


def _select_experts_out_fake(router_logits, top_k, scoring, bias, renormalize, scale, topk_weights, topk_ids) -> None:
    return None


select_experts_out_op = register("select_experts_out", _select_experts_out, mutates_args=("topk_weights", "topk_ids"),
                                 fake=_select_experts_out_fake)


@dataclass
class MoeIndex:
    """The routing index (all device tensors, sized from shapes only: CUDA-graph safe).

    `offsets` int32 [E_local+1]: expert e owns sorted rows [offsets[e], offsets[e+1]); offsets[E_local]
    is the number of locally routed pairs. `sorted_pair` int32 [N]: the pair (t·k + j) of each sorted
    row (rows ≥ offsets[E_local] are unused). `pair_pos` int32 [N]: the sorted row of each pair, −1 when
    its expert is remote (EP) or out of range. `tasks` int32 [2, cap]: per M tile (expert, first row);
    expert −1 marks the end. `cap` = min(N, N // block_m + E_local) bounds the number of tiles.
    """

    offsets: torch.Tensor
    sorted_pair: torch.Tensor
    pair_pos: torch.Tensor
    tasks: torch.Tensor
    block_m: int
    cap: int

    @property
    def counts(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]


def task_capacity(num_pairs: int, num_local_experts: int, block_m: int) -> int:
    """Worst-case number of M tiles: Σ_e ceil(c_e / bm) ≤ N // bm + E (and ≤ N, each tile has a row)."""
    return max(1, min(num_pairs, num_pairs // block_m + num_local_experts))


def build_moe_index(topk_ids: torch.Tensor, num_local_experts: int, block_m: int, *,
                    expert_map: torch.Tensor | None = None, small_max: int = 1024,
                    block: int = INDEX_BLOCK, x_quant: XQuant | None = None, pdl_next: int = 0) -> MoeIndex:
    """Counting sort of the (token, slot) pairs by local expert, on the device, without a host sync.

    `topk_ids`: int32 [T, k] global expert ids; `expert_map`: int32 [E_global] (local id or −1).
    Up to `small_max` pairs one program sorts everything; above, three kernels over blocks of `block` pairs
    (a power of 2): per-block expert histograms, one program's scan (offsets, task map, each block's
    first rows), and a per-block sort + scatter. No atomics; rows are in pair order inside every expert
    either way (deterministic).
    `x_quant` (`fused_moe`'s `MoeConfig.index_quant`): x's fp8 quantization pass, launched here: as T more
    programs of the single program's launch (one launch less; it releases no launch early, so the next one starts
    once it has exited), or alone after the three kernels, releasing the next launch where `pdl_next`
    (`MoeConfig.pdl`).
    """
    ids = topk_ids.contiguous()
    dev = ids.device
    n = ids.numel()
    e_local = num_local_experts
    e_global = expert_map.shape[0] if expert_map is not None else e_local
    cap = task_capacity(n, e_local, block_m)
    offsets = torch.empty(e_local + 1, dtype=torch.int32, device=dev)
    sorted_pair = torch.empty(max(n, 1), dtype=torch.int32, device=dev)
    pair_pos = torch.empty(max(n, 1), dtype=torch.int32, device=dev)
    tasks = torch.empty((2, cap), dtype=torch.int32, device=dev)
    has_map = expert_map is not None
    emap = expert_map if has_map else ids  # dummy pointer when there is no map
    e_pad = triton.next_power_of_2(e_local + 1)
    if n <= small_max:
        n_pad = max(16, triton.next_power_of_2(max(n, 1)))
        warps = 8 if n_pad >= 1024 else 4
        if x_quant is None:
            xq_args, xq_kw = (ids, ids, ids, ids, 0, 0, 0, 0), {}  # placeholders: QUANT_X off
        else:
            xq_args = x_quant.args()
            xq_kw = dict(QUANT_X=True, X_MODE=int(x_quant.mode), X_BLOCK_H=x_quant.block_h)
            warps = max(warps, x_quant.warps)
        grid = 1 + (x_quant.x.shape[0] if x_quant is not None else 0)
        K.moe_index_small_kernel[(grid,)](ids, emap, offsets, sorted_pair, pair_pos, tasks, n, e_global, e_local,
                                          cap, *xq_args, HAS_MAP=has_map, N_PAD=n_pad, E_PAD=e_pad, BLOCK_M=block_m,
                                          CAP_BLOCK=CAP_BLOCK, **xq_kw, num_warps=warps)
    else:
        nb = triton.cdiv(n, block)
        hist = torch.empty((nb, e_pad), dtype=torch.int32, device=dev)
        base = torch.empty((nb, e_pad), dtype=torch.int32, device=dev)
        K.moe_index_hist_kernel[(nb,)](ids, emap, hist, n, e_global, e_local, HAS_MAP=has_map, E_PAD=e_pad,
                                       BLOCK=block, num_warps=4)
        K.moe_index_scan_kernel[(1,)](hist, base, offsets, tasks, nb, e_local, cap, E_PAD=e_pad, BLOCK_M=block_m,
                                      CAP_BLOCK=CAP_BLOCK, NB_BLOCK=min(16, triton.next_power_of_2(nb)),
                                      num_warps=4)
        K.moe_index_scatter_kernel[(nb,)](ids, emap, base, sorted_pair, pair_pos, n, e_global, e_local,
                                          HAS_MAP=has_map, E_PAD=e_pad, BLOCK=block, num_warps=4)
        if x_quant is not None:
            x_quant.launch(pdl_next)
    return MoeIndex(offsets, sorted_pair, pair_pos, tasks, block_m, cap)
