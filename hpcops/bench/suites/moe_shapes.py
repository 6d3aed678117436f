"""Bench suite `moe-shapes`: the fused MoE layer on public MoE models' shapes (generality, issue 9).

Six models, one rank each at the tensor parallelism they are commonly served with on H200s (TP shards I,
every expert is local), each with vLLM 0.33's tuned H200 config for that (E, N = per-rank I, dtype):

| case prefix | checkpoint (config.json) | E | top-k | H | I / TP = I | quant | shared |
|---|---|---:|---:|---:|---|---|---|
| mixtral-8x7b-tp2 | mistralai/Mixtral-8x7B-v0.1 (fp8¹) | 8 | 2 | 4096 | 14336/2 = 7168 | bf16, fp8 per-tensor | no |
| qwen3-30b-a3b | Qwen/Qwen3-30B-A3B(-FP8) | 128 | 8 | 2048 | 768 | bf16, fp8 128-block | no |
| qwen3-235b-a22b-tp4 | Qwen/Qwen3-235B-A22B(-FP8) | 128 | 8 | 4096 | 1536/4 = 384 | bf16, fp8 128-block | no |
| deepseek-v3-tp8 | deepseek-ai/DeepSeek-V3 | 256 | 8 | 7168 | 2048/8 = 256 | fp8 128-block | yes |
| llama4-scout-tp8 | meta-llama/Llama-4-Scout-17B-16E | 16 | 1 | 5120 | 8192/8 = 1024 | bf16 | yes |
| qwen2-57b-a14b-tp2 | Qwen/Qwen2-57B-A14B | 64 | 8 | 3584 | 2560/2 = 1280 | bf16 | yes |

¹ neuralmagic/Mixtral-8x7B-Instruct-v0.1-FP8 (per-tensor weights and static activation scales).
Quant variants are those the model ships (bf16, and fp8 where its publisher or a widely used public
checkpoint ships it: per-tensor with static activation scales for Mixtral, 128×128 blocks for Qwen3 and
DeepSeek) for which vLLM ships an H200 config; DeepSeek-V3 ships fp8 only (vLLM has no bf16 E=256,N=256
file). Batches B = 1, 16, 128, 1024 (decode to a prefill chunk); `--quick`: B = 16, every variant.
Cases are named `<model>[-tp<N>]/B<batch>-<bf16|fp8t|fp8b>`. Inputs as in the `moe` suite (uniform random
routing with distinct experts, x ~ N(0, 1), each layer its own weights: L2-cold; a shared expert's output
added in our reduction for the models that have one); the routers' own rules (DeepSeek's group-limited
top-k, Llama 4's sigmoid weight applied to the input) are not modelled: the GEMM work is the same.
Layers per case: the harness's L2-cold count, capped so all layers' weights stay within 24 GiB.

Rows, all on the same inputs in one process, every one checked against the torch reference on layer 0:
- `hpcops`: `fused_moe` with its default config (`get_config`: a tuned entry of `hpcops/moe/tuned.py` or
  `$HPCOPS_MOE_TUNED` for the device and shape where one exists, else the heuristic), CUDA-graph replay.
- `hpcops-kernels`: the same calls, device time of all their kernels per call (profiler); the reference
  of the kernel-timed rows. Its note lists the cases where a tuned entry applied (params `tuned`).
- `hpcops-heuristic`: `heuristic_config(...)` forced (what a shape without a tuned entry gets), timed the
  same way; gated on layer 0 itself.
- `vllm-triton`: vLLM's Triton `fused_experts` with its own config lookup (`try_get_optimal_moe_config`:
  its shipped tuned JSON, named in the note and in params `vllm_config`), timed by its two
  `fused_moe_kernel` launches only (a lower bound of real vLLM; see the `moe` suite).

Targets (issue 9, deliverable 3), in every case:
- heuristic: `hpcops-heuristic` / `vllm-triton` ≤ 1.0 (at least as fast as vLLM with its tuned configs);
- tuned: `hpcops-kernels` / `vllm-triton` ≤ 0.8, i.e. `vllm-triton`'s `x ours` ≥ 1.25.
The table's `x ours` of the kernel-timed rows is against `hpcops-kernels`; `targets()` (and
`python scripts/moe_shapes_targets.py OUT/moe-shapes.json`) puts both ratios side by side per case.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from hpcops.bench.registry import Case, Impl
from hpcops.bench.suites import _moe_common as common

BATCHES = (1, 16, 128, 1024)
QUICK_BATCHES = (16,)
WEIGHT_BUDGET = 24 << 30  # bytes of expert weights of all layers of one case together
TARGET_HEURISTIC = 1.0  # hpcops-heuristic / vllm-triton, at most
TARGET_TUNED = 0.8  # hpcops-kernels / vllm-triton, at most


@dataclass(frozen=True)
class Model:
    """A public MoE model's expert layer on one rank: `inter_full` (moe_intermediate_size) split over `tp`."""

    name: str
    checkpoint: str
    e: int
    top_k: int
    hidden: int
    inter_full: int
    tp: int
    kinds: tuple[str, ...]
    shared: bool

    @property
    def inter(self) -> int:
        return self.inter_full // self.tp

    @property
    def label(self) -> str:
        return self.name if self.tp == 1 else f"{self.name}-tp{self.tp}"


MODELS = (
    Model("mixtral-8x7b", "mistralai/Mixtral-8x7B-v0.1; fp8: neuralmagic/Mixtral-8x7B-Instruct-v0.1-FP8",
          e=8, top_k=2, hidden=4096, inter_full=14336, tp=2, kinds=("none", "fp8_tensor"), shared=False),
    Model("qwen3-30b-a3b", "Qwen/Qwen3-30B-A3B; fp8: Qwen/Qwen3-30B-A3B-FP8",
          e=128, top_k=8, hidden=2048, inter_full=768, tp=1, kinds=("none", "fp8_block"), shared=False),
    Model("qwen3-235b-a22b", "Qwen/Qwen3-235B-A22B; fp8: Qwen/Qwen3-235B-A22B-FP8",
          e=128, top_k=8, hidden=4096, inter_full=1536, tp=4, kinds=("none", "fp8_block"), shared=False),
    Model("deepseek-v3", "deepseek-ai/DeepSeek-V3 (fp8 128-block)",
          e=256, top_k=8, hidden=7168, inter_full=2048, tp=8, kinds=("fp8_block",), shared=True),
    Model("llama4-scout", "meta-llama/Llama-4-Scout-17B-16E-Instruct",
          e=16, top_k=1, hidden=5120, inter_full=8192, tp=8, kinds=("none",), shared=True),
    Model("qwen2-57b-a14b", "Qwen/Qwen2-57B-A14B-Instruct",
          e=64, top_k=8, hidden=3584, inter_full=2560, tp=2, kinds=("none",), shared=True),
)


@dataclass(frozen=True)
class ModelCase:
    """One (model, batch, quant) case: a `_moe_common.MoeShape` (TP: every expert local, no expert_map)."""

    model: Model
    t: int
    kind: str  # "none" | "fp8_tensor" | "fp8_block"

    @property
    def e_global(self) -> int:
        return self.model.e

    @property
    def e_local(self) -> int:
        return self.model.e

    @property
    def top_k(self) -> int:
        return self.model.top_k

    @property
    def hidden(self) -> int:
        return self.model.hidden

    @property
    def inter(self) -> int:
        return self.model.inter

    @property
    def ep(self) -> bool:
        return False

    @property
    def shared(self) -> bool:
        return self.model.shared

    @property
    def name(self) -> str:
        return f"{self.model.label}/B{self.t}-{common.QUANT_TAGS[self.kind]}"  # `--only /B1-` is B1 only


def scenarios(quick: bool = False) -> list[ModelCase]:
    batches = QUICK_BATCHES if quick else BATCHES
    return [ModelCase(m, t, kind) for m in MODELS for kind in m.kinds for t in batches]


def layers(s: ModelCase, nbytes: int) -> int:
    """The harness's L2-cold layer count for `nbytes` of traffic, capped to WEIGHT_BUDGET of weights."""
    from hpcops.bench.timing import layers_for

    return max(2, min(layers_for(nbytes), WEIGHT_BUDGET // common.weight_bytes(s)))


def cases(opts: dict[str, Any]) -> Iterator[Case]:
    sweep = common.config_overrides()
    device = torch.device("cuda") if torch.cuda.is_available() else None
    for s in scenarios(bool(opts.get("quick"))):
        nbytes, flops = common.traffic(s)
        tuned = common.tuned_note(s, device)
        params = {"model": s.model.name, "tp": s.model.tp, "B": s.t, "quant": s.kind, "E_global": s.e_global,
                  "E_local": s.e_local, "top_k": s.top_k, "H": s.hidden, "I": s.inter, "shared_output": s.shared,
                  "tuned": tuned.startswith("tuned"), "vllm_config": common.vllm_config_file(s)}
        kernels_note = "device time its kernels cover per call (profiler), as vllm-triton"
        yield Case(
            suite="moe-shapes", name=s.name,
            make_inputs=lambda layer, device="cuda", s=s: common.make_inputs(s, layer, device),
            impls=[Impl("hpcops", common.ours(s), ours=True),
                   Impl("hpcops-kernels", common.ours(s), ours=True, timing="kernels",
                        note=kernels_note + ("; " + f"{s.name}: {tuned}" if params["tuned"] else "")),
                   Impl("hpcops-heuristic", common.ours(s, heuristic=True, gate=True), ours=True, timing="kernels",
                        note="heuristic_config forced (no tuned entry), timed as hpcops-kernels; target: "
                             f"<= {TARGET_HEURISTIC} x vllm-triton"),
                   Impl("vllm-triton", common.vllm(s), timing="kernels", kernel_filter=common.VLLM_KERNEL,
                        note="; ".join(filter(None, (common.VLLM_NOTE, common.vllm_config_note(s))))),
                   *[Impl(common.override_label(kw), common.ours(s, kw, gate=True), note="config sweep")
                     for kw in sweep]],
            check=common.check(s), bytes=nbytes, flops=flops, params=params,
            layers=opts.get("layers") or layers(s, nbytes),
            command=f"hpcops bench moe-shapes --only {s.name}",
        )


def _ratio(impls: dict[str, Any], num: str, den: str) -> float | None:
    a, b = (impls[k].us if k in impls else None for k in (num, den))
    return a / b if a and b else None


def targets(rows) -> list[dict[str, Any]]:
    """Per case, the two targets from a run's rows (`runner.Row`s, e.g. `report.load(path).rows`):
    heuristic = hpcops-heuristic / vllm-triton (want <= TARGET_HEURISTIC), tuned = hpcops-kernels /
    vllm-triton (want <= TARGET_TUNED); None where a row has no time."""
    by_case: dict[str, dict[str, Any]] = {}
    for r in rows:
        by_case.setdefault(r.case, {})[r.impl] = r
    out = []
    for case, impls in by_case.items():
        heur, tuned = (_ratio(impls, name, "vllm-triton") for name in ("hpcops-heuristic", "hpcops-kernels"))
        params = next(iter(impls.values())).params
        out.append({"case": case, "heuristic": heur, "tuned": tuned, "tuned_entry": bool(params.get("tuned")),
                    "heuristic_met": heur is not None and heur <= TARGET_HEURISTIC,
                    "tuned_met": tuned is not None and tuned <= TARGET_TUNED})
    return out


def targets_markdown(rows) -> str:
    """A markdown table of `targets(rows)` with a closing count of the cases that meet each target."""
    ts = targets(rows)
    fmt = lambda v: f"{v:.2f}" if v is not None else "—"
    mark = lambda ok: "met" if ok else "**no**"
    lines = [f"| case | hpcops-heuristic / vllm-triton (≤ {TARGET_HEURISTIC}) | | hpcops-kernels / vllm-triton "
             f"(≤ {TARGET_TUNED}) | | tuned entry |", "|---|---:|---|---:|---|---|"]
    lines += [f"| {t['case']} | {fmt(t['heuristic'])} | {mark(t['heuristic_met'])} | {fmt(t['tuned'])} | "
              f"{mark(t['tuned_met'])} | {'yes' if t['tuned_entry'] else 'no'} |" for t in ts]
    n = len(ts)
    lines += ["", f"heuristic target met in {sum(t['heuristic_met'] for t in ts)}/{n} cases, "
              f"tuned target in {sum(t['tuned_met'] for t in ts)}/{n}."]
    return "\n".join(lines) + "\n"
