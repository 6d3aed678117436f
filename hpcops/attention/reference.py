"""Pure-torch references with the same signatures as the public attention ops.

`prefill_attention` lives in `_prefill_reference` and is re-exported here.

`plan_decode` here builds the identical tables as the device kernel (tested for equality);
`decode_attention` computes attention per request in fp32 over dequantized KV.
"""

from __future__ import annotations

import math

import torch

from hpcops import _platform
from hpcops.attention._prefill_reference import prefill_attention
from hpcops.attention.plan import (
    DEFAULT_SNAP,
    TILE,
    CostStream,
    DecodePlan,
    _validate_plan_args,
    pair_buffers,
    split_cost_for,
)
from hpcops.quant import FP8, quantize_per_tensor

__all__ = ["decode_attention", "plan_decode", "prefill_attention", "store_kv"]


def plan_decode(seq_lens: torch.Tensor, *, num_kv_heads: int, q_len: int = 1, block_size: int = 64,
                max_batch: int | None = None, max_seq_len: int | None = None, num_programs: int | None = None,
                min_tiles: int | None = None, task_cost: int | None = None, snap: int | None = None,
                out: DecodePlan | None = None, num_q_heads: int | None = None, head_dim: int | None = None,
                q_dtype: torch.dtype | None = None, kv_dtype: torch.dtype | None = None,
                num_sms: int | None = None) -> DecodePlan:
    """Host reference of `hpcops.plan_decode`: the same tables, computed in Python integers with
    `plan.CostStream` (the descriptor tables always; `has_desc`, which `host_tables` shows them by,
    and so the task cost the cut charges, as the kernel's); the same kernel choice from the same hints."""
    from hpcops.attention.decode import decode_config, plan_defaults, plan_kernel

    _validate_plan_args(seq_lens, num_kv_heads, q_len, block_size, out.max_batch if out else max_batch, task_cost,
                        snap, num_sms)
    dev = seq_lens.device
    b = seq_lens.shape[0]
    kernel = out.kernel if out else plan_kernel(num_kv_heads, q_len, block_size, dev, num_q_heads=num_q_heads,
                                                head_dim=head_dim, q_dtype=q_dtype, kv_dtype=kv_dtype)
    c, tail, mt0, tc0, sc0 = plan_defaults(kernel, num_kv_heads, q_len, dev,
                                           num_programs=out.num_programs if out else num_programs,
                                           num_q_heads=num_q_heads, head_dim=head_dim, q_dtype=q_dtype,
                                           kv_dtype=kv_dtype, max_seq_len=max_seq_len)
    tail = out.tail if out else tail
    own_split = out.split_cost if out else sc0
    mt = out.min_tiles if out else max(1, min_tiles if min_tiles is not None else mt0)
    cap = out.max_batch if out else max(max_batch or b, 1)
    sms = out.num_sms if out else (num_sms or _platform.num_sms(dev))
    asked = out.task_cost if out else (tc0 if task_cost is None else task_cost)
    asked_snap = out.snap if out else (DEFAULT_SNAP if snap is None else snap)
    has_desc = decode_config().task_desc
    cost = asked if has_desc else 0
    cut_snap = asked_snap if cost else 0
    slices = decode_config().merge_slices_used()
    cum = [0]
    lens = seq_lens.long().cpu().tolist()
    for n in lens:
        cum.append(cum[-1] + max(1, -(-n // TILE)))
    header = [0, 0, 0, 0, 0]
    first_b, last_b = [-1] * c, [-1] * c
    task_desc = [[-1, 0, 0, 0, 0] for _ in range(c)]
    merge_desc = [[-1, 0, 0, 0] for _ in range(c)]
    if b:
        cs = CostStream.cut(cum, num_kv_heads, cost, c, mt, cut_snap, split_cost_for(kernel, own_split) if cost else 0,
                            num_sms=sms)
        header = [cs.bucket, cs.s, cs.total, cs.active, cs.snap]
        ranges = [cs.program_range(k) for k in range(min(c, cs.active))]
        for k, (g0, g1) in enumerate(ranges):
            if g1 <= g0:
                continue  # a snap closed this program
            hf, bf, jf = cs.locate(g0)
            hl, bl, _ = cs.locate(g1 - 1)
            first_b[k], last_b[k] = bf, bl
            task_desc[k] = [bf, hf, jf, g1 - g0, lens[bf]]
            pair_lo, pair_hi = hl * cs.s + cum[bl], hl * cs.s + cum[bl + 1]
            if pair_lo >= g0 and pair_hi > g1:  # the pair of its last tile starts here and leaves
                parts = sum(1 for a, z in ranges if a < z and a < pair_hi and z > pair_lo)
                merge_desc[k] = [bl, hl, 2 * k + (0 if pair_lo == g0 else 1), parts]
        if slices > 1 and cs.snap == 0:  # merge helpers: the programs after a long split's owner, inside it
            for k, (bl, hl, slot, parts) in enumerate(list(merge_desc)):
                if bl >= 0 and parts > 16:
                    for j in range(k + 1, min(k + slices, k + parts - 1)):
                        merge_desc[j] = [bl, hl, slot, parts]
    plan = out or DecodePlan(kernel=kernel, tail=tail, num_sms=sms, num_kv_heads=num_kv_heads, q_len=q_len,
                             block_size=block_size, num_programs=c, min_tiles=mt, max_batch=cap, batch=b,
                             task_cost=asked, snap=asked_snap, split_cost=own_split,
                             header=torch.empty(5, dtype=torch.int32, device=dev),
                             cum=torch.empty(cap + 1, dtype=torch.int32, device=dev),
                             first_b=torch.empty(c, dtype=torch.int32, device=dev),
                             last_b=torch.empty(c, dtype=torch.int32, device=dev),
                             task_desc=torch.zeros((c, 8), dtype=torch.int32, device=dev),
                             merge_desc=torch.empty((c, 4), dtype=torch.int32, device=dev),
                             **pair_buffers(cap, num_kv_heads, c, dev))
    plan.batch = b
    plan.has_desc = has_desc  # the tables are always filled; shown as the kernel's
    i32 = dict(dtype=torch.int32)
    plan.header.copy_(torch.tensor(header, **i32))
    # entries past the batch are not part of the map: keep the kernel's (it leaves them untouched)
    plan.cum[: b + 1].copy_(torch.tensor(cum, **i32))
    plan.first_b.copy_(torch.tensor(first_b, **i32))
    plan.last_b.copy_(torch.tensor(last_b, **i32))
    plan.task_desc[:, :5].copy_(torch.tensor(task_desc, **i32))
    plan.merge_desc.copy_(torch.tensor(merge_desc, **i32))
    plan.has_pairs = plan.pair_desc is not None and has_desc
    plan.merge_slices = slices
    if plan.has_pairs:  # each merge seen from its pair (rows of unsplit pairs left as they are); counts at 0
        plan.merge_sem.zero_()
        for k, (bl, hl, slot, parts) in enumerate(merge_desc):
            if bl >= 0 and slot // 2 == k:  # its owner's row (not a merge helper's)
                plan.pair_desc[hl * b + bl].copy_(torch.tensor([k, parts, slot, 0], **i32))
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


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, *, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
             check: bool | None = None) -> None:
    """Reference for `hpcops.store_kv`: the rows of slots >= 0 scattered in torch (fp8: e4m3(x / scale),
    saturated). `check` is accepted for signature parity."""
    del check
    keep = (slot_mapping >= 0).nonzero().reshape(-1)
    slots = slot_mapping[keep].long()
    bs = k_cache.shape[1]
    blk, off = slots // bs, slots % bs
    for x, cache, scale in ((key, k_cache, k_scale), (value, v_cache, v_scale)):
        rows = x[keep]
        cache[blk, off] = quantize_per_tensor(rows, scale)[0] if cache.dtype == FP8 else rows.to(cache.dtype)
