"""Pure-torch references with the same signatures as the public attention ops.

`prefill_attention` lives in `_prefill_reference` and is re-exported here.

`plan_decode` here builds the identical tables as the device kernel (tested for equality);
`decode_attention` computes attention per request in fp32 over dequantized KV.
"""

from __future__ import annotations

import math

import torch

from hpcops.attention._prefill_reference import prefill_attention
from hpcops.attention.plan import (
    DEFAULT_MIN_TILES,
    TILE,
    DecodePlan,
    _validate_plan_args,
    default_num_programs,
)

__all__ = ["decode_attention", "plan_decode", "prefill_attention"]


def plan_decode(seq_lens: torch.Tensor, *, num_kv_heads: int, q_len: int = 1, block_size: int = 64,
                max_batch: int | None = None, max_seq_len: int | None = None, num_programs: int | None = None,
                min_tiles: int | None = None, out: DecodePlan | None = None) -> DecodePlan:
    """Host/torch reference of `hpcops.plan_decode`: the same tables, computed with torch ops (the
    descriptor tables always; `has_desc`, which `host_tables` shows them by, as the kernel's)."""
    del max_seq_len
    _validate_plan_args(seq_lens, num_kv_heads, q_len, block_size, out.max_batch if out else max_batch)
    dev = seq_lens.device
    b = seq_lens.shape[0]
    c = out.num_programs if out else (num_programs or default_num_programs(q_len, dev))
    mt = out.min_tiles if out else max(1, min_tiles if min_tiles is not None else DEFAULT_MIN_TILES)
    cap = out.max_batch if out else max(max_batch or b, 1)
    lens = seq_lens.long().cpu()
    tiles = torch.clamp((lens + TILE - 1) // TILE, min=1)
    cum = torch.zeros(cap + 1, dtype=torch.long)
    cum[1:b + 1] = torch.cumsum(tiles, 0)
    s = int(tiles.sum())
    total = s * num_kv_heads
    bucket = max(-(-total // c), mt) if b else 0
    header = torch.tensor([bucket, s, total, -(-total // bucket) if bucket else 0])
    prog = torch.arange(c)
    first_b = torch.full((c,), -1, dtype=torch.long)
    last_b = torch.full((c,), -1, dtype=torch.long)
    task_desc = torch.zeros((c, 8), dtype=torch.long)
    task_desc[:, 0] = -1
    merge_desc = torch.zeros((c, 4), dtype=torch.long)
    merge_desc[:, 0] = -1
    if b:
        p0 = prog * bucket
        active = p0 < total
        p1 = torch.clamp(p0 + bucket, max=total) - 1
        ends = cum[1:b + 1]
        fb = torch.searchsorted(ends, p0 % max(s, 1), right=True)
        lb = torch.searchsorted(ends, p1 % max(s, 1), right=True)
        first_b = torch.where(active, fb, first_b)
        last_b = torch.where(active, lb, last_b)
        # descriptors (plan.py): one entry per active program
        for k in prog[active].tolist():
            pf, pl = k * bucket, min((k + 1) * bucket, total) - 1
            bf, bl = int(fb[k]), int(lb[k])
            hf, hl = pf // s, pl // s
            task_desc[k, :4] = torch.tensor([bf, hf, pf - hf * s - int(cum[bf]), pl + 1 - pf])
            pair_lo, pair_hi = hl * s + int(cum[bl]), hl * s + int(cum[bl + 1])
            first, last = pair_lo // bucket, (pair_hi - 1) // bucket
            if first == k and last > first:
                merge_desc[k] = torch.tensor([bl, hl, 2 * k + (0 if pair_lo == k * bucket else 1), last - first + 1])
    plan = out or DecodePlan(num_kv_heads=num_kv_heads, q_len=q_len, block_size=block_size, num_programs=c,
                             min_tiles=mt, max_batch=cap, batch=b,
                             header=torch.empty(4, dtype=torch.int32, device=dev),
                             cum=torch.empty(cap + 1, dtype=torch.int32, device=dev),
                             first_b=torch.empty(c, dtype=torch.int32, device=dev),
                             last_b=torch.empty(c, dtype=torch.int32, device=dev),
                             task_desc=torch.zeros((c, 8), dtype=torch.int32, device=dev),
                             merge_desc=torch.empty((c, 4), dtype=torch.int32, device=dev))
    plan.batch = b
    from hpcops.attention.decode import decode_config

    plan.has_desc = decode_config().task_desc  # the tables are always filled; shown as the kernel's
    plan.header.copy_(header.to(torch.int32))
    # entries past the batch are not part of the map: keep the kernel's (it leaves them untouched)
    plan.cum[: b + 1].copy_(cum[: b + 1].to(torch.int32))
    plan.first_b.copy_(first_b.to(torch.int32))
    plan.last_b.copy_(last_b.to(torch.int32))
    plan.task_desc[:, :4].copy_(task_desc[:, :4].to(torch.int32))
    plan.merge_desc.copy_(merge_desc.to(torch.int32))
    return plan


def _dequant(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    x = x.float()
    return x * scale.float().reshape(()) if scale is not None else x


def _gather_kv(cache: torch.Tensor, block_table_row: torch.Tensor, length: int) -> torch.Tensor:
    bs = cache.shape[1]
    nblk = -(-length // bs)
    pages = block_table_row[:nblk].long()
    return cache[pages].reshape(nblk * bs, *cache.shape[2:])[:length]  # [L, Hkv, D]


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                     seq_lens: torch.Tensor, *, plan: DecodePlan | None = None, schedule: str = "dynamic",
                     scale: float | None = None, k_scale: torch.Tensor | None = None,
                     v_scale: torch.Tensor | None = None, q_scale: torch.Tensor | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """Reference decode attention: fp32 softmax(q·Kᵀ·scale)·V per request, causal over the q_len new tokens.

    q: `[B·q_len, Hq, D]`; the q_len query tokens of request b are its last q_len positions.
    """
    del plan, schedule
    b = seq_lens.shape[0]
    total_q, hq, d = q.shape
    q_len = total_q // b if b else 1
    hkv = k_cache.shape[2]
    g = hq // hkv
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    qf = q.float()
    if q_scale is not None:
        qf = qf * q_scale.float()[..., None]
    out_dtype = out.dtype if out is not None else (torch.bfloat16 if q.dtype == torch.float8_e4m3fn else q.dtype)
    res = torch.zeros((total_q, hq, d), dtype=torch.float32, device=q.device)
    lens = seq_lens.tolist()
    for i in range(b):
        length = lens[i]
        if length == 0:
            continue
        k = _dequant(_gather_kv(k_cache, block_table[i], length), k_scale)  # [L, Hkv, D]
        v = _dequant(_gather_kv(v_cache, block_table[i], length), v_scale)
        k = k.repeat_interleave(g, dim=1)
        v = v.repeat_interleave(g, dim=1)
        qi = qf[i * q_len:(i + 1) * q_len]  # [q_len, Hq, D]
        s = torch.einsum("qhd,khd->hqk", qi, k) * scale
        pos = torch.arange(length, device=q.device)
        last = length - q_len + torch.arange(q_len, device=q.device)
        mask = pos[None, :] <= last[:, None]  # [q_len, L]
        s = s.masked_fill(~mask[None], float("-inf"))
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)
        res[i * q_len:(i + 1) * q_len] = torch.einsum("hqk,khd->qhd", p, v)
    res = res.to(out_dtype)
    if out is not None:
        out.copy_(res)
        return out
    return res
