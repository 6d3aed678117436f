"""Bench suite `moe`: the fused MoE layer on Hy3 shapes (the blog's tables 1/2).

TP8/EP1: E 192, top-8, H 4096, I 192, batches 4…16384. TP1/EP8: 24 local experts of 192 (expert_map),
I 1536, batches 4…2048. Uniform random routing (distinct experts per token), a shared-expert output
added in the reduction. Variants: fp8 per-tensor with static activation scales (the main figure, `fp8t`), fp8
per-tensor weights with dynamic per-token activation scales (`fp8d`: TP8 B 64 / 2048 / 16384, EP8 B 2048; the
GEMMs add their fp8 MMA sums into fp32 every 128 products there, `MoeConfig.fp8_promote`), fp8 128×128 blocks (EP8
only: block quantization needs I % 128 == 0 and Hy3 TP8 has I = 192), bf16.
Each layer has its own weights (L2-cold, as in a model). Rows, all on the same inputs in one process:
- `hpcops`: `fused_moe`, CUDA-graph replay of every layer's call / layers. Includes all its kernels (index
  build, gate-up, down, reduce with the shared output) and the gaps between them inside the graph.
- `hpcops-kernels`: the same calls timed like `vllm-triton`: median per call of the device time
  ALL its device work covers (kernels, memsets, copies; durations summed, where kernels overlap under
  `MoeConfig.pdl` the overlap once), torch.profiler, eager. Excludes launch gaps.
  `hpcops-kernels` / `vllm-triton` is the like-for-like ratio (the report's `x ours` of `vllm-triton` is
  against this row).
- `hpcops-gemms`: the same, its gate-up and down GEMM kernels only: the work `vllm-triton`'s row times (its
  `x ours` is against `hpcops-kernels`; `vllm-triton` µs / `hpcops-gemms` µs is the GEMM-for-GEMM ratio).
- `vllm-triton`: vLLM's own Triton `fused_experts` (vendored into `.peers/vllm_kernels` by
  `python3 ../shared/tools/vllm_peer/vendor.py --source wheel`, found there or in `$HPCOPS_PEERS_DIR`;
  unavailable otherwise), configured as vLLM configures it: `try_get_optimal_moe_config`, i.e. vLLM's tuned
  JSON for (E_local, I, device, dtype[, block]) where it ships one (0.33.0 ships none for Hy3's E=192,N=192
  or E=24,N=1536), else its `get_default_config`; fp8 per-tensor via `fp8_w8a8_moe_quant_config` with the
  same static a1/a2 scales (x / scale, saturated, as ours), per-expert weight scales (`fp8d`: its
  `per_act_token_quant`, the weight scale a [E, 1] column); fp8 blocks with
  `block_shape=[128, 128]` (activations quantized per token per 128-group, as ours); EP through its
  `expert_map` (global -> local id, -1 remote) with `global_num_experts=192`. Timed as the device time of its
  two `fused_moe_kernel` launches per call only (profiler, same method as `hpcops-kernels`): a LOWER BOUND of
  real vLLM, which adds its align (`moe_align_block_size`; skipped by vLLM itself when T·k·4 <= E without
  EP), input quant (fp8), activation+quant (`silu_and_mul`), EP zeroing and `moe_sum` kernels. Here those
  run as pure-torch stand-ins from the vendoring shim (not vLLM's CUDA ops) and are not timed. The shared
  expert's output is added outside `fused_experts` in vLLM: here in torch, for the correctness check only.
- `torch-grouped-mm`: torch sorts the pairs by expert, gathers x, `torch._grouped_mm` (bf16) or
  `torch._scaled_grouped_mm` (fp8, row-wise scales) for gate-up and down, silu-mul, weighted sum (graph);
- `torch-loop` (T ≤ 64): a dense loop over local experts with masked weights (sanity row, graph).
Every peer's output (layer 0) is checked against the torch reference before it is timed; a peer that
disagrees is reported `check-failed`, never ranked.
`bytes`: the weights of the experts the layer-0 routing touches, plus x, shared output and out;
`flops`: 2·pairs·H·3I over the locally routed pairs.
Extra configs to time (tuning aid): HPCOPS_MOE_CONFIGS="block_m=16,block_n=32;block_m=32,num_stages=3",
each reported as a row `hpcops[<fields>]`.
The inputs, rows and gate are shared with the `moe-shapes` suite (`_moe_common.py`, from a shape object).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from hpcops.bench.registry import Case, Impl
from hpcops.bench.suites import _moe_common as common
from hpcops.bench.suites._moe_common import FP8, VENDOR_VLLM, VLLM_KERNEL, VLLM_NOTE  # noqa: F401 (re-exported)

E_GLOBAL, TOP_K, HIDDEN = 192, 8, 4096
INTER = {"tp8": 192, "ep8": 1536}
N_LOCAL = {"tp8": 192, "ep8": 24}
TP8_BATCHES = (4, 16, 64, 512, 2048, 4096, 16384)
EP8_BATCHES = (4, 64, 512, 2048)
QUICK_TP8, QUICK_EP8 = (4, 64, 4096), (4, 512)
# fp8 per-tensor weights with dynamic per-token activation scales: the swap-AB tiles and the 64+ row ones
DYN_TP8, DYN_EP8 = (64, 2048, 16384), (2048,)


@dataclass(frozen=True)
class Scenario(common.Hy3Rank):
    """A Hy3 layer (a `_moe_common.MoeShape`; the model's numbers are read from this module's constants)."""

    layout: str  # "tp8" | "ep8"
    t: int
    kind: str  # "fp8_tensor" | "fp8_block" | "none"
    dynamic: bool = False  # fp8_tensor: dynamic per-token activation scales (no a13 / a2)

    @property
    def n_local(self) -> int:
        return self.e_local

    @property
    def name(self) -> str:
        return f"B{self.t}-{self.layout}-{common.quant_tag(self)}"  # `--only B4-` does not match B4096


# the shared machinery, under the names the tests use
_routing, _traffic, _weights, _make_inputs = common.routing, common.traffic, common.weights, common.make_inputs
_config_overrides, _ours, _grouped_mm, _torch_loop = (common.config_overrides, common.ours, common.grouped_mm,
                                                      common.torch_loop)
_vllm_modules, _vllm_quant_config, _vllm_config_note, _vllm = (common.vllm_modules, common.vllm_quant_config,
                                                               common.vllm_config_note, common.vllm)
_reference, _assert_matches, _check = common.reference, common.assert_matches, common.check


def scenarios(quick: bool = False) -> list[Scenario]:
    out = []
    for kind in ("fp8_tensor", "fp8_block", "none"):
        if quick and kind == "fp8_block":
            continue
        if kind != "fp8_block":
            out += [Scenario("tp8", b, kind) for b in (QUICK_TP8 if quick else TP8_BATCHES)]
        out += [Scenario("ep8", b, kind) for b in (QUICK_EP8 if quick else EP8_BATCHES)]
    if not quick:
        out += [Scenario("tp8", b, "fp8_tensor", True) for b in DYN_TP8]
        out += [Scenario("ep8", b, "fp8_tensor", True) for b in DYN_EP8]
    return out


def cases(opts: dict[str, Any]) -> Iterator[Case]:
    sweep = _config_overrides()
    for s in scenarios(bool(opts.get("quick"))):
        nbytes, flops = _traffic(s)
        params = {"layout": s.layout, "B": s.t, "quant": s.kind, "dynamic_scales": s.dynamic, "E_global": E_GLOBAL,
                  "E_local": s.n_local,
                  "top_k": TOP_K, "H": HIDDEN, "I": s.inter, "shared_output": True}
        yield Case(
            suite="moe", name=s.name, make_inputs=lambda layer, device="cuda", s=s: _make_inputs(s, layer, device),
            impls=[Impl("hpcops", _ours(s), ours=True),
                   Impl("hpcops-kernels", _ours(s), ours=True, timing="kernels",
                        note="device time its kernels cover per call (profiler), as vllm-triton"),
                   Impl("hpcops-gemms", _ours(s), ours=True, timing="kernels", kernel_filter=common.GEMM_KERNELS,
                        note=common.GEMMS_NOTE),
                   Impl("vllm-triton", _vllm(s), timing="kernels", kernel_filter=VLLM_KERNEL,
                        note="; ".join(filter(None, (VLLM_NOTE, _vllm_config_note(s))))),
                   *[Impl(common.override_label(kw), _ours(s, kw), note="config sweep") for kw in sweep],
                   Impl("torch-grouped-mm", _grouped_mm(s),
                        note="torch sort + gather + (scaled_)grouped_mm x2 + silu-mul + index_add"),
                   Impl("torch-loop", _torch_loop(s), note="dense masked loop over local experts")],
            check=_check(s), bytes=nbytes, flops=flops, params=params,
            command=f"hpcops bench moe --only {s.name}",
        )
