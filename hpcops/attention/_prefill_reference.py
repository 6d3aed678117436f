"""Torch reference of `prefill_attention` (same signature): dequantize, fp32 maths, one request at a time."""

from __future__ import annotations

import math

import torch

FP8 = torch.float8_e4m3fn


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
    quantize_q: bool = False,
) -> torch.Tensor:
    """Reference for `hpcops.prefill_attention`: query i of request b (the last q_len_b tokens of its
    sequence) attends to keys [0, seq_len_b - q_len_b + i]. Rows past cu_seqlens_q[-1] are untouched.

    `max_seqlen_q` is accepted for signature parity and not used. `quantize_q`: q rounded to e4m3 per (token, head)
    first (`quantize_per_token_head`), the output still in q's dtype.
    """
    del max_seqlen_q
    total_q, hq, d = q.shape
    page, hkv = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    sm_scale = float(scale) if scale is not None else 1.0 / math.sqrt(d)
    out_dtype = torch.bfloat16 if q.dtype == FP8 else q.dtype
    if quantize_q:
        from hpcops.quant import quantize_per_token_head

        q, q_scale = quantize_per_token_head(q)
    if out is None:
        out = torch.empty(q.shape, dtype=out_dtype, device=q.device)
    qf = q.float()
    if q.dtype == FP8:
        qf = qf * q_scale.float()[..., None]
    ks = float(k_scale.float().reshape(-1)[0]) if k_cache.dtype == FP8 else 1.0
    vs = float(v_scale.float().reshape(-1)[0]) if v_cache.dtype == FP8 else 1.0
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    for b in range(len(lens)):
        q0, q1, s = cu[b], cu[b + 1], lens[b]
        n = q1 - q0
        if n == 0:
            continue
        pages = block_table[b, : -(-s // page)].long()
        k = k_cache[pages].reshape(-1, hkv, d)[:s].float() * ks  # [s, Hkv, D]
        v = v_cache[pages].reshape(-1, hkv, d)[:s].float() * vs
        k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, s, D]
        v = v.repeat_interleave(group, dim=1).transpose(0, 1)
        qb = qf[q0:q1].transpose(0, 1)  # [Hq, n, D]
        logits = (qb @ k.transpose(1, 2)) * sm_scale  # [Hq, n, s]
        limit = (s - n) + torch.arange(n, device=q.device)[:, None]
        logits = logits.masked_fill(torch.arange(s, device=q.device)[None, :] > limit, float("-inf"))
        o = torch.softmax(logits, dim=-1) @ v  # [Hq, n, D]
        out[q0:q1] = o.transpose(0, 1).to(out.dtype)
    return out
