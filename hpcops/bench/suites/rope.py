"""Bench suite `rope`: the fused attention prologue (QK-RMSNorm → NeoX RoPE → paged KV write, fp8 q).

Hy3 shapes: one TP8 rank (8 q / 1 kv heads) and the full model (64 / 8), head_dim 128, norm→rope NeoX,
theta 11158840, eps 1e-5, page 64; bf16 KV (bf16 q) and fp8 KV (fp8 q with per-token-head scales).
T ≤ 256 is a decode batch (T requests of one new token at random positions < 4K); T ≥ 2048 is
prefill (requests of 2048 new tokens). Peers, each on the same inputs:
- `torch-unfused`: the reference sequence run eagerly (norm, rope, cache write, quant), capturable;
- `flashinfer`: apply_rope_with_cos_sin_cache_inplace + append_paged_kv_cache (no QK-norm and no q
  quant; fp8 K/V cast in torch first): a lower bound on FlashInfer's cost of the same step.
The `store-kv-*` cases time `store_kv` alone (the paged K/V write, no rope: the vLLM backend's KV update) against
`torch-scatter`, the torch ops that backend ran before it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from hpcops.bench.registry import Case, Impl, PeerUnavailable

FP8 = torch.float8_e4m3fn
THETA = 11158840.0
EPS = 1e-5
PAGE = 64
HEAD_DIM = 128
MAX_POS = 32768
PREFILL_CHUNK = 2048
TOKENS = (1, 16, 64, 256, 2048, 8192, 32768)
QUICK_TOKENS = (1, 256, 8192)
HEADS = ((8, 1), (64, 8))


@dataclass(frozen=True)
class Scenario:
    t: int
    hq: int
    hkv: int
    fp8: bool

    @property
    def name(self) -> str:
        return f"h{self.hq}x{self.hkv}-{'fp8' if self.fp8 else 'bf16'}-T{self.t}"

    @property
    def bytes(self) -> int:
        d, t = HEAD_DIM, self.t
        kvb = 1 if self.fp8 else 2
        read = t * (self.hq + 2 * self.hkv) * d * 2
        q_written = t * self.hq * d * kvb + (t * self.hq * 4 if self.fp8 else 0)
        return read + q_written + 2 * t * self.hkv * d * kvb


_SHARED: dict[tuple, Any] = {}


def _shared(device: str) -> dict[str, torch.Tensor]:
    key = (device,)
    if key not in _SHARED:
        inv = 1.0 / THETA ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)
        f = torch.outer(torch.arange(MAX_POS, dtype=torch.float64), inv)
        g = torch.Generator().manual_seed(7)
        _SHARED[key] = {
            "cos_sin_cache": torch.cat([f.cos(), f.sin()], dim=-1).float().to(device),
            "q_norm_weight": (torch.rand(HEAD_DIM, generator=g) + 0.5).to(device),
            "k_norm_weight": (torch.rand(HEAD_DIM, generator=g) + 0.5).to(device),
            "k_scale": torch.tensor([0.04], device=device),
            "v_scale": torch.tensor([0.02], device=device),
        }
    return _SHARED[key]


def _make_inputs(s: Scenario, layer: int, device: str = "cuda") -> dict[str, Any]:
    g = torch.Generator().manual_seed(1000 * layer + s.t)
    d = HEAD_DIM
    if s.t <= 256:  # decode: one new token per request, its page is the request's last page
        seq_lens = torch.randint(1, 4096, (s.t,), generator=g)
        new = torch.ones(s.t, dtype=torch.long)
    else:  # prefill: requests of PREFILL_CHUNK new tokens without context
        nreq = math.ceil(s.t / PREFILL_CHUNK)
        new = torch.full((nreq,), PREFILL_CHUNK, dtype=torch.long)
        new[-1] = s.t - PREFILL_CHUNK * (nreq - 1)
        seq_lens = new.clone()
    pages_per_req = (seq_lens + PAGE - 1) // PAGE
    first_new_page = (seq_lens - new) // PAGE
    written = pages_per_req - first_new_page  # pages that receive new tokens (distinct, shuffled)
    num_pages = int(written.sum()) + 1
    perm = torch.randperm(num_pages - 1, generator=g) + 1
    # page table: pages before the first written one all alias page 0 (never written, never read)
    kv_indptr = torch.zeros(len(seq_lens) + 1, dtype=torch.long)
    kv_indptr[1:] = torch.cumsum(pages_per_req, 0)
    kv_indices = torch.zeros(int(kv_indptr[-1]), dtype=torch.long)
    positions, batch_indices, slots = [], [], []
    cursor = 0
    for b in range(len(seq_lens)):
        w = int(written[b])
        pages = perm[cursor: cursor + w]
        cursor += w
        base = int(kv_indptr[b])
        kv_indices[base + int(first_new_page[b]): base + int(pages_per_req[b])] = pages
        pos = torch.arange(int(seq_lens[b] - new[b]), int(seq_lens[b]))
        positions.append(pos)
        batch_indices.append(torch.full_like(pos, b))
        slots.append(kv_indices[base + pos // PAGE] * PAGE + pos % PAGE)
    positions = torch.cat(positions)
    width = (s.hq + 2 * s.hkv) * d
    cache_dtype = FP8 if s.fp8 else torch.bfloat16
    shape = (num_pages, PAGE, s.hkv, d)
    x = {
        "qkv": torch.randn(s.t, width, generator=g).to(torch.bfloat16).to(device),
        "positions": positions.to(device),
        "slot_mapping": torch.cat(slots).to(device),
        "k_cache": torch.zeros(shape, dtype=cache_dtype, device=device),
        "v_cache": torch.zeros(shape, dtype=cache_dtype, device=device),
        "q_out": torch.empty((s.t, s.hq, d), dtype=cache_dtype, device=device),
        # FlashInfer's page metadata for the same writes
        "fi_batch_indices": torch.cat(batch_indices).to(torch.int32).to(device),
        "fi_positions": positions.to(torch.int32).to(device),
        "fi_kv_indices": kv_indices.to(torch.int32).to(device),
        "fi_kv_indptr": kv_indptr.to(torch.int32).to(device),
        "fi_kv_last_page_len": ((seq_lens - 1) % PAGE + 1).to(torch.int32).to(device),
    }
    x.update(_shared(device))
    return x


def _kwargs(s: Scenario, x: dict[str, Any]) -> dict[str, Any]:
    kw = {"num_q_heads": s.hq, "num_kv_heads": s.hkv, "head_dim": HEAD_DIM,
          "q_norm_weight": x["q_norm_weight"], "k_norm_weight": x["k_norm_weight"], "eps": EPS,
          "order": "norm_rope", "style": "neox", "quantize_q": s.fp8}
    if s.fp8:
        kw.update(k_scale=x["k_scale"], v_scale=x["v_scale"])
    return kw


def _args(x: dict[str, Any], k_cache=None, v_cache=None):
    return (x["qkv"], x["positions"], x["cos_sin_cache"], x["k_cache"] if k_cache is None else k_cache,
            x["v_cache"] if v_cache is None else v_cache, x["slot_mapping"])


def _ours(s: Scenario, config: tuple[int, ...] | None = None):
    def prepare(x):
        from hpcops.rope.prologue import RopeConfig, rope_norm_store_kv

        args, kw = _args(x), _kwargs(s, x)
        cfg = RopeConfig(*config) if config else None
        return lambda: rope_norm_store_kv(*args, **kw, q_out=x["q_out"], config=cfg)
    return prepare


def _sweep_configs() -> list[tuple[int, ...]]:
    """Extra launch shapes to time beside the default, from HPCOPS_ROPE_CONFIGS="4x8,8x4,4x8x4"
    (block_t x num_warps [x block_kv]): a tuning aid, reported as extra rows `hpcops-bt<B>w<W>[kv<K>]`
    (`hpcops tune rope` searches them all in one process)."""
    spec = os.environ.get("HPCOPS_ROPE_CONFIGS", "").strip()
    out = []
    for item in filter(None, (p.strip() for p in spec.split(","))):
        out.append(tuple(int(v) for v in item.lower().split("x")))
    return out


def _config_name(config: tuple[int, ...]) -> str:
    return f"hpcops-bt{config[0]}w{config[1]}" + (f"kv{config[2]}" if len(config) > 2 else "")


def _torch(s: Scenario):
    def prepare(x):
        from hpcops.rope.reference import unfused_sequence

        args, kw = _args(x), _kwargs(s, x)
        return lambda: unfused_sequence(*args, **kw, skip_invalid_slots=False)
    return prepare


def _flashinfer(s: Scenario):
    def prepare(x):
        try:
            import flashinfer
        except Exception as exc:  # not installed, or fails to load its JIT cache
            raise PeerUnavailable(f"flashinfer does not import: {type(exc).__name__}") from exc
        d = HEAD_DIM
        qkv = x["qkv"]
        q, k = qkv[:, : s.hq * d], qkv[:, s.hq * d: (s.hq + s.hkv) * d]
        v = qkv[:, (s.hq + s.hkv) * d:].view(s.t, s.hkv, d)
        ks, vs = x["k_scale"], x["v_scale"]

        def run():  # rotates q, k inside qkv in place: this peer runs last, after our check and timing
            flashinfer.rope.apply_rope_with_cos_sin_cache_inplace(x["positions"], q, k, d, x["cos_sin_cache"],
                                                                   is_neox=True)
            kk, vv = k.view(s.t, s.hkv, d), v
            if s.fp8:
                kk = (kk.float() / ks).clamp(-448, 448).to(FP8)
                vv = (vv.float() / vs).clamp(-448, 448).to(FP8)
            flashinfer.page.append_paged_kv_cache(kk, vv, x["fi_batch_indices"], x["fi_positions"],
                                                  (x["k_cache"], x["v_cache"]), x["fi_kv_indices"],
                                                  x["fi_kv_indptr"], x["fi_kv_last_page_len"],
                                                  kv_layout="NHD")
        return run
    return prepare


def _check(s: Scenario):
    def check(x):
        from hpcops.rope.prologue import rope_norm_store_kv
        from hpcops.rope.reference import rope_norm_store_kv as ref
        from hpcops.testing import assert_close

        kw = _kwargs(s, x)
        kc, vc = x["k_cache"].clone(), x["v_cache"].clone()
        rkc, rvc = x["k_cache"].clone(), x["v_cache"].clone()
        q, qs = rope_norm_store_kv(*_args(x, kc, vc), **kw)
        q_ref, qs_ref = ref(*_args(x, rkc, rvc), **kw)
        assert_close(q_ref, q, name="q")
        if s.fp8:
            assert_close(qs_ref, qs, name="q_scale", maxtol=1e-5, rmstol=1e-6)
        slots = x["slot_mapping"]
        rows = (slots // PAGE, slots % PAGE)
        for name, out, want in (("k_cache", kc, rkc), ("v_cache", vc, rvc)):
            out8, want8 = out.view(torch.uint8), want.view(torch.uint8)  # byte views: fp8 indexing
            assert_close(want8[rows].view(want.dtype), out8[rows].view(out.dtype), name=name + " (written rows)")
            out8[rows] = want8[rows]  # every other row must be untouched, bit for bit
            if not torch.equal(out8, want8):
                raise AssertionError(f"{name}: rows outside slot_mapping were written")
    return check


STORE_TOKENS = (1, 64, 256, 8192)


def _kv_views(s: Scenario, x: dict[str, Any]):
    """The new tokens' key and value heads: strided views of qkv, as an attention layer receives them."""
    d = HEAD_DIM
    qkv = x["qkv"].view(s.t, s.hq + 2 * s.hkv, d)
    return qkv[:, s.hq:s.hq + s.hkv], qkv[:, s.hq + s.hkv:]


def _store_scales(s: Scenario, x: dict[str, Any]) -> dict[str, Any]:
    return dict(k_scale=x["k_scale"], v_scale=x["v_scale"]) if s.fp8 else {}


def _store_ours(s: Scenario):
    def prepare(x):
        from hpcops.attention.kv_store import store_kv

        k, v = _kv_views(s, x)
        kw = _store_scales(s, x)
        return lambda: store_kv(k, v, x["k_cache"], x["v_cache"], x["slot_mapping"], **kw)
    return prepare


def _store_torch(s: Scenario):
    """What the vLLM backend ran before `store_kv`: index maths, the fp8 conversion chain, two index_put (padding
    redirected to block 0, vLLM's null block: capturable)."""
    def prepare(x):
        k, v = _kv_views(s, x)
        kc, vc = x["k_cache"], x["v_cache"]

        def run():
            slots = x["slot_mapping"].long().clamp_min(0)
            blk, off = slots // PAGE, slots % PAGE
            kk, vv = k, v
            if s.fp8:
                kk = (kk.float() / x["k_scale"].reshape(())).clamp(-448.0, 448.0).to(FP8)
                vv = (vv.float() / x["v_scale"].reshape(())).clamp(-448.0, 448.0).to(FP8)
            kc[blk, off] = kk
            vc[blk, off] = vv
        return run
    return prepare


def _store_check(s: Scenario):
    def check(x):
        from hpcops.attention import reference
        from hpcops.attention.kv_store import store_kv

        k, v = _kv_views(s, x)
        kw = _store_scales(s, x)
        kc, vc = x["k_cache"].clone(), x["v_cache"].clone()
        rkc, rvc = x["k_cache"].clone(), x["v_cache"].clone()
        store_kv(k, v, kc, vc, x["slot_mapping"], **kw)
        reference.store_kv(k, v, rkc, rvc, x["slot_mapping"], **kw)
        for name, out, want in (("k_cache", kc, rkc), ("v_cache", vc, rvc)):
            if not torch.equal(out.view(torch.uint8), want.view(torch.uint8)):
                raise AssertionError(f"store_kv: {name} differs from the reference")
    return check


def store_cases(quick: bool = False) -> Iterator[Case]:
    """`store_kv` alone (the paged K/V write of an attention layer whose rope is not ours: the vLLM backend's
    do_kv_cache_update), against the torch scatter the backend ran before it."""
    for hq, hkv in HEADS[:1] if quick else HEADS:
        for fp8 in (False, True):
            for t in STORE_TOKENS[:2] if quick else STORE_TOKENS:
                s = Scenario(t, hq, hkv, fp8)
                kvb = 1 if fp8 else 2
                yield Case(
                    suite="rope", name="store-kv-" + s.name,
                    make_inputs=lambda layer, device="cuda", s=s: _make_inputs(s, layer, device),
                    impls=[Impl("hpcops", _store_ours(s), ours=True),
                           Impl("torch-scatter", _store_torch(s),
                                note="the vLLM backend's KV write before store_kv: torch ops in the graph")],
                    check=_store_check(s), bytes=t * hkv * HEAD_DIM * 2 * (2 + kvb),
                    params={"T": t, "hq": hq, "hkv": hkv, "head_dim": HEAD_DIM, "kv": "fp8" if fp8 else "bf16",
                            "page": PAGE, "op": "store_kv"},
                    command=f"hpcops bench rope --only store-kv-{s.name}",
                )


def cases(opts: dict[str, Any]) -> Iterator[Case]:
    quick = bool(opts.get("quick"))
    sweep = _sweep_configs()
    for hq, hkv in HEADS[:1] if quick else HEADS:
        for fp8 in (False, True):
            for t in QUICK_TOKENS if quick else TOKENS:
                s = Scenario(t, hq, hkv, fp8)
                yield Case(
                    suite="rope", name=s.name,
                    make_inputs=lambda layer, device="cuda", s=s: _make_inputs(s, layer, device),
                    impls=[Impl("hpcops", _ours(s), ours=True),
                           *[Impl(_config_name(c), _ours(s, c), note="config sweep") for c in sweep],
                           Impl("torch-unfused", _torch(s),
                                note="reference sequence, eager ops in the graph"),
                           Impl("flashinfer", _flashinfer(s),
                                note="rope_inplace + append_paged_kv_cache; no QK-norm, no q quant")],
                    check=_check(s), bytes=s.bytes,
                    params={"T": t, "hq": hq, "hkv": hkv, "head_dim": HEAD_DIM,
                            "kv": "fp8" if fp8 else "bf16", "quantize_q": fp8,
                            "order": "norm_rope", "style": "neox", "page": PAGE},
                    command=f"hpcops bench rope --only {s.name}",
                )
    yield from store_cases(quick)
