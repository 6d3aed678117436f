"""What the MoE bench suites share: one layer's inputs from a shape, its traffic, the implementations
(hpcops, vLLM's Triton kernels, torch pipelines) and the correctness gate.

A shape is any object with the attributes of `MoeShape` (the `moe` suite's Hy3 `Scenario`, the `moe-shapes`
suite's `ModelCase`). Expert parallelism (`ep`): this rank holds the first `e_local` of `e_global` experts,
reached through an `expert_map`; without it `e_local == e_global` (TP: every expert, a slice of I).
"""

from __future__ import annotations

import os
import sys
from dataclasses import fields
from typing import Any, Protocol

import torch

from hpcops.bench.registry import PeerUnavailable

FP8 = torch.float8_e4m3fn
VENDOR_VLLM = ("vendor vLLM's Triton kernels from the repository root with "
               "`python3 ../shared/tools/vllm_peer/vendor.py --source wheel` (writes .peers/vllm_kernels, git-ignored; "
               "carry it to the GPU machine)")
VLLM_KERNEL = "fused_moe_kernel"  # the one Triton kernel of vLLM's fused_experts that is timed (2 launches)
# our two GEMMs (tl and Gluon gate-up, down): the `hpcops-gemms` row, timed as vLLM's row is
GEMM_KERNELS = ("moe_gate_up", "moe_down")
GEMMS_NOTE = ("device time of its gate-up and down GEMM kernels only (profiler), the work vllm-triton's row times: "
              "vllm-triton µs / this row's µs is the GEMM-for-GEMM ratio; the index, quantization and reduce left "
              "out, as vLLM's align, activation and moe_sum are")
VLLM_NOTE = ("device time of its two fused_moe_kernel launches only (profiler, like hpcops-kernels): a lower "
             "bound of real vLLM, which adds align, input quant, activation+quant and moe_sum kernels")
QUANT_TAGS = {"fp8_tensor": "fp8t", "fp8_block": "fp8b", "none": "bf16"}


def dynamic_scales(s) -> bool:
    """Whether shape `s` quantizes its fp8 per-tensor activations per token at run time (a `dynamic` field, False
    where the shape has none) instead of with static a13 / a2 scales."""
    return bool(getattr(s, "dynamic", False)) and s.kind == "fp8_tensor"


def quant_tag(s) -> str:
    """The quantization part of a case name: fp8t / fp8d (dynamic activation scales) / fp8b / bf16."""
    return "fp8d" if dynamic_scales(s) else QUANT_TAGS[s.kind]


class MoeShape(Protocol):
    """One MoE layer on one rank, at one batch."""

    @property
    def t(self) -> int: ...  # tokens (the batch)
    @property
    def kind(self) -> str: ...  # "none" (bf16) | "fp8_tensor" | "fp8_block"
    @property
    def e_global(self) -> int: ...
    @property
    def e_local(self) -> int: ...
    @property
    def top_k(self) -> int: ...
    @property
    def hidden(self) -> int: ...
    @property
    def inter(self) -> int: ...  # per-rank intermediate size I (w2 is [e_local, hidden, inter])
    @property
    def ep(self) -> bool: ...  # an expert_map routes global ids to the e_local experts held here
    @property
    def shared(self) -> bool: ...  # a shared expert's output is added in the reduction


class Hy3Rank:
    """The `MoeShape` properties of one Hy3 rank, for a dataclass with a `layout` field ("tp8" | "ep8") that
    gives `t` and `kind` itself. The model's numbers (E_GLOBAL, TOP_K, HIDDEN, INTER and N_LOCAL by layout)
    are read from the subclass's module when asked, so a test that shrinks that module's constants shrinks
    the shape."""

    layout: str

    def _model(self) -> Any:
        return sys.modules[type(self).__module__]

    @property
    def e_global(self) -> int:
        return self._model().E_GLOBAL

    @property
    def e_local(self) -> int:
        return self._model().N_LOCAL[self.layout]

    @property
    def top_k(self) -> int:
        return self._model().TOP_K

    @property
    def hidden(self) -> int:
        return self._model().HIDDEN

    @property
    def inter(self) -> int:
        return self._model().INTER[self.layout]

    @property
    def ep(self) -> bool:
        return self.layout == "ep8"

    @property
    def shared(self) -> bool:
        return True


def routing(s: MoeShape, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniform random routing with distinct experts per token (CPU, seeded per layer)."""
    g = torch.Generator().manual_seed(10_000 * layer + s.t)
    ids = torch.rand(s.t, s.e_global, generator=g).topk(s.top_k, dim=-1).indices.to(torch.int32)
    w = torch.softmax(torch.randn(s.t, s.top_k, generator=g), dim=-1)
    return w, ids


def weight_bytes(s: MoeShape) -> int:
    """Bytes of one layer's expert weights on this rank (w13 + w2, all local experts; scales left out)."""
    return s.e_local * 3 * s.inter * s.hidden * (1 if s.kind != "none" else 2)


def traffic(s: MoeShape) -> tuple[int, int]:
    """(bytes, flops) of one layer from the layer-0 routing: the weights of the local experts it touches,
    x, the shared output (if any) and out (bf16), topk weights and ids; 2·pairs·H·3I over local pairs."""
    _, ids = routing(s, 0)
    local = ids[ids < s.e_local]  # local experts are the first e_local global ids
    touched = int(torch.unique(local).numel())
    per_expert = weight_bytes(s) // s.e_local
    act = (3 if s.shared else 2) * s.t * s.hidden * 2
    flops = 2 * int(local.numel()) * s.hidden * 3 * s.inter
    return touched * per_expert + act + s.t * s.top_k * 8, flops


def weights(s: MoeShape, layer: int, device: str):
    """(w13 [E_local, 2I, H], w2 [E_local, H, I], quant) of one layer, seeded by `layer`."""
    from hpcops.quant import Fp8Block128, Fp8PerTensor, quantize_block128

    g = torch.Generator(device=device).manual_seed(layer)
    E, H, inter = s.e_local, s.hidden, s.inter
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
    if dynamic_scales(s):  # activations quantized per token at run time
        return q13, q2, Fp8PerTensor(s13.float(), s2.float())
    a13 = torch.tensor([4.0 / 448], device=device)  # x ~ N(0,1); static scales as in FP8 checkpoints
    a2 = torch.tensor([0.5 / 448], device=device)
    return q13, q2, Fp8PerTensor(s13.float(), s2.float(), a13, a2)


def make_inputs(s: MoeShape, layer: int, device: str = "cuda") -> dict[str, Any]:
    """One layer's inputs: x [T, H] bf16, weights and quant, routing, expert_map (EP), shared output, out."""
    w13, w2, quant = weights(s, layer, device)
    tw, ids = routing(s, layer)
    g = torch.Generator(device=device).manual_seed(777 + layer)
    x = torch.randn(s.t, s.hidden, device=device, generator=g).bfloat16()
    emap = None
    if s.ep:
        emap = torch.full((s.e_global,), -1, dtype=torch.int32)
        emap[: s.e_local] = torch.arange(s.e_local, dtype=torch.int32)
        emap = emap.to(device)
    return {"layer": layer, "x": x, "w13": w13, "w2": w2, "quant": quant, "tw": tw.to(device),
            "ids": ids.to(device), "emap": emap, "shared": torch.randn_like(x) * 0.1 if s.shared else None,
            "out": torch.empty_like(x)}


def _shared_f32(x: dict[str, Any]) -> torch.Tensor:
    """The shared output in fp32, zeros without one (the start of a torch pipeline's reduction)."""
    return x["shared"].float() if x["shared"] is not None else torch.zeros_like(x["x"], dtype=torch.float32)


def config_overrides(spec: str | None = None) -> list[dict[str, Any]]:
    """Extra configs to time, one dict each, from `spec` (default: `HPCOPS_MOE_CONFIGS`), e.g.
    "block_m=16,block_n=32;num_stages=3"."""
    from hpcops.moe.configs import MoeConfig

    spec = (os.environ.get("HPCOPS_MOE_CONFIGS", "") if spec is None else spec).strip()
    names = {f.name: f.type for f in fields(MoeConfig)}
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


def override_label(kw: dict[str, Any]) -> str:
    return "hpcops[" + ",".join(f"{k}={v}" for k, v in kw.items()) + "]"


def config_for(s: MoeShape, device: torch.device | None, *, heuristic: bool = False):
    """The MoeConfig `fused_moe` picks for this shape on `device` (`get_config`: a tuned entry for the
    device where one exists, else the heuristic), or with `heuristic` the untuned heuristic itself."""
    from hpcops._platform import is_interpreter
    from hpcops.moe.configs import get_config, heuristic_config
    from hpcops.moe.fused_moe import device_name

    kw = dict(num_tokens=s.t, top_k=s.top_k, num_experts=s.e_global, hidden=s.hidden, inter=s.inter,
              quant=s.kind, interpreter=is_interpreter())
    if heuristic:
        return heuristic_config(**kw, num_local_experts=s.e_local)
    dev_name = device_name(device) if device is not None else None
    return get_config(**kw, num_local_experts=s.e_local, device_name=dev_name)


def tuned_note(s: MoeShape, device: torch.device | None) -> str:
    """Whether `get_config` on `device` replaces the heuristic for this shape, and which fields differ."""
    if device is None:
        return "no CUDA device here: the heuristic"
    tuned, heur = config_for(s, device), config_for(s, device, heuristic=True)
    diff = [f"{f.name}={getattr(tuned, f.name)}" for f in fields(tuned)
            if getattr(tuned, f.name) != getattr(heur, f.name)]
    return f"tuned entry applied ({', '.join(diff)})" if diff else "no tuned entry: the heuristic config"


def ours(s: MoeShape, overrides: dict[str, Any] | None = None, *, heuristic: bool = False, gate: bool = False):
    """`fused_moe` with `config_for(s)` (+ `overrides`); `gate`: layer 0's output is checked against the
    reference in `prepare` (for configs other than the default one the case's gate checks)."""
    def prepare(x):
        from hpcops.moe.fused_moe import fused_moe

        cfg = config_for(s, x["x"].device, heuristic=heuristic).with_(validate_ids=False, **(overrides or {}))
        args = (x["x"], x["w13"], x["w2"], x["tw"], x["ids"])
        kw = {"quant": x["quant"], "expert_map": x["emap"], "shared_output": x["shared"], "out": x["out"],
              "config": cfg}
        fn = lambda: fused_moe(*args, **kw)
        if gate and x["layer"] == 0:
            x["out"].fill_(float("nan"))  # unwritten elements fail
            assert_matches(s, x, fn(), override_label(overrides or {}) if overrides else "hpcops")
        return fn
    return prepare


def grouped_mm(s: MoeShape):
    """Unfused grouped-GEMM pipeline in torch (capturable: sort, scatter_add, no host sync)."""
    def prepare(x):
        if s.kind == "fp8_block":
            raise PeerUnavailable("torch has no 128x128 block-scaled grouped GEMM")
        if dynamic_scales(s):
            raise PeerUnavailable("static activation scales only")
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
            assert_matches(s, x, got, "torch-grouped-mm")
        return fn
    return prepare


def _grouped_pipeline(s: MoeShape, x: dict[str, Any]):
    E, inter, k = s.e_local, s.inter, s.top_k
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
        sb2 = quant.w2_scale[:, None].expand(E, s.hidden).contiguous()

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
        out = _shared_f32(x).index_add_(0, tok, contrib)
        return x["out"].copy_(out)
    return run


def torch_loop(s: MoeShape):
    """Dense loop over local experts with masked combine weights (no host sync, capturable)."""
    def prepare(x):
        if s.t > 64:
            raise PeerUnavailable("sanity row for T <= 64 only")
        if s.kind == "fp8_block":
            raise PeerUnavailable("no block-scaled torch matmul")
        if dynamic_scales(s):
            raise PeerUnavailable("static activation scales only")
        E, inter, T = s.e_local, s.inter, s.t
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
            acc = _shared_f32(x)
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
            assert_matches(s, x, got, "torch-loop")  # the padded fp8 path agrees with the reference
        return run
    return prepare


def vllm_modules():
    """vLLM's vendored fused_moe module and its quant-config shim (PeerUnavailable when not vendored)."""
    from hpcops.bench.registry import import_vendored

    fm = import_vendored("vllm_kernels.moe.fused_moe", how=VENDOR_VLLM)
    cfg = import_vendored("vllm_kernels._shim.moe_config", how=VENDOR_VLLM)
    return fm, cfg


def vllm_quant_config(s: MoeShape, quant, cfg):
    """vLLM's FusedMoEQuantConfig for our quant: None (bf16), fp8 per-tensor with static activation scales
    [1] and per-expert weight scales [E], fp8 per-tensor weights with dynamic per-token activation scales
    (`per_act_token_quant`: its kernel then reads a weight scale per output channel, so ours goes in as an [E, 1]
    column, a zero channel stride), or fp8 128×128 blocks (the same scale layouts as ours)."""
    if s.kind == "none":
        return None
    if s.kind == "fp8_tensor":
        if quant.a13_scale is None and quant.a2_scale is None:
            return cfg.fp8_w8a8_moe_quant_config(quant.w13_scale.float().reshape(-1, 1),
                                                 quant.w2_scale.float().reshape(-1, 1), per_act_token_quant=True)
        if quant.a13_scale is None or quant.a2_scale is None:
            raise PeerUnavailable("one static activation scale and one dynamic: not a vLLM configuration")
        one = lambda v: v.reshape(1).float()
        return cfg.fp8_w8a8_moe_quant_config(quant.w13_scale.float(), quant.w2_scale.float(),
                                             a1_scale=one(quant.a13_scale), a2_scale=one(quant.a2_scale))
    return cfg.fp8_w8a8_moe_quant_config(quant.w13_scale, quant.w2_scale, block_shape=[quant.block, quant.block])


def vllm_config_file(s: MoeShape, device: str = "NVIDIA_H200") -> str:
    """The name of vLLM's tuned-config JSON for this shape on `device` (its `get_config_file_name` format:
    E = local experts = w2.shape[0], N = per-rank I = w2.shape[2], dtype and block shape for fp8)."""
    dtype = "" if s.kind == "none" else ",dtype=fp8_w8a8"
    block = ",block_shape=[128,128]" if s.kind == "fp8_block" else ""
    return f"E={s.e_local},N={s.inter},device_name={device}{dtype}{block}.json"


def vllm_config_note(s: MoeShape) -> str:
    """Which config vLLM's own lookup picks for this shape here (its tuned JSON or get_default_config)."""
    try:
        fm, _ = vllm_modules()
        dtype = None if s.kind == "none" else "fp8_w8a8"
        block = [128, 128] if s.kind == "fp8_block" else None
        name = fm.get_config_file_name(s.e_local, s.inter, dtype, block)
        tuned = fm.get_moe_configs(s.e_local, s.inter, dtype, *(block or (None, None)))
    except Exception:  # not vendored (the row says so) or a vendored tree without these helpers
        return ""
    return f"vLLM config: tuned {name}" if tuned else f"vLLM config: get_default_config (no tuned {name})"


def vllm(s: MoeShape):
    """vLLM's Triton fused_experts as vLLM calls it (see the `moe` suite's docstring); no shared output in
    the call (vLLM adds a shared expert's output outside fused_experts)."""
    def prepare(x):
        fm, cfg = vllm_modules()
        qc = vllm_quant_config(s, x["quant"], cfg)
        args = (x["x"], x["w13"], x["w2"], x["tw"], x["ids"])
        kw = {"global_num_experts": s.e_global, "expert_map": x["emap"], "quant_config": qc}
        fn = lambda: fm.fused_experts(*args, **kw)
        if x["layer"] == 0:  # the gate, with the shared output added here
            got = (fn().float() + _shared_f32(x)).to(x["out"].dtype)
            assert_matches(s, x, got, "vllm-triton")
        return fn
    return prepare


def reference(s: MoeShape, x: dict[str, Any]) -> torch.Tensor:
    from hpcops.moe.reference import fused_moe as ref

    return ref(x["x"], x["w13"], x["w2"], x["tw"], x["ids"], quant=x["quant"], expert_map=x["emap"],
               shared_output=x["shared"])


def assert_matches(s: MoeShape, x: dict[str, Any], got: torch.Tensor, name: str) -> None:
    """The gate: `got` against the torch reference of layer `x` (computed once per inputs)."""
    from hpcops.testing import assert_close

    if "reference" not in x:  # several rows check the same layer-0 inputs: compute it once
        x["reference"] = reference(s, x)
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


def check(s: MoeShape):
    """The case's gate: `fused_moe` with its default config, into a NaN-filled output, on layer 0."""
    def run(x):
        from hpcops.moe.fused_moe import fused_moe

        got = fused_moe(x["x"], x["w13"], x["w2"], x["tw"], x["ids"], quant=x["quant"], expert_map=x["emap"],
                        shared_output=x["shared"], out=torch.full_like(x["out"], float("nan")))
        assert_matches(s, x, got, "hpcops")
    return run
