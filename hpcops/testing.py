"""Helpers shared by the test tiers and `hpcops bench --check`: one closeness check, paged-KV factories."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# Normalized tolerances (max error / max|ref|, RMS error / RMS(ref)) by the output dtype, for outputs
# computed in fp32 inside the kernel and rounded once at the end.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (2e-3, 5e-4),
    torch.float16: (5e-3, 2e-3),
    torch.bfloat16: (2e-2, 8e-3),
}


def assert_close(ref: torch.Tensor, out: torch.Tensor, *, name: str = "output", maxtol: float | None = None,
                 rmstol: float | None = None) -> None:
    """Assert `out` ≈ `ref` by normalized max and RMS error; NaN/Inf in `out` where `ref` is finite fails.

    1-byte (fp8) outputs: `ref` is cast to that dtype and each value must be within 1 fp8 ulp.
    """
    if out.shape != ref.shape:
        raise AssertionError(f"{name}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}")
    if out.dtype.itemsize == 1 and out.dtype.is_floating_point:
        _assert_fp8_close(ref, out, name)
        return
    dmax, drms = TOLERANCES.get(out.dtype, TOLERANCES[torch.float32])
    maxtol = dmax if maxtol is None else maxtol
    rmstol = drms if rmstol is None else rmstol
    r, o = ref.double().cpu(), out.double().cpu()
    bad = ~torch.isfinite(o) & torch.isfinite(r)
    if bad.any():
        idx = bad.nonzero()[0].tolist()
        raise AssertionError(f"{name}: {int(bad.sum())} non-finite values where the reference is finite, "
                             f"first at {idx}")
    if r.numel() == 0:
        return
    err = (o - r).abs()
    scale = max(r.abs().max().item(), 1e-6)
    rms_ref = max(r.pow(2).mean().sqrt().item(), 1e-6)
    max_rel = err.max().item() / scale
    rms_rel = err.pow(2).mean().sqrt().item() / rms_ref
    if max_rel > maxtol or rms_rel > rmstol:
        worst = torch.unravel_index(err.argmax(), err.shape)
        where = tuple(int(i) for i in worst)
        raise AssertionError(
            f"{name}: max err/max|ref| = {max_rel:.3e} (tol {maxtol:.1e}), rms err/rms(ref) = {rms_rel:.3e} "
            f"(tol {rmstol:.1e}); worst at {where}: got {o[where].item():.6g}, want {r[where].item():.6g}")


def _assert_fp8_close(ref: torch.Tensor, out: torch.Tensor, name: str) -> None:
    want = ref.float().cpu().to(out.dtype).float()
    got = out.cpu().float()
    both_nan = torch.isnan(want) & torch.isnan(got)
    # one ulp of e4m3 at |x| is 2**(floor(log2|x|) - 3) (subnormals: 2**-9)
    mag = torch.maximum(want.abs(), got.abs()).clamp_min(2.0 ** -6)
    ulp = torch.exp2(torch.floor(torch.log2(mag)) - 3)
    ok = both_nan | ((want - got).abs() <= ulp * 1.0001)
    if not ok.all():
        i = tuple(int(v) for v in (~ok).nonzero()[0])
        raise AssertionError(f"{name}: {int((~ok).sum())} fp8 values more than 1 ulp off; "
                             f"first at {i}: got {got[i].item()}, want {want[i].item()}")


def nan_like(t: torch.Tensor) -> torch.Tensor:
    """An output buffer filled with NaN (so unwritten elements fail the checks)."""
    return torch.full_like(t, float("nan"))


@dataclass
class PagedKV:
    """A random paged KV cache for tests and benchmarks, in vLLM's layout.

    `k_cache`, `v_cache`: [num_blocks, block_size, num_kv_heads, head_dim] (views into one packed
    buffer when `packed=True`, as vLLM hands them); `block_table`: int32 [B, max_blocks] with
    distinct, shuffled pages; `seq_lens`: int32 [B]. Values are N(0,1) (× 1/k_scale for fp8).
    """

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None


def make_paged_kv(seq_lens: list[int], *, num_kv_heads: int, head_dim: int, block_size: int,
                  dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
                  packed: bool = False, extra_blocks: int = 1, extra_cols: int = 0,
                  generator: torch.Generator | None = None) -> PagedKV:
    """Build a random paged cache holding `seq_lens` tokens per request.

    `packed=True` gives vLLM's LBNHC layout: one buffer [N, block, H, 2D] split into K|V views
    (token stride H·2D). `extra_cols` widens the block table beyond what the longest sequence needs.
    """
    device = torch.device(device)
    blocks_per_seq = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + extra_blocks
    fp8 = dtype == torch.float8_e4m3fn
    store = torch.bfloat16 if fp8 else dtype
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    if packed:
        buf = torch.randn((*shape[:3], 2 * head_dim), generator=generator).to(store)
        k, v = buf[..., :head_dim], buf[..., head_dim:]
    else:
        k = torch.randn(shape, generator=generator).to(store)
        v = torch.randn(shape, generator=generator).to(store)
    k_scale = v_scale = None
    if fp8:
        k_scale = torch.tensor([0.02], dtype=torch.float32)
        v_scale = torch.tensor([0.03], dtype=torch.float32)
        if packed:
            buf8 = torch.cat([(k.float() / k_scale), (v.float() / v_scale)], dim=-1).to(torch.float8_e4m3fn)
            k, v = buf8[..., :head_dim], buf8[..., head_dim:]
        else:
            k = (k.float() / k_scale).to(torch.float8_e4m3fn)
            v = (v.float() / v_scale).to(torch.float8_e4m3fn)
        k_scale, v_scale = k_scale.to(device), v_scale.to(device)
    perm = torch.randperm(num_blocks, generator=generator)
    max_blocks = max(blocks_per_seq, default=0) + extra_cols
    table = torch.zeros((len(seq_lens), max(max_blocks, 1)), dtype=torch.int32)
    cursor = 0
    for b, n in enumerate(blocks_per_seq):
        table[b, :n] = perm[cursor:cursor + n].to(torch.int32)
        cursor += n
    if packed:
        whole = torch.cat([k, v], dim=-1).to(device)
        k, v = whole[..., :head_dim], whole[..., head_dim:]
    else:
        k, v = k.to(device), v.to(device)
    return PagedKV(k, v, table.to(device), torch.tensor(seq_lens, dtype=torch.int32, device=device),
                   k_scale, v_scale)
