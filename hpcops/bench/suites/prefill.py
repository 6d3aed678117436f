"""Bench suite `prefill`: causal prefill / extend attention over a paged KV cache (blog table 4).

Batches use vLLM's batch-spec grammar `[count]q<q_len>[k][s<seq_len>[k]]` (k = 1024; without `s`
the request is a pure prefill, seq_len = q_len; several specs joined by `_`). Heads h64/8 (Hy3) and
h8/1 (one TP8 rank), head_dim 128, page 64, bf16 and fp8 KV. FLOPs are those of causal attention:
4·D·Hq·Σ over queries of visible keys. Peers, each on the same inputs:
- `flashinfer`: FlashInfer's BatchPrefillWithPagedKVCacheWrapper, plan outside the timed region;
  backend auto (FA3 on Hopper) when q and KV share a dtype, FA2 for bf16 q + fp8 KV: FlashInfer 0.5.3's
  auto picks FA3 there too, whose SM90 templates do not compile for mixed q/KV dtypes ("Ninja build
  failed", MajorB static_assert; flashinfer-ai/flashinfer#2348), while FA2 upcasts fp8 K/V in-kernel.
  Its FA3 fp8 path (fp8 q + fp8 KV) is not usable through the 0.5.3 wrapper: `run` passes no
  scale_q/scale_k/scale_v tensors to a kernel that reads them;
- `sdpa-cudnn`, `sdpa-flash`: torch SDPA on the dense-equivalent problem (K/V gathered to contiguous
  tensors and expanded to Hq heads beforehand), bottom-right causal mask.
With fp8 KV we time bf16 q (`hpcops`) and fp8 q with per-token-head scales (`hpcops-fp8q`), plus the
variants `hpcops-quantize-q` (bf16 q, `prefill_attention(quantize_q=True)`: q quantized per token-head, then the fp8
path; what the vLLM backend runs over an fp8 cache) and `hpcops-quant-q` (bf16 q quantized per row inside the tl
kernel, PrefillConfig(quant_q=True)).
`hpcops-notma` (PrefillConfig(tma=False)) tracks the pointer path now that TMA is the default;
with 16-bit q and KV the default (`hpcops`) takes the Hopper kernel in Gluon where `gluon_config` picks it (the
warp-specialized FA3-style kernel at h64/8 from q1ks2k), and `hpcops-tl` (PrefillConfig(gluon=False)) times the
`tl` kernel beside it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from hpcops.bench.registry import Case, Impl, PeerUnavailable, flashinfer_workspace

FP8 = torch.float8_e4m3fn
PAGE = 64
HEAD_DIM = 128
SPECS = ("q512", "q1ks2k", "q2k", "q4k", "q8k", "2q1ks4k")
QUICK_SPECS = ("q2k", "2q1ks4k")
HEADS = ((64, 8), (8, 1))
_SPEC = re.compile(r"^(\d*)q(\d+)(k?)(?:s(\d+)(k?))?$")


def parse_batch_spec(spec: str) -> list[tuple[int, int]]:
    """`2q1ks4k_q512` → [(1024, 4096), (1024, 4096), (512, 512)]: one (q_len, seq_len) per request."""
    reqs: list[tuple[int, int]] = []
    for part in spec.split("_"):
        m = _SPEC.match(part.strip())
        if m is None:
            raise ValueError(f"bad batch spec {part!r}: expected [count]q<q_len>[k][s<seq_len>[k]]")
        count = int(m.group(1)) if m.group(1) else 1
        q_len = int(m.group(2)) * (1024 if m.group(3) else 1)
        seq_len = q_len if m.group(4) is None else int(m.group(4)) * (1024 if m.group(5) else 1)
        if seq_len < q_len:
            raise ValueError(f"bad batch spec {part!r}: seq_len {seq_len} < q_len {q_len}")
        reqs += [(q_len, seq_len)] * count
    return reqs


def causal_flops(reqs: list[tuple[int, int]], hq: int, head_dim: int) -> int:
    """4·D·Hq·Σ_queries(visible keys): QKᵀ and PV, 2 FLOPs per multiply-add each."""
    keys = sum(q * (s - q) + q * (q + 1) // 2 for q, s in reqs)
    return 4 * head_dim * hq * keys


@dataclass(frozen=True)
class Scenario:
    spec: str
    hq: int
    hkv: int
    fp8: bool

    @property
    def name(self) -> str:
        return f"h{self.hq}x{self.hkv}-{'fp8' if self.fp8 else 'bf16'}-{self.spec}"

    @property
    def reqs(self) -> list[tuple[int, int]]:
        return parse_batch_spec(self.spec)

    @property
    def bytes(self) -> int:
        total_q = sum(q for q, _ in self.reqs)
        kv_elem = 1 if self.fp8 else 2
        kv = sum(s for _, s in self.reqs) * 2 * self.hkv * HEAD_DIM * kv_elem
        return 2 * total_q * self.hq * HEAD_DIM * 2 + kv


def _make_inputs(s: Scenario, layer: int, device: str = "cuda") -> dict[str, Any]:
    from hpcops.quant import quantize_per_token_head
    from hpcops.testing import make_paged_kv

    g = torch.Generator().manual_seed(1000 * layer + 17)
    reqs = s.reqs
    kv = make_paged_kv(
        [sl for _, sl in reqs],
        num_kv_heads=s.hkv,
        head_dim=HEAD_DIM,
        block_size=PAGE,
        dtype=FP8 if s.fp8 else torch.bfloat16,
        device=device,
        generator=g,
    )
    q_lens = [ql for ql, _ in reqs]
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    gq = torch.Generator(device=device).manual_seed(1000 * layer + 18)
    q = torch.randn((sum(q_lens), s.hq, HEAD_DIM), generator=gq, device=device).to(torch.bfloat16)
    x = {
        "layer": layer,
        "q": q,
        "kv": kv,
        "cu": cu.to(device),
        "cu_cpu": cu,
        "reqs": reqs,
        "max_q": max(q_lens),
        "scale": 1.0 / math.sqrt(HEAD_DIM),
    }
    if s.fp8:
        x["q8"], x["q_scale"] = quantize_per_token_head(q)
    return x


# the warp-specialized Gluon kernel over an fp8 q and fp8 KV as a fixed config, a program a q tile (not persistent),
# its row sums on the CUDA cores (the variants' base); and with them on the tensor cores, q in registers and V
# transposed by byte permutes (gluon_mma_sum, gluon_q_regs, gluon_vt_prmt: the fp8-q default but for the
# persistent prefetching walk, which session 66 added)
GLUON_FP8 = {"gluon": True, "gluon_ws": True, "block_m": 128, "num_warps": 8, "block_n": 128, "num_stages": 3,
             "heads_inner": True, "gluon_mma_sum": False, "gluon_persist": False, "gluon_prefetch": False}
GLUON_FP8_MSUM = {**GLUON_FP8, "gluon_mma_sum": True, "gluon_q_regs": True, "gluon_vt_prmt": True}
# the fp8-q default as fixed fields (persistent, its producer prefetching q), and its one-knob variants: (row name
# after "hpcops-fp8q-", fields changed, note)
GLUON_FP8_DEFAULT = {**GLUON_FP8_MSUM, "gluon_persist": True, "gluon_prefetch": True}
FP8_DEFAULT_VARIANTS = (
    ("queue", {"gluon_queue": True},
     "the prefetching persistent fp8 kernel taking its tiles from a counter (gluon_queue=True)"),
    ("vt3", {"gluon_vt3": True},
     "the fp8 default with three Vᵀ buffers (gluon_vt3=True): the producer's transpose a step further ahead"),
    ("pdbuf", {"gluon_p_dbuf": True},
     "the fp8 default with two P buffers a consumer (gluon_p_dbuf=True): P_{j+1} stored before the P_j·V_j wait"),
    ("4buf", {"num_stages": 4, "gluon_wide_store": False},
     "the fp8 default with four K/V buffers (num_stages=4) and 4-byte output stores (the 16-byte ones' scratch does "
     "not fit beside four buffers)"),
    ("cvt", {"gluon_vt_prmt": False},
     "the fp8 default with the producer's V transpose by convert_layout (gluon_vt_prmt=False: the default until "
     "session 68), not by byte permutes"),
    ("narrow", {"gluon_wide_store": False},
     "the fp8 default storing its output in 4-byte pieces from the accumulator's layout (gluon_wide_store=False: "
     "the default until session 72)"),
)
# the bf16 Gluon default storing its output in 4-byte pieces (the default until session 72)
GLUON_BF16_NARROW = {"gluon": True, "gluon_wide_store": False}
# the 64-row Gluon tile (one warpgroup, not specialized: the bf16 default where few 128-row tiles exist, h8/1 q512
# and q1ks2k) storing its output in 4-byte pieces (its default until session 73)
GLUON_BF16_NARROW64 = {"gluon": True, "block_m": 64, "num_warps": 4, "gluon_ws": False, "gluon_wide_store": False}

# the bf16 warp-specialized Gluon kernel with gluon_tree, on the same tile (the bf16 default's at q2k-q8k)
GLUON_BF16_TREE = {**GLUON_FP8, "gluon_tree": True}

BOOL_FIELDS = ("pv_fp8", "quant_q", "fma_scale", "heads_inner", "gluon", "gluon_ws", "gluon_p_regs", "gluon_tree",
               "gluon_p_dbuf", "gluon_pv_overlap", "gluon_mma_sum", "gluon_persist", "gluon_q_regs",
               "gluon_prefetch", "gluon_vt3", "gluon_vt_prmt", "gluon_wide_store")


def config_override(variant: dict | None = None):
    """A PrefillConfig from the heuristic's fields updated by env HPCOPS_PREFILL_CONFIG
    ("block_m=128,block_n=64,num_warps=8,num_stages=3,tma=1,pv_fp8=0"; tma=auto for the automatic
    choice) and `variant`; None = heuristic."""
    import os

    text = os.environ.get("HPCOPS_PREFILL_CONFIG", "").strip()
    fields: dict[str, Any] = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        key, _, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if key == "tma":
            fields[key] = None if value.lower() in ("auto", "none") else bool(int(value))
        elif key in BOOL_FIELDS:
            fields[key] = bool(int(value))
        else:
            fields[key] = int(value)
    fields.update(variant or {})
    return fields or None


def _ours(fp8_q: bool, variant: dict | None = None, *, check: bool = True):
    """Ours on the heuristic config, or (`variant`) on the heuristic updated by `variant`'s fields (the tl kernel's
    heuristic unless they set gluon=True: a variant with Gluon knobs and no gluon=True is a ValueError). A variant
    checks its own output against the sampled reference on layer 0 when it is prepared, so that a failing
    variant marks only its own row, never the case's default rows (which `_check` gates). check=False: no such
    check (the tuner gates its candidates itself, and its compile workers launch nothing: an output left NaN)."""
    def prepare(x):
        from hpcops.attention.prefill import prefill_attention

        kv = x["kv"]
        q, q_scale = (x["q8"], x["q_scale"]) if fp8_q else (x["q"], None)
        out = torch.empty(q.shape, dtype=torch.bfloat16, device=q.device)
        args = (q, kv.k_cache, kv.v_cache, kv.block_table, kv.seq_lens, x["cu"])
        quantize_q = bool((variant or {}).get("quantize_q"))  # prefill_attention's argument, not a config field
        config = variant_config(variant, group=q.shape[1] // kv.k_cache.shape[2], max_seqlen_q=x["max_q"],
                                q_dtype=q.dtype, kv_dtype=kv.k_cache.dtype)
        kw = dict(
            max_seqlen_q=x["max_q"], k_scale=kv.k_scale, v_scale=kv.v_scale, q_scale=q_scale, out=out, config=config
        )
        if quantize_q:
            kw["quantize_q"] = True
        run = lambda: prefill_attention(*args, **kw)  # noqa: E731
        if variant is None:
            x["out_fp8q" if fp8_q else "out"] = out
        elif check and x["layer"] == 0:
            _check_variant(x, run, out, fp8_q, variant)
        return run

    prepare.variant = variant  # the row's config fields (tests resolve them with `variant_config`)
    return prepare


def variant_config(variant: dict | None, *, group: int, max_seqlen_q: int, q_dtype: torch.dtype,
                   kv_dtype: torch.dtype):
    """The PrefillConfig a row of `_ours(…, variant)` runs (None: the launcher's heuristic): the heuristic for the
    shape updated by `variant`'s fields and HPCOPS_PREFILL_CONFIG (`config_override`), on the Gluon heuristic
    (`gluon_config`, its knobs included) where the fields say gluon=True, else the tl one; a variant with Gluon
    knobs and no gluon=True is a ValueError (it would time the tl kernel under a Gluon row's name)."""
    import dataclasses

    from hpcops.attention.prefill import prefill_config

    fields = config_override({k: v for k, v in variant.items() if k != "quantize_q"} if variant else None)
    if not fields:
        return None
    base = prefill_config(head_dim=HEAD_DIM, group=group, max_seqlen_q=max_seqlen_q, q_dtype=q_dtype,
                          kv_dtype=kv_dtype, gluon=fields.get("gluon", False))
    config = dataclasses.replace(base, **fields)
    knobs = sorted(k for k, v in fields.items() if k.startswith("gluon_") and v)
    if knobs and not config.gluon:  # the base is the tl heuristic unless the fields say gluon=True
        raise ValueError(f"prefill variant {fields}: Gluon knobs {knobs} without gluon=True would time the "
                         "tl kernel (add the Gluon config's fields, e.g. GLUON_FP8_MSUM)")
    return config


FP8_BUDGET = {"maxtol": 6e-2, "rmstol": 3e-2}  # the fp8 error budget (PREFILL.md), against the fp32 reference


def _ours_bf16_kv(x, variant: dict | None = None):
    """Our bf16 default (bf16 q, heuristic config; `variant`: its fields updated, as `_ours`) on the fp8 case's shape
    over a bf16 cache of its own (`x["kv16"]`, made here: the other rows, the tuner and the probes never pay for
    it), gated on layer 0 against the sampled reference of that cache. Issue 12's fp8-q goal is a ratio to our
    bf16: this row is timed beside the fp8 rows (interleaved with --rounds), not minutes apart as the bf16 case's."""
    from hpcops.attention.prefill import prefill_attention
    from hpcops.testing import assert_close, make_paged_kv

    if "kv16" not in x:
        x["kv16"] = make_paged_kv(
            [sl for _, sl in x["reqs"]],
            num_kv_heads=x["kv"].k_cache.shape[2],
            head_dim=HEAD_DIM,
            block_size=PAGE,
            dtype=torch.bfloat16,
            device=x["q"].device,
            generator=torch.Generator().manual_seed(1000 * x["layer"] + 19),
        )
    kv, q = x["kv16"], x["q"]
    out = torch.empty_like(q)
    args = (q, kv.k_cache, kv.v_cache, kv.block_table, kv.seq_lens, x["cu"])
    config = variant_config(variant, group=q.shape[1] // kv.k_cache.shape[2], max_seqlen_q=x["max_q"],
                            q_dtype=q.dtype, kv_dtype=kv.k_cache.dtype) if variant else None
    run = lambda: prefill_attention(*args, max_seqlen_q=x["max_q"], out=out, config=config)  # noqa: E731
    if x["layer"] == 0:
        out.fill_(float("nan"))
        run()
        rows, heads, want = _sampled_reference({**x, "kv": kv}, q, None)
        assert_close(want, out[rows][:, heads], name="prefill bf16 q over bf16 KV (hpcops-bf16kv)")
    return run


def _e4m3_p_tolerance(x) -> dict:
    """The fp8 Gluon kernel (an H200's default for an fp8 q) rounds P to e4m3: the fp8 budget there."""
    hopper = x["q"].is_cuda and torch.cuda.get_device_capability(x["q"].device)[0] == 9
    return dict(FP8_BUDGET) if hopper else {}


def _check_variant(x, run, out, fp8_q: bool, variant: dict) -> None:
    """A variant's own gate: its output (NaN-filled first) on the sampled reference rows. An fp8 q, or a bf16 q
    quantized in the kernel (`quant_q`), is compared with the reference of the quantized q; the Gluon fp8
    kernel and `pv_fp8` with the e4m3-P tolerance."""
    from hpcops.testing import assert_close

    out.fill_(float("nan"))
    run()
    quantized = fp8_q or bool(variant.get("quant_q")) or bool(variant.get("quantize_q"))
    q, q_scale = (x["q8"], x["q_scale"]) if quantized else (x["q"], None)
    rows, heads, want = _sampled_reference(x, q, q_scale)
    gluon_fp8 = (fp8_q or bool(variant.get("quantize_q"))) and variant.get("gluon", True) is not False
    # quant_q rounds q to e4m3 in the kernel, not bit for bit as x["q8"]: the fp8 budget on any device
    if variant.get("quant_q") or variant.get("quantize_q"):
        tol = dict(FP8_BUDGET)
    else:
        tol = _e4m3_p_tolerance(x) if gluon_fp8 or variant.get("pv_fp8") else {}
    assert_close(want, out[rows][:, heads], name=f"prefill {'fp8' if fp8_q else 'bf16'} q, variant {variant}", **tol)


def flashinfer_backend(q: torch.Tensor, k_cache: torch.Tensor) -> str:
    """FA2 for a 16-bit q over an fp8 cache (FlashInfer's FA3 templates need q and KV of one dtype)."""
    return "fa2" if q.dtype != k_cache.dtype else "auto"


def _flashinfer(x):
    try:
        import flashinfer
    except Exception as exc:  # not installed, or its import fails on this machine
        raise PeerUnavailable(f"flashinfer not importable: {exc}") from exc
    kv, reqs = x["kv"], x["reqs"]
    q = x["q"]
    pages = [-(-sl // PAGE) for _, sl in reqs]
    kv_indptr = torch.tensor([0] + torch.tensor(pages).cumsum(0).tolist(), dtype=torch.int32)
    bt = kv.block_table.cpu()
    kv_indices = torch.cat([bt[b, :n] for b, n in enumerate(pages)]).to(q.device)
    last = torch.tensor([sl - (n - 1) * PAGE for (_, sl), n in zip(reqs, pages)], dtype=torch.int32)
    out = torch.empty_like(q)
    try:
        ws = flashinfer_workspace(q.device)
        wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=flashinfer_backend(q, kv.k_cache))
        wrapper.plan(
            x["cu_cpu"],
            kv_indptr,
            kv_indices,
            last,
            q.shape[1],
            kv.k_cache.shape[2],
            HEAD_DIM,
            PAGE,
            causal=True,
            sm_scale=x["scale"],
            q_data_type=q.dtype,
            kv_data_type=kv.k_cache.dtype,
        )
        scales = {}
        if kv.k_scale is not None:
            scales = dict(k_scale=float(kv.k_scale), v_scale=float(kv.v_scale))

        def fn():
            return wrapper.run(q, (kv.k_cache, kv.v_cache), out=out, **scales)

        fn()
        torch.cuda.synchronize()
    except Exception as exc:
        raise PeerUnavailable(f"flashinfer failed: {type(exc).__name__}: {exc}"[:200]) from exc
    x["_fi_keep"] = (ws, wrapper)
    return fn


def _dense_kv(x, hq: int):
    """K/V of every request gathered to contiguous [B, Hq, seq, D] bf16 (GQA expanded), outside timing."""
    kv, reqs = x["kv"], x["reqs"]
    group = hq // kv.k_cache.shape[2]
    ks, vs = [], []
    for b, (_, sl) in enumerate(reqs):
        n = -(-sl // PAGE)
        pages = kv.block_table[b, :n].long()
        k = kv.k_cache[pages].reshape(-1, kv.k_cache.shape[2], HEAD_DIM)[:sl]
        v = kv.v_cache[pages].reshape(-1, kv.v_cache.shape[2], HEAD_DIM)[:sl]
        if kv.k_scale is not None:
            k, v = k.float() * kv.k_scale, v.float() * kv.v_scale
        ks.append(k.to(torch.bfloat16).repeat_interleave(group, dim=1).transpose(0, 1))
        vs.append(v.to(torch.bfloat16).repeat_interleave(group, dim=1).transpose(0, 1))
    return ks, vs


def _sdpa(backend_name: str):
    def prepare(x):
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.attention.bias import causal_lower_right

        backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend_name]
        q, reqs = x["q"], x["reqs"]
        ks, vs = _dense_kv(x, q.shape[1])
        cu = x["cu_cpu"].tolist()
        calls = []
        for b, (ql, sl) in enumerate(reqs):
            qb = q[cu[b] : cu[b + 1]].transpose(0, 1).unsqueeze(0)  # [1, Hq, q_len, D]
            kb, vb = ks[b].unsqueeze(0).contiguous(), vs[b].unsqueeze(0).contiguous()
            mask = None if ql == sl else causal_lower_right(ql, sl)
            calls.append((qb, kb, vb, mask))

        def fn():
            with sdpa_kernel([backend]):
                return [
                    torch.nn.functional.scaled_dot_product_attention(
                        qb, kb, vb, attn_mask=mask, is_causal=mask is None, scale=x["scale"]
                    )
                    for qb, kb, vb, mask in calls
                ]

        try:
            fn()
            torch.cuda.synchronize()
        except Exception as exc:
            raise PeerUnavailable(f"sdpa {backend_name}: {type(exc).__name__}: {exc}"[:200]) from exc
        return fn

    return prepare


def _sampled_reference(x, q, q_scale, *, rows_per_req: int = 192, heads: int = 16) -> tuple:
    """Reference rows for a sample of queries and query heads of each request (fp32, dequantized)."""
    kv, reqs = x["kv"], x["reqs"]
    hq, hkv = q.shape[1], kv.k_cache.shape[2]
    group = hq // hkv
    head_idx = torch.unique(torch.cat([torch.arange(min(heads // 2, hq)), torch.arange(hq - heads // 2, hq)]))
    head_idx = head_idx.clamp(0, hq - 1).unique().to(q.device)
    cu = x["cu_cpu"].tolist()
    qf = q.float() * (q_scale[..., None] if q_scale is not None else 1.0)
    rows, want = [], []
    for b, (ql, sl) in enumerate(reqs):
        n = -(-sl // PAGE)
        pages = kv.block_table[b, :n].long()
        k = kv.k_cache[pages].reshape(-1, hkv, HEAD_DIM)[:sl].float()
        v = kv.v_cache[pages].reshape(-1, hkv, HEAD_DIM)[:sl].float()
        if kv.k_scale is not None:
            k, v = k * kv.k_scale, v * kv.v_scale
        i = torch.unique(torch.cat([torch.linspace(0, ql - 1, rows_per_req).long(), torch.tensor([0, ql - 1])]))
        i = i.to(q.device)
        kh, vh = k[:, head_idx // group].transpose(0, 1), v[:, head_idx // group].transpose(0, 1)  # [h, s, D]
        qb = qf[cu[b] + i][:, head_idx].transpose(0, 1)  # [h, r, D]
        logits = (qb @ kh.transpose(1, 2)) * x["scale"]
        limit = (sl - ql) + i[:, None]
        logits = logits.masked_fill(torch.arange(sl, device=q.device)[None, :] > limit, float("-inf"))
        want.append((torch.softmax(logits, -1) @ vh).transpose(0, 1))  # [r, h, D]
        rows.append(cu[b] + i)
    return torch.cat(rows), head_idx, torch.cat(want)


def _check(x) -> None:
    """The case's gate: the default rows (`hpcops`, and `hpcops-fp8q` over fp8 KV) on the sampled reference rows.
    The variants gate themselves when prepared (`_check_variant`)."""
    from hpcops.testing import assert_close

    _ours(False)(x)()
    rows, heads, want = _sampled_reference(x, x["q"], None)
    assert_close(want, x["out"][rows][:, heads], name="prefill bf16 q")
    if "q8" in x:
        _ours(True)(x)()
        rows, heads, want = _sampled_reference(x, x["q8"], x["q_scale"])
        assert_close(want, x["out_fp8q"][rows][:, heads], name="prefill fp8 q", **_e4m3_p_tolerance(x))


def cases(opts: dict) -> Iterator[Case]:
    specs = QUICK_SPECS if opts.get("quick") else SPECS
    heads = HEADS[:1] if opts.get("quick") else HEADS
    for fp8 in (False, True):
        for hq, hkv in heads:
            for spec in specs:
                s = Scenario(spec, hq, hkv, fp8)
                impls = [Impl("hpcops", _ours(False), ours=True, note="bf16 q, fp8 KV" if fp8 else "")]
                if fp8:
                    impls.append(Impl("hpcops-fp8q", _ours(True), ours=True,
                                      note="fp8 q per token-head (on Hopper the warp-specialized Gluon kernel, "
                                      "persistent, its producer prefetching q)"))
                    impls.append(Impl("hpcops-bf16kv", _ours_bf16_kv,
                                      note="our bf16 default on this shape over bf16 KV (issue 12's fp8-q goal: "
                                      "its µs over hpcops-fp8q's, timed in this case)"))
                    impls.append(
                        Impl("hpcops-quantize-q", _ours(False, {"quantize_q": True}),
                             note="variant: bf16 q, prefill_attention(quantize_q=True): quantized per token-head, "
                             "then the fp8 path (on an H200 a quantizing kernel and the fp8 Gluon kernel)")
                    )
                    impls.append(
                        Impl("hpcops-quant-q", _ours(False, {"quant_q": True}), note="variant: bf16 q, quant_q=True")
                    )
                    impls.append(
                        Impl("hpcops-fp8q-tl", _ours(True, {"gluon": False}),
                             note="variant: fp8 q on the tl kernel, P·V in bf16 (PrefillConfig(gluon=False))")
                    )
                    impls.append(
                        Impl("hpcops-fp8q-gluon-preg", _ours(True, {**GLUON_FP8, "gluon_p_regs": True,
                                                                    "gluon_vt_prmt": False}),
                             note="variant: the Gluon fp8 kernel with P in registers and a synchronous P·V "
                             "(gluon_p_regs=True)")
                    )
                    impls.append(
                        Impl("hpcops-fp8q-fsum", _ours(True, {**GLUON_FP8_MSUM, "gluon_mma_sum": False}),
                             note="variant: the Gluon fp8 kernel, row sums on the CUDA cores (gluon_mma_sum=False)")
                    )
                    impls.append(
                        Impl("hpcops-fp8q-persist", _ours(True, {**GLUON_FP8_MSUM, "gluon_persist": True}),
                             note="variant: the persistent grid without the prefetch, a program an SM walking the "
                             "tiles (gluon_persist=True, gluon_prefetch=False)")
                    )
                    impls.append(
                        Impl("hpcops-fp8q-plain", _ours(True, GLUON_FP8_MSUM),
                             note="variant: the fp8 kernel a program a q tile, not persistent (gluon_persist=False, "
                             "gluon_prefetch=False: the fp8-q default until session 66)")
                    )
                    impls += [Impl(f"hpcops-fp8q-{name}", _ours(True, {**GLUON_FP8_DEFAULT, **fields}),
                                   note=f"variant: {note}") for name, fields, note in FP8_DEFAULT_VARIANTS]
                    impls.append(
                        Impl("hpcops-bf16kv-narrow", lambda x: _ours_bf16_kv(x, GLUON_BF16_NARROW),
                             note="variant: hpcops-bf16kv storing its output in 4-byte pieces "
                             "(gluon_wide_store=False): issue 12's ratio with both kernels so")
                    )
                    impls.append(
                        Impl("hpcops-fp8q-smemq", _ours(True, {**GLUON_FP8_MSUM, "gluon_q_regs": False}),
                             note="variant: the fp8 default with q read from shared memory by every S wgmma "
                             "(gluon_q_regs=False)")
                    )
                    impls.append(
                        Impl("hpcops-fp8q-tree", _ours(True, {**GLUON_FP8, "gluon_tree": True}),
                             note="variant: the Gluon fp8 kernel with its row max and sum as trees (gluon_tree=True)")
                    )
                if not fp8:
                    # the tl kernel beside the default, which takes the Gluon kernel here on an H200 (gluon_config)
                    impls.append(
                        Impl("hpcops-tl", _ours(False, {"gluon": False}), note="variant: PrefillConfig(gluon=False)")
                    )
                    impls.append(
                        Impl("hpcops-tree", _ours(False, GLUON_BF16_TREE),
                             note="variant: the warp-specialized Gluon kernel with its row max and sum as trees "
                             "(gluon_tree=True)")
                    )
                    impls.append(
                        Impl("hpcops-narrow", _ours(False, GLUON_BF16_NARROW),
                             note="variant: the Gluon default storing its output in 4-byte pieces "
                             "(gluon_wide_store=False: the default until session 72; the 128-row tile at few-tile "
                             "cases too, as a variant's base knows no tile count)")
                    )
                    impls.append(
                        Impl("hpcops-narrow64", _ours(False, GLUON_BF16_NARROW64),
                             note="variant: the 64-row Gluon tile (the default at few tiles) storing its output in "
                             "4-byte pieces (block_m=64, gluon_ws=False, gluon_wide_store=False: its default until "
                             "session 73)")
                    )
                    impls.append(
                        Impl("hpcops-persist", _ours(False, {**GLUON_BF16_TREE, "gluon_persist": True}),
                             note="variant: the bf16 default's kernel as a persistent grid (gluon_tree=True, "
                             "gluon_persist=True)")
                    )
                # variants timed in the same run: the pointer path (TMA is the default where the layout allows)
                impls.append(
                    Impl(
                        "hpcops-notma",
                        _ours(False, {"tma": False}),
                        note="variant: PrefillConfig(tma=False)" + (", bf16 q" if fp8 else ""),
                    )
                )
                impls += [
                    Impl(
                        "flashinfer",
                        _flashinfer,
                        note="BatchPrefillWithPagedKVCacheWrapper" + (", backend fa2 (bf16 q)" if fp8 else ""),
                    ),
                    Impl("sdpa-cudnn", _sdpa("cudnn"), note="dense, bf16 (fp8 KV dequantized)"),
                    Impl("sdpa-flash", _sdpa("flash"), note="dense, bf16 (fp8 KV dequantized)"),
                ]
                yield Case(
                    suite="prefill",
                    name=s.name,
                    make_inputs=lambda layer, device="cuda", s=s: _make_inputs(s, layer, device),
                    impls=impls,
                    check=_check,
                    bytes=s.bytes,
                    flops=causal_flops(s.reqs, hq, HEAD_DIM),
                    params={
                        "spec": s.spec,
                        "hq": hq,
                        "hkv": hkv,
                        "head_dim": HEAD_DIM,
                        "page": PAGE,
                        "kv": "fp8" if fp8 else "bf16",
                    },
                    command=f"python -m hpcops bench prefill --only {s.name}",
                )
