"""Bench suite `layer`: one Hy3-shaped decoder layer at decode and at prefill, composed two ways (issue 11).

What a serving user gains per token: the same layer, the same random Hy3-shaped weights and the same
inputs, built from hpcops' ops and from what a vLLM user runs today, timed in the same process by the
same CUDA-graph method (`timing.graph_time_us`: layers with their own weights and KV cache, L2-cold).

Two phases, rows of the same suite: decode (`B<b>-<ctx>-<kv>-<rank>`: B requests, one new token each, over
their paged contexts; TPOT) and prefill (`prefill-<2K|8K|32K>-<kv>-<rank>`: one prompt of T tokens, the
whole layer at T rows, causal attention over the prompt's own paged KV; TTFT). T below is the layer's
tokens: B at decode, the prompt's length at prefill.

The layer, in order (one TP8 rank's attention: 8 q heads / 1 kv head, head_dim 128, page 64):
1. input RMSNorm and the QKV projection GEMM (torch, `shared`);
2. QK-RMSNorm then NeoX RoPE (Hy3's order) and the paged KV write of the new tokens;
3. attention over the paged cache: decode, or causal prefill of the prompt;
4. the o_proj GEMM and the residual (torch, `shared`);
5. post-attention RMSNorm, the fp32 router GEMM, `select_experts` (sigmoid, selection bias,
   renormalize × 2.826) (5a), the shared expert's MLP (`shared`: 5s), then the routed MoE and the
   residual (5b). The baseline's router is torch's fp32 GEMM (the cast, then the GEMM), hpcops' is
   `routing.route` (a split-K router GEMM on the fp32 weight whose partial logits the top-k kernel adds, as
   HPC-Ops has its own router GEMM). `select_experts` is hpcops' one-launch kernel on both sides: it stands in
   for the fused CUDA top-k vLLM runs there (the torch sequence it replaced was ~10 launches, ~20 µs of a decode
   layer's graph; the `router` suite times both). At T ≤ SHARED_STREAM_MAX_T (256, vLLM's
   `VLLM_SHARED_EXPERTS_STREAM_TOKEN_THRESHOLD` default: every decode row) the baseline runs step 5 on two
   streams, as vLLM's SharedFusedMoE does: the shared expert on an auxiliary CUDA stream beside
   `select_experts` and the routed experts; hpcops computes the shared expert inside its routed MoE's GEMM
   kernels (`fused_moe(shared_w13=, shared_w2=)`: its tiles first in both grids, one stream; `hp_step5`).
   Above it (prefill) both sides run it in line, torch's GEMMs.

Sides:
- `hpcops`: `rope_norm_store_kv` (fp8 KV: it also emits the fp8 query with per-token-head scales, which
  the attention reads, at both phases: the prefill suite's `hpcops-fp8q` path), `decode_attention` with its
  load-balanced plan (built once per model step, outside the graph: the `hpcops-plan` row, per step) or
  `prefill_attention` (no plan), `fused_moe` with the shared expert fused into its GEMM kernels at
  T ≤ SHARED_FUSED_MAX_T (above it, torch's shared expert added in its reduction). The `hpcops` row is the
  whole layer in one graph.
- `baseline`: torch QK-RMSNorm (FlashInfer has no QK-norm) + FlashInfer's
  `apply_rope_with_cos_sin_cache_inplace` + `append_paged_kv_cache` (fp8 KV: K/V cast in torch first),
  then at decode FlashInfer's `BatchDecodeWithPagedKVCacheWrapper` on its tensor-core path (the faster of its
  two paths at 8/1 heads in `bench/results/decode.md`), at prefill its `BatchPrefillWithPagedKVCacheWrapper`
  (causal; bf16 q, as vLLM's FlashInfer backend runs it on Hopper: backend auto for bf16 KV, FA2 for fp8 KV,
  whose FA3 templates do not build for bf16 q over fp8 KV, see the `prefill` suite); both planned outside
  the graph, on the host (not timed), in a 512 MiB workspace. vLLM's Triton
  `fused_experts` (vendored in `.peers/vllm_kernels`, configured as in the `moe` suite), the shared output
  and the residual added in torch. vLLM's CUDA helpers around its two `fused_moe_kernel` launches run here
  as pure-torch stand-ins, so the baseline's routed MoE is timed as those two kernels' device time
  (profiler: `baseline-moe-kernels`) plus an ALLOWANCE for the helpers (`_layer_report.allowance_us`):
  3 µs each for align (skipped by vLLM when T·k·4 ≤ E without EP), activation + quant, x-quant (fp8 only)
  and moe_sum, plus moe_sum's T·k·H·2 bytes at the measured copy bandwidth (the issue's allowance; at
  prefill's T the real helpers cost more than 3 µs each, so there it favours the baseline). Everything else
  of the baseline layer is one graph (`baseline-rest`); the `baseline` row = baseline-rest +
  baseline-moe-kernels + allowance (derived after the run by `finish`). At T ≤ 256 vLLM clones the MoE
  input on the main stream and runs the shared expert on its auxiliary stream: `baseline-rest` keeps the
  clone and leaves the shared expert out, and the derived row counts the longer of the routed MoE (kernels
  + allowance) and the shared expert alone (`shared:5s-shared-expert`), a perfect overlap that favours
  the baseline.
- `shared:*` rows: the torch steps both sides run identically, timed once.

Per-component rows (`<side>:<step>`) time each step alone with the same graph method, on inputs the
previous steps produced; `layer.components.md` puts them side by side with the whole layer and the model
(× `MODEL_LAYERS`: the decode step with its TPOT difference, the prompt's prefill with its TTFT
difference; embedding, LM head and sampling left out on both sides), `layer.stack.png` stacks them
(a panel per phase), `layer.summary.json` holds it all.

Variants: `fp8` = Hy3-FP8 as served (fp8 e4m3 KV with per-tensor scales, fp8 per-tensor MoE weights with
static activation scales); `bf16` = bf16 KV and MoE. The dense GEMMs (QKV, o_proj, router, shared expert)
are bf16 torch matmuls on both sides in both variants. Ranks: `tp8` (all 192 experts, I = 192) and `ep8`
(24 local experts of 192 through an expert_map, I = 1536); the attention is the TP8 slice in both, the
shared expert's MLP is TP-sharded (I = 1536 / 8) in both, as vLLM shards it. Tensor-parallel all-reduces
(after o_proj and after the MoE) are left out on both sides.

Layers per graph: decode as every suite (`timing.layers_for`, at least 8); prefill as few as keep L2 cold,
at least 2 (a prefill layer's MoE weights alone exceed L2, and at 32K a layer takes GBs and tens of ms).

Correctness gate (before any timing): the composed hpcops layer on layer 0's inputs, `CHECK_B` token rows
(`check_rows`: decode, the first requests; prefill, tokens spread over the prompt, the last included)
against a torch fp32 reference of the same layer (`reference_layer`: at prefill it computes the prompt's
K/V up to the last checked token and attends each checked token causally over them); the baseline layer
is checked the same way when its row is prepared (a disagreeing baseline is reported check-failed, never
ranked). The reference takes the expert choice (top-k ids) of the side it checks: near-ties of the sigmoid
scores flip under bf16 rounding, a discrete choice and not an accuracy question; at least 75 % of the
(token, slot) choices must agree with the reference's own.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from hpcops.bench.registry import Case, Impl, PeerUnavailable, flashinfer_workspace
from hpcops.bench.scenarios import DECODE_SCENARIOS, log_uniform_lens, parse_lengths
from hpcops.bench.suites import _moe_common as common
from hpcops.bench.suites.decode import K_SCALE, V_SCALE, make_decode_inputs
from hpcops.bench.suites.prefill import flashinfer_backend
from hpcops.bench.timing import layers_for

FP8 = torch.float8_e4m3fn
# Hy3 (research/hpcops.md §7; DESIGN.md "Reference model shapes")
HIDDEN = 4096
HQ, HKV, HEAD_DIM = 8, 1, 128  # one TP8 rank of 64 q / 8 kv heads
E_GLOBAL, TOP_K = 192, 8
INTER = {"tp8": 192, "ep8": 1536}
N_LOCAL = {"tp8": 192, "ep8": 24}
SHARED_INTER = 192  # the shared expert (width 1536) TP-sharded over 8 ranks, in both layouts
ROUTE_SCALE = 2.826
THETA = 11158840.0
EPS = 1e-5
PAGE = 64
# Hy3 has 80 decoder layers (research/hpcops.md §7: num_hidden_layers 80; layer 0 is dense, 1-79 MoE): a
# model step is reported as 80 x this MoE layer (+ the plan once), an approximation for the dense layer 0.
MODEL_LAYERS = 80
BATCHES = (1, 4, 16, 64, 256)
QUICK_BATCHES = (4, 64)
PROMPTS = (2048, 8192, 32768)  # prefill: one prompt of 2K, 8K, 32K tokens
QUICK_PROMPTS = (2048, 8192)
LOGMIX = (100, 100_000)  # the seeded log-uniform context mix, tokens
TABLE3_BATCHES = (32, 64)  # the blog's table-3 mixes of these sizes are added
# vLLM's SharedFusedMoE runs the shared expert on an auxiliary CUDA stream, beside the routed experts, for calls
# of at most this many tokens (its VLLM_SHARED_EXPERTS_STREAM_TOKEN_THRESHOLD default): every decode row here
SHARED_STREAM_MAX_T = 256
# hpcops computes the shared expert inside its routed MoE kernels at the same sizes (prefill: torch's GEMMs in line)
SHARED_FUSED_MAX_T = SHARED_STREAM_MAX_T
CHECK_B = 4  # rows of layer 0 checked against the fp32 reference (decode: the first; prefill: spread over the prompt)


@dataclass(frozen=True)
class Scenario(common.Hy3Rank):
    """One layer on one rank: a decode step of `b` requests, or (`prompt` > 0) the prefill of one prompt of
    `prompt` tokens. Also a `_moe_common.MoeShape` for the MoE part (T = b, or the prompt's tokens)."""

    b: int
    ctx: str  # decode: "u4K" | "logmix" | a length spec (the blog's table-3 mixes); prefill: ""
    kv: str  # "fp8" | "bf16"
    layout: str  # "tp8" | "ep8"
    prompt: int = 0  # prefill: the prompt's tokens (b = 1); 0: a decode step

    @property
    def prefill(self) -> bool:
        return self.prompt > 0

    @property
    def name(self) -> str:
        if self.prefill:
            return f"prefill-{self.prompt // 1024}K-{self.kv}-{self.layout}"
        return f"B{self.b}-{self.ctx}-{self.kv}-{self.layout}"

    @property
    def lens(self) -> list[int]:
        """KV lengths after this step (including the new tokens)."""
        return [self.prompt] if self.prefill else context_lens(self.ctx, self.b)

    @property
    def t(self) -> int:
        return self.prompt or self.b

    @property
    def kind(self) -> str:
        return "fp8_tensor" if self.kv == "fp8" else "none"


def context_lens(ctx: str, b: int) -> list[int]:
    """KV lengths (including the new token) of a batch: uniform 4K, the seeded log-uniform mix, or a spec."""
    if ctx == "u4K":
        return [4096] * b
    if ctx == "logmix":
        return log_uniform_lens(b, *LOGMIX, seed=1234 + b)
    lens = parse_lengths(ctx)
    if len(lens) != b:
        raise ValueError(f"context spec {ctx!r} has {len(lens)} requests, not B = {b}")
    return lens


def scenarios(quick: bool = False) -> list[Scenario]:
    """Decode: B × context × KV × rank, the table-3 mixes of B = 32 and 64 (uniform 64x4K is the u4K row);
    then prefill: prompt × KV × rank. Quick (12 cases, for a few minutes on one GPU): B 4 and 64 at u4K on
    both ranks, prompts of 2K and 8K on the TP8 rank (EP8 changes only the MoE's shape, which the decode rows
    cover); both KV dtypes throughout."""
    if quick:
        ctxs = [(b, "u4K") for b in QUICK_BATCHES]
    else:
        ctxs = [(b, c) for b in BATCHES for c in ("u4K", "logmix")]
        for spec in DECODE_SCENARIOS:
            n = len(parse_lengths(spec))
            if n in TABLE3_BATCHES and set(parse_lengths(spec)) != {4096}:
                ctxs.append((n, spec))
    ranks = [(kv, lay) for kv in ("fp8", "bf16") for lay in ("tp8", "ep8")]
    return ([Scenario(b, c, kv, lay) for kv, lay in ranks for b, c in ctxs]
            + [Scenario(1, "", kv, lay, p) for kv, lay in ranks for p in (QUICK_PROMPTS if quick else PROMPTS)
               if not (quick and lay == "ep8")])


# ---------------------------------------------------------------------------------------------- inputs

_COS_SIN: dict[tuple[str, int], torch.Tensor] = {}


def cos_sin_cache(max_pos: int, device: str) -> torch.Tensor:
    """[n, HEAD_DIM] fp32, n the power of 2 ≥ max_pos: cos | sin of NeoX RoPE at theta 11158840 (all layers)."""
    n = 1 << max(10, (max_pos - 1).bit_length())
    key = (str(device), n)
    if key not in _COS_SIN:
        inv = 1.0 / THETA ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)
        f = torch.outer(torch.arange(n, dtype=torch.float64), inv)
        _COS_SIN.clear()  # one size at a time
        _COS_SIN[key] = torch.cat([f.cos(), f.sin()], dim=-1).float().to(device)
    return _COS_SIN[key]


def make_inputs(s: Scenario, layer: int, device: str = "cuda") -> dict[str, Any]:
    """One layer's weights (seeded by `layer`), its paged KV cache (decode: holding the context), the new
    tokens' positions and slots, the residual stream `hidden` [T, H] bf16 (T = B, or the prompt's tokens),
    and FlashInfer's page metadata."""
    H, d, t = HIDDEN, HEAD_DIM, s.t
    lens = s.lens
    kv = make_decode_inputs(lens, HQ, HKV, s.kv == "fp8", seed=layer, device=device)
    g = torch.Generator(device=device).manual_seed(50_000 + layer)
    rn = lambda *shape, std=1.0: torch.randn(*shape, generator=g, device=device) * std
    bf = lambda t: t.to(torch.bfloat16)
    w13, w2, quant = common.weights(s, layer, device)
    emap = None
    if s.ep:
        emap = torch.full((E_GLOBAL,), -1, dtype=torch.int32)
        emap[: s.e_local] = torch.arange(s.e_local, dtype=torch.int32)
        emap = emap.to(device)
    seq_lens = kv["seq_lens"]
    if s.prefill:  # the prompt's tokens 0..T-1 of request 0 (its cache holds random values they overwrite)
        req, pos = torch.zeros(t, dtype=torch.long, device=device), torch.arange(t, device=device)
    else:  # one new token per request, at the end of its context
        req, pos = torch.arange(s.b, device=device), (seq_lens - 1).long()
    table = kv["block_table"]
    slots = table.long()[req, pos // PAGE] * PAGE + pos % PAGE
    nblk = (seq_lens + PAGE - 1) // PAGE
    indptr = torch.zeros(s.b + 1, dtype=torch.int32, device=device)
    indptr[1:] = torch.cumsum(nblk, 0)
    cols = torch.arange(table.shape[1], device=device)[None, :]
    x = {
        "layer": layer, "b": s.b, "prefill": s.prefill,
        "hidden": bf(rn(t, H)),
        "w_in": bf(1 + 0.1 * rn(H)), "w_post": bf(1 + 0.1 * rn(H)),
        "w_qkv": bf(rn((HQ + 2 * HKV) * d, H, std=H ** -0.5)),
        "q_norm": bf(1 + 0.1 * rn(d)), "k_norm": bf(1 + 0.1 * rn(d)),
        "w_o": bf(rn(H, HQ * d, std=(HQ * d) ** -0.5)),
        "w_router": rn(E_GLOBAL, H, std=H ** -0.5), "router_bias": 0.1 * rn(E_GLOBAL),
        "ws13": bf(rn(2 * SHARED_INTER, H, std=H ** -0.5)), "ws2": bf(rn(H, SHARED_INTER, std=SHARED_INTER ** -0.5)),
        "w13": w13, "w2": w2, "quant": quant, "emap": emap,
        "k_cache": kv["k_cache"], "v_cache": kv["v_cache"], "packed": kv["packed"],
        "k_scale": kv["k_scale"], "v_scale": kv["v_scale"], "block_table": table, "seq_lens": seq_lens,
        "max_seq_len": max(lens), "positions": pos, "slot_mapping": slots, "cos_sin": cos_sin_cache(max(lens), device),
        "q_out": torch.empty((t, HQ, d), dtype=FP8 if s.kv == "fp8" else torch.bfloat16, device=device),
        "attn_out": torch.empty((t, HQ, d), dtype=torch.bfloat16, device=device),
        "moe_out": torch.empty((t, H), dtype=torch.bfloat16, device=device),
        # prefill_attention's query layout: one request of T rows
        "cu_q": torch.tensor([0, t], dtype=torch.int32, device=device), "max_q": t,
        # FlashInfer's page metadata for the same cache
        "fi_indptr": indptr, "fi_indices": table[cols < nblk[:, None]].contiguous(),
        "fi_last": (seq_lens - (nblk - 1) * PAGE).to(torch.int32),
        "fi_batch": req.to(torch.int32), "fi_pos": pos.to(torch.int32),
    }
    return x


def nbytes(s: Scenario) -> int:
    """Minimum traffic of one layer: KV read (prefill: the prompt's, written once), dense weights (bf16), the
    MoE weights the routing touches and its activations."""
    kv_elem = 1 if s.kv == "fp8" else 2
    kv = sum(s.lens) * HKV * HEAD_DIM * 2 * kv_elem
    dense = 2 * HIDDEN * ((HQ + 2 * HKV) * HEAD_DIM + HQ * HEAD_DIM + 3 * SHARED_INTER) + 4 * HIDDEN * E_GLOBAL
    return kv + dense + common.traffic(s)[0]


# ---------------------------------------------------------------------------------------------- steps

def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), w.float(), EPS).to(x.dtype)


def step1_norm_qkv(x: dict[str, Any], hidden: torch.Tensor) -> torch.Tensor:
    """[T, H] → qkv [T, (Hq + 2 Hkv)·D] bf16."""
    return _rms(hidden, x["w_in"]) @ x["w_qkv"].t()


def step4_oproj_residual(x: dict[str, Any], hidden: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    return hidden + attn.reshape(hidden.shape[0], -1) @ x["w_o"].t()


def router_logits(x: dict[str, Any], h2: torch.Tensor) -> torch.Tensor:
    """The fp32 router GEMM → [T, E] fp32."""
    return h2.float() @ x["w_router"].t()


def step5a_router(x: dict[str, Any], h1: torch.Tensor):
    """→ (h2 [T, H] bf16 MoE input, router logits fp32 [T, E]): the post-attention norm, the fp32 router GEMM."""
    h2 = _rms(h1, x["w_post"])
    return h2, router_logits(x, h2)


def step5a_select(x: dict[str, Any], logits: torch.Tensor):
    """`select_experts` (sigmoid, selection bias, renormalize × ROUTE_SCALE) → (weights fp32, ids int32)."""
    from hpcops.moe.routing import select_experts

    return select_experts(logits, TOP_K, scoring="sigmoid", bias=x["router_bias"], scale=ROUTE_SCALE)


def shared_expert(x: dict[str, Any], h2: torch.Tensor) -> torch.Tensor:
    """The shared expert's MLP (TP-sharded, bf16 torch GEMMs on both sides) → [T, H] bf16."""
    gu = h2 @ x["ws13"].t()
    return (torch.nn.functional.silu(gu[:, :SHARED_INTER]) * gu[:, SHARED_INTER:]) @ x["ws2"].t()


def hp_route(x: dict[str, Any], h2: torch.Tensor):
    """hpcops' router: `routing.route` (the fp32 router GEMM as a split-K kernel whose partial logits the top-k
    kernel adds: two launches) → (weights fp32, ids int32)."""
    from hpcops.moe.routing import route

    return route(h2, x["w_router"], TOP_K, scoring="sigmoid", bias=x["router_bias"], scale=ROUTE_SCALE)


def step5a_router_shared(x: dict[str, Any], h1: torch.Tensor):
    """Step 5a in one stream → (h2, topk weights, topk ids, shared expert output)."""
    h2, logits = step5a_router(x, h1)
    tw, ids = step5a_select(x, logits)
    return h2, tw, ids, shared_expert(x, h2)


def shared_on_aux_stream(t: int, device: torch.device) -> bool:
    """Whether a layer of `t` tokens runs its shared expert on the auxiliary stream (both sides, as vLLM)."""
    return device.type == "cuda" and t <= SHARED_STREAM_MAX_T


_AUX: dict[torch.device, torch.cuda.Stream] = {}


def _aux(device: torch.device) -> torch.cuda.Stream:
    """One auxiliary stream a device (at the default priority, as vLLM's `aux_stream()`: a higher one made no
    difference in a captured graph, `bench/results/probe_shared_overlap_cfdfcf9.md`)."""
    if device not in _AUX:
        _AUX[device] = torch.cuda.Stream(device)
    return _AUX[device]


def fork_shared_expert(x: dict[str, Any], h2: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event]:
    """The shared expert on this device's auxiliary stream, after what the current stream has queued (h2): → (its
    output, the event recorded after it). The caller joins the stream (`join_aux`) before it ends a graph capture;
    h2 and the output are marked used on the other stream for the caching allocator."""
    main, aux = torch.cuda.current_stream(h2.device), _aux(h2.device)
    aux.wait_stream(main)
    with torch.cuda.stream(aux):
        shared = shared_expert(x, h2)
        ready = torch.cuda.Event()
        ready.record(aux)
    h2.record_stream(aux)
    shared.record_stream(main)
    return shared, ready


def join_aux(device: torch.device) -> None:
    torch.cuda.current_stream(device).wait_stream(_aux(device))


def _hp_rope(s: Scenario, x: dict[str, Any], qkv: torch.Tensor):
    from hpcops.rope.prologue import rope_norm_store_kv

    fp8 = s.kv == "fp8"
    return rope_norm_store_kv(qkv, x["positions"], x["cos_sin"], x["k_cache"], x["v_cache"], x["slot_mapping"],
                              num_q_heads=HQ, num_kv_heads=HKV, head_dim=HEAD_DIM, q_norm_weight=x["q_norm"],
                              k_norm_weight=x["k_norm"], eps=EPS, order="norm_rope", style="neox",
                              k_scale=x["k_scale"] if fp8 else None, v_scale=x["v_scale"] if fp8 else None,
                              quantize_q=fp8, q_out=x["q_out"])


def _hp_attn(x: dict[str, Any], q: torch.Tensor, q_scale, plan) -> torch.Tensor:
    """`decode_attention` with its plan, or (prefill) `prefill_attention` of the prompt over its own KV."""
    from hpcops.attention.decode import decode_attention
    from hpcops.attention.prefill import prefill_attention

    kw = dict(k_scale=x["k_scale"], v_scale=x["v_scale"], q_scale=q_scale, out=x["attn_out"])
    if x["prefill"]:
        return prefill_attention(q, x["k_cache"], x["v_cache"], x["block_table"], x["seq_lens"], x["cu_q"],
                                 max_seqlen_q=x["max_q"], **kw)
    return decode_attention(q, x["k_cache"], x["v_cache"], x["block_table"], x["seq_lens"], plan=plan, **kw)


def _hp_moe(s: Scenario, x: dict[str, Any], h1, h2, tw, ids, shared, shared_ready=None,
            fused: bool = False) -> torch.Tensor:
    """The routed MoE + the shared expert (its output `shared` added in the reduction, or with `fused` computed
    in the MoE's GEMM kernels) + the residual."""
    from hpcops.moe.fused_moe import fused_moe

    if "moe_cfg" not in x:
        x["moe_cfg"] = common.config_for(s, h2.device).with_(validate_ids=False)
    sw = dict(shared_w13=x["ws13"], shared_w2=x["ws2"]) if fused else {}
    y = fused_moe(h2, x["w13"], x["w2"], tw, ids, quant=x["quant"], expert_map=x["emap"], shared_output=shared,
                  shared_ready=shared_ready, out=x["moe_out"], config=x["moe_cfg"], **sw)
    return h1 + y


def plan_for(x: dict[str, Any]):
    """The decode plan of the step (None at prefill: `prefill_attention` has none)."""
    from hpcops.attention.plan import plan_decode

    if x["prefill"]:
        return None
    # what the step's decode takes (the prologue's fp8 q over an fp8 cache: the Gluon kernel on an H200)
    return plan_decode(x["seq_lens"], num_kv_heads=HKV, block_size=PAGE, num_q_heads=HQ, head_dim=x["q_out"].shape[-1],
                       q_dtype=x["q_out"].dtype, kv_dtype=x["k_cache"].dtype, max_seq_len=x["max_seq_len"])


SHARED_MODES = ("fused", "aux", "inline")


def shared_mode_for(t: int) -> str:
    """hpcops' shared expert at `t` tokens: fused into the routed MoE's kernels up to SHARED_FUSED_MAX_T, else in
    line (torch's GEMMs)."""
    return "fused" if t <= SHARED_FUSED_MAX_T else "inline"


def hp_step5(s: Scenario, x: dict[str, Any], h1: torch.Tensor, trace: dict | None = None,
             shared_mode: str | None = None) -> torch.Tensor:
    """hpcops' step 5 (post-attention norm, router GEMM, select_experts, shared expert, routed MoE + residual) →
    [T, H] bf16. `shared_mode` (default `shared_mode_for(T)`):
    - "fused": the shared expert computed in the routed MoE's GEMM kernels (`fused_moe(shared_w13=, shared_w2=)`),
      its tiles first in both grids: one stream, its 4.7 MB of weights read beside the routed experts';
    - "aux": torch's shared expert on the auxiliary stream (GPU only), forked before the router GEMM (1-7 µs a layer
      better than after it, probe_shared_overlap_cfdfcf9.md), the MoE's reduction alone waiting for it: hid about
      half of its 14-16 µs (the router GEMM and select_experts beside it instead were level, within 0.5 µs a
      layer in 9 cases, probe_shared_overlap.md at a1c8305);
    - "inline": torch's shared expert, then the routed MoE adding its output."""
    mode = shared_mode or shared_mode_for(s.t)
    if mode not in SHARED_MODES:
        raise ValueError(f"shared_mode must be one of {SHARED_MODES}, got {mode!r}")
    h2 = _rms(h1, x["w_post"])
    shared, ready = fork_shared_expert(x, h2) if mode == "aux" else (None, None)
    tw, ids = hp_route(x, h2)
    if mode == "inline":
        shared = shared_expert(x, h2)
    if trace is not None:
        trace["ids"] = ids
    y = _hp_moe(s, x, h1, h2, tw, ids, shared, ready, fused=mode == "fused")
    if mode == "aux":
        join_aux(h1.device)
    return y


def hpcops_layer(s: Scenario, x: dict[str, Any], plan, hidden: torch.Tensor, trace: dict | None = None):
    """The whole hpcops layer: [T, H] bf16 → [T, H] bf16 (`trace` collects the expert choice)."""
    qkv = step1_norm_qkv(x, hidden)
    q, qs = _hp_rope(s, x, qkv)
    attn = _hp_attn(x, q, qs, plan)
    h1 = step4_oproj_residual(x, hidden, attn)
    return hp_step5(s, x, h1, trace)


# baseline

def _flashinfer():
    try:
        import flashinfer
    except Exception as exc:  # noqa: BLE001 - any import failure means the peer is absent
        raise PeerUnavailable(f"flashinfer not importable: {type(exc).__name__}: {exc}"[:200]) from exc
    return flashinfer


def _fi_wrapper(x: dict[str, Any]):
    """FlashInfer's decode (or prefill) wrapper for this layer's cache, planned (host side, outside the graph).
    All layers share one float workspace (`flashinfer_workspace`)."""
    fi = _flashinfer()
    dev = x["hidden"].device
    ws = flashinfer_workspace(dev)
    if x["prefill"]:  # bf16 q like attn_out; FA2 over an fp8 cache (see the prefill suite)
        w = fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=flashinfer_backend(x["attn_out"],
                                                                                         x["k_cache"]))
        w.plan(x["cu_q"], x["fi_indptr"], x["fi_indices"], x["fi_last"], HQ, HKV, HEAD_DIM, PAGE, causal=True,
               q_data_type=torch.bfloat16, kv_data_type=x["k_cache"].dtype)
        return w
    w = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_cuda_graph=True, use_tensor_cores=True,
                                              paged_kv_indptr_buffer=x["fi_indptr"],
                                              paged_kv_indices_buffer=x["fi_indices"],
                                              paged_kv_last_page_len_buffer=x["fi_last"])
    w.plan(x["fi_indptr"], x["fi_indices"], x["fi_last"], HQ, HKV, HEAD_DIM, PAGE, q_data_type=torch.bfloat16,
           kv_data_type=x["k_cache"].dtype)
    return w


def _bl_rope(s: Scenario, x: dict[str, Any], qkv: torch.Tensor) -> torch.Tensor:
    """Torch QK-RMSNorm, FlashInfer RoPE in place on the normed q/k, FlashInfer paged append → q bf16."""
    fi = _flashinfer()
    b, d = qkv.shape[0], HEAD_DIM
    q = _rms(qkv[:, : HQ * d].reshape(b, HQ, d), x["q_norm"]).reshape(b, HQ * d)
    k = _rms(qkv[:, HQ * d: (HQ + HKV) * d].reshape(b, HKV, d), x["k_norm"]).reshape(b, HKV * d)
    v = qkv[:, (HQ + HKV) * d:].reshape(b, HKV, d)
    fi.rope.apply_rope_with_cos_sin_cache_inplace(x["positions"], q, k, d, x["cos_sin"], is_neox=True)
    kk = k.view(b, HKV, d)
    if s.kv == "fp8":
        kk = (kk.float() / x["k_scale"]).clamp(-448, 448).to(FP8)
        v = (v.float() / x["v_scale"]).clamp(-448, 448).to(FP8)
    fi.page.append_paged_kv_cache(kk, v, x["fi_batch"], x["fi_pos"], (x["k_cache"], x["v_cache"]),
                                  x["fi_indices"], x["fi_indptr"], x["fi_last"], kv_layout="NHD")
    return q.view(b, HQ, d)


def _bl_attn(s: Scenario, x: dict[str, Any], wrapper, q: torch.Tensor) -> torch.Tensor:
    kw = dict(k_scale=K_SCALE, v_scale=V_SCALE) if s.kv == "fp8" else {}
    return wrapper.run(q, (x["k_cache"], x["v_cache"]), out=x["attn_out"], **kw)


def _bl_experts(s: Scenario, x: dict[str, Any]):
    """vLLM's Triton fused_experts as the `moe` suite configures it: (h2, tw, ids) → routed output bf16."""
    fm, cfg = common.vllm_modules()
    qc = common.vllm_quant_config(s, x["quant"], cfg)
    kw = {"global_num_experts": E_GLOBAL, "expert_map": x["emap"], "quant_config": qc}
    return lambda h2, tw, ids: fm.fused_experts(h2, x["w13"], x["w2"], tw, ids, **kw)


def baseline_layer(s: Scenario, x: dict[str, Any], wrapper, experts, hidden, trace: dict | None = None,
                   routed: torch.Tensor | None = None, shared: torch.Tensor | None = None):
    """The whole baseline layer; with `routed` given, that tensor stands for vLLM's routed output (the
    `baseline-rest` graph, whose routed MoE is timed by its kernels), and with `shared` given (at most
    SHARED_STREAM_MAX_T tokens) that tensor stands for the shared expert vLLM runs on its auxiliary stream
    (hidden under the routed MoE: `_layer_report.derived_baseline` counts the longer of the two)."""
    qkv = step1_norm_qkv(x, hidden)
    q = _bl_rope(s, x, qkv)
    attn = _bl_attn(s, x, wrapper, q)
    h1 = step4_oproj_residual(x, hidden, attn)
    ready = None
    if not shared_on_aux_stream(s.t, h1.device):
        h2, tw, ids, sh = step5a_router_shared(x, h1)
    else:  # vLLM's SharedFusedMoE: hidden_states cloned on the main stream, the shared expert on the aux stream
        h2, logits = step5a_router(x, h1)
        hc = h2.clone()
        sh, ready = fork_shared_expert(x, hc) if shared is None else (shared, None)
        tw, ids = step5a_select(x, logits)
    if trace is not None:
        trace.update(ids=ids, h2=h2, tw=tw)
    y = experts(h2, tw, ids) if routed is None else routed
    if ready is not None:
        join_aux(h1.device)
    return h1 + (y + sh)


# ---------------------------------------------------------------------------------------------- the gate

def check_rows(s: Scenario) -> list[int]:
    """The token rows the gate checks: decode, the first CHECK_B requests; prefill, CHECK_B tokens spread over
    the prompt from the first to the last (which attends to all of it)."""
    if s.prefill:
        return sorted({round(i * (s.t - 1) / (CHECK_B - 1)) for i in range(CHECK_B)})
    return list(range(min(CHECK_B, s.b)))


def reference_layer(s: Scenario, x: dict[str, Any], rows: list[int], ids: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 torch reference of token rows `rows` of the layer (n of them), with the expert choice `ids`
    [n, k] of the side it checks → (output fp32 [n, H], the reference's own top-k ids). Writes the new K/V of
    those rows (prefill: of the prompt up to the last of them, which they attend to)."""
    from hpcops.attention.reference import decode_attention
    from hpcops.moe.reference import fused_moe
    from hpcops.moe.reference import select_experts as ref_select
    from hpcops.rope.reference import rope_norm_store_kv

    f = lambda t: t.float()
    rms = lambda v, w: torch.nn.functional.rms_norm(v, (v.shape[-1],), f(w), EPS)
    n, dev = len(rows), x["hidden"].device
    idx = torch.tensor(rows, device=dev)
    kv_rows = torch.arange(max(rows) + 1, device=dev) if x["prefill"] else idx
    qkv = rms(f(x["hidden"][kv_rows]), x["w_in"]) @ f(x["w_qkv"]).t()
    fp8 = s.kv == "fp8"
    q, _ = rope_norm_store_kv(qkv, x["positions"][kv_rows], x["cos_sin"], x["k_cache"], x["v_cache"],
                              x["slot_mapping"][kv_rows], num_q_heads=HQ, num_kv_heads=HKV, head_dim=HEAD_DIM,
                              q_norm_weight=x["q_norm"], k_norm_weight=x["k_norm"], eps=EPS, order="norm_rope",
                              style="neox", k_scale=x["k_scale"] if fp8 else None,
                              v_scale=x["v_scale"] if fp8 else None)
    if x["prefill"]:
        q = q[idx]
    # each checked token as a request of one query over its keys [0, position]: causal attention
    attn = decode_attention(q, x["k_cache"], x["v_cache"], x["block_table"][x["fi_batch"][idx].long()],
                            (x["positions"][idx] + 1).to(torch.int32), k_scale=x["k_scale"], v_scale=x["v_scale"])
    hidden = f(x["hidden"][idx])
    h1 = hidden + attn.float().reshape(n, -1) @ f(x["w_o"]).t()
    h2 = rms(h1, x["w_post"])
    logits = h2 @ x["w_router"].float().t()
    _, own_ids = ref_select(logits, TOP_K, scoring="sigmoid", bias=x["router_bias"], scale=ROUTE_SCALE)
    w = torch.sigmoid(logits).gather(1, ids.long())
    tw = w / w.sum(-1, keepdim=True) * ROUTE_SCALE
    gu = h2 @ f(x["ws13"]).t()
    shared = (torch.nn.functional.silu(gu[:, :SHARED_INTER]) * gu[:, SHARED_INTER:]) @ f(x["ws2"]).t()
    routed = fused_moe(h2, x["w13"], x["w2"], tw, ids, quant=x["quant"], expert_map=x["emap"])
    return h1 + routed.float() + shared, own_ids


def assert_layer_matches(s: Scenario, x: dict[str, Any], got: torch.Tensor, ids: torch.Tensor, name: str) -> None:
    """`got` [T, H]: its `check_rows` against the fp32 reference (the layer's update `out - hidden`)."""
    from hpcops.testing import assert_close

    rows = check_rows(s)
    idx = torch.tensor(rows, device=got.device)
    want, own = reference_layer(s, x, rows, ids[idx])
    agree = sum(len(set(a) & set(b)) for a, b in zip(own.tolist(), ids[idx].tolist())) / (len(rows) * TOP_K)
    if agree < 0.75:
        raise AssertionError(f"{name}: only {agree:.0%} of the expert choices agree with the fp32 router")
    base = x["hidden"][idx].float()
    dw, dg = (want - base).double(), (got[idx].float() - base).double()
    cos = torch.nn.functional.cosine_similarity(dw.flatten(), dg.flatten(), dim=0).item()
    if not cos > 0.995:
        raise AssertionError(f"{name}: cosine similarity {cos:.5f} of the layer update to the reference")
    # bf16 activations between the steps (qkv, q, attention out, h1, h2, the MoE's bf16 expert outputs) against
    # fp32 throughout; fp8: the query quantized per token-head (the reference attends with the fp32 query)
    # and the fp8 activations of the MoE flip by an ulp where the bf16 and fp32 inputs round differently
    # (measured at the CPU tests' shapes: 0.7 % max / 0.6 % RMS bf16, 2.4 % / 2.3 % fp8)
    tol = {"fp8": (1e-1, 5e-2), "bf16": (4e-2, 1.5e-2)}[s.kv]
    assert_close(dw, dg, name=f"{name} layer update", maxtol=tol[0], rmstol=tol[1])


def check(s: Scenario):
    def run(x):
        trace: dict[str, Any] = {}
        x["moe_out"].fill_(float("nan"))
        got = hpcops_layer(s, x, plan_for(x), x["hidden"], trace)
        assert_layer_matches(s, x, got, trace["ids"], "hpcops")
    return run


# ---------------------------------------------------------------------------------------------- rows

def _materialize(s: Scenario, x: dict[str, Any]) -> dict[str, Any]:
    """Run the hpcops chain once eagerly and keep every step's input, for the per-component rows."""
    if "m" not in x:
        plan = plan_for(x)
        m = {"plan": plan, "qkv": step1_norm_qkv(x, x["hidden"])}
        m["q"], m["qs"] = _hp_rope(s, x, m["qkv"])
        m["attn"] = _hp_attn(x, m["q"], m["qs"], plan).clone()
        m["h1"] = step4_oproj_residual(x, x["hidden"], m["attn"])
        m["h2"], m["tw"], m["ids"], m["shared"] = step5a_router_shared(x, m["h1"])
        x["m"] = m
    return x["m"]


def impl_hpcops(s: Scenario):
    def prepare(x):
        plan = plan_for(x)
        return lambda: hpcops_layer(s, x, plan, x["hidden"])
    return prepare


def impl_plan(x):
    from hpcops.attention.plan import plan_decode

    plan = plan_for(x)
    return lambda: plan_decode(x["seq_lens"], num_kv_heads=HKV, block_size=PAGE, out=plan)


def impl_baseline_rest(s: Scenario):
    def prepare(x):
        wrapper, experts = _fi_wrapper(x), _bl_experts(s, x)
        trace: dict[str, Any] = {}
        got = baseline_layer(s, x, wrapper, experts, x["hidden"], trace)  # eager, vLLM's stand-ins included
        if x["layer"] == 0:
            assert_layer_matches(s, x, got, trace["ids"], "baseline")
        routed = experts(trace["h2"], trace["tw"], trace["ids"])
        shared = shared_expert(x, trace["h2"]) if shared_on_aux_stream(s.t, routed.device) else None
        return lambda: baseline_layer(s, x, wrapper, experts, x["hidden"], routed=routed, shared=shared)
    return prepare


def impl_baseline_moe_kernels(s: Scenario):
    def prepare(x):
        experts = _bl_experts(s, x)
        m = _materialize(s, x)
        return lambda: experts(m["h2"], m["tw"], m["ids"])
    return prepare


def impl_component(s: Scenario, step: str):
    """One step alone, on the inputs the previous steps produced (the hpcops chain's; the baseline's q)."""
    def prepare(x):
        m = _materialize(s, x)
        if step == "shared:1-norm-qkv":
            return lambda: step1_norm_qkv(x, x["hidden"])
        if step == "hpcops:2-rope-kv":
            return lambda: _hp_rope(s, x, m["qkv"])
        if step == "hpcops:3-attention":
            return lambda: _hp_attn(x, m["q"], m["qs"], m["plan"])
        if step == "shared:4-oproj-residual":
            return lambda: step4_oproj_residual(x, x["hidden"], m["attn"])
        if step == "hpcops:5a-norm-route":
            return lambda: hp_route(x, _rms(m["h1"], x["w_post"]))
        if step == "baseline:5a-norm-router-select":
            return lambda: step5a_select(x, step5a_router(x, m["h1"])[1])
        if step == "shared:5s-shared-expert":
            return lambda: shared_expert(x, m["h2"])
        if step == "hpcops:5b-moe":  # with the shared expert where hpcops fuses it
            if shared_mode_for(s.t) == "fused":
                return lambda: _hp_moe(s, x, m["h1"], m["h2"], m["tw"], m["ids"], None, fused=True)
            return lambda: _hp_moe(s, x, m["h1"], m["h2"], m["tw"], m["ids"], m["shared"])
        if step == "baseline:2-rope-kv":
            return lambda: _bl_rope(s, x, m["qkv"])
        if step == "baseline:3-attention":
            wrapper = _fi_wrapper(x)
            qb = _bl_rope(s, x, m["qkv"])
            return lambda: _bl_attn(s, x, wrapper, qb)
        if step == "baseline:5c-combine":
            routed = torch.randn_like(m["shared"])
            return lambda: m["h1"] + (routed + m["shared"])
        raise ValueError(f"unknown layer component {step!r}")
    return prepare


COMPONENTS = ("shared:1-norm-qkv", "hpcops:2-rope-kv", "baseline:2-rope-kv", "hpcops:3-attention",
              "baseline:3-attention", "shared:4-oproj-residual", "hpcops:5a-norm-route",
              "baseline:5a-norm-router-select",
              "shared:5s-shared-expert", "hpcops:5b-moe", "baseline:5c-combine")


PREFILL_MIN_LAYERS = 2  # a prefill layer's MoE weights alone exceed L2 (≥ 450 MB): two layers are L2-cold


def case_for(s: Scenario) -> Case:
    """One scenario's rows. Prefill: no plan row, and as few layers per graph as keep L2 cold (`layers_for`
    from the layer's bytes, at least PREFILL_MIN_LAYERS) instead of the default minimum of 8: at 32K tokens
    a layer's inputs and intermediates take GBs and tens of ms."""
    params = {"phase": "prefill" if s.prefill else "decode", "B": s.b, "T": s.t, "ctx": s.ctx, "prompt": s.prompt,
              "kv": s.kv, "layout": s.layout, "hq": HQ, "hkv": HKV, "d": HEAD_DIM, "H": HIDDEN,
              "E_global": E_GLOBAL, "E_local": s.e_local, "I": s.inter, "shared_I": SHARED_INTER, "top_k": TOP_K,
              "moe_quant": s.kind, "model_layers": MODEL_LAYERS, "kv_tokens": sum(s.lens),
              "shared_stream": s.t <= SHARED_STREAM_MAX_T, "shared_fused": shared_mode_for(s.t) == "fused"}
    attn = "prefill (BatchPrefillWithPagedKVCacheWrapper)" if s.prefill else "decode"
    impls = [Impl("hpcops", impl_hpcops(s), ours=True, note="whole layer, one graph"),
             *([] if s.prefill else [Impl("hpcops-plan", impl_plan, ours=True, per_step=True)]),
             Impl("baseline-rest", impl_baseline_rest(s),
                  note=f"baseline layer without vLLM's routed experts (graph; at T <= {SHARED_STREAM_MAX_T} also "
                       "without the shared expert, which vLLM runs on an auxiliary stream); FlashInfer "
                       f"rope/append/{attn}"),
             Impl("baseline-moe-kernels", impl_baseline_moe_kernels(s), timing="kernels",
                  kernel_filter=common.VLLM_KERNEL, note=common.VLLM_NOTE),
             *[Impl(c, impl_component(s, c), note="component") for c in COMPONENTS]]
    nb = nbytes(s)
    return Case(suite="layer", name=s.name, make_inputs=lambda layer, device="cuda", s=s: make_inputs(s, layer, device),
                impls=impls, check=check(s), bytes=nb, params=params,
                layers=layers_for(nb, minimum=PREFILL_MIN_LAYERS) if s.prefill else None,
                command=f"hpcops bench layer --only {s.name}")


def cases(opts: dict[str, Any]) -> Iterator[Case]:
    for s in scenarios(bool(opts.get("quick"))):
        c = case_for(s)
        if opts.get("layers"):  # `--layers` wins over the prefill rows' own count
            c.layers = None
        yield c


def finish(result, out_dir):
    """After a run (and after every case): the derived `baseline` rows, `layer.components.md`, `layer.stack.png`."""
    from hpcops.bench.suites import _layer_report

    return _layer_report.finish(result, out_dir)
