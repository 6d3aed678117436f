"""Bench suite `decode-grid` (`hpcops bench decode --grid`): issue 10's generality grid for paged decode.

Axes: GQA 1, 4, 5, 8, 16; head_dim 64, 128, 256; page 16, 32, 64; KV bf16 and fp8; lengths uniform short
(64x0.5K), uniform long (32x8K), one 256K request (1x256K+15x2K) and a seeded log-uniform mix (32 requests
of 100..100K tokens, the `layer` suite's B32-logmix). Not the cross product (1080 cases): one axis at a time
around the base case h8/1 d128 p64 (one TP8 rank of Hy3), plus corners:
- base: every length × both KV dtypes (8 cases);
- GQA: h8/8, h32/8, h40/8, h64/8 (GQA 1, 4, 5, 8 at 8 kv heads: a 7–70B model's heads on one GPU) and h16/1
  (GQA 16: Llama-3 405B's 128/8 heads on a TP8 rank), at short and long × both KV (20);
- head_dim 64, 256 at long and the log mix × both KV (8); page 16, 32 at short and 256K × both KV (8);
- 10 corners mixing the axes (GQA 5 on page 16, d256 on page 16 with GQA 1, h64/8 at 256K, ...).
54 cases; `--quick` is a 12-case subset with every value of every axis (`QUICK`).

Implementations, each timed on the same inputs in the same run (L2-cold, one CUDA graph of layers, as
the `decode` suite):
- `hpcops-fp8q` (fp8 KV only; first, so `x ours` is against it) — the decode with the fp8 q our fused
  prologue emits: on fp8 KV it is the row the targets count (issue 10);
- `hpcops` — the decode with a bf16 q (the row the targets count on bf16 KV);
- `hpcops-gluon` — the decode on the Hopper kernel (`DecodeConfig.gluon`; the bench `decode` suite's row), not yet
  in the verdict;
- `flashinfer-decode` / `flashinfer-tc` — FlashInfer's BatchDecodeWithPagedKVCacheWrapper without and
  with tensor cores, planned outside the graph (the `decode` suite's adapter);
- `vllm-unified` — vLLM's Triton unified attention (`.peers/vllm_kernels`, vendored with
  `../shared/tools/vllm_peer/vendor.py`, git-ignored), set up as vLLM's TRITON_ATTN metadata builder does.

Gate: before timing, ours (both q dtypes) against the torch reference on layer 0; each peer's first call
on layer 0 against the same reference in its `prepare` (a wrong peer is `check-failed`, never ranked). A
peer that raises on a case (an unsupported GQA, head_dim, page or dtype) is `unavailable` with its error.

Peer of a case: FlashInfer's best path (the faster of its two rows) where FlashInfer runs and passes the
gate, else `vllm-unified`. Target (issue 10): no case below 1.0× its peer, except ≥ 0.95× where the peer
streams at ≥ 90 % of copy bandwidth; the markdown ends with the verdict per case (`summary_markdown`),
the PNG shows peer time / our time per case (`plot`).

GPU time (H200, session 48, FlashInfer wheels and `.peers` carried): on a fresh
machine `--grid --only bf16` (26 cases) took ~150 s and `--grid --only fp8` (28 cases) ~210 s, so the whole grid
fits two 10-minute device commands (or one, tightly). What costs is per case ~3–5 s (inputs, the reference gate of
ours and of each peer, graph captures) and Triton compilation per new (GQA, head_dim, page, KV) — ours with both q
dtypes, vLLM's kernel and reduction; timing itself is < 0.2 s a row (one graph of L ≥ 8 L2-cold layers replayed 50
times). Run the parts with `--out A` / `--out B` and join them anywhere with
`python -m hpcops.bench.report decode-grid OUT A B`. The reports are rewritten after every case, so a part cut
short keeps what it measured.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from hpcops.attention import reference as ref
from hpcops.bench.registry import Case, Impl, PeerUnavailable, import_vendored
from hpcops.bench.scenarios import log_uniform_lens, parse_lengths
from hpcops.bench.suites._moe_common import VENDOR_VLLM
from hpcops.bench.suites.decode import _flashinfer, _gluon, _ours, make_decode_inputs
from hpcops.testing import assert_close

SUITE = "decode-grid"
LENGTHS = {"short": "64x0.5K", "long": "32x8K", "256K": "1x256K+15x2K", "logmix": "logmix32"}
LOGMIX = (100, 100_000)  # tokens; 32 requests seeded 1234 + 32: the `layer` suite's B32-logmix
KVS = ("fp8", "bf16")
BASE = dict(hq=8, hkv=1, d=128, page=64)
GQA_SHAPES = ((8, 8), (32, 8), (40, 8), (64, 8), (16, 1))  # (Hq, Hkv): GQA 1, 4, 5, 8, 16
HEAD_DIMS = (64, 256)
PAGES = (16, 32)
CORNERS = (  # (hq, hkv, d, page, kv, lengths)
    (40, 8, 128, 16, "fp8", "logmix"),
    (16, 1, 256, 32, "bf16", "256K"),
    (32, 8, 64, 16, "bf16", "logmix"),
    (8, 8, 256, 16, "fp8", "long"),
    (64, 8, 128, 64, "fp8", "256K"),
    (16, 1, 64, 64, "fp8", "logmix"),
    (40, 8, 256, 64, "bf16", "short"),
    (8, 8, 64, 32, "fp8", "256K"),
    (64, 8, 256, 32, "fp8", "logmix"),
    (16, 1, 128, 16, "bf16", "256K"),
)
QUICK = (  # every value of every axis at least once; d64 and d256 on fp8 KV only (2 FlashInfer builds fewer)
    (8, 1, 128, 64, "fp8", "long"), (8, 1, 128, 64, "bf16", "logmix"), (8, 1, 128, 64, "fp8", "256K"),
    (8, 8, 128, 64, "bf16", "short"), (32, 8, 128, 64, "fp8", "long"), (40, 8, 128, 64, "bf16", "long"),
    (16, 1, 128, 64, "fp8", "short"), (8, 1, 64, 64, "fp8", "long"), (8, 1, 256, 64, "fp8", "logmix"),
    (8, 1, 128, 16, "fp8", "short"), (8, 1, 128, 32, "bf16", "256K"), (64, 8, 128, 64, "fp8", "256K"),
)
FLASHINFER = ("flashinfer-decode", "flashinfer-tc")
VLLM = "vllm-unified"
VLLM_MODULE = "vllm_kernels.attention.triton_unified_attention"
VLLM_SEGMENTS = 16  # vLLM's num_par_softmax_segments
VLLM_GRID_2D = 128  # vLLM's MIN_LAUNCH_GRID_SIZE_2D: split-KV (3D) while B ≤ 128 // Hkv
VLLM_NOTE = (f"vLLM 0.33's unified_attention as its TRITON_ATTN builder sets it up (split-KV with {VLLM_SEGMENTS} "
             f"segments while B ≤ {VLLM_GRID_2D} // Hkv, else its 2D kernel; bf16 q, fp8 KV by per-tensor "
             "scales), CUDA-graph timed like ours")
TARGET, TARGET_STREAMING, STREAMING_PCT = 1.0, 0.95, 90.0


@dataclass(frozen=True)
class GridCase:
    """One decode step: `lengths` (a LENGTHS key) of KV, Hq/Hkv heads of `d`, pages of `page` tokens."""

    hq: int
    hkv: int
    d: int
    page: int
    kv: str  # "fp8" | "bf16"
    lengths: str
    group: str = "corner"  # the axis this case varies ("base", "gqa", "head_dim", "page", "corner")

    @property
    def spec(self) -> str:
        return LENGTHS[self.lengths]

    @property
    def gqa(self) -> int:
        return self.hq // self.hkv

    @property
    def fp8(self) -> bool:
        return self.kv == "fp8"

    @property
    def name(self) -> str:
        return f"{self.spec} h{self.hq}/{self.hkv} d{self.d} p{self.page} {self.kv}"

    @property
    def key(self) -> tuple:
        return (self.hq, self.hkv, self.d, self.page, self.kv, self.lengths)

    @property
    def lens(self) -> list[int]:
        if self.lengths == "logmix":
            return log_uniform_lens(32, *LOGMIX, seed=1234 + 32)
        return parse_lengths(self.spec)

    @property
    def bytes(self) -> int:
        """K and V of every token read once, q read and out written in bf16."""
        kv = sum(self.lens) * self.hkv * self.d * 2 * (1 if self.fp8 else 2)
        return kv + len(self.lens) * self.hq * self.d * 2 * 2


def grid() -> list[GridCase]:
    """The full grid, in axis order (base, GQA, head_dim, page, corners)."""
    out: list[GridCase] = []

    def add(group: str, **kw) -> None:
        out.append(GridCase(**{**BASE, **kw}, group=group))

    for kv in KVS:
        for lengths in LENGTHS:
            add("base", kv=kv, lengths=lengths)
    for hq, hkv in GQA_SHAPES:
        for kv in KVS:
            for lengths in ("short", "long"):
                add("gqa", hq=hq, hkv=hkv, kv=kv, lengths=lengths)
    for d in HEAD_DIMS:
        for kv in KVS:
            for lengths in ("long", "logmix"):
                add("head_dim", d=d, kv=kv, lengths=lengths)
    for page in PAGES:
        for kv in KVS:
            for lengths in ("short", "256K"):
                add("page", page=page, kv=kv, lengths=lengths)
    for hq, hkv, d, page, kv, lengths in CORNERS:
        out.append(GridCase(hq, hkv, d, page, kv, lengths))
    return out


def scenarios(quick: bool = False) -> list[GridCase]:
    cases = grid()
    if quick:
        keys = set(QUICK)
        cases = [c for c in cases if c.key in keys]
    return cases


# ------------------------------------------------------------------------------------------ inputs, gate

def make_inputs(c: GridCase, layer: int, device: str = "cuda") -> dict[str, Any]:
    x = make_decode_inputs(c.lens, c.hq, c.hkv, c.fp8, seed=layer, device=device, page=c.page, head_dim=c.d)
    x["layer"] = layer
    return x


def reference(x: dict[str, Any], *, fp8q: bool = False) -> torch.Tensor:
    """The torch reference of layer `x` (bf16 q, or with `fp8q` the fp8 q and its scales), computed once."""
    key = "reference_fp8q" if fp8q else "reference"
    if key not in x:
        q, qs = (x["q8"], x["q_scale"]) if fp8q else (x["q"], None)
        x[key] = ref.decode_attention(q, x["k_cache"], x["v_cache"], x["block_table"], x["seq_lens"],
                                      k_scale=x["k_scale"], v_scale=x["v_scale"], q_scale=qs)
    return x[key]


def check(x: dict[str, Any]) -> None:
    """The case's gate: our decode (planned, NaN-filled output) with a bf16 q and, on fp8 KV, the fp8 q."""
    import hpcops

    variants = [("hpcops", False)] + ([("hpcops-fp8q", True)] if "q8" in x else [])
    for name, fp8q in variants:
        q, qs = (x["q8"], x["q_scale"]) if fp8q else (x["q"], None)
        got = hpcops.decode_attention(q, x["k_cache"], x["v_cache"], x["block_table"], x["seq_lens"],
                                      k_scale=x["k_scale"], v_scale=x["v_scale"], q_scale=qs,
                                      out=torch.full_like(x["out"], float("nan")))
        assert_close(reference(x, fp8q=fp8q), got, name=name)


def gated_peer(name: str, prepare):
    """A peer's `prepare`, tried: any error it raises on this case (an unsupported shape or dtype) makes it
    unavailable, with the error; its first call on layer 0 is checked against the reference."""
    def wrapped(x):
        try:
            fn = prepare(x)
            if x.get("layer") == 0:
                x["out"].fill_(float("nan"))  # unwritten elements fail
                fn()
                if x["out"].is_cuda:
                    torch.cuda.synchronize()
        except (PeerUnavailable, AssertionError):
            raise
        except Exception as exc:  # the peer cannot run this case: say why on its row
            first = (str(exc).strip().splitlines() or [""])[0]
            raise PeerUnavailable(f"{name} cannot run this case: {type(exc).__name__}: {first}"[:300]) from exc
        if x.get("layer") == 0:
            assert_close(reference(x), x["out"], name=name)
        return fn
    return wrapped


def vllm_unified(x: dict[str, Any]):
    """vLLM's unified_attention on our inputs, as vLLM's Triton backend calls it for a decode batch: one query
    token per request, the packed K|V views, bf16 q (vLLM passes no q_descale), fp8 KV with per-tensor
    scales, and the split-KV scratch its metadata builder allocates (3D while B ≤ 128 // Hkv)."""
    ua = import_vendored(VLLM_MODULE, how=VENDOR_VLLM)
    modes = import_vendored("vllm_kernels._shim.kv_cache_interface", how=VENDOR_VLLM).KVQuantMode
    q, k, v, out = x["q"], x["k_cache"], x["v_cache"], x["out"]
    b, hq, d = q.shape
    hkv = k.shape[2]
    dev = q.device
    cu_q = torch.arange(b + 1, dtype=torch.int32, device=dev)
    max_k = int(x["seq_lens"].max())  # on the host, once, outside the graph (as vLLM's builder)
    threshold = VLLM_GRID_2D // hkv
    segs = VLLM_SEGMENTS
    seg_out = torch.empty((threshold, hq, segs, 1 << (d - 1).bit_length()), dtype=torch.float32, device=dev)
    seg_max = torch.empty((threshold, hq, segs), dtype=torch.float32, device=dev)
    seg_sum = torch.empty((threshold, hq, segs), dtype=torch.float32, device=dev)
    kw = {"kv_quant_mode": modes.FP8_PER_TENSOR} if k.dtype == torch.float8_e4m3fn else {}

    def run():
        ua.unified_attention(q, k, v, out, cu_q, 1, x["seq_lens"], max_k, d ** -0.5, True, (-1, -1),
                             x["block_table"], 0, None, x["k_scale"], x["v_scale"], seq_threshold_3D=threshold,
                             num_par_softmax_segments=segs, softmax_segm_output=seg_out,
                             softmax_segm_max=seg_max, softmax_segm_expsum=seg_sum, **kw)
        return out
    return run


def impls(c: GridCase) -> list[Impl]:
    ours = [Impl("hpcops", _ours("dynamic"), ours=True)]
    if c.fp8:
        ours.insert(0, Impl("hpcops-fp8q", _ours("dynamic", fp8q=True), ours=True))
    # the Hopper kernel (DecodeConfig.gluon) beside them, not yet in the verdict: unavailable where it does not apply
    ours.append(Impl("hpcops-gluon", _gluon(), ours=True))
    return ours + [Impl("flashinfer-decode", gated_peer("flashinfer-decode", _flashinfer(False))),
                   Impl("flashinfer-tc", gated_peer("flashinfer-tc", _flashinfer(True))),
                   Impl(VLLM, gated_peer(VLLM, vllm_unified), note=VLLM_NOTE)]


def cases(opts: dict[str, Any]) -> Iterator[Case]:
    for c in scenarios(bool(opts.get("quick"))):
        yield Case(
            suite=SUITE, name=c.name, impls=impls(c), bytes=c.bytes, check=check,
            make_inputs=lambda layer, device="cuda", c=c: make_inputs(c, layer, device),
            params=dict(spec=c.spec, lengths=c.lengths, hq=c.hq, hkv=c.hkv, gqa=c.gqa, d=c.d, page=c.page,
                        kv=c.kv, group=c.group),
            command=f"hpcops bench decode --grid --only '{c.name}'",
        )


# ------------------------------------------------------------------------------------------ verdicts

def select_peer(rows: list) -> tuple[Any, str]:
    """(the peer row of a case, why): FlashInfer's faster row among those that ran and passed the gate, else
    `vllm-unified`'s; (None, why) when neither has a time."""
    by = {r.impl: r for r in rows}
    fi = [r for r in rows if r.impl in FLASHINFER and r.us is not None and r.status == "ok"]
    if fi:
        return min(fi, key=lambda r: r.us), "FlashInfer's best path"
    fi_why = "; ".join(f"{r.impl}: {r.status}" for r in rows if r.impl in FLASHINFER) or "no FlashInfer rows"
    v = by.get(VLLM)
    if v is not None and v.us is not None and v.status == "ok":
        return v, f"FlashInfer cannot: {fi_why}"
    return None, f"{fi_why}; {VLLM}: {v.status if v is not None else 'no row'}"


def counted_row(rows: list) -> Any:
    """Our row the targets count: `hpcops-fp8q` on fp8 KV, `hpcops` on bf16 KV (None without a time)."""
    kv = rows[0].params.get("kv") if rows else None
    want = "hpcops-fp8q" if kv == "fp8" else "hpcops"
    r = next((r for r in rows if r.impl == want), None)
    return r if r is not None and r.us is not None and r.status == "ok" else None


def summarize(result) -> list[dict[str, Any]]:
    """Per case: our counted row, its peer, peer time / our time, the peer's % of copy bandwidth, the bar it
    must clear (1.0, or 0.95 where the peer streams at ≥ 90 %) and the verdict: pass, short or no verdict."""
    from hpcops.bench.report import by_case

    copy = result.machine.get("copy_gbps")
    out = []
    for name, rows in by_case(result).items():
        ours, (peer, why) = counted_row(rows), select_peer(rows)
        pct = 100 * peer.gbps / copy if peer is not None and peer.gbps and copy else None
        need = TARGET_STREAMING if pct is not None and pct >= STREAMING_PCT else TARGET
        ratio = peer.us / ours.us if peer is not None and ours is not None else None
        verdict = "—" if ratio is None else "pass" if ratio >= need else "short"
        if ours is None:
            why = "our counted row has no time"
        out.append(dict(case=name, params=rows[0].params, ours=ours.impl if ours else None,
                        ours_us=ours.us if ours else None, peer=peer.impl if peer else None,
                        peer_us=peer.us if peer else None, peer_pct_copy=pct, ratio=ratio, need=need,
                        verdict=verdict, why=why))
    return out


def _geomean(vals: list[float]) -> float | None:
    return math.exp(sum(map(math.log, vals)) / len(vals)) if vals else None


def summary_markdown(result) -> str:
    """The targets of issue 10 (deliverable 3), evaluated per case: appended to `decode-grid.md`."""
    rows = summarize(result)
    f = lambda v, fmt="{:.1f}": fmt.format(v) if v is not None else "—"
    lines = ["## Targets (issue 10, deliverable 3)", "",
             "Peer per case: FlashInfer's best path (the faster of `flashinfer-decode`, `flashinfer-tc`) where it "
             "runs and passes the gate, else `vllm-unified`. Ours: `hpcops-fp8q` on fp8 KV (the fp8 q our "
             "prologue emits), `hpcops` on bf16 KV. `× peer` = peer µs / our µs; target ≥ "
             f"{TARGET:.2f}×, ≥ {TARGET_STREAMING:.2f}× where the peer streams at ≥ {STREAMING_PCT:.0f} % of copy "
             "bandwidth.", "",
             "| case | GQA | d | page | KV | lengths | ours | µs | peer | µs | peer % copy BW | × peer | need | "
             "verdict |",
             "|---|---:|---:|---:|---|---|---|---:|---|---:|---:|---:|---:|---|"]
    for s in rows:
        p = s["params"]
        lines.append(f"| {s['case']} | {p.get('gqa')} | {p.get('d')} | {p.get('page')} | {p.get('kv')} | "
                     f"{p.get('lengths')} | {s['ours'] or '—'} | {f(s['ours_us'])} | {s['peer'] or '—'} | "
                     f"{f(s['peer_us'])} | {f(s['peer_pct_copy'], '{:.0f}%')} | {f(s['ratio'], '{:.2f}')} | "
                     f"{s['need']:.2f} | {s['verdict']} |")
    n = {v: sum(s["verdict"] == v for s in rows) for v in ("pass", "short", "—")}
    lines += ["", f"**{n['pass']} pass, {n['short']} short, {n['—']} without a verdict** of {len(rows)} cases."]
    for label, peers in (("FlashInfer", FLASHINFER), (VLLM, (VLLM,))):
        vals = [s["ratio"] for s in rows if s["ratio"] and s["peer"] in peers]
        if vals:
            lines.append(f"Against {label}: {len(vals)} cases, geomean {_geomean(vals):.2f}×, "
                         f"lowest {min(vals):.2f}×.")
    short = [s for s in rows if s["verdict"] == "short"]
    if short:
        lines += ["", "Short:", "", *[f"- {s['case']}: {s['ratio']:.2f}× {s['peer']} (need {s['need']:.2f})"
                                      for s in short]]
    fallback = [s for s in rows if s["peer"] == VLLM or s["verdict"] == "—"]
    if fallback:
        lines += ["", "Why not FlashInfer / why no verdict:", "",
                  *[f"- {s['case']}: {s['why']}" for s in fallback]]
    return "\n".join(lines) + "\n"


def plot(result, path) -> bool:
    """Peer time / our time per case (the counted rows), one bar each, coloured by the peer, grouped by the
    axis the case varies, with the 1.0 and 0.95 bars; a short case is hatched. False without matplotlib/data."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        return False
    rows = [s for s in summarize(result) if s["ratio"] is not None]
    if not rows:
        return False
    colors = {"flashinfer-decode": "tab:blue", "flashinfer-tc": "tab:cyan", VLLM: "tab:orange"}
    fig, ax = plt.subplots(figsize=(max(8, 0.28 * len(rows) + 2), 5.5))
    for i, s in enumerate(rows):
        ax.bar(i, s["ratio"], 0.8, color=colors.get(s["peer"], "tab:gray"), edgecolor="k", linewidth=0.4,
               hatch="//" if s["verdict"] == "short" else "")
        ax.text(i, s["ratio"], f"{s['ratio']:.2f}", ha="center", va="bottom", rotation=90, fontsize=5)
    for y, style in ((TARGET, "-"), (TARGET_STREAMING, ":")):
        ax.axhline(y, color="k", lw=0.8, ls=style)
    groups = [s["params"].get("group", "") for s in rows]
    for i in range(1, len(rows)):
        if groups[i] != groups[i - 1]:
            ax.axvline(i - 0.5, color="gray", lw=0.6)
    for g in dict.fromkeys(groups):
        idx = [i for i, x in enumerate(groups) if x == g]
        ax.text((idx[0] + idx[-1]) / 2, 1.0, g, transform=ax.get_xaxis_transform(), ha="center", va="bottom",
                fontsize=8)
    ax.set_yscale("log")
    lo, hi = min(s["ratio"] for s in rows), max(s["ratio"] for s in rows)
    ax.set_ylim(min(0.9, lo) / 1.1, max(1.1, hi) * 1.25)
    ticks = [t for t in (0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5, 2, 3, 4, 6, 8) if lo / 1.1 <= t <= hi * 1.25]
    ax.yaxis.set_major_locator(matplotlib.ticker.FixedLocator(ticks or [1.0]))
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([s["case"] for s in rows], rotation=70, ha="right", fontsize=6)
    ax.set_ylabel("peer time / hpcops time (> 1: hpcops faster)")
    ax.set_title(f"hpcops bench {result.suite} on {result.machine.get('gpu', '?')}: "
                 "hatched = short of the target (line: 1.0, dotted: 0.95)", fontsize=9, pad=16)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    ax.legend(handles, list(colors), fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
