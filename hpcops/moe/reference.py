"""Pure-torch references with the signatures of the public MoE ops (fp32 maths, dequantized weights).

For fp8 the reference quantizes activations exactly as the kernels define it (see README.md): x with the
static a13 scale, per token, or per token and 128-group; the SiLU-and-mul output is rounded to the
16-bit activation dtype, then quantized (static a2, per token, or per token and 128-group).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hpcops.moe.configs import MoeConfig
from hpcops.quant import (
    FP8,
    FP8_MAX,
    Fp8Block128,
    Fp8PerTensor,
    dequantize_block128,
    expand_block_scale,
    quantize_per_token,
    quantize_per_token_group,
)


def select_experts(router_logits, top_k, *, scoring="softmax", bias=None, renormalize=True, scale=1.0):
    """`hpcops.select_experts` in torch (fp32): the same arguments, checks and results (up to the order of
    equal scores, which torch.topk leaves open)."""
    from hpcops.moe.routing import _check_select

    _check_select(router_logits, top_k, scoring, bias, scale)
    logits = router_logits.float()
    if scoring == "softmax":
        scores = torch.softmax(logits, dim=-1)
        weights, ids = torch.topk(scores, top_k, dim=-1)
    else:
        scores = torch.sigmoid(logits)
        choose = scores + bias.float() if bias is not None else scores
        _, ids = torch.topk(choose, top_k, dim=-1)
        weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(1e-20)
    if scale != 1.0:
        weights = weights * scale
    return weights.contiguous(), ids.to(torch.int32).contiguous()


def route(hidden, router_weight, top_k, *, scoring="softmax", bias=None, renormalize=True, scale=1.0):
    """`hpcops.moe.routing.route` in torch: the fp32 router GEMM, then `select_experts` (the reference's)."""
    logits = hidden.float() @ router_weight.float().t()
    return select_experts(logits, top_k, scoring=scoring, bias=bias, renormalize=renormalize, scale=scale)


def _static_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    s = scale.float().reshape(())
    return (x.float() / s).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * s


def _per_token(x: torch.Tensor) -> torch.Tensor:
    q, s = quantize_per_token(x.float())
    return q.float() * s[:, None]


def _per_group(x: torch.Tensor, block: int) -> torch.Tensor:
    q, s = quantize_per_token_group(x.float(), block)
    return q.float() * expand_block_scale(s[:, None, :], (1, x.shape[1]), block)[:, 0, :]


def local_expert_ids(topk_ids: torch.Tensor, num_local: int, expert_map: torch.Tensor | None) -> torch.Tensor:
    """Local expert of each (token, slot), −1 when remote or out of range (same rule as the kernels)."""
    ids = topk_ids.long()
    n_global = expert_map.shape[0] if expert_map is not None else num_local
    ok = (ids >= 0) & (ids < n_global)
    if expert_map is not None:
        loc = torch.where(ok, expert_map.long()[ids.clamp(0, n_global - 1)], -1)
    else:
        loc = torch.where(ok, ids, -1)
    return torch.where((loc >= 0) & (loc < num_local), loc, -1)


def moe_index(topk_ids: torch.Tensor, num_local: int, block_m: int, expert_map: torch.Tensor | None = None):
    """Reference counts [E_local], offsets [E_local+1] and task list [(expert, first_row)] of the index."""
    loc = local_expert_ids(topk_ids, num_local, expert_map).flatten().cpu()
    counts = torch.bincount(loc[loc >= 0], minlength=num_local)[:num_local].to(torch.int32)
    offsets = torch.zeros(num_local + 1, dtype=torch.int32)
    offsets[1:] = torch.cumsum(counts, 0)
    tasks = [(e, int(offsets[e]) + m * block_m) for e in range(num_local)
             for m in range(-(-int(counts[e]) // block_m))]
    return counts, offsets, tasks


def fused_moe(x, w13, w2, topk_weights, topk_ids, *, quant=None, expert_map=None, shared_output=None,
              out=None, x_scale=None, config: MoeConfig | None = None, shared_ready=None, shared_w13=None,
              shared_w2=None):
    """Reference for `hpcops.fused_moe`: a loop over local experts in fp32 (`shared_ready`: the current stream
    waits for it before anything reads `shared_output`; `shared_w13`/`shared_w2`: the shared expert in fp32 on the
    16-bit x, its activation and output rounded to the output dtype, added like `shared_output`)."""
    if shared_ready is not None:
        torch.cuda.current_stream(x.device).wait_event(shared_ready)
    T, H = x.shape
    E, I2, _ = w13.shape
    inter = I2 // 2
    act_dt = x.dtype if x.dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
    bf16_mul = config is not None and config.act_mul == "bf16"
    # activations entering the gate-up GEMM, dequantized
    if quant is None:
        xa = x.float()
        w13f, w2f = w13.float(), w2.float()
    elif isinstance(quant, Fp8PerTensor):
        if x.dtype == FP8:
            xs = x_scale if x_scale is not None else quant.a13_scale
            xa = x.float() * xs.float().reshape(-1, 1)
        elif quant.a13_scale is not None:
            xa = _static_fp8(x, quant.a13_scale)
        else:
            xa = _per_token(x)
        w13f = w13.float() * quant.w13_scale.float().reshape(-1, 1, 1)
        w2f = w2.float() * quant.w2_scale.float().reshape(-1, 1, 1)
    elif isinstance(quant, Fp8Block128):
        b = quant.block
        if x.dtype == FP8:
            xa = x.float() * expand_block_scale(x_scale[:, None, :], (1, H), b)[:, 0, :]
        else:
            xa = _per_group(x, b)
        w13f = dequantize_block128(w13, quant.w13_scale, b)
        w2f = dequantize_block128(w2, quant.w2_scale, b)
    else:
        raise TypeError(f"quant must be None, Fp8PerTensor or Fp8Block128, got {type(quant).__name__}")

    loc = local_expert_ids(topk_ids, E, expert_map)
    y = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    tw = topk_weights.float()
    for e in range(E):
        tt, jj = (loc == e).nonzero(as_tuple=True)
        if tt.numel() == 0:
            continue
        h = xa[tt] @ w13f[e].t()
        g, u = h[:, :inter], h[:, inter:]
        if bf16_mul:
            g16, u16 = g.to(act_dt), u.to(act_dt)
            act = (F.silu(g16.float()).to(act_dt).float() * u16.float()).to(act_dt)
        else:
            act = (F.silu(g) * u).to(act_dt)
        if quant is None:
            a = act.float()
        elif isinstance(quant, Fp8PerTensor):
            a = _static_fp8(act, quant.a2_scale) if quant.a2_scale is not None else _per_token(act)
        else:
            a = _per_group(act, quant.block)
        o = a @ w2f[e].t()
        y.index_add_(0, tt, o * tw[tt, jj, None])
    if shared_w13 is not None:
        h = x.float() @ shared_w13.float().t()
        i_s = shared_w13.shape[0] // 2
        g, u = h[:, :i_s], h[:, i_s:]
        if bf16_mul:
            act = (F.silu(g.to(act_dt).float()).to(act_dt).float() * u.to(act_dt).float()).to(act_dt)
        else:
            act = (F.silu(g) * u).to(act_dt)
        shared_output = (act.float() @ shared_w2.float().t()).to(act_dt)
    if shared_output is not None:
        y = y + shared_output.float()
    res = y.to(act_dt)
    if out is not None:
        out.copy_(res)
        return out
    return res
