"""Bench suite `router`: the router's top-k (`select_experts`) on public MoE routings.

One launch of ours (`hpcops`; `hpcops-4warps`: the same kernel on the first, 4-warp launch; `hpcops-batched`:
several tokens a program on one warp, the rule before one token a program from 128 experts) against the
torch sequence a framework runs when it has no fused op (sigmoid or softmax, bias add, topk, gather,
renormalize, scale: `hpcops.moe.reference.select_experts`), all timed
as CUDA-graph replays of every layer's call (each layer its own logits, L2-cold). At decode sizes the
torch sequence is a chain of ~10 tiny launches; vLLM replaces it by fused CUDA ops (`topk_softmax`, and
for sigmoid + bias routings its biased grouped top-k), which cannot run here: compare ours with those
as "one small launch each" (the layer bench counts the router as a shared step for that reason).

Routings: Hy3 (E 192, top-8, sigmoid + selection bias, renormalize × 2.826), DeepSeek-V3 (E 256, top-8,
sigmoid + bias, × 2.5; no expert groups here), Qwen3-MoE (E 128, top-8, softmax, renormalize), Mixtral
(E 8, top-2, softmax, renormalize). Tokens: 4, 64, 512, 4096 (quick: 4 and 512). fp32 logits, as the
router GEMM writes them.
`bytes`: the logits read plus the weights and ids written.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import triton

from hpcops.bench.registry import Case, Impl
from hpcops.moe import routing


@dataclass(frozen=True)
class Routing:
    model: str
    experts: int
    top_k: int
    scoring: str
    bias: bool
    scale: float


ROUTINGS = (
    Routing("hy3", 192, 8, "sigmoid", True, 2.826),
    Routing("dsv3", 256, 8, "sigmoid", True, 2.5),
    Routing("qwen3", 128, 8, "softmax", False, 1.0),
    Routing("mixtral", 8, 2, "softmax", False, 1.0),
)
TOKENS = (4, 64, 512, 4096)
QUICK_TOKENS = (4, 512)


def _make_inputs(r: Routing, t: int, layer: int, device: str) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1000 * layer + t)
    logits = torch.randn(t, r.experts, generator=g).to(device)
    bias = (0.1 * torch.randn(r.experts, generator=g)).to(device) if r.bias else None
    return {"logits": logits, "bias": bias}


def _kwargs(r: Routing, x: dict[str, Any]) -> dict[str, Any]:
    return {"scoring": r.scoring, "bias": x["bias"], "renormalize": True, "scale": r.scale}


def _ours(r: Routing, launch: tuple[int, int] | None = None):
    """Ours; `launch` = (tokens a program, warps) instead of `routing.select_launch`'s choice."""
    def prepare(x):
        from hpcops.moe import routing

        if launch is None:
            return lambda: routing.select_experts(x["logits"], r.top_k, **_kwargs(r, x))
        logits = x["logits"]
        w = torch.empty(logits.shape[0], r.top_k, device=logits.device)
        ids = torch.empty(logits.shape[0], r.top_k, dtype=torch.int32, device=logits.device)
        kw = _kwargs(r, x)
        return lambda: routing._launch_select(logits, r.top_k, kw["scoring"], kw["bias"], kw["renormalize"],
                                              kw["scale"], w, ids, launch=launch) or (w, ids)
    return prepare


def _four_warps(experts: int) -> tuple[int, int]:
    """The first launch rule (16 tokens of a 256-wide tile on 4 warps), kept as a row to compare."""
    return max(1, min(64, 4096 // triton.next_power_of_2(experts))), 4


def _torch(r: Routing):
    def prepare(x):
        from hpcops.moe.reference import select_experts

        return lambda: select_experts(x["logits"], r.top_k, **_kwargs(r, x))
    return prepare


def _check(r: Routing):
    def check(x):
        from hpcops.moe.reference import select_experts as reference
        from hpcops.moe.routing import select_experts

        w, ids = select_experts(x["logits"], r.top_k, **_kwargs(r, x))
        want_w, want_ids = reference(x["logits"], r.top_k, **_kwargs(r, x))
        if not torch.equal(ids, want_ids):
            raise AssertionError(f"expert ids differ in {(ids != want_ids).any(-1).sum().item()} tokens")
        torch.testing.assert_close(w, want_w)
    return check


# the routings whose router GEMM runs on an fp32 weight, with their hidden size: the `route-*` cases time the GEMM
# and the top-k together (`routing.route`) against torch's fp32 GEMM then `select_experts`
ROUTE_HIDDEN = {"hy3": 4096, "dsv3": 7168}


def _route_inputs(r: Routing, t: int, layer: int, device: str) -> dict[str, Any]:
    h = ROUTE_HIDDEN[r.model]
    g = torch.Generator().manual_seed(1000 * layer + t + 7)
    x = {"hidden": torch.randn(t, h, generator=g).to(torch.bfloat16).to(device),
         "weight": (torch.randn(r.experts, h, generator=g) * h ** -0.5).to(device),
         "bias": (0.1 * torch.randn(r.experts, generator=g)).to(device) if r.bias else None}
    return x


def _route_ours(r: Routing):
    def prepare(x):
        from hpcops.moe.routing import route

        return lambda: route(x["hidden"], x["weight"], r.top_k, **_kwargs(r, x))
    return prepare


def _route_torch_gemm(r: Routing):
    def prepare(x):
        from hpcops.moe.routing import select_experts

        return lambda: select_experts(x["hidden"].float() @ x["weight"].t(), r.top_k, **_kwargs(r, x))
    return prepare


def _route_check(r: Routing):
    def check(x):
        from hpcops.moe.reference import route as reference
        from hpcops.moe.routing import route
        from hpcops.testing import assert_routes_agree

        w, ids = route(x["hidden"], x["weight"], r.top_k, **_kwargs(r, x))
        want_w, want_ids = reference(x["hidden"], x["weight"], r.top_k, **_kwargs(r, x))
        assert_routes_agree(w, ids, want_w, want_ids, x["hidden"].float() @ x["weight"].t(), scoring=r.scoring,
                            bias=x["bias"])
    return check


def cases(opts: dict[str, Any]) -> Iterator[Case]:
    yield from _select_cases(opts)
    for r in ROUTINGS:
        if r.model not in ROUTE_HIDDEN:
            continue
        h = ROUTE_HIDDEN[r.model]
        for t in QUICK_TOKENS if opts.get("quick") else TOKENS:
            name = f"route-{r.model}-e{r.experts}k{r.top_k}-H{h}-T{t}"
            yield Case(
                suite="router", name=name,
                make_inputs=lambda layer, device="cuda", r=r, t=t: _route_inputs(r, t, layer, device),
                impls=[Impl("hpcops", _route_ours(r), ours=True,
                            note="routing.route: the router GEMM on the tensor cores with fp32 precision (the "
                                 "fp32 weight as three bf16 terms), split K at decode sizes, + the top-k"),
                       Impl("torch-gemm", _route_torch_gemm(r),
                            note="torch's fp32 GEMM (the cast, the GEMM), then select_experts: the layer bench's "
                                 "baseline router")],
                check=_route_check(r), bytes=r.experts * h * 4 + t * h * 2 + t * r.top_k * 8,
                params={"model": r.model, "E": r.experts, "top_k": r.top_k, "H": h, "T": t, "route": True},
                command=f"hpcops bench router --only {name}",
            )


def _select_cases(opts: dict[str, Any]) -> Iterator[Case]:
    for r in ROUTINGS:
        for t in QUICK_TOKENS if opts.get("quick") else TOKENS:
            name = f"{r.model}-e{r.experts}k{r.top_k}-T{t}"
            yield Case(
                suite="router", name=name,
                make_inputs=lambda layer, device="cuda", r=r, t=t: _make_inputs(r, t, layer, device),
                impls=[Impl("hpcops", _ours(r), ours=True),
                       Impl("hpcops-4warps", _ours(r, _four_warps(r.experts)),
                            note=f"variant: {_four_warps(r.experts)[0]} tokens a program on 4 warps "
                                 "(cross-warp reductions)"),
                       Impl("hpcops-batched", _ours(r, routing.batched_select_launch(r.experts)),
                            note="variant: the batched launch, "
                                 f"{routing.batched_select_launch(r.experts)[0]} tokens a program on 1 warp"),
                       Impl("torch", _torch(r), note="the torch sequence (hpcops.moe.reference.select_experts)")],
                check=_check(r), bytes=t * r.experts * 4 + t * r.top_k * 8,
                params={"model": r.model, "E": r.experts, "top_k": r.top_k, "scoring": r.scoring,
                        "bias": r.bias, "scale": r.scale, "T": t},
                command=f"hpcops bench router --only {name}",
            )
