"""Bench suite `moe`: the fused MoE layer on Hy3 shapes (the blog's tables 1/2).

TP8/EP1: E 192, top-8, H 4096, I 192, batches 4…16384. TP1/EP8: 24 local experts of 192 (expert_map),
I 1536, batches 4…2048. Uniform random routing (distinct experts per token), a shared-expert output
added in the reduction. Variants: fp8 per-tensor with static activation scales (the main figure), fp8
128×128 blocks (EP8 only: block quantization needs I % 128 == 0 and Hy3 TP8 has I = 192), bf16.
Each layer has its own weights (L2-cold, as in a model). Rows, all on the same inputs in one process:
- `hpcops`: `fused_moe`, CUDA-graph replay of every layer's call / layers. Includes all its kernels (index
  build, gate-up, down, reduce with the shared output) and the gaps between them inside the graph.
- `hpcops-kernels`: the same calls timed like `vllm-triton`: median per call of the summed device time
  of ALL its device work (kernels, memsets, copies), torch.profiler, eager. Excludes launch gaps.
  `hpcops-kernels` / `vllm-triton` is the like-for-like ratio (the report's `x ours` of `vllm-triton` is
  against this row).
- `vllm-triton`: vLLM's own Triton `fused_experts` (vendored into `.peers/vllm_kernels` by
  `python3 ../shared/tools/vllm_peer/vendor.py --source wheel`, found there or in `$HPCOPS_PEERS_DIR`;
  unavailable otherwise), configured as vLLM configures it: `try_get_optimal_moe_config`, i.e. vLLM's tuned
  JSON for (E_local, I, device, dtype[, block]) where it ships one (0.33.0 ships none for Hy3's E=192,N=192
  or E=24,N=1536), else its `get_default_config`; fp8 per-tensor via `fp8_w8a8_moe_quant_config` with the
  same static a1/a2 scales (x / scale, saturated, as ours), per-expert weight scales; fp8 blocks with
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
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import Any

import torch

from hpcops.bench.registry import Case, Impl, PeerUnavailable

FP8 = torch.float8_e4m3fn
E_GLOBAL, TOP_K, HIDDEN = 192, 8, 4096
INTER = {"tp8": 192, "ep8": 1536}
N_LOCAL = {"tp8": 192, "ep8": 24}
TP8_BATCHES = (4, 16, 64, 512, 2048, 4096, 16384)
EP8_BATCHES = (4, 64, 512, 2048)
QUICK_TP8, QUICK_EP8 = (4, 64, 4096), (4, 512)
VENDOR_VLLM = ("vendor vLLM's Triton kernels from the repository root with "
               "`python3 ../shared/tools/vllm_peer/vendor.py --source wheel` (writes .peers/vllm_kernels, git-ignored; "
               "carry it to the GPU machine)")
VLLM_KERNEL = "fused_moe_kernel"  # the one Triton kernel of vLLM's fused_experts that is timed (2 launches)
VLLM_NOTE = ("device time of its two fused_moe_kernel launches only (profiler, like hpcops-kernels): a lower "
             "bound of real vLLM, which adds align, input quant, activation+quant and moe_sum kernels")


@dataclass(frozen=True)
class Scenario:
    layout: str  # "tp8" | "ep8"
    t: int
    kind: str  # "fp8_tensor" | "fp8_block" | "none"

    @property
    def inter(self) -> int:
        return INTER[self.layout]

    @property
    def n_local(self) -> int:
        return N_LOCAL[self.layout]

    @property
    def name(self) -> str:
        q = {"fp8_tensor": "fp8t", "fp8_block": "fp8b", "none": "bf16"}[self.kind]
        return f"B{self.t}-{self.layout}-{q}"  # batch first: `--only B4-` does not also match B4096


def _routing(s: Scenario, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniform random routing with distinct experts per token (CPU, seeded per layer)."""
    g = torch.Generator().manual_seed(10_000 * layer + s.t)
    ids = torch.rand(s.t, E_GLOBAL, generator=g).topk(TOP_K, dim=-1).indices.to(torch.int32)
    w = torch.softmax(torch.randn(s.t, TOP_K, generator=g), dim=-1)
    return w, ids


def _traffic(s: Scenario) -> tuple[int, int]:
    """(bytes, flops) of one layer from the layer-0 routing."""
    _, ids = _routing(s, 0)
    local = ids[ids < s.n_local]  # local experts are the first n_local global ids
    touched = int(torch.unique(local).numel())
    wbytes = 1 if s.kind != "none" else 2
    per_expert = 3 * s.inter * HIDDEN * wbytes
    act = 3 * s.t * HIDDEN * 2  # x, shared output, out (bf16)
    flops = 2 * int(local.numel()) * HIDDEN * 3 * s.inter
    return touched * per_expert + act + s.t * TOP_K * 8, flops


def _weights(s: Scenario, layer: int, device: str):
    from hpcops.quant import Fp8Block128, Fp8PerTensor, quantize_block128

    g = torch.Generator(device=device).manual_seed(layer)
    E, H, inter = s.n_local, HIDDEN, s.inter
    w13 = torch.randn(E, 2 * inter, H, device=device, generator=g) / H ** 0.5
    w2 = torch.randn(E, H, inter, device=device, generator=g) / inter ** 0.5
    if s.kind == "none":
        return w13.bfloat16(), w2.bfloat16(), None
    if s.kind == "fp8_block":
        q13, s13 = quantize_block128(w13)
        del w13
        q2, s2 = quantize_block128(w2)
        return q13, q2, Fp8Block128(s13, s2)
    s13 = w13.abs().amax(dim=(1, 2)) / 448.0
    s2 = w2.abs().amax(dim=(1, 2)) / 448.0
    q13 = (w13 / s13[:, None, None]).to(FP8)
    del w13
    q2 = (w2 / s2[:, None, None]).to(FP8)
    a13 = torch.tensor([4.0 / 448], device=device)  # x ~ N(0,1); static scales as in FP8 checkpoints
    a2 = torch.tensor([0.5 / 448], device=device)
    return q13, q2, Fp8PerTensor(s13.float(), s2.float(), a13, a2)


def _make_inputs(s: Scenario, layer: int, device: str = "cuda") -> dict[str, Any]:
    w13, w2, quant = _weights(s, layer, device)
    tw, ids = _routing(s, layer)
    g = torch.Generator(device=device).manual_seed(777 + layer)
    x = torch.randn(s.t, HIDDEN, device=device, generator=g).bfloat16()
    emap = None
    if s.layout == "ep8":
        emap = torch.full((E_GLOBAL,), -1, dtype=torch.int32)
        emap[: s.n_local] = torch.arange(s.n_local, dtype=torch.int32)
        emap = emap.to(device)
    return {"layer": layer, "x": x, "w13": w13, "w2": w2, "quant": quant, "tw": tw.to(device),
            "ids": ids.to(device), "emap": emap, "shared": torch.randn_like(x) * 0.1,
            "out": torch.empty_like(x)}


def _config_overrides() -> list[dict[str, Any]]:
    spec = os.environ.get("HPCOPS_MOE_CONFIGS", "").strip()
    names = {f.name: f.type for f in fields(_moe_config_cls())}
    out = []
    for item in filter(None, (p.strip() for p in spec.split(";"))):
        kw = {}
        for pair in filter(None, (p.strip() for p in item.split(","))):
            key, val = pair.split("=")
            if key not in names:
                raise ValueError(f"HPCOPS_MOE_CONFIGS: unknown MoeConfig field {key!r}")
            kind = names[key]
            kw[key] = val if key == "act_mul" else bool(int(val)) if kind in (bool, "bool") else int(val)
        out.append(kw)
    return out


def _moe_config_cls():
    from hpcops.moe.configs import MoeConfig

    return MoeConfig


def _ours(s: Scenario, overrides: dict[str, Any] | None = None):
    def prepare(x):
        from hpcops._platform import is_interpreter
        from hpcops.moe.configs import get_config
        from hpcops.moe.fused_moe import device_name, fused_moe

        cfg = get_config(num_tokens=s.t, top_k=TOP_K, num_experts=E_GLOBAL, hidden=HIDDEN, inter=s.inter,
                         quant=s.kind, interpreter=is_interpreter(), num_local_experts=s.n_local,
                         device_name=device_name(x["x"].device))
        cfg = cfg.with_(validate_ids=False, **(overrides or {}))
        args = (x["x"], x["w13"], x["w2"], x["tw"], x["ids"])
        kw = {"quant": x["quant"], "expert_map": x["emap"], "shared_output": x["shared"], "out": x["out"],
              "config": cfg}
        return lambda: fused_moe(*args, **kw)
    return prepare


def _grouped_mm(s: Scenario):
    """Unfused grouped-GEMM pipeline in torch (capturable: sort, scatter_add, no host sync)."""
    def prepare(x):
        if s.kind == "fp8_block":
            raise PeerUnavailable("torch has no 128x128 block-scaled grouped GEMM")
        op = "_scaled_grouped_mm" if s.kind == "fp8_tensor" else "_grouped_mm"
        if not hasattr(torch, op):
            raise PeerUnavailable(f"torch.{op} is missing in torch {torch.__version__}")
        fn = _grouped_pipeline(s, x)
        try:
            got = fn()
            if got.is_cuda:
                torch.cuda.synchronize()
        except Exception as exc:  # unsupported shape/layout on this build
            raise PeerUnavailable(f"torch.{op} failed: {type(exc).__name__}: {str(exc)[:120]}") from exc
        if x["layer"] == 0:
            _assert_matches(s, x, got, "torch-grouped-mm")
        return fn
    return prepare


def _grouped_pipeline(s: Scenario, x: dict[str, Any]):
    E, inter, k = s.n_local, s.inter, TOP_K
    T = s.t
    n = T * k
    dev = x["x"].device
    ids = x["ids"]
    quant = x["quant"]
    w13t, w2t = x["w13"].transpose(1, 2), x["w2"].transpose(1, 2)  # [E, K, N] column-major views
    ones = torch.ones(n, dtype=torch.int32, device=dev)
    fp8 = s.kind == "fp8_tensor"
    if fp8:
        a13, a2 = quant.a13_scale, quant.a2_scale
        sa1 = a13.expand(n).contiguous()
        sa2 = a2.expand(n).contiguous()
        sb1 = quant.w13_scale[:, None].expand(E, 2 * inter).contiguous()
        sb2 = quant.w2_scale[:, None].expand(E, HIDDEN).contiguous()

    def run():
        flat = ids.flatten().long()
        loc = x["emap"][flat].long() if x["emap"] is not None else flat
        loc = torch.where(loc < 0, E, loc)
        order = torch.argsort(loc, stable=True)
        counts = torch.zeros(E + 1, dtype=torch.int32, device=dev).scatter_add_(0, loc, ones)
        offs = torch.cumsum(counts[:E], 0, dtype=torch.int32)
        tok = order // k
        if fp8:
            xq = (x["x"].float() / a13).clamp(-448, 448).to(FP8)[tok]
            h = torch._scaled_grouped_mm(xq, w13t, sa1, sb1, offs=offs, out_dtype=torch.bfloat16)
            act = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
            aq = (act.float() / a2).clamp(-448, 448).to(FP8)
            y = torch._scaled_grouped_mm(aq, w2t, sa2, sb2, offs=offs, out_dtype=torch.bfloat16)
        else:
            h = torch._grouped_mm(x["x"][tok], w13t, offs=offs)
            act = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
            y = torch._grouped_mm(act, w2t, offs=offs)
        valid = (loc[order] < E)[:, None]
        contrib = torch.where(valid, y.float() * x["tw"].flatten()[order][:, None], 0.0)
        out = x["shared"].float().index_add_(0, tok, contrib)
        return x["out"].copy_(out)
    return run


def _torch_loop(s: Scenario):
    """Dense loop over local experts with masked combine weights (no host sync, capturable)."""
    def prepare(x):
        if s.t > 64:
            raise PeerUnavailable("sanity row for T <= 64 only")
        if s.kind == "fp8_block":
            raise PeerUnavailable("no block-scaled torch matmul")
        E, inter, T = s.n_local, s.inter, s.t
        ids, tw, emap = x["ids"].long(), x["tw"], x["emap"]
        quant = x["quant"]
        if quant is not None:
            # cuBLASLt fp8 (torch._scaled_mm): rows padded to a multiple of 16 and every scale its own
            # fresh [1] fp32 allocation (views into the per-expert scale vector sit at 4-byte offsets;
            # the H200 run failed with CUBLAS_STATUS_NOT_SUPPORTED at T = 4, 16, 64 before this)
            t_pad = max(16, -(-T // 16) * 16)
            one = lambda v: v.detach().float().reshape(1).clone()
            sa13, sa2 = one(quant.a13_scale), one(quant.a2_scale)
            sb13 = [one(quant.w13_scale[e]) for e in range(E)]
            sb2 = [one(quant.w2_scale[e]) for e in range(E)]
            xpad = torch.zeros(t_pad, x["x"].shape[1], dtype=torch.float32, device=x["x"].device)

        def run():
            loc = emap[ids].long() if emap is not None else ids
            acc = x["shared"].float()
            if quant is not None:
                xpad[:T] = x["x"].float()
                xq = (xpad / sa13).clamp(-448, 448).to(FP8)
            for e in range(E):
                wt = (tw * (loc == e)).sum(-1, keepdim=True)
                if quant is None:
                    h = x["x"] @ x["w13"][e].t()
                    act = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
                    y = act @ x["w2"][e].t()
                else:
                    h = torch._scaled_mm(xq, x["w13"][e].t(), scale_a=sa13, scale_b=sb13[e],
                                         out_dtype=torch.bfloat16)
                    act = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
                    aq = (act.float() / sa2).clamp(-448, 448).to(FP8)
                    y = torch._scaled_mm(aq, x["w2"][e].t(), scale_a=sa2, scale_b=sb2[e],
                                         out_dtype=torch.bfloat16)[:T]
                acc = acc + wt * y.float()
            return x["out"].copy_(acc)
        try:
            got = run()
            if got.is_cuda:
                torch.cuda.synchronize()
        except Exception as exc:
            raise PeerUnavailable(f"torch loop failed: {type(exc).__name__}: {str(exc)[:200]}") from exc
        if x["layer"] == 0 and got.is_cuda and quant is not None:
            _assert_matches(s, x, got, "torch-loop")  # the padded fp8 path agrees with the reference
        return run
    return prepare


def _vllm_modules():
    from hpcops.bench.registry import import_vendored

    fm = import_vendored("vllm_kernels.moe.fused_moe", how=VENDOR_VLLM)
    cfg = import_vendored("vllm_kernels._shim.moe_config", how=VENDOR_VLLM)
    return fm, cfg


def _vllm_quant_config(s: Scenario, quant, cfg):
    """vLLM's FusedMoEQuantConfig for our quant: None (bf16), fp8 per-tensor with static activation scales
    [1] and per-expert weight scales [E], or fp8 128×128 blocks (the same scale layouts as ours)."""
    if s.kind == "none":
        return None
    if s.kind == "fp8_tensor":
        if quant.a13_scale is None or quant.a2_scale is None:
            raise PeerUnavailable("the bench's fp8 rows use static activation scales")
        one = lambda v: v.reshape(1).float()
        return cfg.fp8_w8a8_moe_quant_config(quant.w13_scale.float(), quant.w2_scale.float(),
                                             a1_scale=one(quant.a13_scale), a2_scale=one(quant.a2_scale))
    return cfg.fp8_w8a8_moe_quant_config(quant.w13_scale, quant.w2_scale, block_shape=[quant.block, quant.block])


def _vllm_config_note(s: Scenario) -> str:
    """Which config vLLM's own lookup picks for this shape here (its tuned JSON or get_default_config)."""
    try:
        fm, _ = _vllm_modules()
        dtype = None if s.kind == "none" else "fp8_w8a8"
        block = [128, 128] if s.kind == "fp8_block" else None
        name = fm.get_config_file_name(s.n_local, s.inter, dtype, block)
        tuned = fm.get_moe_configs(s.n_local, s.inter, dtype, *(block or (None, None)))
    except Exception:  # not vendored (the row says so) or a vendored tree without these helpers
        return ""
    return f"vLLM config: tuned {name}" if tuned else f"vLLM config: get_default_config (no tuned {name})"


def _vllm(s: Scenario):
    """vLLM's Triton fused_experts as vLLM calls it (see the module docstring); no shared output in the call."""
    def prepare(x):
        fm, cfg = _vllm_modules()
        qc = _vllm_quant_config(s, x["quant"], cfg)
        args = (x["x"], x["w13"], x["w2"], x["tw"], x["ids"])
        kw = {"global_num_experts": E_GLOBAL, "expert_map": x["emap"], "quant_config": qc}
        fn = lambda: fm.fused_experts(*args, **kw)
        if x["layer"] == 0:  # the gate: vLLM adds the shared expert's output outside fused_experts
            got = (fn().float() + x["shared"].float()).to(x["out"].dtype)
            _assert_matches(s, x, got, "vllm-triton")
        return fn
    return prepare


def _reference(s: Scenario, x: dict[str, Any]) -> torch.Tensor:
    from hpcops.moe.reference import fused_moe as ref

    return ref(x["x"], x["w13"], x["w2"], x["tw"], x["ids"], quant=x["quant"], expert_map=x["emap"],
               shared_output=x["shared"])


def _assert_matches(s: Scenario, x: dict[str, Any], got: torch.Tensor, name: str) -> None:
    from hpcops.testing import assert_close

    if "reference" not in x:  # several rows check the same layer-0 inputs: compute it once
        x["reference"] = _reference(s, x)
    want = x["reference"]
    cos = torch.nn.functional.cosine_similarity(want.double().flatten(), got.double().flatten(), dim=0).item()
    if not cos > 0.999:
        raise AssertionError(f"{name}: cosine similarity {cos:.5f} to the reference (want > 0.999)")
    if s.kind == "none":
        assert_close(want, got, name=name)
    else:
        # fp8: the same activation quantization as the reference, but fp32 accumulation order flips the
        # rounding of a few fp8 activations by one ulp (6 %), and each expert's output is rounded to bf16
        assert_close(want, got, name=name, maxtol=5e-2, rmstol=2e-2)


def _check(s: Scenario):
    def check(x):
        from hpcops.moe.fused_moe import fused_moe

        got = fused_moe(x["x"], x["w13"], x["w2"], x["tw"], x["ids"], quant=x["quant"], expert_map=x["emap"],
                        shared_output=x["shared"], out=torch.full_like(x["out"], float("nan")))
        _assert_matches(s, x, got, "hpcops")
    return check


def scenarios(quick: bool = False) -> list[Scenario]:
    out = []
    for kind in ("fp8_tensor", "fp8_block", "none"):
        if quick and kind == "fp8_block":
            continue
        if kind != "fp8_block":
            out += [Scenario("tp8", b, kind) for b in (QUICK_TP8 if quick else TP8_BATCHES)]
        out += [Scenario("ep8", b, kind) for b in (QUICK_EP8 if quick else EP8_BATCHES)]
    return out


def cases(opts: dict[str, Any]) -> Iterator[Case]:
    sweep = _config_overrides()
    for s in scenarios(bool(opts.get("quick"))):
        nbytes, flops = _traffic(s)
        params = {"layout": s.layout, "B": s.t, "quant": s.kind, "E_global": E_GLOBAL, "E_local": s.n_local,
                  "top_k": TOP_K, "H": HIDDEN, "I": s.inter, "shared_output": True}
        label = lambda kw: "hpcops[" + ",".join(f"{k}={v}" for k, v in kw.items()) + "]"
        yield Case(
            suite="moe", name=s.name, make_inputs=lambda layer, device="cuda", s=s: _make_inputs(s, layer, device),
            impls=[Impl("hpcops", _ours(s), ours=True),
                   Impl("hpcops-kernels", _ours(s), ours=True, timing="kernels",
                        note="sum of the device time of all its kernels per call (profiler), as vllm-triton"),
                   Impl("vllm-triton", _vllm(s), timing="kernels", kernel_filter=VLLM_KERNEL,
                        note="; ".join(filter(None, (VLLM_NOTE, _vllm_config_note(s))))),
                   *[Impl(label(kw), _ours(s, kw), note="config sweep") for kw in sweep],
                   Impl("torch-grouped-mm", _grouped_mm(s),
                        note="torch sort + gather + (scaled_)grouped_mm x2 + silu-mul + index_add"),
                   Impl("torch-loop", _torch_loop(s), note="dense masked loop over local experts")],
            check=_check(s), bytes=nbytes, flops=flops, params=params,
            command=f"hpcops bench moe --only {s.name}",
        )
